"""Where the documents of packed rows are, read once per forward in O(row length).

A packed row (``packing: true``) holds documents end to end; attention stays within each one,
causally. The documents are handed from the mask step to the attention step of a Hugging Face
model as **document ids**: an int32 tensor ``(rows, 1, 1, length)`` in place of the
``(rows, 1, length, length)`` mask transformers would build (transformers' masks are bool or
floating point, so the two never meet). The row lengths of each document are computed once, when
the ids are made, and kept on the ids tensor (``document_lengths``) for the attention of every layer
(and for the recomputation of a checkpointed block, which is handed the same tensor).
"""

from __future__ import annotations

from typing import Callable

import torch

Lengths = tuple[tuple[int, ...], ...]  # per row, its documents' lengths in order

LENGTHS = "document_lengths"  # the attribute of a document-ids tensor that holds its lengths


def probe_documents(mask_function: Callable, rows: int, length: int, device) -> torch.Tensor | None:
    """Where the documents of a causal-within-documents ``mask_function`` start, ``(rows, length)`` bool (an
    index-based ``f(batch_idx, head_idx, q_idx, kv_idx)``), read from three diagonals: every token
    sees itself, none sees the next, and a token that does not see the one before starts a
    document. None when the mask is not causal (a token sees the next) or hides a token from itself
    (padding): those are not documents."""
    batch = torch.arange(rows, device=device)[:, None]
    head = torch.zeros(1, 1, dtype=torch.long, device=device)
    here = torch.arange(length, device=device)[None, :]
    later = here[:, 1:]
    sees_self = mask_function(batch, head, here, here)
    sees_next = mask_function(batch, head, later - 1, later)
    if not bool(torch.as_tensor(sees_self).all()) or bool(torch.as_tensor(sees_next).any()):
        return None
    starts = ~torch.as_tensor(mask_function(batch, head, later, later - 1)).expand(rows, length - 1)
    return torch.cat([starts.new_ones(rows, 1), starts], 1)


def lengths_of_ids(ids: torch.Tensor) -> Lengths:
    """Each row's document lengths from its ids ``(rows, length)`` (one host transfer)."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return lengths_of_starts(starts)


def lengths_of_starts(starts: torch.Tensor) -> Lengths:
    """Each row's document lengths from where its documents start ``(rows, length)`` (one host transfer)."""
    rows, length = starts.shape
    found: list[list[int]] = [[] for _ in range(rows)]
    for row, column in starts.nonzero().tolist():
        found[row].append(column)
    return tuple(tuple(b - a for a, b in zip(cols, cols[1:] + [length])) for cols in found)


def lengths_of_bounds(bounds: torch.Tensor) -> Lengths:
    """One row's document lengths from flash attention's cumulative ``cu_seq_lens``."""
    return (tuple(bounds.diff().tolist()),)


def document_ids_mask(starts: torch.Tensor) -> torch.Tensor:
    """What the mask step hands the attention for documents starting at ``starts`` ``(rows, length)``:
    their ids as ``(rows, 1, 1, length)`` int32, their lengths computed now and kept on the tensor."""
    marker = starts.cumsum(1, dtype=torch.int32)[:, None, None, :]
    setattr(marker, LENGTHS, lengths_of_starts(starts))
    return marker


def is_document_ids(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4 and mask.shape[2] == 1


def lengths_of_mask(marker: torch.Tensor) -> Lengths:
    """The documents' lengths of a :func:`document_ids_mask` (kept, or read again from it)."""
    found = getattr(marker, LENGTHS, None)
    return found if found is not None else lengths_of_ids(marker[:, 0, 0, :])
