"""A pipeline's windows: what the window executor's ``STAGES`` actions run (``engine.schedule``).

``train_batch((inputs, labels), loss_fn)`` hands the executor the rank's per-device batch (every
stage of one replica gets the same one); ``loss_fn(outputs, labels)``, or one decorated with
``@engine.loss_on_outputs`` (which also trains without a pipeline). The window split cuts it into the plan's A
micro-batches, exactly as without a pipeline (a short last batch: A smaller ones); they run
as one order through the stages (``engine.strategies.stage_schedules``), the first
stage called with each micro-batch's ``inputs`` and the last computing
``loss_fn(outputs, labels)`` — a mean or ``(sum, count)``, as everywhere. This module puts a window in the
form the stages take (:class:`StageWindow`) and runs it; the executor weighs, records and fails it.

Exactness. The last stage weights each micro-batch loss by its real share of the global
batch, ``units · W_dp / G`` (units: its samples for a mean loss, 1 for a sum), as the engine
weights a manual-loop backward; the schedule's own 1/A is off. Every stage counts every
micro-step with its samples; the last stage's losses, their counts and kind, and a failed
``loss_fn`` reach the other stages in the reduction of the window's statistics, which spans
the world on a pipeline anyway (``WindowCapabilities.loss_copies``): no wait of its own after the
schedule. So the boundary's correction G / U (U: the real samples or items over every
data-parallel rank) is the same on every stage, and so are the counters, the reported loss,
the scheduler and the monitor; a failed ``loss_fn`` abandons the window on every rank there,
its own rank raising its error. (Evaluation sums the last stages' totals in its one reduction
over every rank the same way.)

Shapes. An order runs micro-batches of one shape: smaller ones (a balanced plan, a short window)
are padded with copies of their own first rows, cut off before ``loss_fn`` (rows must not interact).
Under a token budget (``micro_batch_tokens``) a window's micro-batches are cut to one bucket length and
row count on every rank (``window_split.OneShapeTokenSplit``), each bucket a schedule of its own, each
micro-batch weighted by its real tokens; a zero-weight step runs without calling ``loss_fn``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from engine.batching.micro_batches import MicroBatches
from engine.distributed.collectives import small_sum
from engine.errors import EngineUsageError
from engine.losses import outputs_loss_of
from engine.schedule import through_stages
from engine.pipeline.schedule_inputs import (check_model_batch, equal_chunks, inputs_and_labels, packed_positions,
                                             real_rows, rows_of, sequence_parts, zero_from)
from engine.window.loss_checks import model_call_refused, written_for_model
from engine.window.model_loss import LastStageModel, ModelLoss, NoModelLoss

if TYPE_CHECKING:  # imported with the strategy, only when a pipeline runs (torch.distributed.pipelining)
    from engine.strategies.pipeline import PipelineParallel

LossFn = Callable[[object, object], object]


@dataclass
class StageWindow:
    """One window's micro-batches as the stages take them: ``pieces`` ((inputs, labels) form, each this
    rank's part of its sequences, and its samples), their equal ``inputs`` chunks of ``rows`` rows, what
    the stages are handed (``positions``), and the call that waits for the ranks' position check."""

    pieces: list
    sizes: list[int]
    inputs: object
    rows: int
    positions: Callable
    loss_fn: LossFn
    device: torch.device
    confirm_start: Callable[[], None] = lambda: None
    failure: Exception | None = None  # the first error of the last stage's loss_fn in the last run


