"""Windows under a pipeline: the accumulation steps are the schedule's micro-batches.

``train_batch((inputs, labels), loss_fn)`` hands this runner the rank's per-device batch (every
stage of one replica gets the same one); ``loss_fn(outputs, labels)``, or one decorated with
``@engine.loss_on_outputs`` (which also trains without a pipeline). The window split cuts it into the plan's A
micro-batches, exactly as without a pipeline (a short last batch: A smaller ones); they run
as one schedule through the stages (``engine.strategies.stage_schedules``), the first
stage called with each micro-batch's ``inputs`` and the last computing
``loss_fn(outputs, labels)`` — a mean or ``(sum, count)``, as everywhere.

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

Shapes. A schedule runs micro-batches of one shape: smaller ones (a balanced plan, a short window)
are padded with copies of their own first rows, cut off before ``loss_fn`` (rows must not interact).
Under a token budget (``micro_batch_tokens``) a window's micro-batches are cut to one bucket length and
row count on every rank (``window_split.OneShapeTokenSplit``), each bucket a schedule of its own, each
micro-batch weighted by its real tokens; a zero-weight step runs without calling ``loss_fn``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable

import torch

from engine.pipeline.schedule_inputs import (check_model_batch, equal_chunks, inputs_and_labels, packed_positions,
                                             real_rows, rows_of, sequence_parts, zero_from)
from engine.distributed.collectives import small_sum
from engine.experts.stages import stage_routers
from engine.state.rng import restore_rng_state, rng_state
from engine.accounting import (evaluation_mean, evaluation_terms, loss_and_units, loss_tensor,
                               losses_with_window_term, mean_items)
from engine.window.loss_checks import (check_scalar_loss, failed_on_another_rank, model_call_refused,
                                       written_for_model)
from engine.window.model_loss import LastStageModel, ModelLoss, NoModelLoss
from engine.window.runner import Engine, LossFn, WindowRunner
from engine.errors import EngineUsageError
from engine.losses import outputs_loss_of

if TYPE_CHECKING:  # imported with the strategy, only when a pipeline runs (torch.distributed.pipelining)
    from engine.strategies.pipeline import PipelineParallel
    from engine.strategies.stage_schedules import StageSchedules

log = logging.getLogger("engine")


class PipelineWindows(WindowRunner):
    """Runs training and evaluation windows through the pipeline schedule."""

    calls_loss_on_outputs = True  # the last stage's loss_fn(outputs, labels)

    def __init__(self, strategy: PipelineParallel, accumulation: int | None,
                 model_loss: ModelLoss | NoModelLoss | None = None, routers=None,
                 hold_forwards: bool = False):
        """``accumulation``: the plan's, checked against the schedule; None when a token budget
        chooses it per window (as many as the schedule runs) or the automatic micro size does
        (``runs_plan``). ``model_loss``: the model's own loss, which the last stage applies for a
        ``loss_fn(model, micro_batch)`` (``engine.window.model_loss``). ``routers`` (``moe.load_balance:
        global``): a routed model's stages, whose term is the window's, their router counts exchanged
        first (``engine.experts.stages``): by a counting schedule, or
        (``hold_forwards``, a schedule that runs every forward first) between the training
        schedule's forwards and its backwards."""
        self.strategy, self.schedules = strategy, strategy.schedules
        if accumulation is not None:
            self.schedules.rules.check_accumulation(accumulation)
        self.model_loss = model_loss or NoModelLoss()
        self.routers = routers
        self._routers_counted = False  # while the stages count a routed model's routers (its term added outside)
        self.holds_forwards = hold_forwards and self.routers is not None
        if self.routers is not None and not self.holds_forwards and strategy.rank == 0:
            log.info("moe.load_balance: global under a pipeline: each window first runs a counting schedule (every "
                     "micro-batch forward without gradients, the bubble once more%s)",
                     "; pipeline.schedule: gpipe learns the counts in its own forwards instead, at no extra forward"
                     if not strategy.capabilities().can_hold_forwards else "")

    def _schedule_form(self, batch, loss_fn: LossFn, method: str):
        """``(batch as (inputs, labels), loss_fn(outputs, labels))``. A ``loss_fn(model, micro_batch)`` on a
        mapping batch (``m(**batch).loss``): the first stage is called with its ``input_ids``, the last
        stage hands ``loss_fn`` the micro-batch and a stand-in model whose call returns the last stage's
        outputs with the model's own loss (``LastStageModel``)."""
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
            LastStageModel(outputs, model, self._routers_counted), micro_batch)

    def runs_plan(self, plan) -> bool:
        return self.schedules.rules.runs(plan.gradient_accumulation_steps)

    def fitting_micro_batches(self, count: int) -> int:
        """The fewest micro-batches, at least ``count``, the schedule runs (the window split asks)."""
        return self.schedules.rules.fitting(count)

    def run_window(self, engine: Engine, batch, loss_fn: LossFn) -> None:
        routed = self.routers is not None and written_for_model(loss_fn)  # the model's own loss, with its term
        batch, loss_fn = self._schedule_form(batch, loss_fn, "train_batch")
        inputs = batch[0]
        split = engine.window_split.split(batch, engine.plan)
        pieces = sequence_parts(engine.context, list(split.pieces))
        sizes = [n for _, n in pieces]
        # The position check is waited for before this rank's first message of the schedule, not
        # before the schedule: the first stage's first forward hides its wait.
        confirm_start = engine.windows.start_check_posted()
        engine.windows.planned(split)
        outputs: list = [None] * len(pieces)  # the last stage's losses, as loss_fn returned them (detached)
        # the window's term, added to the recorded losses after the schedule
        term = self.routers.new_window_term(len(pieces)) if routed else None
        held = routed and self.holds_forwards
        losses = _LastStageLosses(self.schedules, pieces, loss_fn)

        def weighed(k, output):
            weighted, outputs[k], count = engine.windows.weighed_loss(output, sizes[k])
            if term is not None:
                term.record(k, output, count)
            return weighted

        def last_stage_loss(outputs_of_stage, index):
            loss = losses.read(outputs_of_stage, index, weighed)
            if held and not self.routers.learning_shapes():
                term.seen.add(int(index[0]))
                if len(term.seen) == len(pieces):  # the window's last forward: its backwards follow
                    self._exchange_held(engine, term)
            return loss

        rows = engine.window_split.schedule_rows()
        if rows is not None or any(n != sizes[0] for n in sizes) or engine.context.size > 1:
            inputs = equal_chunks([piece[0] for piece, _ in pieces], rows)  # not the batch's own equal chunks
        chunk = rows_of(inputs) // len(pieces)  # rows of each micro-batch in the schedule
        positions = self.schedules.positions(packed_positions(pieces, chunk))

        def before_gradients():  # where this rank waits for the next stage's first gradient anyway
            engine.windows.fingerprint_batch()
            if held:  # the counts of the training schedule's forwards, exchanged before its backwards
                self._exchange_held(engine, term)

        try:
            routing = contextlib.nullcontext()
            if routed:  # the window's router counts over every stage, before its first backward
                weights = self.routers.row_weights(pieces, sizes, chunk, self.strategy.device)
                if held:  # counted in the training schedule's forwards, exchanged before its backwards
                    routing = self.routers.holding(weights)
                else:
                    routing, term.value = self._count_routers(engine, inputs, pieces, sizes, loss_fn, weights,
                                                              confirm_start, positions)
                self._routers_counted = True
            # a recorded window: every micro-batch's saved activations count
            with engine.windows.measured_forwards(), routing, engine.context.running(), positions():
                self.schedules.run(inputs, len(pieces), last_stage_loss, train=True,
                                   before_first_message=confirm_start, before_first_gradient_wait=before_gradients)
        finally:  # (a schedule that failed before its first message)
            self._routers_counted = False
            confirm_start()
        failure = losses.failure
        if term is not None:
            if term.not_own_loss:  # known on every rank (held forwards): the window is abandoned on every rank
                failure = failure or self.routers.not_own_loss()
            outputs = losses_with_window_term(outputs, term.value, term.multipliers)
        self.schedules.raise_stage_failure()  # kept by the failure guard: the tuner's vote follows
        # Every stage counts every micro-step; the last stage's losses reach the others in the
        # window's statistics (``WindowCapabilities.loss_copies``), and so does a failure, raised after them.
        for output, samples in zip(outputs, sizes):
            engine.windows.record(output, samples)
        if failure is not None:
            engine.windows.fail(failure)

    def _count_routers(self, engine: Engine, inputs, pieces, sizes, loss_fn, weights, confirm_start, positions):
        """The counting schedule (``engine.experts.stages``): every stage's router counts and the last
        stage's items over the window, summed over the world. Returns the training schedule's context, in
        which each stage's routers get the term's gradient, and λ · aux of the window."""
        routers, schedules = self.routers, self.schedules
        # per micro-batch on the last stage: (items, not the own loss); a schedule's shape inference may
        # call loss_fn once more with micro-batch 0's index, which its own call then replaces
        counted: list = [(0, False)] * len(pieces)
        losses = _LastStageLosses(schedules, pieces, loss_fn)

        def count(k, output):
            loss, units, item_weighted = loss_and_units(output, sizes[k])
            check_scalar_loss(loss)
            counted[k] = (units, not item_weighted or mean_items(loss_tensor(output)) is None)

        def count_units(outputs, index):
            losses.read(outputs, index, count)
            return zero_from(outputs)

        saved = rng_state()  # the training schedule's forwards draw the same numbers
        self._routers_counted = True
        try:
            with torch.no_grad(), routers.counting(weights), engine.context.running(), positions():
                schedules.run(inputs, len(pieces), count_units, train=False, before_first_message=confirm_start)
        finally:
            restore_rng_state(saved)
            self._routers_counted = False
        confirm_start()  # the ranks' position check, before the window's first collective
        failure = losses.failure
        counts, items, not_own, failed = routers.window_sums(counted, failure is not None or schedules.stage_failed,
                                                             schedules)
        if failed:
            schedules.raise_stage_failure()
            raise failure or failed_on_another_rank("window")
        if not_own:
            raise routers.not_own_loss()
        value, coefficients = routers.term_and_coefficients(counts, items, self._term_weight(engine),
                                                            engine.window_hooks)
        return routers.training(weights, coefficients), value

    def _exchange_held(self, engine: Engine, term) -> None:
        """A held window's counts, summed over the world once every stage has run its forwards (on the
        last stage after its last loss, on the others before their first gradient's receive): the
        coefficients its backwards read. A failure rides the window's statistics as in any window."""
        if not term.exchanged:
            self.routers.exchange_held(term, self.schedules, self._term_weight(engine), engine.window_hooks)

    def _term_weight(self, engine: Engine):
        """What the term's gradient beside the loss is multiplied by, from the window's items U: U · W / G
        (``Accounting.outside_loss_weight``) in the loss scale."""
        one = torch.ones((), dtype=torch.float64, device=self.strategy.device)
        scale = self.strategy.precision.scale_loss(one, 1.0)
        return lambda items: engine.accounting.outside_loss_weight(items) * scale

    def evaluate(self, engine: Engine, batch, loss_fn: LossFn, size: int | None = None) -> float:
        """The mean loss over every rank's ``batch``, in micro-batches of at most ``size``
        samples (default: the plan's). A routed model's own loss (``moe.load_balance: global``) is the
        whole batch's: its language-model part averaged over the items, plus λ · aux of the batch, the
        stages' router counts taken in the same schedule and summed in its one reduction."""
        routed = self.routers is not None and written_for_model(loss_fn)
        batch, loss_fn = self._schedule_form(batch, loss_fn, "eval_batch")
        # (a rank with fewer samples than its peers repeats its last micro-batch with 0 samples)
        pieces = sequence_parts(engine.context, list(engine.window_split.eval_pieces(batch, engine.plan, size)))
        # as many as the schedule runs: the last one repeated with 0 samples
        pieces += [(pieces[-1][0], 0)] * (self.schedules.rules.fitting(len(pieces)) - len(pieces))
        sizes = [n for _, n in pieces]
        device = self.strategy.device
        inputs = equal_chunks([piece[0] for piece, _ in pieces], engine.window_split.schedule_rows())
        chunk = rows_of(inputs) // len(pieces)  # rows of each micro-batch in the schedule
        # on the last stage: Σ loss (times its samples for a mean), Σ units; loss_fn failed; not the own loss
        total = torch.zeros(4, dtype=torch.float64, device=device)
        losses = _LastStageLosses(self.schedules, pieces, loss_fn)
        counting = contextlib.nullcontext()
        if routed:  # the last stage's own loss without the term (0), which is added once after the reduction
            weights = self.routers.row_weights(pieces, sizes, chunk, device)
            counting, self._routers_counted = self.routers.counting(weights), True

        def add(k, output):
            check_scalar_loss(loss_and_units(output, sizes[k])[0])
            total[:2] += torch.stack(evaluation_terms(output, sizes[k]))
            if routed and mean_items(loss_tensor(output)) is None:
                total[3] = 1.0

        def loss_only(outputs, index):
            losses.read(outputs, index, add)
            return zero_from(outputs)

        module = engine.module
        was_training = module.training
        module.eval()
        try:
            positions = self.schedules.positions(packed_positions(pieces, chunk))
            with torch.no_grad(), engine.context.running(), counting, positions():
                self.schedules.run(inputs, len(pieces), loss_only, train=False)
        finally:
            module.train(was_training)
            self._routers_counted = False
        failure = losses.failure
        total[2] = float(failure is not None)
        if routed:  # every stage's router counts ride the same reduction
            total = torch.cat([total, self.routers.window_counts().to(device)])
        # Summed over every rank: the last stages' totals (the other stages add zeros; a last
        # stage's tensor ranks each add the same, which the quotient cancels).
        total = small_sum(total).cpu()
        if total[2] > 0:
            raise failure or failed_on_another_rank("evaluation")
        self.schedules.raise_stage_failure()  # after the evaluation's collectives: the tuner's vote follows
        if total[3] > 0:
            raise self.routers.not_own_loss()
        mean = evaluation_mean(total)
        return mean + float(self.routers.weighted_term(total[4:])) if routed else mean


