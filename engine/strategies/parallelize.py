"""The composition of parallelisms on one mesh, in a fixed order, for every way of holding a model:

    tensor → documents → context → experts → activation checkpointing → compile → (data sharding)

Each step runs where its mesh dimension splits (the size guards below), on the groups of
``engine.distributed.mesh.MeshGroups``; the holder (``engine.strategies``) shards or replicates
the data dimension right after, since that is what differs between ZeRO stages. Under a pipeline
the model is cut first and each rank applies the same steps to the stages it holds: the tensor
plan is resolved on the whole model (its names) and given here for the layers held.

The model transforms run last but for the data sharding, as torchtitan orders them: they wrap
block forwards (``engine.strategies.model_transforms``). Under a pipeline the blocks are chosen on the
whole model before its cut (a Hugging Face model's ``_no_split_modules`` is the root's, and
``every``-th counts over all of them) and each stage's holder hands the ones it holds here.
A new dimension is one more guarded step here and the module that implements it.

Documents (``packing: true``): a Hugging Face decoder's attention within each document of a packed
row (``engine.attention``), before the context step, which wraps the model's attention as it then is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.attention.hugging_face import apply_document_attention
from engine.context.parallel import ContextParallel
from engine.distributed.group_held import NO_GROUP_HELD, GroupHeldParameters
from engine.experts.parallel import ExpertShards, stage_expert_modules
from engine.strategies.model_transforms import CheckpointSwitch, ModelBlocks, model_blocks, transform_blocks
from engine.config.setup import Setup
from engine.strategies.tensor_plan import apply_checked_tensor_parallel, apply_tensor_parallel, resolve_plan


class Parallelized(NamedTuple):
    """What ``parallelize`` leaves for the holder and the engine."""

    checkpoint_switch: CheckpointSwitch | None  # activation_checkpointing: auto's switch
    context: ContextParallel | None  # the context dimension's batch split and attention exchange
    group_held: GroupHeldParameters  # parameters held apart (split experts), NO_GROUP_HELD without


def parallelize(module: torch.nn.Module, setup: Setup, groups, *, tensor_plan: dict | None = None,
                whole_model: torch.nn.Module | None = None, stages: str = "", blocks: ModelBlocks | None = None,
                attention_model: torch.nn.Module | None = None) -> Parallelized:
    """Apply the setup's model-parallel dimensions, then activation checkpointing and compile, to
    ``module`` in place. ``groups``: the mesh's ``MeshGroups`` (None on a mesh of
    data ranks only); ``tensor_plan``: the resolved plan of the layers ``module`` holds (a pipeline
    stage's), else the setup's, resolved on ``module``; ``whole_model``: the model a pipeline stage
    ``module`` is part of (keeping its names; ``stages``: the stage numbers), on which each dimension that
    names modules finds them (the experts), else ``module`` itself; ``blocks``: those to checkpoint and compile, chosen on the
    whole model (a pipeline stage's), else found on ``module``; ``attention_model``: the model whose
    attention the context dimension wraps when it is not ``module`` (a pipeline cut by a Hugging Face
    model's plan: the whole model, whose configuration and attention its stages share; the stages
    hand their parts' positions themselves). Returns the switch of
    ``activation_checkpointing: auto`` (else None), the context dimension's split (else None) and
    the parameters held apart (the split experts, else ``NO_GROUP_HELD``)."""
    mesh = setup.mesh
    if mesh.tensor > 1:
        if tensor_plan is not None:  # a pipeline stage's layers: the probe needs the whole model's input
            apply_tensor_parallel(module, groups.submesh(("tensor",)), tensor_plan)
        else:  # the whole model: checked against what it computed before the split (issue 33)
            plan = resolve_plan(module, setup.tensor_parallel.plan, mesh.tensor)
            apply_checked_tensor_parallel(module, groups.submesh(("tensor",)), plan)
    if setup.packing:
        apply_document_attention(module)
    context = apply_context_parallel(module, setup, groups, attention_model) if mesh.context > 1 else None
    group_held = apply_expert_parallel(module, setup, groups, whole_model, stages) if mesh.expert > 1 \
        else NO_GROUP_HELD
    blocks = blocks if blocks is not None else model_blocks(module, setup.checkpointing, setup.compile)
    return Parallelized(transform_blocks(blocks, setup.checkpointing, setup.compile), context, group_held)


def apply_context_parallel(module: torch.nn.Module, setup: Setup, groups,
                           attention_model: torch.nn.Module | None = None) -> ContextParallel:
    """Split each sequence over the mesh's ``context`` dimension: the model's attention wrapped in
    the exchange, its forward in the part's positions (``engine.context.parallel``); the engine
    splits each batch and weighs each loss with what this returns. With ``attention_model`` (a
    pipeline's whole model): its attention only, the stages asking the context for positions."""
    section = setup.context_parallel
    context = ContextParallel(setup.mesh, groups, method=section.method, labels=section.labels,
                              check_micro_batches=section.check_micro_batches)
    if attention_model is None:
        context.apply(module)
    else:
        context.apply_attention(attention_model)
    return context


def apply_expert_parallel(module: torch.nn.Module, setup: Setup, groups, whole_model: torch.nn.Module | None = None,
                          stages: str = "") -> ExpertShards:
    """Split the model's experts over the mesh's expert groups (inside data × context): each rank
    keeps its slice, tokens are dispatched to their expert's rank (``engine.experts.parallel``); the
    holder keeps the returned experts out of its data sharding and reduces their gradients."""
    patterns = list(setup.expert_modules) if setup.expert_modules else None
    if whole_model is not None:  # a pipeline stage: the whole model's modules of experts that it holds
        patterns = stage_expert_modules(whole_model, patterns, module, stages)
    experts = ExpertShards(groups, setup.mesh, groups.rank)
    experts.apply(module, patterns)
    return experts
