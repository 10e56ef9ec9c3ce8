"""The gradient norm, placement-aware, written once for every way of holding the model.

A rank holds pieces of the gradient: whole tensors (replicas), shards (FSDP2's DTensors over
the data dimension; on a hybrid mesh Replicate over the replicas × Shard in the shard group, each
shard held by every replica), tensor-parallel pieces (DTensors over the tensor dimension), or both
(a 2-D DTensor), of the stages its pipeline index holds. The squared norm of the whole
gradient is the sum over the world of every rank's pieces' squares, each divided by the number
of ranks that hold the same piece (a gradient every rank of the module holds is first split
between the ranks that all-reduced it, each squaring its part); that count is the ranks holding
the module the piece belongs to (the world over the pipeline: every rank of a pipeline index
holds its stages) over the number of distinct pieces its placements cut it into — or, for a
plain tensor that is one slice of a whole (parameters held apart, ``engine.distributed.group_held``),
over the number of slices. So one reduction of one float64 number over the world gives the norm,
identical on every rank, whatever the mesh.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from engine.distributed.collectives import sum_of_squares


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a plain tensor is its own piece)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def copies(tensor: torch.Tensor, holders: int) -> int:
    """On how many ranks this rank's piece of ``tensor`` is held identically: the ``holders``
    of the module it belongs to over the number of distinct pieces (mesh dimensions it is
    split on)."""
    if not isinstance(tensor, DTensor):
        return holders
    # Every placement but Replicate splits (FSDP2 on a tensor split shards with _StridedShard,
    # which is not a Shard); gradients are never Partial once reduced.
    pieces = math.prod(tensor.device_mesh.size(dim) for dim, placement in enumerate(tensor.placements)
                       if not placement.is_replicate())
    return holders // pieces


def whole_on_every_rank(params, holders: int, world_size: int) -> bool:
    """Whether every rank holds the whole gradient of ``params`` (replicas on a mesh of data ranks):
    then its squared norm is this rank's own sum, with no collective."""
    return holders == world_size and not any(isinstance(p.grad, DTensor) for p in params)


def squares_share(params, holders: int, device: torch.device, slices=None, split: tuple[int, int] = (0, 1)
                  ) -> torch.Tensor:
    """This rank's share of the squared norm of the whole gradient of ``params`` (a float64
    scalar on ``device``): summed over the world it is the squared norm. ``holders``: the ranks
    holding each of this rank's modules (world / pipeline); ``slices(p)``: into how many slices the
    ranks cut a plain parameter ``p`` (None: 1 for every one). ``split``: this rank's index among
    the ranks whose copies come out of one all-reduce (the gradient-reduction group), and their
    number: the pieces every holder holds (replicated gradients) are split between them, each
    squaring its part (their copies are then equal bit for bit; a copy each tensor rank computes
    itself is squared by each, divided by the tensor ranks, so a non-finite value in any copy counts)."""
    index, parts = split
    by_copies: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            count = copies(p.grad, holders // (slices(p) if slices is not None else 1))
            by_copies.setdefault(count, []).append(local(p.grad))
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for count, pieces in by_copies.items():
        if count == holders:
            squares = squares + sum_of_squares(_part(pieces, index, parts), device) / (holders // parts)
        else:
            squares = squares + sum_of_squares(pieces, device) / count
    return squares


def _part(pieces: list[torch.Tensor], index: int, parts: int) -> list[torch.Tensor]:
    """The ``index``-th of ``parts`` nearly equal runs of the pieces' elements, taken in order (views)."""
    total = sum(piece.numel() for piece in pieces)
    start, end = total * index // parts, total * (index + 1) // parts
    run, offset = [], 0
    for piece in pieces:
        low, high = max(start - offset, 0), min(end - offset, piece.numel())
        if low < high:
            run.append(piece.reshape(-1)[low:high])
        offset += piece.numel()
    return run
