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
    """Three float64 whole numbers below 2**40 (120 bits) that tell different batches apart.

    Every tensor of ``tree`` is read as the int64 view of its elements (floats widened to float64
    first, so float32 and float64 holding the same values agree; one NaN pattern, +0.0 for -0.0).
    Each element ``x`` at flat index ``i`` — its row and its position in the row, ``divmod(i, row
    length)`` — is keyed by ``i`` and by a seed that mixes in the tensor's shape (so its row length)
    and its place in ``tree``: ``z = mix(x ^ key(i) ^ seed)`` (``mix``: splitmix64's finaliser, a
    bijection of 64-bit words whose every output bit depends on every input bit), and the
    fingerprint is the pair of 64-bit sums ``Σ z`` and ``Σ z·odd(i)``, modulo 2**64, cut to 120
    bits. A swap, a rotation, a shifted row, one changed token or rows differing only in padding
    change the keyed word of every element they move or change, and no structure of the data (a
    period, a row length) lines up with the keys, as the old period-13 position weights did.

    Collision probability, modelling ``mix`` and the keys as random: two different batches give
    equal fingerprints with probability about 2**-120 when their keyed words differ as multisets
    (the two sums' differences are then independent and uniform: the multiset-hash argument), and
    their keyed words coincide as multisets only if each moved element's keyed word equals another
    element's, 2**-64 a pair. So a batch of n elements (n below 2**24) collides with a different one
    with probability below about n·2**-64 < 2**-40, and typically 2**-120. Not a cryptographic
    hash: data crafted against the public keys can collide.

    The sums wrap modulo 2**64, exact in any order; the three 40-bit parts stay exact when up to
    2**13 fingerprints are summed in float64 in any order (a ring all-reduce over many ranks does
    not add every slot in the same order). Computed on ``device``, in place on one copy of each
    chunk of ``_CHUNK`` elements; no host sync."""
    sums = torch.zeros(2, dtype=torch.int64, device=device)
    for position, tensor in enumerate(_tensors(tree), start=1):
        words = _int64_view(tensor.detach().to(device))
        seed = _seed(position, tuple(tensor.shape))
        for chunk, start in enumerate(range(0, words.numel(), _CHUNK)):
            part = words[start:start + _CHUNK]
            keys, odd = _keys(part.numel(), device)
            mixed = _mix_(torch.bitwise_xor(part, keys).bitwise_xor_(_mix_int(seed + chunk, signed=True)))
            sums[0] += mixed.sum()
            sums[1] += mixed.mul_(odd).sum()
    low, high = sums[0], sums[1]
    parts = torch.stack([low & _LOW_BITS,
                         _shift_right(low, 40) | ((high & 0xFFFF) << 24),
                         _shift_right(high, 16) & _LOW_BITS])
    return parts.to(torch.float64)


_LOW_BITS = (1 << 40) - 1
_CHUNK = 1 << 20  # elements hashed at a time, keyed by index within the chunk and by the chunk's number
_WORD = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(value: int) -> int:
    """A 64-bit word as the int64 torch holds."""
    value &= _WORD
    return value - (1 << 64) if value >= 1 << 63 else value


_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` keeps the sign)."""
    return (words >> bits) & ((1 << (64 - bits)) - 1)


def _mix_(words: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 words, in place (multiplication wraps modulo 2**64)."""
    shifted = torch.empty_like(words)
    for bits, factor in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(words, bits, out=shifted)
        words.bitwise_xor_(shifted.bitwise_and_((1 << (64 - bits)) - 1))
        if factor is not None:
            words.mul_(factor)
    return words


def _mix_int(value: int, signed: bool = False) -> int:
    """``_mix_`` on one Python int (the same words)."""
    value &= _WORD
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _WORD
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _WORD
    value ^= value >> 31
    return _signed(value) if signed else value


def _seed(position: int, shape: tuple) -> int:
    """One tensor's seed: its place in the tree and its shape (so its row length), mixed."""
    seed = _mix_int(position * _GOLDEN)
    for size in (len(shape), *shape):
        seed = _mix_int(seed ^ (size + _GOLDEN))
    return seed


def _int64_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as int64 words, flat: integers and booleans widened, floating point
    (and complex, as its real pairs) widened to float64 and read bit for bit, with one NaN
    pattern and +0.0 for -0.0 (equal batches holding NaN compare equal)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    flat = tensor.reshape(-1)
    if not flat.is_floating_point():
        return flat.to(torch.int64)
    flat = flat.to(torch.float64) + 0.0  # -0.0 + 0.0 is +0.0
    return flat.masked_fill_(torch.isnan(flat), float("nan")).view(torch.int64)


def _keys(numel: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys of indices ``0 .. numel - 1`` of a chunk and their odd multipliers: slices of the
    ``_CHUNK`` keys of ``device``, made once (16 MB) and kept."""
    keys, odd = _chunk_keys(torch.device(device))
    return keys[:numel], odd[:numel]


@functools.lru_cache(maxsize=4)
def _chunk_keys(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    keys = _mix_(torch.arange(_CHUNK, device=device, dtype=torch.int64).mul_(_signed(_GOLDEN)))
    odd = _mix_(keys ^ _signed(_GOLDEN)).bitwise_or_(1)
    return keys, odd


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
