"""Pipeline parallelism: this rank holds one stage of the model (two for the interleaved and
zero-bubble schedules) and runs windows as the engine's own schedules (``engine.schedule``: one list of
stage actions per pipeline rank), on ``torch.distributed.pipelining``'s stages and runtime
(``engine.adapters.pipelining.ActionSchedule``).

Ranks: the mesh's ``pipeline`` dimension holds the stages of one model replica (its ranks
pass activations and their gradients point to point); the ``data`` dimension holds replicas
of the same stage, whose gradients are averaged once per window (ZeRO-0; at ZeRO-1 each replica
then steps the share of the stage's optimizer state it owns, ``engine.strategies.zero1``) or which
shard each stage by FSDP2 (ZeRO-2/3). The model is cut first; each rank then applies the same composition
as without a pipeline (``engine.strategies.parallelize``) to the stages it holds: with a tensor
dimension, the plan is resolved on the whole model (every pattern must match a module of the
model, under the model's own names) and its layers held here are split over the tensor group; the
modules of experts and the blocks to checkpoint and compile are likewise found on the whole model.
A stage may not end on a layer whose output stays split (``tensor_plan.stage_boundary_problems``):
each rank sends its stage's outputs to the rank of the same tensor index in the next stage.

Gradient convention (as every strategy): after ``reduce_gradients`` each stage holds the
mean over data-parallel ranks of its accumulated gradients. The schedule's own averaging
over micro-batches (``scale_grads``) is off: the window runner (``engine.window.pipeline``)
weights each micro-batch loss by its real share of the global batch, as the engine does, and
this strategy adds the fp16 loss scale. What spans every stage is computed over the pipeline
group: the clipping norm (each stage's squares summed), an fp16 overflow (any stage's
discards the window everywhere) and ``full_state_dict`` (the stages' pieces joined).

A window's micro-batches must share one shape (each stage infers its shapes once, at its
first step, and sizes every micro-batch's receive buffers from them): a schedule is built per
shape and micro-batch count, the most recent few kept for reuse; ``schedules_built`` counts
them (a token budget's windows of other bucket lengths build others), each build is logged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from torch.distributed.tensor import DTensor

from engine.adapters.pipelining import ActionSchedule, GuardedPipelineStage, NeighbourStage
from engine.adapters.torch_internals import drop_unreduced_gradients, fsdp_held_tensors
from engine.distributed.collectives import small_sum
from engine.errors import ConfigError, EngineUsageError
from engine.schedule import forwards_first, gpipe, interleaved, one_f_one_b, splits_backward, zero_bubble_v
from engine.strategies.model_transforms import ModelBlocks, model_blocks
from engine.pipeline.split import StageModule
from engine.pipeline.stages import split_model
from engine.strategies.base import TorchStrategy, cpu_state_dict, repoint_optimizer
from engine.strategies.sharding import ShardingPolicy, host_offload_policy, shard
from engine.strategies.stage_failures import StageFailures
from engine.strategies.tensor_plan import resolve_plan, stage_boundary_problems
from engine.strategies.torch_checkpoint import load_training_state
from engine.strategies.zero1 import optimizer_state

log = logging.getLogger("engine")

# schedule name -> its order (every pipeline rank's actions, from the ranks and micro-batches)
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zero_bubble": zero_bubble_v}
_RULES = {"1f1b": "at least one micro-batch per pipeline rank",
          "interleaved": "a multiple of its rounds, ⌊micro-batches / pipeline ranks⌋"}
_KEPT_SCHEDULES = 4  # schedules kept for other shapes (each holds its stages' receive buffers)

LossFn = Callable[[object, torch.Tensor], torch.Tensor]


class PipelineParallel(TorchStrategy):
    def __init__(self, setup, dist_info):
        super().__init__(setup, dist_info)
        mesh = self.mesh
        # each stage sharded by FSDP2 over its data replicas (ZeRO 2 / 3, and wherever it offloads)
        self.sharded = mesh.data_sharded
        self.offload_policy = host_offload_policy(setup.offload, self.device)
        self.schedule_name = setup.pipeline.schedule
        self.order_of = SCHEDULES[self.schedule_name]
        self.position = mesh.pipeline_rank(self.rank)
        one = self.order_of(mesh.pipeline, 1)  # where the stages are: the same for any number of micro-batches
        self.stage_indices = list(dict.fromkeys(action.stage for action in one[self.position]))
        self.stages_per_rank = len(self.stage_indices)
        self.num_stages = mesh.pipeline * self.stages_per_rank
        self.splits_backward = splits_backward(one)
        self.pipeline_group = self.groups.submesh(("pipeline",)).get_group()
        self.holds_first_stage = 0 in self.stage_indices
        self.holds_last_stage = self.num_stages - 1 in self.stage_indices
        self._schedules: dict[tuple, _KeptSchedule] = {}
        self.schedules_built = 0  # each new shape and micro-batch count (or one dropped and met again)
        self._step_options = _step_options(ActionSchedule)
        self._loss: LossFn | None = None
        self._failures: StageFailures | None = None  # the automatic micro size's failure guard

    # -- the model -------------------------------------------------------------------------
    def setup(self, module, optimizer):
        self.start_equal(module)  # every rank starts from rank 0's model, as under DDP
        # The blocks to checkpoint and compile are chosen on the whole model, before its cut; each stage
        # wraps those it holds in the same parallelize as every holder (engine.strategies.parallelize).
        blocks = model_blocks(module, self.settings.checkpointing, self.settings.compile)
        self._key_order = list(module.state_dict())
        split = self._split = split_model(module, self.num_stages, self.settings.pipeline.split, self.stages_per_rank)
        pieces = split.pieces
        if self.rank == 0:
            log.info("pipeline: %d stage(s), %s schedule: %s", self.num_stages, self.settings.pipeline.schedule,
                     "; ".join(f"stage {i + 1}: {piece[0][0]}..{piece[-1][0]} "
                               f"({sum(p.numel() for _, m in piece for p in m.parameters())} parameters)"
                               for i, piece in enumerate(pieces)))
        mine = [part for index in sorted(self.stage_indices) for part in pieces[index]]
        # What the user sees (eng.module): this rank's parts under the model's own names.
        self.module = StageModule(mine).to(self.device)
        self.stage_modules = [split.stage(index, self.precision.forward_context,
                                          own_outputs=self.splits_backward).to(self.device)
                              for index in self.stage_indices]
        self._last_stage = self.stage_modules[self.stage_indices.index(self.num_stages - 1)] \
            if self.holds_last_stage else None
        held = {id(p) for p in self.module.parameters()}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in held]
        _release_others(module, [self.module, *self.stage_modules])  # a stage may hold more (rotary embeddings)
        self.optimizer = optimizer
        self.forward_module = self.module
        self._parallelize_stages(module, pieces, blocks)
        if self.sharded:
            self._shard_stages()
        # ZeRO 1: each of the stage's data replicas owns a share of its optimizer state
        self.owned = optimizer_state(self, self.module, self.optimizer)

    def _parallelize_stages(self, model: torch.nn.Module, pieces: list, blocks: ModelBlocks) -> None:
        """The composition every holder applies (``engine.strategies.parallelize``), on the layers this
        rank's stages hold, by what the whole model names: its tensor plan, the modules each dimension
        finds, its blocks to checkpoint and compile (the stages keep the model's names and modules)."""
        held = dict(self.module.named_modules())
        tensor_plan = None
        if self.mesh.tensor > 1:
            plan = resolve_plan(model, self.settings.tensor_parallel.plan, self.mesh.tensor)
            problems = stage_boundary_problems(pieces, plan)
            if problems:  # raised on every rank: every rank sees every stage
                raise ConfigError(problems)
            tensor_plan = {name: style for name, style in plan.items() if name in held}
        names = {id(p): name for name, p in self.module.named_parameters()}
        self.parallelize(self.module, tensor_plan=tensor_plan, whole_model=model,
                         stages=", ".join(str(i + 1) for i in self.stage_indices),
                         blocks=blocks.held(self.module), attention_model=self._attention_model(model))
        repoint_optimizer(self.optimizer, names, self.module)

    def _attention_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """Under context parallelism: the whole model, whose attention the context wraps (its stages
        share the model's configuration and attention modules); None without a context dimension."""
        if self.mesh.context == 1:
            return None
        if not self._split.hands_positions:  # raised on every rank
            raise ConfigError([
                f"context_parallel.size {self.mesh.context} under a pipeline: {type(model).__name__} is cut as a "
                "chain of modules, each stage called with the previous stage's output alone, which cannot carry "
                "the places in the whole sequence of a rank's part (position embeddings would number every part "
                "from 0); use a Hugging Face model with a pipeline plan (each stage runs the model's forward, "
                "handed its part's position_ids), or one of pipeline.stages and context_parallel.size"])
        return model

    def _shard_stages(self) -> None:
        """ZeRO 2 / 3 (and host offload): each stage sharded by FSDP2 over its data replicas, with the
        offload policy where asked. torch's schedules let a
        stage's gradients accumulate unsharded over the window's micro-batches and reduce-scatter
        them (a mean over the replicas) after the last one; stage 3 frees the gathered parameters
        after every forward, stage 2 keeps them."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        # 2-D (replicas, shard group) on a hybrid mesh; the experts' slices are kept out (reduced over their
        # own replicas at the boundary); each stage a root of its own
        policy = ShardingPolicy(self.groups.sharding_mesh(), self.offload_policy, self.group_held)
        shard(policy, self.stage_modules, root_reshards=self.settings.stage == 3)
        repoint_optimizer(self.optimizer, names, self.module)

    def forward(self, *args, **kwargs):
        self.check_manual_loop()

    def check_manual_loop(self):
        raise EngineUsageError(
            f"under a pipeline of {self.mesh.pipeline} stages the accumulation steps are the pipeline's "
            "micro-batches: train with eng.train_batch((inputs, labels), loss_fn) and evaluate with "
            "eng.eval_batch((inputs, labels), loss_fn), where loss_fn(outputs, labels) runs on the last stage; "
            "eng(x) / eng.backward() / eng.step() work with pipeline.stages: 1 only")

    def backward(self, loss, weight):
        self.check_manual_loop()

    def capabilities(self):
        """A stage holds some layers; the last stage's loss records stand for every stage's in the
        window's statistics (the others record none); forwards are held where the order runs them first."""
        return replace(super().capabilities(), holds_every_layer=False, can_hold_forwards=self._forwards_first(),
                       loss_copies=self.mesh.pipeline if self.holds_last_stage else 0)

    def _forwards_first(self) -> bool:
        # A schedule that runs every forward of a window before its first backward, on every stage, for
        # any number of micro-batches (GPipe): the window runner exchanges what the forwards learnt in
        # between (engine.window.pipeline). 1F1B and the interleaved schedules start backwards earlier
        # once a window has more micro-batches than their warm-up (up to 2 per rank shows it).
        ranks = self.mesh.pipeline
        return all(forwards_first(self.order_of(ranks, count))
                   for count in range(1, 2 * ranks + 1) if self.runs_micro_batches(count))

    # -- how many micro-batches a schedule runs -------------------------------------------------
    def runs_micro_batches(self, count: int) -> bool:
        """Whether the schedule runs ``count`` micro-batches: 1F1B at least one per rank (its warm-up fills the
        pipeline; a shorter window would run as GPipe with a longer bubble),
        interleaved 1F1B a multiple of its rounds (⌊count / ranks⌋)."""
        ranks = self.mesh.pipeline
        if self.schedule_name == "1f1b":
            return count >= ranks
        if self.schedule_name == "interleaved":
            return count % max(1, count // ranks) == 0
        return count >= 1

    def fitting_micro_batches(self, count: int) -> int:
        """The fewest micro-batches, at least ``count``, the schedule runs."""
        while not self.runs_micro_batches(count):
            count += 1
        return count

    def check_accumulation(self, accumulation: int) -> None:
        """A ConfigError naming the valid numbers when the schedule cannot run ``accumulation``
        micro-batches per window."""
        if self.runs_micro_batches(accumulation):
            return
        below = next((n for n in range(accumulation - 1, 0, -1) if self.runs_micro_batches(n)), None)
        above = self.fitting_micro_batches(accumulation)
        nearest = f"{below} or {above}" if below else str(above)
        raise ConfigError([
            f"gradient_accumulation_steps: {accumulation} micro-batches per window cannot run as a "
            f"pipeline.schedule {self.settings.pipeline.schedule} over {self.mesh.pipeline} pipeline ranks "
            f"({_RULES[self.schedule_name]}); nearest: {nearest} (change train_micro_batch_size_per_gpu or "
            "train_batch_size), or schedule gpipe"])

    # -- surviving a failed stage (automatic micro size) -----------------------------------------
    def enable_failure_guard(self):
        """A stage that fails in a window keeps its error and stands in for the rest of the
        schedule (``engine.strategies.stage_failures``): no peer is left in a send or receive.
        The window runner raises it with ``raise_stage_failure`` once the schedule and its
        collectives are through; the tuner's vote follows. ZeRO 0 only (engine.config.checks):
        FSDP's collectives inside a stage's forward and backward would not pair up."""
        super().enable_failure_guard()
        self._failures = StageFailures(self.device)
        for stage in self.stage_modules:
            stage.failures = self._failures

    def keep_failure(self, error: BaseException) -> bool:
        """With the failure guard: keep ``error`` (raised by this rank's part of a schedule,
        e.g. its ``loss_fn``) until ``raise_stage_failure``, the rest of the schedule standing
        in (True). Without it: False, nothing kept."""
        if self._failures is None:
            return False
        self._failures.keep(error)
        return True

    @property
    def stage_failed(self) -> bool:
        """Whether this rank's stages failed in the schedule now running (they stand in)."""
        return self._failures is not None and self._failures.error is not None

    def raise_stage_failure(self) -> None:
        """Raise the error this rank's stages kept in the last schedule, if any (on this rank
        only: call it after every collective of the window, before the vote)."""
        if self._failures is not None:
            self._failures.raise_kept()

    # -- running a window --------------------------------------------------------------------
    def run_schedule(self, inputs, micro_batches: int, loss_fn: LossFn, *, train: bool,
                     before_first_message: Callable[[], None] | None = None,
                     before_first_gradient_wait: Callable[[], None] | None = None) -> None:
        """Run ``micro_batches`` micro-batches through the stages: ``inputs`` (a tensor or a tuple
        of tensors, ``micro_batches`` equal chunks along dimension 0; used on the first stage only).
        On the last stage, ``loss_fn(outputs, index)`` gets each micro-batch's outputs and its
        index as a 1-element tensor, and returns its weighted loss (training: back-propagated,
        times the fp16 loss scale; evaluation: a zero computed from the outputs).
        Training runs the schedule's order; evaluation (``train=False``) its forwards alone, a schedule
        of its own. ``before_first_message``: called once before this rank's stages send or receive
        anything (before the schedule where its first run exchanges the stages' shapes).
        ``before_first_gradient_wait``: called once before a stage receives the next stage's first
        gradient, which it would wait for anyway (a last stage receives none)."""
        self._split.check_inputs(_as_tuple(inputs))  # on every rank: one raising alone would hang the others
        if self.same_batch is not None:  # every rank is given its replica's inputs, whatever its stage
            self.same_batch.check(_as_tuple(inputs), {})
        shapes = tuple(tuple(t.shape) for t in _as_tuple(inputs))
        kept = self._schedule((shapes, micro_batches, train))
        schedule = kept.schedule
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
        target = torch.arange(micro_batches, device=self.device)
        args = _as_tuple(inputs) if self.holds_first_stage else ()
        try:
            if train:
                schedule.step(*args, target=target, **self._step_options)
            else:
                schedule.eval(*args, target=target)
        finally:
            self._loss = None
            for stage in kept.stages:
                stage.before_first_message = stage.before_first_gradient_wait = None

    def _scaled_loss(self, output, target):
        return self.precision.scale_loss(self._loss(output, target), 1.0)

    def _schedule(self, key) -> _KeptSchedule:
        kept = self._schedules.pop(key, None)
        if kept is None:
            stages = [self._stage(module, index) for module, index in zip(self.stage_modules, self.stage_indices)]
            build = ActionSchedule if key[2] else ActionSchedule.forwards
            schedule = build(stages, key[1], self._scaled_loss, self.order_of(self.mesh.pipeline, key[1]))
            kept = _KeptSchedule(schedule, stages)
            self.schedules_built += 1
            log.info("pipeline: schedule %d built, %s %d micro-batches of shape %s (the %d most recent are kept)",
                     self.schedules_built, "training" if key[2] else "forwards of", key[1],
                     ", ".join(str([shape[0] // key[1], *shape[1:]]) for shape in key[0]), _KEPT_SCHEDULES)
            if len(self._schedules) >= _KEPT_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
        self._schedules[key] = kept  # most recently used last
        return kept

    def micro_batch_positions(self, positions: list[torch.Tensor] | None):
        """A context in which each stage hands the model micro-batch k's ``positions[k]`` at its k-th
        forward (packed rows' restarting positions, or a context part's places in the whole sequence: a
        stage sees hidden states only, and the schedule runs the micro-batches in order on every stage;
        its shape-learning forward gets micro-batch 0's); None: nothing to hand."""
        if positions is None:
            return contextlib.nullcontext
        if not self._split.hands_positions:
            raise EngineUsageError(
                "packed rows (position_ids) under a pipeline: a model cut as a chain of modules is called with the "
                "previous stage's output alone, which cannot carry the rows' positions; use a Hugging Face model "
                "with a pipeline plan (each stage runs the model's forward with the micro-batch's position_ids), "
                "or pad the documents one per row")
        return functools.partial(_handing_positions, self.stage_modules, positions)

    def model_outputs(self, outputs):
        """What ``loss_fn`` sees of the last stage's ``outputs`` (a Hugging Face model's own output
        type around its logits; other models' outputs as they are), in fp32 where the precision
        policy returns fp32 outputs (autocast: as without a pipeline)."""
        return self._last_stage.model_outputs(self.precision.outputs(outputs))

    def _stage(self, module, index: int) -> PipelineStage:
        if self._failures is None:
            return NeighbourStage(module, index, self.num_stages, self.device, group=self.pipeline_group)
        return GuardedPipelineStage(module, index, self.num_stages, self.device, group=self.pipeline_group,
                                    guard=self._failures)

    def sum_over_world(self, tensor: torch.Tensor) -> torch.Tensor:
        """A small tensor summed over every rank (an evaluation's totals, which only last stages hold)."""
        return small_sum(tensor) if self.world_size > 1 else tensor

    # -- the boundary ------------------------------------------------------------------------------
    def optimizer_step(self):
        self.owned.step()

    def reduce_gradients(self):
        if not self.sharded:  # sharded: the schedule reduce-scattered them after the window's last backward
            self.average_gradients()
        else:
            self.reduce_group_held_gradients()

    def held_tensors(self):
        held = super().held_tensors()
        return held + list(fsdp_held_tensors(self.stage_modules)) if self.sharded else held

    def discard_window(self):
        if self.sharded:
            for stage in self.stage_modules:
                drop_unreduced_gradients(stage, [stage])
        self.zero_grad()

    # -- checkpoints: a DCP checkpoint keyed by the model's own names (each stage writes and
    # reads its own entries), so it loads on any data-parallel size, and on any pipeline size.
    def load_training_state(self, directory):
        load_training_state(self.module, self.optimizer, directory, model_keys=self._key_order,
                            group_held=self.group_held)

    def _stage_state(self) -> dict:
        """This rank's stages' state, whole (sharded or tensor-split entries gathered, experts' slices joined)."""
        return self.group_held.whole({key: value.full_tensor() if isinstance(value, DTensor) else value
                                      for key, value in self.module.state_dict().items()})

    def full_state_dict(self):
        self.check_replicas("full_state_dict()")
        pieces: list = [None] * self.mesh.pipeline
        dist.all_gather_object(pieces, cpu_state_dict(self._stage_state()), group=self.pipeline_group)
        whole = {key: value for piece in pieces for key, value in piece.items()}
        return {key: whole[key] for key in self._key_order if key in whole}


@dataclass
class _KeptSchedule:
    """A schedule built for one shape and mode, its stages on this rank, and whether it ran: its first
    run exchanges the stages' shapes."""

    schedule: object
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


def _release_others(model: torch.nn.Module, mine: list[torch.nn.Module]) -> None:
    """Free the storage of the parameters and buffers of the stages other ranks hold: each rank
    keeps its own stages only (the model passed to ``initialize`` belongs to the engine)."""
    kept = {id(t) for module in mine for t in (*module.parameters(), *module.buffers())}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in kept:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _as_tuple(inputs) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _step_options(schedule_class) -> dict:
    """``return_outputs=False`` where the schedule accepts it (the last stage need not merge
    the outputs of a training window)."""
    return {"return_outputs": False} if "return_outputs" in inspect.signature(schedule_class.step).parameters else {}
