"""The window's arithmetic, in one place: every number that makes a window exact.

An update must be the gradient of the mean loss over the global batch: per sample for a mean
loss, per item for a ``(sum, count)`` loss (and for a model's own loss, read as one:
``engine.window.model_loss``). The strategies leave the mean over the ``W`` gradient-averaging
ranks (data × context) of each rank's accumulated gradient, so:

* **what a loss stands for** (:func:`loss_and_units`): a mean stands for its samples, a pair for its
  count, a model's own mean loss for the sum over the items its labels hold;
* **a micro-step's weight** (:meth:`Accounting.micro_step_weight`): its share — samples for a mean,
  1 for a sum, 0 for a zero-weight step — × W / G, G the planned (or nominal) global batch;
* **the boundary multiplier** (:meth:`Accounting.boundary_multiplier`): G / U, U the window's real
  samples or items over every rank (1 for a full window of means);
* **the window's totals** (:func:`window_totals`): the loss, its units and the samples summed over
  the ranks in one reduction, where a loss computed on several ranks (a pipeline's last stage over
  ``WindowCapabilities.loss_copies``) is added once per copy and a row split over ``holders`` context ranks adds
  1/holders of its samples and tokens from each;
* **evaluation's totals** (:func:`evaluation_terms`): Σ loss × share and Σ units, divided once;
* **a load-balancing term's factor** (:func:`term_factors`): the inverse of the weight its loss
  gets, N / n for a mean, U for a sum, U / c for a model's own mean over c items read as a sum;
  and the weight of a term's gradient added beside the loss (:meth:`Accounting.outside_loss_weight`):
  U · W / G.

Every runner (plain, pipeline, router counting, context) and evaluation asks this module; none re-derives
a weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.distributed.mesh import GRADIENT_REDUCTION
from engine.errors import EngineUsageError

MARK = "_microstep_mean_items"  # the attribute that marks a model's own mean loss: (multiplier, items)


def mark_mean_items(loss: torch.Tensor, multiplier, items) -> None:
    """Mark a model's own mean ``loss`` as read: ``loss × multiplier`` is its sum over ``items``
    (``engine.window.model_loss`` reads them from the labels the engine handed in)."""
    setattr(loss, MARK, (multiplier, items))


def mean_items(loss) -> tuple[object, object] | None:
    """``(multiplier, items)`` when ``loss`` is a model's own mean loss as the engine marked it
    (``loss × multiplier`` is its sum over ``items``), else None."""
    return getattr(loss, MARK, None) if isinstance(loss, torch.Tensor) else None


def as_sum(loss: torch.Tensor, multiplier) -> torch.Tensor:
    """``loss × multiplier``; a micro-batch without an item (its mean 0/0) adds 0, not NaN."""
    multiplier = torch.as_tensor(multiplier, device=loss.device)
    return torch.where(multiplier > 0, loss, torch.zeros_like(loss)) * multiplier


def part_as_sum(loss: torch.Tensor, tokens: torch.Tensor, *, keeps_other_terms: bool):
    """A context rank's mean ``loss`` over its part's real ``tokens`` as ``(sum, count)``. Where the
    model divided its part's sum by ``max(tokens, 1)`` (``keeps_other_terms``: its own shifted loss), a
    part without a target keeps what its loss holds besides the token sum (a mixture of experts'
    load-balancing term) and a NaN counts 0; otherwise a part without a real token adds 0 (not NaN)."""
    if keeps_other_terms:
        return torch.where(tokens > 0, loss * tokens, torch.nan_to_num(loss, nan=0.0)), tokens
    return as_sum(loss, tokens), tokens


EXPECTED = ("the loss must be a scalar tensor (the mean over the micro-batch) or a pair (loss_sum, num_items), "
            "e.g. (F.cross_entropy(..., reduction='sum'), (labels != -100).sum())")


def describe(value) -> str:
    """A loss output's form, as an error names it."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, dict):
        return f"a dict with keys {', '.join(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(describe(v) for v in value)})"
    return f"a {type(value).__name__}"


def checked_count(output, count):
    """``count`` when the pair ``output`` = (loss_sum, count) holds a count: a number or a
    one-element tensor."""
    if isinstance(count, (int, float)) and not isinstance(count, bool):
        return count
    if isinstance(count, torch.Tensor) and count.numel() == 1:
        return count
    raise EngineUsageError(
        f"{EXPECTED}; got {describe(output)}: a pair is read as (loss_sum, num_items), and "
        f"{describe(count)} is not a count. Returning (loss, logits) or (loss, outputs)? Return the loss alone")