class StageWindows:
    """A pipeline's windows: their form, their micro-batches' shape, and their run through the stages."""

    def __init__(self, strategy: PipelineParallel, accumulation: int | None,
                 model_loss: ModelLoss | NoModelLoss | None = None):
        """``accumulation``: the plan's, checked against the schedule; None when a token budget
        chooses it per window (as many as the schedule runs) or the automatic micro size does.
        ``model_loss``: the model's own loss, which the last stage applies for a ``loss_fn(model,
        micro_batch)`` (``engine.window.model_loss``)."""
        self.strategy, self.schedules = strategy, strategy.schedules
        if accumulation is not None:
            self.schedules.rules.check_accumulation(accumulation)
        self.model_loss = model_loss or NoModelLoss()

    def runs(self, plan) -> bool:
        """Whether the schedule runs windows of ``plan``'s accumulation."""
        return self.schedules.rules.runs(plan.gradient_accumulation_steps)

    def fitting_micro_batches(self, count: int) -> int:
        """The fewest micro-batches, at least ``count``, the schedule runs (the window split asks)."""
        return self.schedules.rules.fitting(count)

    def schedule_form(self, batch, loss_fn: LossFn, method: str, routers_counted: bool):
        """``(batch as (inputs, labels), loss_fn(outputs, labels))``. A ``loss_fn(model, micro_batch)`` on a
        mapping batch (``m(**batch).loss``): the first stage is called with its ``input_ids``, the last
        stage hands ``loss_fn`` the micro-batch and a stand-in model whose call returns the last stage's
        outputs with the model's own loss (``LastStageModel``; ``routers_counted``: a routed model's term is
        the window's, ``engine.experts.stages``)."""
        if isinstance(batch, MicroBatches):
            raise EngineUsageError(
                f"{method}(engine.MicroBatches(...)) under a pipeline: its schedule runs micro-batches of one shape "
                "cut by the window split; give the per-device batch ((inputs, labels), or the mapping for "
                "loss_fn(model, micro_batch)) and let the engine cut it")
        if not written_for_model(loss_fn):
            inputs_and_labels(batch, method)
            if self.strategy.mesh.context > 1:
                raise EngineUsageError(
                    f"{method}(): under a pipeline with context_parallel.size {self.strategy.mesh.context} each rank "
                    "holds a part of every sequence, whose labels and real tokens the engine reads from a mapping "
                    "batch (input_ids, labels -100 at padding): give the batch as that mapping and loss_fn(model, "
                    "micro_batch) returning the model's own loss (m(**micro_batch).loss)")
            return batch, outputs_loss_of(loss_fn)
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise model_call_refused(loss_fn)
        check_model_batch(batch, method, self.strategy.mesh.context)
        model = self.model_loss
        return (batch["input_ids"], batch), lambda outputs, micro_batch: loss_fn(
            LastStageModel(outputs, model, routers_counted), micro_batch)

    def window(self, inputs, pieces: list, loss_fn: LossFn, context, schedule_rows: int | None) -> StageWindow:
        """A training window's micro-batches (the window split's ``pieces`` of the batch whose ``inputs``
        are given) as the stages take them: this rank's part of each sequence, the batch's own inputs where
        the micro-batches are its equal chunks, else theirs cut equal (to ``schedule_rows`` rows where the
        split says)."""
        pieces = sequence_parts(context, pieces)
        sizes = [n for _, n in pieces]
        if schedule_rows is not None or any(n != sizes[0] for n in sizes) or context.size > 1:
            inputs = equal_chunks([piece[0] for piece, _ in pieces], schedule_rows)
        return self._stage_window(pieces, sizes, inputs, loss_fn)

    def evaluation_window(self, pieces: list, loss_fn: LossFn, context, schedule_rows: int | None) -> StageWindow:
        """An evaluation's micro-batches as the stages take them, as many as the schedule runs (a rank
        with fewer than its peers repeats its last one with 0 samples)."""
        pieces = sequence_parts(context, pieces)
        pieces += [(pieces[-1][0], 0)] * (self.fitting_micro_batches(len(pieces)) - len(pieces))
        inputs = equal_chunks([piece[0] for piece, _ in pieces], schedule_rows)
        return self._stage_window(pieces, [n for _, n in pieces], inputs, loss_fn)

    def _stage_window(self, pieces: list, sizes: list[int], inputs, loss_fn: LossFn) -> StageWindow:
        rows = rows_of(inputs) // len(pieces)  # rows of each micro-batch in the schedule
        return StageWindow(pieces, sizes, inputs, rows, self.schedules.positions(packed_positions(pieces, rows)),
                           loss_fn, self.strategy.device)

    def run(self, window: StageWindow, read: Callable, *, train: bool,
            before_first_gradient_wait: Callable[[], None] | None = None) -> None:
        """``window``'s micro-batches through the stages (``train``: the order; else its forwards alone),
        ``read(outputs, index)`` on the last stage for each micro-batch's loss (``StageSchedules.run``)."""
        with window.positions():
            self.schedules.run(window.inputs, len(window.pieces), read, train=train,
                               before_first_message=window.confirm_start,
                               before_first_gradient_wait=before_first_gradient_wait)

    def losses(self, window: StageWindow) -> LastStageLosses:
        """The last stage's ``loss_fn`` for ``window``'s micro-batches (one run's)."""
        return LastStageLosses(self.schedules, window.pieces, window.loss_fn)

    @property
    def failures_voted(self) -> bool:
        """Whether every rank votes on a window's failures after it (``StageSchedules.failures_voted``)."""
        return self.schedules.failures_voted

    def raise_stage_failure(self) -> None:
        """A stage's failure the guard kept, raised after the window's collectives (the tuner's vote follows)."""
        self.schedules.raise_stage_failure()

    @staticmethod
    def evaluation_sum(total: torch.Tensor) -> torch.Tensor:
        """An evaluation's totals over every rank: the last stages' (the other stages add zeros; a last
        stage's tensor ranks each add the same, which the quotient cancels)."""
        return small_sum(total)


