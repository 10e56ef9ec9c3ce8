"""The 3-D mesh: pipeline × data × tensor (``engine.distributed.mesh``, tensor innermost).

A pipeline (``engine.strategies.pipeline``) whose stages are split over the tensor dimension
(``engine.strategies.parallelize``, PyTorch's DTensor engine), as torchtitan composes them:
each rank cuts the model into stages, keeps its own, and splits the planned layers among them
over its tensor group. The plan is resolved on the whole model (every pattern must match a
module of the model, under the model's own names) and applied to the layers this rank's
stages hold. Then the data dimension holds each stage as ZeRO asks: whole, gradients averaged
over the data group once per window (:class:`TensorPipelineParallel`), or sharded again by
FSDP2 over the data group (:class:`ShardedTensorPipelineParallel`, ZeRO 2 / 3).

The ranks of one tensor group run one stage of one replica on the same micro-batches; each
sends its stage's outputs to the rank of the same tensor index in the next stage. So what
passes between stages must be the whole activation on every tensor rank: a stage may not end
on a layer whose output stays split (a ``colwise`` layer before its ``rowwise`` partner);
such a cut is refused before anything is split, naming the layer.

What spans the mesh: window statistics are summed over the data group (the ranks of a tensor
group, and of a pipeline, share one batch); the clipping norm counts every shard and every replicated
parameter of every stage once (``TensorMesh.global_grad_norm``); ``full_state_dict`` joins
every stage's whole tensors; the first ``tensor_parallel.check_batches`` optimizer steps check
that the ranks of each tensor group were given the same inputs.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from engine.errors import ConfigError
from engine.strategies.base import repoint_optimizer
from engine.strategies.parallelize import apply_tensor_parallel, resolve_plan
from engine.strategies.pipeline import PipelineParallel, ShardedPipelineParallel
from engine.strategies.tensor_parallel import TensorMesh, TensorParallel


def leaves_output_split(style: ParallelStyle) -> bool:
    """Whether a layer split by ``style`` hands on a piece of its output (not the whole)."""
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return not style.output_layouts[0].is_replicate()
    return False


def stage_boundary_problems(pieces: list[list[tuple[str, torch.nn.Module]]], plan: dict) -> list[str]:
    """A stage (but the last) whose last planned layer leaves its output split: the next stage
    would get a piece of the activation on each tensor rank."""
    problems = []
    for index, piece in enumerate(pieces[:-1]):
        last = None
        for part_name, part in piece:
            for name, _ in part.named_modules():
                full = f"{part_name}.{name}" if name else part_name
                if full in plan:
                    last = full
        if last is not None and leaves_output_split(plan[last]):
            problems.append(
                f"pipeline.split: stage {index + 1} ends after {last}, whose output stays split over the tensor "
                f"group ({type(plan[last]).__name__}): the next stage needs the whole activation on every tensor "
                f"rank. Cut where activations are whole (after a rowwise layer: move the split point past "
                f"{last}'s rowwise partner), or give {last} a style with a whole output (colwise_rep)")
    return problems


class TensorPipelineParallel(TensorMesh, PipelineParallel):
    """ZeRO 0: each stage split over its tensor group, whole on its data replicas, whose
    gradients are averaged once per window."""

    name = "pipeline"  # checkpoints: DCP keyed by the model's own names, as the pipeline's

    def split_stages(self, model, pieces):
        plan = resolve_plan(model, self.settings.tensor_parallel.plan, self.layout.tensor)
        problems = stage_boundary_problems(pieces, plan)
        if problems:  # raised on every rank: every rank sees every stage
            raise ConfigError(problems)
        held = dict(self.module.named_modules())
        names = {id(p): name for name, p in self.module.named_parameters()}
        apply_tensor_parallel(self.module, self.device_mesh["tensor"],
                              {name: style for name, style in plan.items() if name in held})
        repoint_optimizer(self.optimizer, names, self.module)

    def run_schedule(self, inputs, micro_batches, loss_fn, *, train):
        # every rank is given its replica's inputs, whatever its stage
        self.check_tensor_group_inputs(inputs if isinstance(inputs, (tuple, list)) else (inputs,), {})
        super().run_schedule(inputs, micro_batches, loss_fn, train=train)

    reduce_gradients = TensorParallel.reduce_gradients  # the gradients' local pieces, over the data group
    full_state_dict = PipelineParallel.full_state_dict  # every stage's pieces, joined


class ShardedTensorPipelineParallel(TensorPipelineParallel, ShardedPipelineParallel):
    """ZeRO 2 / 3: each tensor-split stage sharded again by FSDP2 over its data replicas."""

    name = "pipeline_fsdp"

    reduce_gradients = ShardedPipelineParallel.reduce_gradients  # the schedule reduce-scattered them
