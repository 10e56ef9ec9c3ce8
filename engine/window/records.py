"""One accumulation window's records on this rank, its totals over the ranks, and the report
of a closed window."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.batching.token_budget import TokenCost
from engine.errors import EngineUsageError
from engine.strategies.base import StepResult


MIXED_KINDS = "one window mixes mean losses and (sum, count) losses; use one kind per window"


@dataclass
class Window:
    """One accumulation window in progress on this rank."""

    micro_steps: int = 0
    samples: int = 0  # local samples seen (as planned in the manual loop, real in train_batch)
    item_weighted: bool | None = None  # (sum, count) losses
    # Kept as lists and summed at the boundary: no tensor op per micro-step besides backward.
    losses: list = field(default_factory=list)  # detached micro-batch losses
    loss_weights: list = field(default_factory=list)  # samples (mean losses) or 1 (sums)
    counts: list = field(default_factory=list)  # items of (sum, count) losses
    exact_counts: bool = False  # units must be summed over ranks at the boundary
    planned_steps: int | None = None  # set by train_batch; the manual loop follows the plan
    tokens: TokenCost | None = None  # the window's micro-batches, when split by tokens
    failure: Exception | None = None  # loss_fn failed on this rank in a window run to its end (a pipeline)
    backward_since_step: bool = False
    forwarded: bool = False
    training_forwards: int = 0  # forwards for a backward, failed ones included
    forwards: list = field(default_factory=list)  # this micro-step's forwards, as the window split records them

    def loss_total(self) -> torch.Tensor:
        """Σ loss × weight over the window's micro-steps (0-dim, float64); 0 where this rank holds
        no loss (a pipeline stage before the last)."""
        if not self.losses:
            return torch.zeros((), dtype=torch.float64)
        losses = torch.stack(self.losses).double()
        return losses @ torch.tensor(self.loss_weights, dtype=torch.float64, device=losses.device)

    def units(self):
        """What the window's mean divides by: local samples, or local items."""
        if not self.item_weighted:
            return self.samples
        return sum(torch.as_tensor(c, dtype=torch.float64) for c in self.counts)

    def check_same_kind(self, item_weighted: bool) -> None:
        """One kind of loss per window: means, or (sum, count) pairs."""
        if self.item_weighted is None:
            self.item_weighted = item_weighted
        elif self.item_weighted != item_weighted:
            raise EngineUsageError(MIXED_KINDS)


@dataclass
class WindowReport:
    """Statistics of the last closed window (for logging; the loss is read lazily)."""

    loss: torch.Tensor | None = None
    samples: int = 0
    items: torch.Tensor | None = None
    step: StepResult = field(default_factory=lambda: StepResult(applied=False))
    lr: float | None = None  # the learning rate this window's update used (first param group)
    peak_memory_bytes: int | None = None  # measured when the monitor records the window
    micro_steps: int = 0  # on each rank
    real_tokens: int | None = None  # split by tokens: real and padded (computed) tokens, all ranks
    padded_tokens: int | None = None


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


def window_totals(window: Window, plan, strategy, *, over_all_ranks: bool, same_batch=None,
                  holders: int = 1) -> WindowTotals:
    """The statistics of ``window``. Over all ranks: one small reduction over the window-statistics
    group (real counts, or a record the monitor makes) of the loss, units, samples, (real, padded)
    tokens, the kind of loss and whether one failed. Otherwise the manual loop's planned sizes
    (``plan``): no collective, no host sync, and the loss is this rank's. ``same_batch``: a
    ``ReplicaBatchCheck`` and this window's batch fingerprint, checked in the same reduction
    (which then spans the world; EngineUsageError on every rank when a replica's ranks differ).
    Where the reduction spans the world it carries the strategy's share of the squared gradient
    norm too (``Strategy.grad_squares_share``): the step then needs no collective of its own.
    ``holders``: how many ranks of that group hold each row (the context size: a context group
    splits its rows' tokens, so each of its ranks adds 1/holders of the rows and their tokens).
    The loss, its units and its kind are added ``strategy.loss_copies`` times: under a pipeline
    only the last stage computes them (its stages learn them here, in the reduction the window
    makes anyway, not in a broadcast of their own)."""
    if not over_all_ranks:
        samples = plan.window_samples(window.micro_steps)
        return WindowTotals(window.loss_total() / window.samples, samples, samples, (None, None), None,
                            bool(window.item_weighted), failed=False)
    device = strategy.device
    cost = window.tokens
    copies = strategy.loss_copies
    values = [window.loss_total() * copies, window.units() * copies, float(window.samples) / holders,
              float(cost.real_tokens if cost else 0) / holders, float(cost.padded_tokens if cost else 0) / holders,
              float(bool(window.item_weighted)) * copies, float(window.failure is not None)]
    share = strategy.grad_squares_share() if same_batch is not None or strategy.statistics_span_world else None
    stats = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=device).reshape(()) for value in values])
    if same_batch is not None:
        check, fingerprint = same_batch
        stats = check.reduce(stats, fingerprint, world_sums=share)
    else:
        stats = strategy.all_reduce_sum(stats if share is None else torch.cat([stats, share.reshape(1).double()]))
    counts = stats[2:].tolist()  # the step's one host sync
    samples, real, padded = (round(n) for n in counts[:3])  # shares of 1/holders add up to whole numbers
    item_weighted, failed = counts[3] > 0, counts[4] > 0
    return WindowTotals(stats[0] / stats[1], stats[1], samples, (real, padded) if cost else (None, None),
                        counts[5] if share is not None else None, item_weighted, failed)