class NoStageHooks:
    """The hooks of a pipeline window without routers to count (a dense model, or a loss other than the model's
    own): nothing is counted, held or added."""

    counts_routers = False

    def schedule(self, micro_batches: int) -> list:
        return through_stages(micro_batches)

    def _no_context(self, *args) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _nothing(self, *args) -> None:
        return None

    window = training = evaluating = _no_context
    record = last_stage_read = before_gradients = failure = _nothing

    def recorded(self, outputs: list) -> list:
        return outputs

    def evaluated_own_loss(self, output) -> bool:
        return True

    def evaluation_counts(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64)

    def evaluation_term(self, counts: torch.Tensor) -> float:
        return 0.0


NO_STAGE_HOOKS = NoStageHooks()


def stage_windows(strategy, plan, model_loss: ModelLoss | NoModelLoss) -> StageWindows | None:
    """A pipeline's windows (None without one): the plan's accumulation checked against the schedule,
    unless a token budget (micro-batches of one shape, as many as the schedule runs) or the automatic micro
    size chooses it per window."""
    if strategy.mesh.pipeline == 1:
        return None
    chosen_per_window = plan.is_provisional or plan.micro_batch_tokens is not None
    return StageWindows(strategy, None if chosen_per_window else plan.gradient_accumulation_steps, model_loss)


class LastStageLosses:
    """The last stage's ``loss_fn(outputs, labels)`` for each micro-batch of one run, and the first
    error it raised (kept: raised after the run's collectives, on every rank). A zero-weight
    micro-batch (it only keeps the ranks' micro-step counts equal), and every micro-batch after a
    failure (this rank's, or its stage's standing in), calls nothing."""

    def __init__(self, schedules, pieces: list, loss_fn: LossFn):
        self.schedules, self.pieces, self.loss_fn = schedules, pieces, loss_fn
        self.failure: Exception | None = None

    def read(self, outputs, index: torch.Tensor, use: Callable[[int, object], torch.Tensor | None]):
        """``use(k, loss_fn's output)`` for micro-batch ``k = index[0]``, or a zero of ``outputs``' graph
        where it was not called or failed."""
        k = int(index[0])
        (micro_batch, samples) = self.pieces[k]
        if samples and not self.schedules.stage_failed and self.failure is None:
            try:
                seen = self.schedules.model_outputs(real_rows(outputs, samples))  # as the model returns them
                used = use(k, self.loss_fn(seen, micro_batch[1]))
            except Exception as error:  # noqa: BLE001 - every error is raised after the schedule
                if not self.schedules.keep_failure(error):
                    self.failure = error
            else:
                if used is not None:
                    return used
        return zero_from(outputs)