def pipeline_windows(model: torch.nn.Module, moe, strategy, plan, model_loss: ModelLoss | NoModelLoss,
                     experts) -> PipelineWindows | None:
    """The runner of a pipeline's windows (None without one): the plan's accumulation checked against the
    schedule, unless a token budget (micro-batches of one shape, as many as the schedule runs) or the automatic
    micro size chooses it per window; a routed model's stages under ``moe`` (``engine.experts.stages``), its
    forwards held where its balance (``experts``) holds them."""
    if strategy.mesh.pipeline == 1:
        return None
    chosen_per_window = plan.is_provisional or plan.micro_batch_tokens is not None
    return PipelineWindows(strategy, None if chosen_per_window else plan.gradient_accumulation_steps, model_loss,
                           routers=stage_routers(model, moe, strategy),
                           hold_forwards=experts is not None and experts.holds_forwards)


class _LastStageLosses:
    """The last stage's ``loss_fn(outputs, labels)`` for each micro-batch of one schedule, and the first
    error it raised (kept: raised after the schedule's collectives, on every rank). A zero-weight
    micro-batch (it only keeps the ranks' micro-step counts equal), and every micro-batch after a
    failure (this rank's, or its stage's standing in), calls nothing."""

    def __init__(self, schedules: StageSchedules, pieces: list, loss_fn: LossFn):
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
