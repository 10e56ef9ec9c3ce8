"""How a window is cut into micro-batches, and what each micro-batch counts for: one object per
kind of plan, chosen once by ``engine.initialize`` (:func:`window_split_for`).

The engine asks it

* ``split(batch, plan)``: ``train_batch``'s micro-batches of this rank's per-device batch,
  with their samples (and their token cost when split by tokens);
* ``eval_pieces(batch, plan, size)``: ``eval_batch``'s, the same number on every rank (a rank
  with fewer samples repeats its last micro-batch with weight 0);
* in the manual loop (``eng(x)``, ``backward``, ``step``): ``record_forward`` at each forward
  and ``manual_samples`` at each backward — what the micro-batch counts for — and
  ``counts_exactly``: whether those counts are real (summed over the ranks at the boundary)
  or the plan's (no collective);
* ``schedule_rows()``: the rows every micro-batch of the latest split runs with in a schedule
  of one shape (a pipeline's), when the split fixes them for every rank;
* ``weighting_batch(plan)``: the G in the weights, and ``window_closed(samples)`` at each
  boundary; ``restored_plan(plan, saved)``: the plan a checkpoint's micro size or budget gives.

The kinds:

* :class:`PlannedSplit` — a plan with sizes. ``train_batch`` cuts the per-device batch as
  the plan does (a shorter last batch into A near-equal micro-batches: a short window); the
  manual loop's k-th micro-batch counts as ``plan.micro_batch_sizes[k]``.
* :class:`InputSizedSplit` — the same plan, but the manual loop counts each micro-batch as
  what ``eng(...)`` was given (``engine.batching.forward_sizes``); inputs without one batch dimension
  count as the plan's size, with a warning. The DeepSpeed / Colossal-AI facades choose it
  (``initialize(manual_sizes="inputs")``).
* :class:`DataDefinedSplit` — only A is known (a config giving only the accumulation steps):
  ``train_batch`` splits into A near-equal parts, the manual loop must read its sizes from
  the inputs, and the weights use a nominal G: the previous window's real total (A·W before
  the first), so the boundary's G / U is 1 whenever windows repeat their size.
* :class:`TokenSplit` — ``micro_batch_tokens``: micro-batches by padded tokens
  (``engine.batching.token_budget``), every rank running as many as the rank that needs the most (one
  small agreement); the latest split's groups are kept for reports and for the micro-batch
  tuner. There is no manual loop: the script hands over whole per-device batches.
  With ``packing: true`` each micro-batch's documents are packed end to end into one row of at
  most N real tokens instead (``engine.batching.packing``).
* :class:`OneShapeTokenSplit` — ``micro_batch_tokens`` under a pipeline, whose schedule runs
  micro-batches of one shape: all of a window's, on every rank, share one length and one
  number of rows (``schedule_rows``), as many as the schedule runs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from engine.batching.plan import BatchPlan, split_evenly
from engine.distributed.collectives import agreed_max
from engine.errors import BatchConfigError, EngineUsageError
from engine.batching.forward_sizes import Forward, forward_of_loss, record_forward
from engine.batching.microbatch import batch_size, split_batch
from engine.batching.packing import Seams, fewest_packed_steps, group_packed, packable_layout, take_packed
from engine.batching.token_budget import (LengthsFn, MicroGroup, TokenCost, TokenSplitter, bucket_length, group_uniformly,
                                         one_shape_cost, one_shape_micro_steps, padding_row, smaller_budget, take_rows,
                                         token_cost)

log = logging.getLogger("engine")

MANUAL_SIZES = ("plan", "inputs")  # initialize(manual_sizes=...)
_EVERY_RANK = "every rank must call train_batch() / eval_batch() for each step"
_ANY_LENGTH = 2 ** 62


class Split(NamedTuple):
    """One window's micro-batches on this rank."""

    micro_steps: int
    pieces: Iterable[tuple[Any, int]]  # (micro-batch, samples); 0 samples: a zero-weight step
    tokens: TokenCost | None = None  # when split by tokens


def _pieces(batch, sizes: Sequence[int]) -> Split:
    return Split(len(sizes), zip(split_batch(batch, sizes), sizes))


