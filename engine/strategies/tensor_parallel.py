"""Tensor parallelism composed with data parallelism on one ``DeviceMesh``
(``engine.distributed.mesh``: world = pipeline × data × tensor, tensor innermost).

The planned layers are split over the ``tensor`` dimension by PyTorch's own DTensor engine
(``engine.strategies.parallelize``); the data dimension then holds the model as ZeRO asks:

* ZeRO 0 (:class:`TensorParallel`): every data rank holds its tensor shard of the whole
  model; the gradients are averaged over the data group once per window.
* ZeRO 1 (:class:`TensorParallelZero1`): the same, with the optimizer state of each
  parameter on one data rank, which broadcasts the updated parameter.
* ZeRO 2 / 3 (:class:`TensorFullySharded`): FSDP2 shards each tensor shard again over the
  data group (``fully_shard(mesh=mesh["data"])``, torchtitan's 2-D composition), with
  ``engine.strategies.fsdp``'s memory profile per stage.

What changes against data parallelism alone, and lives here (the engine does not know):
the ranks of one tensor group compute one model replica on the *same* batch, so window
statistics (samples, items, loss) are summed over the data group only; the global gradient
norm counts every shard once and every replicated piece once; and the first
``tensor_parallel.check_batches`` optimizer steps check that the ranks of each tensor group
were given the same inputs (a fingerprint of every input tensor, one small all-gather per
forward), raising on every rank when they differ rather than training on it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.distributed.collectives import (average_used_gradients_, broadcast_, check_peers, failure_vote,
                                           sum_of_squares)
from engine.errors import EngineUsageError
from engine.strategies.base import TorchStrategy, cpu_state_dict, repoint_optimizer
from engine.strategies.fsdp import FullyShardedDataParallel
from engine.distributed.same_batch import batch_fingerprint, check_replicas_equal
from engine.strategies.parallelize import apply_checked_tensor_parallel, resolve_plan
from engine.strategies.zero1 import partition


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a plain tensor is its own piece)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def copies(tensor: torch.Tensor, holders: int) -> int:
    """On how many ranks this rank's piece of ``tensor`` is held identically: the ``holders``
    of the module it belongs to over the number of distinct pieces (mesh dimensions it is
    sharded on)."""
    if not isinstance(tensor, DTensor):
        return holders
    # Every placement but Replicate splits (FSDP2 on a tensor split shards with _StridedShard,
    # which is not a Shard); gradients are never Partial once reduced.
    pieces = math.prod(tensor.device_mesh.size(dim) for dim, placement in enumerate(tensor.placements)
                       if not placement.is_replicate())
    return holders // pieces


class TensorMesh:
    """What a strategy on a mesh with a tensor dimension adds to a data-parallel one. Mixed in
    before the data-parallel strategy's class."""

    communicates_before_closing_backward = True  # split layers communicate in every forward
    norm_in_statistics = False  # the statistics add up over the data group, the norm over the world

    def __init__(self, setup, dist_info):
        super().__init__(setup, dist_info)
        self.layout = setup.mesh
        self._batch_checks_left = setup.tensor_parallel.check_batches
        self._steps_done = 0
        self._guarded = False  # the automatic micro size's failure guard is on

    def gathered(self, modifier_rank):
        raise EngineUsageError(
            f"gathered parameters (GatheredParameters, eng.gathered_parameters) are not available under "
            f"{self.layout.describe()}: read the whole model with eng.full_state_dict(), change it through a "
            "checkpoint (eng.load_checkpoint)")

    def split_model(self, module: torch.nn.Module):
        """Split ``module``'s planned layers over the tensor dimension; returns the data mesh."""
        plan = resolve_plan(module, self.settings.tensor_parallel.plan, self.layout.tensor)
        self.device_mesh = self.layout.device_mesh(self.device.type)
        apply_checked_tensor_parallel(module, self.device_mesh["tensor"], plan)
        data_mesh = self.device_mesh["data"]
        self.data_group = data_mesh.get_group()
        return data_mesh

    # -- the batch of a tensor group ---------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.check_tensor_group_inputs(args, kwargs)
        return super().forward(*args, **kwargs)

    def check_tensor_group_inputs(self, args, kwargs) -> None:
        """During the first ``tensor_parallel.check_batches`` optimizer steps: raise on every
        rank when the ranks of a tensor group were given different inputs (collective)."""
        if self._batch_checks_left:
            self._check_same_inputs(args, kwargs)

    def _check_same_inputs(self, args, kwargs) -> None:
        if self._guarded:
            self.check_peers_before(None)
        mine = batch_fingerprint((args, kwargs), self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)  # every rank learns every group's verdict: all raise together
        tensor = self.layout.tensor
        differing = [list(range(start, start + tensor)) for start in range(0, self.world_size, tensor)
                     if any(not torch.equal(everyone[start], everyone[r]) for r in range(start, start + tensor))]
        if differing:
            groups = "; ".join(f"ranks {ranks[0]}..{ranks[-1]} (data index {self.layout.data_rank(ranks[0])})"
                               for ranks in differing)
            raise EngineUsageError(
                f"tensor parallelism: the ranks of a tensor group were given different inputs at optimizer step "
                f"{self._steps_done + 1} ({groups}). The ranks of one tensor group compute one model replica together "
                f"and must see the same batch: slice the data by eng.plan.rank and eng.plan.world_size (the "
                f"data-parallel index and size, {self.layout.describe()}), or use eng.batches(dataset). "
                "(tensor_parallel.check_batches sets how many steps are checked)")

    def step(self, multiplier, max_norm, want_norm=False, grad_squares=None):
        result = super().step(multiplier, max_norm, want_norm, grad_squares)
        self._steps_done += 1
        if self._batch_checks_left:
            self._batch_checks_left -= 1
        return result

    # -- collectives -------------------------------------------------------------------------
    def all_reduce_sum(self, tensor):
        """Window statistics: the ranks of a tensor group share one batch, so only data ranks add up."""
        if self.layout.data > 1:
            dist.all_reduce(tensor, group=self.data_group)
        return tensor

    # -- surviving a failed micro-step (automatic micro size) ---------------------------------
    # Guards and votes run on the whole world, whatever group the guarded collective uses: a
    # failed rank's one vote must answer every peer's check. The ranks of a tensor group fail
    # together (the same layers on the same batch); one failing alone inside a split layer
    # leaves its group's DTensor collective waiting until the process-group timeout.
    def enable_failure_guard(self):
        self._guarded = True
        super().enable_failure_guard()

    def check_peers_before(self, group) -> None:
        check_peers(None, rank=self.rank, world_size=self.world_size, device=self.device)

    def agree_on_failures(self, failure):
        return failure_vote(failure, self.rank, self.world_size, self.device, None)

    def local_gradients(self):
        return [local(p.grad) for p in self.module.parameters() if p.grad is not None]

    def global_grad_norm(self, grads):
        """Σ over this rank's gradient pieces of their squares, each divided by the number of
        ranks holding the same piece, summed over the world: every shard and every replicated
        gradient counted once (a pipeline stage is held by the data × tensor ranks of its
        pipeline index; every stage's squares join the sum)."""
        stage_ranks = self.layout.data * self.layout.tensor
        by_copies: dict[int, list[torch.Tensor]] = {}
        for p in self.module.parameters():
            if p.grad is not None:
                by_copies.setdefault(copies(p.grad, stage_ranks), []).append(local(p.grad))
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for count, pieces in by_copies.items():
            squares = squares + sum_of_squares(pieces, self.device) / count
        dist.all_reduce(squares)
        return squares.sqrt()

    def full_state_dict(self):
        check_replicas_equal(self.module, self.device_mesh["tensor"].get_group(), "full_state_dict()")
        return cpu_state_dict({name: value.full_tensor() if isinstance(value, DTensor) else value
                               for name, value in self.module.state_dict().items()})

    def save_training_state(self, directory):
        # issue 33: a checkpoint keeps one rank's copy of a replicated parameter: they must agree
        check_replicas_equal(self.module, self.device_mesh["tensor"].get_group(), "saving a checkpoint")
        super().save_training_state(directory)


