"""The ranks of one tensor group compute one model replica together and must be given the same
batch: during the first ``tensor_parallel.check_batches`` optimizer steps every forward compares a
fingerprint of its inputs across each tensor group (one small all-gather), raising on every rank
when they differ rather than training on it. This is the manual loop's check; ``train_batch``
windows are checked at every window, in the window statistics' all-reduce
(``engine.distributed.batch_fingerprint``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.distributed.batch_fingerprint import batch_fingerprint
from engine.errors import EngineUsageError


class SameBatchCheck:
    """The check of one strategy (``strategy``: its rank, world, device, mesh and failure guard)."""

    def __init__(self, strategy, steps: int):
        self.strategy = strategy
        self.steps_left = steps
        self.steps_done = 0
        self.guarded = False  # the automatic micro size's failure guard is on: check the peers first

    def check(self, args, kwargs) -> None:
        """Raise on every rank when the ranks of a tensor group were given different inputs
        (collective, during the checked steps only)."""
        if not self.steps_left:
            return
        strategy, mesh = self.strategy, self.strategy.mesh
        if self.guarded:
            strategy.check_peers_before(None)
        mine = batch_fingerprint((args, kwargs), strategy.device)
        everyone = [torch.empty_like(mine) for _ in range(strategy.world_size)]
        dist.all_gather(everyone, mine)  # every rank learns every group's verdict: all raise together
        differing = sorted({tuple(ranks) for ranks in (mesh.group_ranks(("tensor",), r) for r in range(strategy.world_size))
                            if any(not torch.equal(everyone[ranks[0]], everyone[r]) for r in ranks)})
        if differing:
            groups = "; ".join(f"ranks {ranks[0]}..{ranks[-1]} (data index {mesh.data_rank(ranks[0])})"
                               for ranks in differing)
            raise EngineUsageError(
                f"tensor parallelism: the ranks of a tensor group were given different inputs at optimizer step "
                f"{self.steps_done + 1} ({groups}). The ranks of one tensor group compute one model replica together "
                f"and must see the same batch: slice the data by eng.plan.rank and eng.plan.world_size (the "
                f"data-parallel index and size, {mesh.describe()}), or use eng.batches(dataset). "
                "(tensor_parallel.check_batches sets how many steps are checked)")

    def step_done(self) -> None:
        self.steps_done += 1
        if self.steps_left:
            self.steps_left -= 1
