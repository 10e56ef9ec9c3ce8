"""Pipeline parallelism: this rank holds one stage of the model (two for the interleaved and
zero-bubble schedules), where the schedule's order (``engine.schedule``) places them; its windows run
through ``schedules`` (below).

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
over micro-batches (``scale_grads``) is off: the window executor (``engine.window.stages``)
weights each micro-batch loss by its real share of the global batch, as the engine does, and
this strategy adds the fp16 loss scale. What spans every stage is computed over the pipeline
group: the clipping norm (each stage's squares summed), an fp16 overflow (any stage's
discards the window everywhere) and ``full_state_dict`` (the stages' pieces joined).

The windows run through ``schedules`` (``engine.strategies.stage_schedules.StageSchedules``), built
once the stages exist: the schedules per shape and mode, what the stages are handed, a failed stage
standing in.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.adapters.torch_internals import drop_unreduced_gradients, fsdp_held_tensors
from engine.errors import ConfigError, EngineUsageError
from engine.schedule import splits_backward
from engine.strategies.model_transforms import ModelBlocks, model_blocks
from engine.pipeline.split import StageModule
from engine.pipeline.stages import split_model
from engine.strategies.base import TorchStrategy, cpu_state_dict, repoint_optimizer
from engine.strategies.sharding import ShardingPolicy, host_offload_policy, shard
from engine.strategies.stage_schedules import ScheduleRules, StageSchedules
from engine.strategies.tensor_plan import resolve_plan, stage_boundary_problems
from engine.strategies.torch_checkpoint import load_training_state
from engine.strategies.zero1 import optimizer_state

log = logging.getLogger("engine")


class PipelineParallel(TorchStrategy):
    def __init__(self, setup, dist_info):
        super().__init__(setup, dist_info)
        mesh = self.mesh
        # each stage sharded by FSDP2 over its data replicas (ZeRO 2 / 3, and wherever it offloads)
        self.sharded = mesh.data_sharded
        self.offload_policy = host_offload_policy(setup.offload, self.device)
        self.rules = ScheduleRules(setup.pipeline.schedule, mesh.pipeline)
        self.position = mesh.pipeline_rank(self.rank)
        one = self.rules.order(1)  # where the stages are: the same for any number of micro-batches
        self.stage_indices = list(dict.fromkeys(action.stage for action in one[self.position]))
        self.stages_per_rank = len(self.stage_indices)
        self.num_stages = mesh.pipeline * self.stages_per_rank
        self.splits_backward = splits_backward(one)
        self.pipeline_group = self.groups.submesh(("pipeline",)).get_group()
        self.holds_last_stage = self.num_stages - 1 in self.stage_indices
        self.schedules: StageSchedules | None = None  # once the stages exist (setup)

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
        last = self.stage_modules[self.stage_indices.index(self.num_stages - 1)] if self.holds_last_stage else None
        self.schedules = StageSchedules(self.rules, stages=self.stage_modules, indices=self.stage_indices,
                                        count=self.num_stages, last_stage=last, split=split, device=self.device,
                                        group=self.pipeline_group, precision=self.precision,
                                        same_batch=self.same_batch)

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
        return replace(super().capabilities(), holds_every_layer=False, can_hold_forwards=self.rules.forwards_first_in_any_window(),
                       loss_copies=self.mesh.pipeline if self.holds_last_stage else 0)

    def enable_failure_guard(self):
        """A stage that fails in a window stands in for the rest of its schedule
        (``StageSchedules.guard_failures``). ZeRO 0 only (engine.config.checks): FSDP's collectives inside
        a stage's forward and backward would not pair up."""
        super().enable_failure_guard()
        self.schedules.guard_failures()

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


def _release_others(model: torch.nn.Module, mine: list[torch.nn.Module]) -> None:
    """Free the storage of the parameters and buffers of the stages other ranks hold: each rank
    keeps its own stages only (the model passed to ``initialize`` belongs to the engine)."""
    kept = {id(t) for module in mine for t in (*module.parameters(), *module.buffers())}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in kept:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
