"""A pipeline's windows on this rank's stages: the schedules, built per shape and mode, that run them.

The pipeline holder (``engine.strategies.pipeline``) holds the stages; once they exist it builds one
:class:`StageSchedules`, through which the window executor (``engine.window.stages``) runs every window:

* :class:`ScheduleRules`: the schedule's order (``engine.schedule``) for a number of micro-batches, which
  numbers it runs (1F1B at least one per pipeline rank, interleaved a multiple of its rounds), and
  whether it runs every forward before any backward for any window (GPipe's held forwards);
* :meth:`StageSchedules.run`: a window's micro-batches through the stages, as torch's runtime running
  the order (``engine.adapters.pipelining.ActionSchedule``; an evaluation or counting pass its forwards
  alone), built once per shape, micro-batch count and mode, the most recent few kept for reuse;
* what the stages are handed (packed rows' or a context part's positions) and what the last stage's
  ``loss_fn`` sees of its outputs;
* a failed stage standing in for the rest of a schedule (``engine.strategies.stage_failures``), where
  the automatic micro size guards failures.

Every micro-batch of one schedule has one shape: a stage infers its shapes at its schedule's first run
and sizes every micro-batch's receive buffers from them (``built`` counts the schedules built; a token
budget's windows of other bucket lengths build others, each build is logged).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine.adapters.pipelining import ActionSchedule, GuardedPipelineStage, NeighbourStage
from engine.errors import ConfigError, EngineUsageError
from engine.schedule import forwards_first, gpipe, interleaved, one_f_one_b, zero_bubble_v
from engine.strategies.stage_failures import StageFailures

log = logging.getLogger("engine")

# schedule name -> its order (every pipeline rank's actions, from the ranks and micro-batches)
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zero_bubble": zero_bubble_v}
_RULES = {"1f1b": "at least one micro-batch per pipeline rank",
          "interleaved": "a multiple of its rounds, ⌊micro-batches / pipeline ranks⌋"}
_KEPT_SCHEDULES = 4  # schedules kept per mode for other shapes (each holds its stages' receive buffers)

LossFn = Callable[[object, torch.Tensor], torch.Tensor]


class ScheduleRules:
    """``pipeline.schedule`` over ``ranks`` pipeline ranks: its orders and the windows it runs."""

    def __init__(self, name: str, ranks: int):
        self.name, self.ranks = name, ranks
        self._order_of = SCHEDULES[name]

    def order(self, micro_batches: int) -> dict:
        """Every pipeline rank's stage actions for a window of ``micro_batches``."""
        return self._order_of(self.ranks, micro_batches)

    def runs(self, count: int) -> bool:
        """Whether the schedule runs ``count`` micro-batches: 1F1B at least one per rank (its warm-up fills the
        pipeline; a shorter window would run as GPipe with a longer bubble), interleaved 1F1B a multiple of
        its rounds (⌊count / ranks⌋)."""
        if self.name == "1f1b":
            return count >= self.ranks
        if self.name == "interleaved":
            return count % max(1, count // self.ranks) == 0
        return count >= 1

    def fitting(self, count: int) -> int:
        """The fewest micro-batches, at least ``count``, the schedule runs."""
        while not self.runs(count):
            count += 1
        return count

    def check_accumulation(self, accumulation: int) -> None:
        """A ConfigError naming the valid numbers when the schedule cannot run ``accumulation``
        micro-batches per window."""
        if self.runs(accumulation):
            return
        below = next((n for n in range(accumulation - 1, 0, -1) if self.runs(n)), None)
        above = self.fitting(accumulation)
        nearest = f"{below} or {above}" if below else str(above)
        raise ConfigError([
            f"gradient_accumulation_steps: {accumulation} micro-batches per window cannot run as a "
            f"pipeline.schedule {self.name} over {self.ranks} pipeline ranks ({_RULES[self.name]}); nearest: "
            f"{nearest} (change train_micro_batch_size_per_gpu or train_batch_size), or schedule gpipe"])

    def forwards_first_in_any_window(self) -> bool:
        """Whether every window's order runs every forward before its first backward, on every stage (GPipe):
        1F1B and the interleaved schedules start backwards earlier once a window has more micro-batches than
        their warm-up, which up to 2 per rank shows."""
        return all(forwards_first(self.order(count)) for count in range(1, 2 * self.ranks + 1) if self.runs(count))


class StageSchedules:
    """Runs windows through this rank's ``stages`` (their modules, at ``indices`` of ``count`` stages);
    ``last_stage``: the module of the last stage where this rank holds it; ``split``: the model's cut
    (``engine.pipeline.split``), which checks the first stage's inputs and says whether stages take
    positions; ``same_batch``: the tensor group's input check, or None."""

    def __init__(self, rules: ScheduleRules, *, stages: list[torch.nn.Module], indices: list[int], count: int,
                 last_stage: torch.nn.Module | None, split, device: torch.device, group, precision, same_batch):
        self.rules = rules
        self.stages, self.indices, self.count, self.last_stage = stages, indices, count, last_stage
        self.split, self.device, self.group, self.precision = split, device, group, precision
        self.same_batch = same_batch
        self.holds_first_stage = 0 in indices
        self._kept: dict[tuple, _KeptSchedule] = {}
        self.built = 0  # each new shape, micro-batch count and mode (or one dropped and met again)
        self._step_options = _step_options(ActionSchedule)
        self._loss: LossFn | None = None
        self._failures: StageFailures | None = None  # the automatic micro size's failure guard

    # -- surviving a failed stage (automatic micro size) -----------------------------------------
    def guard_failures(self) -> None:
        """A stage that fails in a window keeps its error and stands in for the rest of the schedule
        (``engine.strategies.stage_failures``): no peer is left in a send or receive. The window executor
        raises it with ``raise_stage_failure`` once the schedule and its collectives are through; the
        tuner's vote follows."""
        self._failures = StageFailures(self.device)
        for stage in self.stages:
            stage.failures = self._failures

    def keep_failure(self, error: BaseException) -> bool:
        """With the failure guard: keep ``error`` (raised by this rank's part of a schedule, e.g. its
        ``loss_fn``) until ``raise_stage_failure``, the rest of the schedule standing in (True). Without
        it: False, nothing kept."""
        if self._failures is None:
            return False
        self._failures.keep(error)
        return True

    @property
    def failures_voted(self) -> bool:
        """Whether a failure in a window is voted on by every rank after it (the failure guard is on): a rank
        that only learns of another's failure then leaves the window to the vote."""
        return self._failures is not None

    @property
    def stage_failed(self) -> bool:
        """Whether this rank's stages failed in the schedule now running (they stand in)."""
        return self._failures is not None and self._failures.error is not None

    def raise_stage_failure(self) -> None:
        """Raise the error this rank's stages kept in the last schedule, if any (on this rank only: call
        it after every collective of the window, before the vote)."""
        if self._failures is not None:
            self._failures.raise_kept()

    # -- running a window --------------------------------------------------------------------
    def run(self, inputs, micro_batches: int, loss_fn: LossFn, *, train: bool,
            before_first_message: Callable[[], None] | None = None,
            before_first_gradient_wait: Callable[[], None] | None = None) -> None:
        """Run ``micro_batches`` micro-batches through the stages: ``inputs`` (a tensor or a tuple of
        tensors, ``micro_batches`` equal chunks along dimension 0; used on the first stage only). On the
        last stage, ``loss_fn(outputs, index)`` gets each micro-batch's outputs and its index as a
        1-element tensor, and returns its weighted loss (training: back-propagated, times the fp16 loss
        scale; evaluation: a zero computed from the outputs). Training runs the schedule's order;
        evaluation (``train=False``) its forwards alone, a schedule of its own. ``before_first_message``:
        called once before this rank's stages send or receive anything (before the schedule where its
        first run exchanges the stages' shapes). ``before_first_gradient_wait``: called once before a stage
        receives the next stage's first gradient, which it would wait for anyway (a last stage receives
        none)."""
        self.split.check_inputs(_as_tuple(inputs))  # on every rank: one raising alone would hang the others
        if self.same_batch is not None:  # every rank is given its replica's inputs, whatever its stage
            self.same_batch.check(_as_tuple(inputs), {})
        shapes = tuple(tuple(t.shape) for t in _as_tuple(inputs))
        kept = self._schedule((shapes, micro_batches, train))
        if before_first_message is not None:
            if kept.ran:
                for stage in kept.stages:
                    stage.before_first_message = before_first_message
            else:
                before_first_message()
        kept.ran = True
        for stage in kept.stages:
            stage.before_first_gradient_wait = before_first_gradient_wait
        self._loss = loss_fn
        if self._failures is not None:
            self._failures.clear()
        # each micro-batch's index, read on the host by the last stage's loss: kept there (no device sync)
        target = torch.arange(micro_batches)
        args = _as_tuple(inputs) if self.holds_first_stage else ()
        try:
            if train:
                kept.schedule.step(*args, target=target, **self._step_options)
            else:
                kept.schedule.eval(*args, target=target, **self._step_options)
        finally:
            self._loss = None
            for stage in kept.stages:
                stage.before_first_message = stage.before_first_gradient_wait = None

    def _scaled_loss(self, output, target):
        return self.precision.scale_loss(self._loss(output, target), 1.0)

    def _schedule(self, key) -> _KeptSchedule:
        kept = self._kept.pop(key, None)
        if kept is None:
            stages = [self._stage(module, index) for module, index in zip(self.stages, self.indices)]
            build = ActionSchedule if key[2] else ActionSchedule.forwards
            kept = _KeptSchedule(build(stages, key[1], self._scaled_loss, self.rules.order(key[1])), stages)
            self.built += 1
            log.info("pipeline: schedule %d built, %s %d micro-batches of shape %s (the %d most recent of each "
                     "mode are kept)",
                     self.built, "training" if key[2] else "forwards of", key[1],
                     ", ".join(str([shape[0] // key[1], *shape[1:]]) for shape in key[0]), _KEPT_SCHEDULES)
            same_mode = [kept_key for kept_key in self._kept if kept_key[2] == key[2]]
            if len(same_mode) >= _KEPT_SCHEDULES:  # the least recently used of this mode
                self._kept.pop(same_mode[0])
        self._kept[key] = kept  # most recently used last
        return kept

    def _stage(self, module, index: int) -> NeighbourStage:
        if self._failures is None:
            return NeighbourStage(module, index, self.count, self.device, group=self.group)
        return GuardedPipelineStage(module, index, self.count, self.device, group=self.group, guard=self._failures)

    # -- what the stages are handed, and what the loss sees ------------------------------------------------
    def positions(self, positions: list[torch.Tensor] | None):
        """A context in which each stage hands the model micro-batch k's ``positions[k]`` at its k-th
        forward (packed rows' restarting positions, or a context part's places in the whole sequence: a
        stage sees hidden states only, and the schedule runs the micro-batches in order on every stage;
        its shape-learning forward gets micro-batch 0's); None: nothing to hand."""
        if positions is None:
            return contextlib.nullcontext
        if not self.split.hands_positions:
            raise EngineUsageError(
                "packed rows (position_ids) under a pipeline: a model cut as a chain of modules is called with the "
                "previous stage's output alone, which cannot carry the rows' positions; use a Hugging Face model "
                "with a pipeline plan (each stage runs the model's forward with the micro-batch's position_ids), "
                "or pad the documents one per row")
        return functools.partial(_handing_positions, self.stages, positions)

    def model_outputs(self, outputs):
        """What ``loss_fn`` sees of the last stage's ``outputs`` (a Hugging Face model's own output
        type around its logits; other models' outputs as they are), in fp32 where the precision
        policy returns fp32 outputs (autocast: as without a pipeline)."""
        return self.last_stage.model_outputs(self.precision.outputs(outputs))


@dataclass
class _KeptSchedule:
    """A schedule built for one shape and mode, its stages on this rank, and whether it ran: its first
    run exchanges the stages' shapes."""

    schedule: ActionSchedule
    stages: list[NeighbourStage]
    ran: bool = False


@contextlib.contextmanager
def _handing_positions(stages: list[torch.nn.Module], positions: list[torch.Tensor]):
    saved = [stage.part_positions for stage in stages]
    for stage in stages:
        stage.part_positions = _PositionsInOrder(stage, positions)
    try:
        yield
    finally:
        for stage, own in zip(stages, saved):
            stage.part_positions = own


class _PositionsInOrder:
    """One stage's micro-batch positions, in the order its forwards come."""

    def __init__(self, stage: torch.nn.Module, positions: list[torch.Tensor]):
        self.stage, self.positions, self.next = stage, positions, 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if getattr(self.stage, "learning_shapes", False):  # torch's shape inference: micro-batch 0's shape
            return self.positions[0].to(hidden.device)
        self.next += 1
        return self.positions[self.next - 1].to(hidden.device)


def _as_tuple(inputs) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _step_options(schedule_class) -> dict:
    """``return_outputs=False`` where the schedule accepts it (the last stage need not keep and merge
    every micro-batch's outputs: the loss was read from each)."""
    return {"return_outputs": False} if "return_outputs" in inspect.signature(schedule_class.step).parameters else {}
