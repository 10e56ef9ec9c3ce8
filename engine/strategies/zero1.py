"""ZeRO stage 1 without sharding the model: optimizer state owned, one owner per parameter.

Each parameter has one owner among the ranks of its gradient-reduction group (data × context).
The user's optimizer keeps its param groups (so a scheduler built on it keeps working) but each
group is narrowed, in place, to the parameters this rank owns: optimizer state exists only for
those. After the owners' step every owner broadcasts its updated parameters (this rank's
tensor pieces, under a tensor split) to its group. A policy of the replicated holders
(``engine.strategies.ddp``, ``engine.strategies.replicas``, and each stage of
``engine.strategies.pipeline``: Megatron's distributed optimizer with pipelining), not a holder of
its own: where it applies is decided with the setup (``Setup.owns_optimizer_state``),
:func:`optimizer_state` builds it, :class:`WholeOptimizerState` its null object.
"""

from __future__ import annotations

import torch

from engine.distributed.collectives import broadcast_
from engine.distributed.mesh import GRADIENT_REDUCTION
from engine.strategies.gradients import local


def partition(params: list[torch.nn.Parameter], world_size: int) -> list[int]:
    """An owner rank for each parameter, balancing element counts (largest first; a DTensor's
    global count, so every tensor rank of a column makes the same choice)."""
    load = [0] * world_size
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += params[i].numel()
    return owners


def optimizer_state(strategy, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """How a holder's ``optimizer`` steps ``module``: owned shares at ZeRO 1 over more than one replica
    (:class:`OwnedOptimizerState`), else whole on every rank (and where FSDP2 shards the data dimension:
    ZeRO 1 with host offload, whose shards each rank steps)."""
    if strategy.settings.owns_optimizer_state:
        return OwnedOptimizerState(strategy, module, optimizer)
    return WholeOptimizerState(optimizer)


class WholeOptimizerState:
    """Every rank holds the whole optimizer state and steps it (ZeRO 0, or a single replica)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.step()


class OwnedOptimizerState:
    """``optimizer`` narrowed to what ``strategy``'s rank owns of ``module``'s parameters."""

    def __init__(self, strategy, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.group = strategy.group_of(GRADIENT_REDUCTION)
        self.bucket_bytes = strategy.settings.overlap.allgather_bucket_bytes
        ranks = strategy.mesh.group_ranks(GRADIENT_REDUCTION, strategy.rank)  # global ranks, in group order
        # Parameters held apart (engine.distributed.group_held) differ between the group's ranks: each keeps its own.
        held_apart = strategy.group_held.holds
        params = [p for p in module.parameters() if p.requires_grad and not held_apart(p)]
        owners = partition(params, len(ranks))
        mine = ranks.index(strategy.rank)
        owner_of = {id(p): owner for p, owner in zip(params, owners)}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"]
                               if owner_of.get(id(p)) == mine or held_apart(p)]
        self.params_by_owner = [(ranks[owner], [p for p, o in zip(params, owners) if o == owner])
                                for owner in range(len(ranks))]

    @torch.no_grad()
    def step(self) -> None:
        """The owners' step, then every rank's parameters equal their owner's (broadcast in buckets
        of ``zero_optimization.allgather_bucket_size``, as DeepSpeed gathers its partitions)."""
        self.optimizer.step()
        for source, params in self.params_by_owner:
            broadcast_([local(p) for p in params], src=source, group=self.group, bucket_bytes=self.bucket_bytes)
