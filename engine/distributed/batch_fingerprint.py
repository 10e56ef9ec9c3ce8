"""Ranks that must see the same batch check it at every window, inside an all-reduce the window
makes anyway; replicated parameters are checked equal across their group where they are saved.
(``engine.strategies.same_batch`` also compares every forward's inputs across a tensor group in
the manual loop's first steps, with the same :func:`batch_fingerprint`.)

The ranks of one data index — its pipeline stages, context and tensor ranks (``mesh.SAME_BATCH``)
— compute one model replica together and must be handed the same batch. A script that slices
its data by the global rank instead of ``eng.plan.rank`` gives them different ones, and the
run trains, silently, on a mixture (stage 0 on one rank's inputs, the last stage on another
rank's labels; tensor ranks whose replicated parameters drift apart).

The check costs no collective of its own. At a ``train_batch`` boundary the window's statistics
(loss, samples, token counts) are summed over the data ranks in one small all-reduce; on a
mesh that all-reduce spans the whole world instead, with the statistics divided by the
pipeline × tensor copies of them it then adds up (every stage and tensor rank of a replica
holds the same statistics; context ranks hold shares), and it carries a *fingerprint* of the
window's batch (:func:`batch_fingerprint`: three numbers, not the data) in a slot per position
inside the replica. Summed over the world, slot ``j`` holds the sum over every replica of the
fingerprint of its ``j``-th rank: when every replica's ranks saw the same batch, every slot
holds the same sum; when some replica's did not, the slots differ (but for a negligible chance
of differences cancelling between replicas), on every rank alike, so every rank raises the same
error at the same boundary, before the update is applied.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.distributed.collectives import small_sum
from engine.distributed.mesh import SAME_BATCH, STATISTICS_COPIES, MeshLayout
from engine.errors import EngineUsageError

FINGERPRINT_SIZE = 3


def batch_fingerprint(tree, device) -> torch.Tensor:
    """Three float64 numbers that differ, but for a negligible chance, between batches that differ:
    the number of elements and, weighted by each tensor's position in ``tree``, their sums and
    index-weighted sums, each kept as a 40-bit whole number folded from its float64 pattern: sums
    of up to 2**13 of them are exact in any order, so equal fingerprints add up alike however a
    reduction orders its additions (a ring all-reduce over many ranks does not add every slot in
    the same order). Computed on ``device``; no host sync."""
    values = torch.zeros(FINGERPRINT_SIZE, dtype=torch.float64, device=device)
    for position, tensor in enumerate(_tensors(tree), start=1):
        flat = tensor.detach().reshape(-1).to(device=device, dtype=torch.float64)
        values[0] += position * flat.numel()
        values[1] += position * flat.sum()
        values[2] += position * (flat @ _index_weights(flat.numel(), device))
    values.nan_to_num_(nan=-1.0)  # equal batches holding NaN (or +inf and -inf) compare equal
    bits = values.view(torch.int64)
    return ((bits ^ (bits >> 24)) & _LOW_BITS).to(torch.float64)  # the exponent folded onto the low bits


_LOW_BITS = (1 << 40) - 1


def _index_weights(numel: int, device: torch.device) -> torch.Tensor:
    """1, 2, ..., 13, 1, 2, ... (``numel`` of them). Every window of a run fingerprints batches of
    the same few shapes: up to 8 MB each, they are made once and kept."""
    return _kept_weights(numel, device) if numel <= _KEPT_WEIGHTS_MAX else _weights(numel, device)


_KEPT_WEIGHTS_MAX = 1 << 20  # elements (float64)


def _weights(numel: int, device: torch.device) -> torch.Tensor:
    return torch.arange(numel, device=device, dtype=torch.float64).remainder_(13).add_(1)


_kept_weights = functools.lru_cache(maxsize=8)(_weights)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


class ReplicaBatchCheck:
    """The window-statistics all-reduce of a mesh with ranks that must see the same batch,
    carrying their batch fingerprints (module docstring)."""

    def __init__(self, layout: MeshLayout, rank: int):
        self.layout = layout
        self.copies = layout.size(STATISTICS_COPIES)  # ranks holding the same window statistics
        self.slots = layout.size(SAME_BATCH)
        self.slot = layout.index_in(SAME_BATCH, rank)

    @staticmethod
    def needed(layout: MeshLayout) -> bool:
        return layout.size(SAME_BATCH) > 1

    def reduce(self, stats: torch.Tensor, fingerprint: torch.Tensor,
               world_sums: torch.Tensor | None = None) -> torch.Tensor:
        """``stats`` summed over the data (× context) ranks, as the strategy's window-statistics
        reduction gives them, then ``world_sums`` (a scalar, or None) summed over the world, in one
        all-reduce over the world that also compares every replica's batch fingerprints; raises
        EngineUsageError on every rank when they differ. Collective."""
        device, n = stats.device, stats.numel()
        sums = torch.zeros(0, dtype=torch.float64, device=device) if world_sums is None else world_sums.reshape(1)
        carried = torch.zeros(self.slots, FINGERPRINT_SIZE, dtype=torch.float64, device=device)
        carried[self.slot] = fingerprint.to(device)
        combined = torch.cat([stats.to(torch.float64), sums.to(device=device, dtype=torch.float64),
                              carried.reshape(-1)])
        combined = small_sum(combined)
        slots = combined[n + sums.numel():].reshape(self.slots, FINGERPRINT_SIZE)
        if not bool((slots == slots[0]).all()):  # reads the reduced tensor, which the step reads anyway
            raise EngineUsageError(self._different(slots))
        return torch.cat([combined[:n] / self.copies, combined[n:n + sums.numel()]]).to(stats.dtype)

    def _different(self, slots: torch.Tensor) -> str:
        layout = self.layout
        odd = [index for index in range(self.slots) if not torch.equal(slots[index], slots[0])]
        names = [dim for dim in SAME_BATCH if getattr(layout, dim) > 1]
        return (f"the ranks of one data index ({' × '.join(names)}: {self.slots} ranks, one model replica) were "
                f"given different batches in this window (position {odd[0]} of {self.slots} in a replica differs "
                f"from position 0; {layout.describe()}). They compute one replica together and must see the same "
                "batch: slice the data by eng.plan.rank and eng.plan.world_size (the data-parallel index and size), "
                "not by the global rank, or use eng.batches(dataset). The window was not applied.")


def check_replicas_equal(module: torch.nn.Module, tensor_group, what: str) -> None:
    """Every parameter of ``module`` not split over the tensor dimension is replicated on the
    ranks of ``tensor_group``: check, in one all-reduce over that group (a fingerprint slot per
    rank), that their copies are equal, before ``what`` (a save) takes one rank's copy for all.
    Raises EngineUsageError naming the parameters that differ, on every rank of the group."""
    replicated = [(name, p) for name, p in module.named_parameters() if not _split_over_tensor(p)]
    size = dist.get_world_size(tensor_group)
    if size == 1 or not replicated:
        return
    device = replicated[0][1].device
    carried = torch.zeros(size, len(replicated), FINGERPRINT_SIZE, dtype=torch.float64, device=device)
    mine = dist.get_rank(tensor_group)
    for index, (_, p) in enumerate(replicated):
        carried[mine, index] = batch_fingerprint(p.to_local() if isinstance(p, DTensor) else p, device)
    dist.all_reduce(carried, group=tensor_group)
    differs = [name for index, (name, _) in enumerate(replicated)
               if not bool((carried[:, index] == carried[0, index]).all())]
    if differs:
        raise EngineUsageError(
            f"{what}: replicated parameters differ between the ranks of a tensor group ({', '.join(differs[:5])}"
            f"{', ...' if len(differs) > 5 else ''}): a save would keep one rank's copy. They drift apart when the "
            "ranks of a tensor group train on different batches (slice the data by eng.plan.rank, or use "
            "eng.batches), or when a script changes one rank's parameters")


def _split_over_tensor(p: torch.Tensor) -> bool:
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return any(name == "tensor" and not placement.is_replicate() for name, placement in zip(names, p.placements))