def unrecognised_loss(output) -> EngineUsageError:
    """The error for a return that is neither a tensor, a pair, nor an output with a ``loss``."""
    hint = ""
    if isinstance(output, dict) and "loss" in output:
        hint = "; return output['loss']"
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        hint = "; return the loss alone, or (loss_sum, num_items)"
    return EngineUsageError(f"{EXPECTED}; got {describe(output)}{hint}")


MIXED_KINDS = "one window mixes mean losses and (sum, count) losses; use one kind per window"


def loss_and_units(output, samples: int):
    """(loss, the units the window's mean divides by, item-weighted?): a mean loss
    stands for its samples, a ``(sum, count)`` pair for its count, and a model's own loss (its
    ``.loss``, as the engine's forward returned it) for the sum over the items its labels hold."""
    if isinstance(getattr(output, "loss", None), torch.Tensor):  # e.g. a Hugging Face ModelOutput
        output = output.loss
    if isinstance(output, torch.Tensor):
        read = mean_items(output)  # a model's own loss, marked with its items (engine.window.model_loss)
        if read is not None:
            multiplier, items = read
            return as_sum(output, multiplier), items, True
        return output, samples, False
    if isinstance(output, (tuple, list)) and len(output) == 2:
        loss_sum, count = output
        if isinstance(loss_sum, torch.Tensor):
            return loss_sum, checked_count(output, count), True
    raise unrecognised_loss(output)


def loss_tensor(output) -> torch.Tensor:
    """The tensor a loss ``output`` holds (its ``.loss``, a pair's sum, or itself), as given: for checks
    made before the loss is weighed (no reading, no tensor op)."""
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return output.loss
    if isinstance(output, (tuple, list)) and len(output) == 2 and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, torch.Tensor):
        return output
    raise unrecognised_loss(output)


def share(samples: int, item_weighted: bool) -> int:
    """What a micro-batch's loss is multiplied by before its weighting: its samples (a mean),
    1 (a sum), 0 (a zero-weight step)."""
    return (1 if item_weighted else samples) if samples else 0


def gradient_ranks(mesh) -> int:
    """W: the ranks over which the strategies average each gradient (data × context of ``mesh``, an
    ``engine.distributed.mesh.MeshLayout``: the parts of one sequence add up). The dense gradients are
    averaged over them and an expert gradient summed over its replicas is divided by them."""
    return mesh.size(GRADIENT_REDUCTION)


class Accounting:
    """A window's weights for one engine: ``mesh`` the mesh whose gradient-averaging ranks W are read at
    each window, ``weighting_batch()`` the G of the weights (the planned global batch, or a data-defined
    plan's nominal one)."""

    def __init__(self, *, mesh, weighting_batch: Callable[[], int]):
        self.mesh = mesh
        self.weighting_batch = weighting_batch

    @property
    def ranks(self) -> int:
        """W, as the mesh says now."""
        return gradient_ranks(self.mesh)

    def micro_step_weight(self, samples: int, item_weighted: bool) -> float:
        """What a micro-batch's loss is multiplied by before its backward, in every window runner."""
        return share(samples, item_weighted) * self.ranks / self.weighting_batch()

    def outside_loss_weight(self, units):
        """What a load-balancing term's gradient added beside the loss (a pipeline stage's routers,
        ``engine.experts.stages``) is multiplied by so that it enters the window's gradient once:
        the window's U items over every rank × W / G, which the boundary's G / U and the ranks'
        average undo."""
        return units * self.ranks / self.weighting_batch()

    def boundary_multiplier(self, item_weighted: bool, units, samples: int):
        """What the reduced gradient is multiplied by at the boundary to be the global mean (None: the
        window holds no item to average, e.g. every label is -100)."""
        target = self.weighting_batch()
        if item_weighted:
            return None if float(units) == 0 else target / units
        return 1.0 if samples == target else target / samples