def _even_eval_pieces(batch, micro_batch_size: int) -> list[tuple[Any, int]]:
    """``batch`` in near-equal micro-batches of at most ``micro_batch_size``, as many as the
    rank that needs the most (sharded models gather parameters in each forward)."""
    size = batch_size(batch)
    parts, negative_fewest = agreed_max(
        [-(-size // micro_batch_size), -size],
        f"rank {{rank}} {{waited}} at the agreement to split its evaluation batch: {{cause}}; {_EVERY_RANK}")
    if negative_fewest == 0:
        raise EngineUsageError("eval_batch(): some rank got an empty batch; every rank needs at least one sample")
    sizes = [n for n in split_evenly(size, parts) if n]
    pieces = list(zip(split_batch(batch, sizes), sizes))
    return pieces + [(pieces[-1][0], 0)] * (parts - len(pieces))


class PlannedSplit:
    """A plan with sizes; the manual loop counts its micro-batches as the plan's."""

    counts_exactly = False

    def __init__(self):
        self._warned = False

    # -- whole batches --------------------------------------------------------------------------
    def split(self, batch, plan: BatchPlan) -> Split:
        accumulation, planned = plan.gradient_accumulation_steps, plan.per_device_batch_size
        size = batch_size(batch)
        if size == planned:
            return _pieces(batch, plan.micro_batch_sizes)
        if accumulation <= size < planned:
            return _pieces(batch, split_evenly(size, accumulation))
        shorter = (f" (a shorter last batch of {accumulation} to {planned - 1} samples is run as a short window)"
                   if accumulation < planned else "")
        raise EngineUsageError(
            f"train_batch() got a batch of {size} samples but the plan gives this rank (rank {plan.rank}) "
            f"{planned} per optimizer step in {accumulation} micro-batches; pass exactly {planned} samples{shorter}")

    def eval_pieces(self, batch, plan: BatchPlan, size: int | None = None) -> Iterable[tuple[Any, int]]:
        """``size``: the most samples per micro-batch (default: the plan's micro-batch cap)."""
        return _even_eval_pieces(batch, size or plan.train_micro_batch_size_per_gpu)

    # -- the manual loop ------------------------------------------------------------------------
    def record_forward(self, forwards: list, plan: BatchPlan, k: int, args, kwargs, output) -> None:
        """The k-th micro-step is weighted as the plan's k-th micro-batch: say so (once) when
        the data disagrees, since the weighting would then be off."""
        first = args[0] if args else None
        if (self._warned or not isinstance(first, torch.Tensor) or first.dim() == 0
                or k >= plan.gradient_accumulation_steps or plan.is_provisional):
            return
        expected = plan.micro_batch_sizes[k]
        if first.shape[0] != expected:
            self._warned = True
            log.warning("micro-step %d of the window got %d samples but the plan expects %d; in a manual loop each "
                        "micro-batch is weighted by the plan's size (eng.plan.micro_batch_sizes) — feed those sizes, "
                        "or use train_batch() with the whole per-device batch", k, first.shape[0], expected)

    def manual_samples(self, forwards: Sequence[Forward], plan: BatchPlan, k: int, loss) -> int:
        """What the k-th micro-step of a manual-loop window counts for."""
        _refuse_provisional(plan)
        return plan.micro_batch_sizes[k]

    # -- weights ----------------------------------------------------------------------------------
    def weighting_batch(self, plan: BatchPlan) -> int:
        return plan.train_batch_size

    def window_closed(self, samples: int) -> None:
        """A window of ``samples`` (over every rank) closed."""

    def schedule_rows(self) -> int | None:
        """The rows every micro-batch of the latest split runs with in a schedule of one shape,
        when this split sets them (None: the most of any micro-batch of this rank)."""
        return None

    def restored_plan(self, plan: BatchPlan, saved: dict) -> BatchPlan:
        """The plan to go on with after restoring a checkpoint's ``micro_batch`` state: a micro
        size found by auto / explore is kept when it suits the current plan."""
        size = saved["size"]
        if saved["mode"] == "fixed" or size == plan.train_micro_batch_size_per_gpu:
            return plan
        if plan.micro_batch_mode == "fixed":
            log.info("the checkpoint's micro-batch size %d (%s) is not restored: the config fixes it at %d",
                     size, saved["mode"], plan.train_micro_batch_size_per_gpu)
            return plan
        try:
            return plan.with_micro_batch_size(size)
        except BatchConfigError as error:
            log.info("the checkpoint's micro-batch size %d does not fit this plan (%s); keeping %d",
                     size, error, plan.train_micro_batch_size_per_gpu)
            return plan


def _refuse_provisional(plan: BatchPlan) -> None:
    if plan.is_provisional:
        raise EngineUsageError(
            f"train_micro_batch_size_per_gpu: {plan.micro_batch_mode} lets train_batch() choose the micro-batches; "
            "a manual loop (eng(x), backward, step) needs a number there")


class InputSizedSplit(PlannedSplit):
    """A plan with sizes, whose manual loop counts each micro-batch as what ``eng(...)`` was
    given — in the forward its loss came from (``engine.batching.forward_sizes``)."""

    counts_exactly = True

    def record_forward(self, forwards: list, plan: BatchPlan, k: int, args, kwargs, output) -> None:
        forwards.append(record_forward(args, kwargs, output))

    def manual_samples(self, forwards: Sequence[Forward], plan: BatchPlan, k: int, loss) -> int:
        _refuse_provisional(plan)
        if not forwards:
            raise EngineUsageError(
                "backward() without a forward through the engine: the micro-batch's size is read from what "
                "eng(...) is given — call eng(x), not eng.module(x)")
        forward = forward_of_loss(loss, forwards)
        if forward is None:
            forward = forwards[-1]
            self._warn_once("micro-step %d ran %d forwards of different batch sizes (%s) and the loss could not be "
                            "traced to one of them: it is weighted by the last one's; run other forwards under "
                            "torch.no_grad()", k, len(forwards), ", ".join(str(f.samples) for f in forwards))
        if forward.samples is not None:
            return forward.samples
        return self._unreadable(forward, plan, k)

    def _unreadable(self, forward: Forward, plan: BatchPlan, k: int) -> int:
        """Inputs without one batch dimension: the plan's size."""
        expected = plan.micro_batch_sizes[k]
        self._warn_once("micro-step %d: the tensors given to eng(...) do not share a first (batch) dimension (%s); it "
                        "counts as the plan's micro-batch of %d samples (eng.plan.micro_batch_sizes), as will any "
                        "other micro-step whose size cannot be read (shown once)", k, forward.inputs, expected)
        return expected

    def _warn_once(self, message: str, *args) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message, *args)


class DataDefinedSplit(InputSizedSplit):
    """Only A is given: the data sizes every micro-batch."""

    def __init__(self, plan: BatchPlan):
        super().__init__()
        self._nominal = plan.gradient_accumulation_steps * plan.world_size  # the G in the weights

    def split(self, batch, plan: BatchPlan) -> Split:
        accumulation, size = plan.gradient_accumulation_steps, batch_size(batch)
        if size < accumulation:
            raise EngineUsageError(
                f"train_batch() got a batch of {size} samples to split into gradient_accumulation_steps "
                f"{accumulation} micro-batches; pass at least {accumulation} samples")
        return _pieces(batch, split_evenly(size, accumulation))

    def eval_pieces(self, batch, plan: BatchPlan, size: int | None = None) -> Iterable[tuple[Any, int]]:
        """Default: A near-equal micro-batches, as train_batch splits."""
        return _even_eval_pieces(batch, size or math.ceil(batch_size(batch) / plan.gradient_accumulation_steps))

    def _unreadable(self, forward: Forward, plan: BatchPlan, k: int) -> int:
        raise EngineUsageError(
            f"cannot tell this micro-batch's size: the tensors given to eng(...) do not share a first (batch) "
            f"dimension ({forward.inputs}). The config gives only gradient_accumulation_steps, so each micro-batch "
            "counts with the batch size of its inputs: give every tensor passed to eng(...) the batch as its first "
            "dimension (e.g. position_ids [batch, T], not [1, T]), or set train_micro_batch_size_per_gpu (or "
            "train_batch_size) so the plan gives the sizes")

    def weighting_batch(self, plan: BatchPlan) -> int:
        return self._nominal

    def window_closed(self, samples: int) -> None:
        if samples:
            self._nominal = samples  # the same on every rank: summed over them


class TokenSplit(PlannedSplit):
    """Micro-batches formed by padded tokens (``micro_batch_tokens``)."""

    def __init__(self, lengths: LengthsFn | None = None, sequence_keys: Sequence[str] | None = None,
                 length_multiple: int = 1, packing: Seams | None = None):
        super().__init__()
        self.reader = TokenSplitter(lengths, sequence_keys, length_multiple)
        # each micro-batch's documents in one row, its seams marked so (engine.batching.packing); None: rows
        self.packing = packing
        self.groups: list[MicroGroup] = []  # this rank's micro-batches of the latest split

    def split(self, batch, plan: BatchPlan, budget: int | None = None) -> Split:
        """``batch`` in micro-batches of at most ``budget`` (default: the plan's) padded tokens (packed:
        real tokens in one row), as many on this rank as on the rank that needs the most."""
        budget, cap = budget or plan.micro_batch_tokens, plan.train_micro_batch_size_per_gpu
        try:
            if self.packing:
                layout = packable_layout(batch, self.reader.layout)
                fewest = fewest_packed_steps(layout.lengths, budget, cap)
            else:
                layout, fewest = self.reader.read(batch, budget, cap)
            problem = None
        except Exception as error:  # noqa: BLE001 - e.g. the user's lengths(): every rank must reach the agreement
            layout, fewest, problem = None, 0, error
        steps, = _agreed([fewest], problem, plan)
        if self.packing:
            groups = self.groups = self.reader.logged(layout, group_packed(layout.lengths, budget, steps, cap), budget)
            seams = self.packing
            take = lambda batch, layout, group: take_packed(batch, layout, group, seams)  # noqa: E731
        else:
            groups = self.groups = self.reader.group(layout, budget, steps, cap)
            take = take_rows
        return Split(steps, ((take(batch, layout, g), g.samples) for g in groups), token_cost(groups))

    def eval_pieces(self, batch, plan: BatchPlan, size: int | None = None) -> Iterable[tuple[Any, int]]:
        """``size``: the token budget (default: the plan's). Each micro-batch is made when reached."""
        return self.split(batch, plan, size).pieces

    def record_forward(self, forwards: list, plan: BatchPlan, k: int, args, kwargs, output) -> None:
        """No manual loop (refused at backward)."""

    def manual_samples(self, forwards: Sequence[Forward], plan: BatchPlan, k: int, loss) -> int:
        raise EngineUsageError(
            f"micro_batch_tokens: {plan.micro_batch_tokens} forms micro-batches by tokens out of a whole per-device "
            "batch; a manual loop (eng(x), backward, step) hands over micro-batches already formed. Use "
            "eng.train_batch(batch, loss_fn), or remove micro_batch_tokens for a manual loop")

    def restored_plan(self, plan: BatchPlan, saved: dict) -> BatchPlan:
        """A budget found by auto / explore is kept; a fixed one is the config's."""
        tokens = saved.get("tokens")
        if saved["mode"] != "fixed" and plan.micro_batch_mode != "fixed" and tokens is not None:
            return plan.with_micro_batch_tokens(tokens)
        if tokens not in (None, plan.micro_batch_tokens):
            log.info("the checkpoint's micro_batch_tokens %d is not restored: the config sets %d",
                     tokens, plan.micro_batch_tokens)
        return plan

    # -- for the micro-batch tuner (engine.autotune.tuner) ------------------------------------------------
    @property
    def micro_steps(self) -> int:
        """Micro-steps of the latest split."""
        return len(self.groups)

    def smaller_budget(self) -> int:
        """This rank's next budget after the latest split ran out of memory (0: none)."""
        return smaller_budget(self.groups)

    def longest_row(self, batch, plan: BatchPlan) -> int:
        """The longest row of ``batch`` (0 when it cannot be read: its own split reports why)."""
        try:
            layout, _ = self.reader.read(batch, plan.micro_batch_tokens)
        except Exception:  # noqa: BLE001 - e.g. the user's lengths(): every rank must reach the tuner's agreement
            return 0
        return max(layout.lengths)


def _agreed(proposal: list[int], problem: Exception | None, plan: BatchPlan) -> list[int]:
    """The maximum of each of ``proposal``'s numbers over every rank; every rank raises when one
    could not read its batch (``problem``: this rank's error)."""
    *agreed, failed = agreed_max(
        [*proposal, plan.rank + 1 if problem else 0],
        f"rank {{rank}} {{waited}} at the agreement to split its batch by tokens: {{cause}}; {_EVERY_RANK}")
    if problem is not None:
        raise problem
    if failed:
        raise EngineUsageError(f"rank {failed - 1} could not split its batch by tokens (its error is in its "
                               "log); every rank stops at the same micro-step")
    return agreed


class OneShapeTokenSplit(TokenSplit):
    """``micro_batch_tokens`` for a schedule that runs micro-batches of one shape per step and
    only some numbers of them (a pipeline's): every rank's micro-batches share one length (the
    bucket of the longest row on any rank) and one number of rows (``rows``), and there are as
    many as the schedule runs (``engine.batching.token_budget``, "One shape per window")."""

    def __init__(self, schedule_steps: Callable[[int], int], lengths: LengthsFn | None = None,
                 sequence_keys: Sequence[str] | None = None):
        super().__init__(lengths, sequence_keys)
        self._schedule_steps = schedule_steps
        self.rows = 0  # rows of every micro-batch of the latest split, on every rank (copies pad them)

    def split(self, batch, plan: BatchPlan, budget: int | None = None) -> Split:
        budget, cap = budget or plan.micro_batch_tokens, plan.train_micro_batch_size_per_gpu
        try:
            layout = self.reader.layout(batch)
            # the most columns this rank can give: any, extended with its own padding, unless every row is full
            limit = layout.padded_length if padding_row(layout) is None else _ANY_LENGTH
            bucket = bucket_length(max(layout.lengths), budget, None if limit == _ANY_LENGTH else limit)
            proposal = [bucket, len(layout.lengths), -limit]
            problem = None
        except Exception as error:  # noqa: BLE001 - e.g. the user's lengths(): every rank must reach the agreement
            layout, proposal, problem = None, [0, 0, -_ANY_LENGTH], error
        length, rows, negative_limit = _agreed(proposal, problem, plan)
        if length > -negative_limit:
            raise EngineUsageError(
                f"micro_batch_tokens under a pipeline: every rank runs micro-batches of one shape, {length} columns here "
                f"(the bucket of the longest row on any rank), but some rank's batch has {-negative_limit} columns and "
                "no padding to extend it with (every row full); pad every rank's batches to one length (e.g. the "
                "tokenizer's padding='max_length'), or leave one padded row")
        steps = self._schedule_steps(one_shape_micro_steps(rows, length, budget, cap))
        self.rows = -(-rows // steps)
        groups = self.groups = self.reader.logged(layout, group_uniformly(layout.lengths, length, budget, steps),
                                                  budget)
        return Split(steps, ((take_rows(batch, layout, g), g.samples) for g in groups),
                     one_shape_cost(groups, self.rows))

    def schedule_rows(self) -> int | None:
        return self.rows


def window_split_for(plan: BatchPlan, *, manual_sizes: str = "plan", lengths: LengthsFn | None = None,
                     sequence_keys: Sequence[str] | None = None,
                     schedule_steps: Callable[[int], int] | None = None, length_multiple: int = 1,
                     packing: Seams | None = None) -> PlannedSplit:
    """The window split for ``plan``; ``manual_sizes`` (one of ``MANUAL_SIZES``): how a manual
    loop counts a micro-batch of a plan with sizes, ``"plan"`` (its planned size) or
    ``"inputs"`` (what ``eng(...)`` was given). ``schedule_steps``: under a pipeline, the
    fewest micro-batches, at least n, its schedule runs (token budgets then form micro-batches
    of one shape). ``length_multiple``: what a token budget's trimmed length is rounded up to
    (context parallelism's chunks). ``packing``: each token-budget micro-batch's documents packed
    into one row, its seams marked by that function (``engine.batching.packing``; the config refuses it
    under a pipeline or context parallelism; None: not packed)."""
    if plan.micro_batch_tokens is not None:
        if schedule_steps is not None:
            return OneShapeTokenSplit(schedule_steps, lengths, sequence_keys)
        return TokenSplit(lengths, sequence_keys, length_multiple, packing)
    if plan.is_data_defined:
        return DataDefinedSplit(plan)
    return InputSizedSplit() if manual_sizes == "inputs" else PlannedSplit()