class TensorParallel(TensorMesh, TorchStrategy):
    """ZeRO 0 on the data dimension: one gradient all-reduce over the data group per window."""

    name = "tensor"

    def setup(self, module, optimizer):
        module = module.to(self.device)
        broadcast_([*module.parameters(), *module.buffers()], src=0)  # every rank starts from rank 0's model
        self.transform(module)  # blocks checkpointed / compiled before their layers are split
        names = {id(p): name for name, p in module.named_parameters()}
        self.split_model(module)
        repoint_optimizer(optimizer, names, module)
        self.module = self.forward_module = module
        self.optimizer = optimizer

    def reduce_gradients(self):
        if self.layout.data == 1:
            return
        average_used_gradients_(self.module.parameters(), self.layout.data, self.device, group=self.data_group,
                                bucket_bytes=self.settings.overlap.reduce_bucket_bytes)


class TensorParallelZero1(TensorParallel):
    """ZeRO 1 on the data dimension: :class:`TensorParallel`'s gradients; each parameter's
    optimizer state lives on one data rank of its tensor column (``engine.strategies.zero1``'s
    partition, by global sizes, so every tensor rank makes the same choice), which broadcasts
    its updated piece to the column after the step."""

    name = "tensor_zero1"

    def setup(self, module, optimizer):
        super().setup(module, optimizer)
        params = [p for p in self.module.parameters() if p.requires_grad]
        owners = partition(params, self.layout.data)
        owner_of = {id(p): r for p, r in zip(params, owners)}
        mine = self.layout.data_rank(self.rank)
        self.params_by_owner = [(dist.get_global_rank(self.data_group, owner),
                                 [p for p, r in zip(params, owners) if r == owner])
                                for owner in range(self.layout.data)]
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if owner_of.get(id(p)) == mine]

    @torch.no_grad()
    def optimizer_step(self):
        self.optimizer.step()
        for source, params in self.params_by_owner:
            broadcast_([local(p) for p in params], src=source, group=self.data_group)


class TensorFullySharded(TensorMesh, FullyShardedDataParallel):
    """ZeRO 2 / 3 on the data dimension: FSDP2 over the data group of tensor-split layers."""

    name = "fsdp"  # its checkpoints are FSDP's: DCP, keyed by parameter names

    def sharding_mesh(self, module):
        return self.split_model(module)