def evaluation_terms(output, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's (Σ loss × share, units) in an evaluation's totals (0 samples: nothing)."""
    loss, units, item_weighted = loss_and_units(output, samples)
    loss = loss.detach().double()
    if not samples:
        return torch.zeros_like(loss), torch.zeros_like(loss)
    return loss * (1 if item_weighted else samples), torch.as_tensor(units, dtype=torch.float64, device=loss.device)


def evaluation_mean(totals: torch.Tensor) -> float:
    """An evaluation's mean from its totals (:func:`evaluation_terms`) summed over the ranks."""
    return float(totals[0] / totals[1])


def losses_with_window_term(outputs: list, value, multipliers: list) -> list:
    """A pipeline's last-stage losses with λ · aux of the window (``value``, None: none) added as the model's
    own loss adds it: to its mean, read as a sum (times each one's multiplier); weighted as each loss is
    (its items / U), they then hold it once."""
    if value is None:
        return outputs
    added = []
    for output, multiplier in zip(outputs, multipliers):
        if isinstance(output, tuple):
            loss, count = output
            output = (loss + (value * multiplier).to(loss.device, loss.dtype), count)
        added.append(output)
    return added


def term_factors(item_weighted: bool, total_items, total_samples, sizes) -> list:
    """Each micro-step's load-balancing factor: N / n for a mean loss of n of the window's N samples,
    U for a ``(sum, count)`` loss, U / c for a model's own mean over c items read as its sum (the term
    it holds was multiplied by c). ``sizes``: ``(samples, multiplier)`` per micro-step."""
    if item_weighted:
        return [torch.where(c > 0, total_items / c.clamp(min=1), 0.0) for _, c in sizes]
    return [total_samples / n if n else 0.0 for n, _ in sizes]


@dataclass
class WindowTotals:
    """A window's statistics over the ranks (or this rank's planned ones: ``window_totals``)."""

    loss: torch.Tensor  # the mean loss, weighted exactly as the gradient
    units: object  # what the mean divides by: samples, or items
    samples: int
    tokens: tuple  # (real, padded) tokens, or (None, None)
    squares: float | None  # Σ squares of the reduced gradient, when the reduction carried them
    item_weighted: bool  # (sum, count) losses
    failed: bool  # a rank's loss failed in this window (``Window.failure``): nothing is applied
    unread: tuple  # (micro-batches, Σ, Σ²) of unread means' items per row, over the ranks where reduced


def window_totals(window, plan, strategy, capabilities, *, over_all_ranks: bool, same_batch=None,
                  holders: int = 1, unread=(0.0, 0.0, 0.0)) -> WindowTotals:
    """The statistics of ``window`` (``engine.window.records.Window``). Over all ranks: one small
    reduction over the window-statistics group (real counts, or a record the monitor makes) of the
    loss, units, samples, (real, padded) tokens, the kind of loss and whether one failed. Otherwise
    the manual loop's planned sizes (``plan``): no collective, no host sync, and the loss is this
    rank's. ``same_batch``: a ``ReplicaBatchCheck`` and this window's batch fingerprint, checked in the
    same reduction (which then spans the world; EngineUsageError on every rank when a replica's ranks
    differ). Where the reduction spans the world it carries the strategy's share of the squared
    gradient norm too (``Strategy.grad_squares_share``; ``capabilities``: the holder's
    ``engine.strategies.capabilities.WindowCapabilities``): the step then needs no collective of its own.
    ``holders``: how many ranks of that group hold each row (the context size: a context group
    splits its rows' tokens, so each of its ranks adds 1/holders of the rows and their tokens).
    The loss, its units and its kind are added ``capabilities.loss_copies`` times: under a pipeline
    only the last stage computes them (its stages learn them here, in the reduction the window
    makes anyway, not in a broadcast of their own). ``unread``: this rank's sums of the items per row
    of the micro-batches whose mean loss went unread (``LossReading.unread_sums``), summed over the
    ranks in the same reduction (``WindowTotals.unread``; this rank's own where nothing is reduced)."""
    if not over_all_ranks:
        samples = plan.window_samples(window.micro_steps)
        return WindowTotals(window.loss_total() / window.samples, samples, samples, (None, None), None,
                            bool(window.item_weighted), failed=False, unread=tuple(unread))
    device = strategy.device
    cost = window.tokens
    copies = capabilities.loss_copies
    values = [window.loss_total() * copies, window.units() * copies, float(window.samples) / holders,
              float(cost.real_tokens if cost else 0) / holders, float(cost.padded_tokens if cost else 0) / holders,
              float(bool(window.item_weighted)) * copies, float(window.failure is not None), *unread]
    squares = strategy.grad_squares_share() if same_batch is not None or capabilities.statistics_span_world else None
    stats = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=device).reshape(()) for value in values])
    if same_batch is not None:
        check, fingerprint = same_batch
        stats = check.reduce(stats, fingerprint, world_sums=squares)
    else:
        stats = strategy.all_reduce_sum(stats if squares is None else torch.cat([stats, squares.reshape(1).double()]))
    counts = stats[2:].tolist()  # the step's one host sync
    samples, real, padded = (round(n) for n in counts[:3])  # shares of 1/holders add up to whole numbers
    item_weighted, failed = counts[3] > 0, counts[4] > 0
    return WindowTotals(stats[0] / stats[1], stats[1], samples, (real, padded) if cost else (None, None),
                        counts[8] if squares is not None else None, item_weighted, failed, tuple(counts[5:8]))
