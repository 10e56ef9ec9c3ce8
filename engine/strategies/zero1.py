"""ZeRO stage 1: DDP gradients, optimizer state sharded across ranks.

Each parameter has one owner rank. The user's optimizer keeps its param groups (so a
scheduler built on it keeps working) but each group is narrowed, in place, to the
parameters this rank owns: optimizer state exists only for those. After the step every
owner broadcasts its updated parameters.
"""

from __future__ import annotations

import torch

from engine.distributed.collectives import broadcast_
from engine.strategies.ddp import DataParallel


def partition(params: list[torch.nn.Parameter], world_size: int) -> list[int]:
    """An owner rank for each parameter, balancing element counts (largest first)."""
    load = [0] * world_size
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += params[i].numel()
    return owners


def keep_owned(optimizer: torch.optim.Optimizer, module: torch.nn.Module, rank: int,
               world_size: int) -> list[list[torch.nn.Parameter]]:
    """Narrow ``optimizer``'s groups, in place, to the parameters ``rank`` owns; every rank's
    parameters, by owner."""
    params = [p for p in module.parameters() if p.requires_grad]
    owners = partition(params, world_size)
    owner_of = {id(p): r for p, r in zip(params, owners)}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if owner_of.get(id(p)) == rank]
    return [[p for p, r in zip(params, owners) if r == owner] for owner in range(world_size)]


def broadcast_from_owners(params_by_owner: list[list[torch.nn.Parameter]], bucket_bytes: int | None) -> None:
    """After the owners' step: every rank's parameters equal their owner's (broadcast in
    buckets of ``zero_optimization.allgather_bucket_size``, as DeepSpeed gathers its partitions)."""
    for owner, params in enumerate(params_by_owner):
        broadcast_(params, src=owner, bucket_bytes=bucket_bytes)


class OwnedOptimizerState:
    """ZeRO-1 over a data-parallel strategy (mixed in before it): the optimizer narrowed to the
    parameters this rank owns, and the owners' broadcast after their step."""

    def setup(self, module, optimizer):
        super().setup(module, optimizer)
        self.params_by_owner = keep_owned(optimizer, self.module, self.rank, self.world_size)

    def step_owned(self) -> None:
        self.optimizer.step()
        broadcast_from_owners(self.params_by_owner, self.settings.overlap.allgather_bucket_bytes)


class ShardedOptimizerDataParallel(OwnedOptimizerState, DataParallel):
    name = "zero1"

    def optimizer_step(self):
        self.step_owned()
