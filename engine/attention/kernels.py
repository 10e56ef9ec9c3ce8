"""Attention within each document of packed rows, without a mask over the row.

Two kernels, one contract: ``query`` ``(rows, heads, length, d)``, ``key`` / ``value``
``(rows, key/value heads, length, d)`` (grouped-query heads allowed), each row's document lengths;
the result ``(rows, length, heads, d)`` (the layout transformers' attention functions return).

* :func:`grouped_sdpa` (CPU, and CUDA without flash-attention): a document's queries only ever
  meet its own keys, so each document is one causal ``scaled_dot_product_attention`` on its own
  slice: sum(n_i^2) work instead of the row's length^2, and no mask (the fused kernel's
  ``is_causal`` path). Documents of equal length next to each other (packing places them longest
  first, so equal lengths sit together) go in one call as a batch of views. Measured on this CPU
  (4 heads of 32, fp32, forward and backward, rows of about 1,000 tokens of 10-29 documents):
  4-9 ms, against about 30 ms for the dense per-document mask and 20 ms for one causal call over
  the whole row, and within 10% of one padded call over the same documents; documents of
  different lengths gathered into one padded call (each document's window of the longest length,
  later tokens hidden by causality) were 1.3x slower than the per-run calls, flex attention has no
  CPU backward in torch 2.13.
* :func:`flash_varlen` (CUDA, half precision, ``flash_attn`` 2 installed): flash-attention's
  variable-length kernel over the rows flattened, one ``cu_seqlens`` for all documents.

:func:`choose_kernel` picks one per call from the device, the dtype and whether flash-attention
was found (:func:`find_flash_varlen`, once, when the attention is installed).
"""

from __future__ import annotations

from itertools import accumulate, groupby
from typing import Callable

import torch
import torch.nn.functional as F

from engine.attention.documents import Lengths

HALF = (torch.float16, torch.bfloat16)  # the dtypes flash-attention computes in


def _runs(documents: tuple[int, ...]) -> list[tuple[int, int]]:
    """(length, count) of each run of equal-length documents, in order."""
    return [(length, len(list(run))) for length, run in groupby(documents)]


def _rows(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A batch's rows as views (one row: squeezed, whose backward is a view too)."""
    return (tensor.squeeze(0),) if tensor.shape[0] == 1 else tensor.unbind(0)


def _split_runs(row: torch.Tensor, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """One row ``(heads, length, d)`` as a batch ``(count, heads, length, d)`` of views per run.
    Split along the tokens of the token-major layout the projections made (``(length, heads, d)``):
    one split, whose backward joins the runs' gradients in one copy into the layout the projections'
    backward takes (a slice per run would write a gradient of the whole row for each)."""
    pieces = row.transpose(0, 1).split([length * count for length, count in runs])
    return [piece.unflatten(0, (count, length)).transpose(1, 2) for piece, (length, count) in zip(pieces, runs)]


def grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: Lengths, *,
                 scale: float | None, dropout: float, causal: bool) -> torch.Tensor:
    """Each document's causal attention, one fused call per run of equal-length documents."""
    heads, width = query.shape[1], query.shape[-1]
    grouped_query = heads != key.shape[1]
    rows = []
    # a row by unbinding, not indexing: an index's backward would zero and fill a gradient of every row
    for documents, *row in zip(lengths, *(_rows(t) for t in (query, key, value))):
        runs = _runs(documents)
        pieces = []
        for (length, count), q, k, v in zip(runs, *(_split_runs(t, runs) for t in row)):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal, scale=scale,
                                                 enable_gqa=grouped_query)
            pieces.append(out.transpose(1, 2).reshape(count * length, heads, width))
        rows.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    return torch.stack(rows) if len(rows) > 1 else rows[0].unsqueeze(0)


def flash_varlen(varlen: Callable) -> Callable:
    """A kernel of the contract above over flash-attention's ``flash_attn_varlen_func`` (``varlen``)."""

    def run(query, key, value, lengths: Lengths, *, scale, dropout, causal):
        rows, heads, length, width = query.shape
        flat = [n for documents in lengths for n in documents]
        bounds = torch.tensor([0, *accumulate(flat)], dtype=torch.int32, device=query.device)
        q, k, v = (t.transpose(1, 2).reshape(rows * length, t.shape[1], width) for t in (query, key, value))
        out = varlen(q, k, v, bounds, bounds, max(flat), max(flat), dropout_p=dropout, softmax_scale=scale,
                     causal=causal)
        return out.view(rows, length, heads, width)

    return run


def find_flash_varlen() -> Callable | None:
    """flash-attention 2's variable-length function, None where the package is absent (or not 2.x,
    whose arguments this module passes)."""
    try:
        import flash_attn
    except ImportError:
        return None
    if not str(getattr(flash_attn, "__version__", "")).startswith("2."):
        return None
    return getattr(flash_attn, "flash_attn_varlen_func", None)


def choose_kernel(device_type: str, dtype: torch.dtype, varlen: Callable | None) -> Callable:
    """flash-attention's varlen kernel on CUDA in half precision where installed, else grouped SDPA."""
    if varlen is not None and device_type == "cuda" and dtype in HALF:
        return flash_varlen(varlen)
    return grouped_sdpa
