"""Ulysses: attention over whole sequences on ranks that each hold a part of every sequence.

Before attention each rank of a context group holds, for every head, its shard of the
sequence (``engine.context.sharding``'s head–tail layout). One all-to-all over the group
trades that for every token of 1/N of the heads (sequence ↔ heads); the attention runs there
as it would in one process — any implementation: eager, SDPA, flash — then a second all-to-all
trades back. Everything outside attention works on tokens one at a time and never sees the
difference. Both exchanges are differentiable (an all-to-all's gradient is the reverse
all-to-all) and run on any backend, gloo included.

Two ways in, both installed by ``engine.context.parallel``:

* a Hugging Face model calls its attention through transformers' ``AttentionInterface``:
  :func:`hugging_face_attention` wraps the model's own implementation and is registered under a
  new name the model is switched to (transformers then builds no mask for it: the wrapped
  implementation gets a causal mask of the whole sequence, or none where it makes its own);
* any other model: each attention module's forward runs under :class:`SequenceAttention`, a
  ``TorchFunctionMode`` that routes ``torch.nn.functional.scaled_dot_product_attention`` calls
  through the exchange. A module that computed attention without it is refused (its attention
  would have seen its shard alone).

Both are active only while the engine runs a micro-step's forward or backward (the recompute of
activation checkpointing happens in the backward); at other times the model is the plain model
(``eng.module.generate(...)`` works on whole sequences).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from engine.attention.hugging_face import takes_document_bounds
from engine.context.sharding import ContextShards
from engine.distributed.collectives import all_to_all
from engine.errors import EngineUsageError

# Hugging Face implementations that build their own causal masking from ``is_causal`` (no mask given).
SELF_MASKING = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def refuse_non_causal_over_padding(padded: bool, causal: bool, what: str, chunks: int) -> None:
    """Raise when attention that is not causal meets padding the engine added (``padded``: the real
    tokens would attend to it)."""
    if padded and not causal:
        raise EngineUsageError(
            f"context_parallel: {what} attends without a causal mask, and this micro-batch's sequences were "
            f"padded on the right to cut into {chunks} equal chunks: the real tokens would attend to "
            f"that padding. Pad every batch's sequences to a multiple of {chunks} yourself")


class UlyssesExchange:
    """The two exchanges of one context group for tensors laid out (..., heads, sequence, head width)."""

    def __init__(self, shards: ContextShards, group):
        self.shards, self.group = shards, group
        self.padded = False  # the micro-step's sequences were padded to cut into equal chunks
        # the micro-step's documents of the whole sequence (packed rows), None: one per row
        self.documents: torch.Tensor | None = None
        self._orders: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _order(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(gathered → natural, natural → gathered) index of a sequence of ``length`` tokens."""
        key = (length, device)
        if key not in self._orders:
            gathered = self.shards.gathered_positions(length, device)
            self._orders[key] = (torch.argsort(gathered), gathered)
        return self._orders[key]

    def check_causal(self, causal: bool, what: str) -> None:
        refuse_non_causal_over_padding(self.padded, causal, what, self.shards.chunks)

    def hugging_face_attention(self, inner, implementation: str, activity: "Activity"):
        return hugging_face_attention(inner, implementation, self, activity)

    def sdpa(self, what: str, func, query, key, value, *rest, **kwargs):
        """``what``'s ``scaled_dot_product_attention`` call over the whole sequence of 1/N of the heads."""
        query, key, value = (self.to_sequence(t, what) for t in (query, key, value))
        return self.to_heads(func(query, key, value, *rest, **kwargs))

    def check_heads(self, heads: int, what: str) -> None:
        size = self.shards.size
        if heads % size:
            raise EngineUsageError(
                f"context_parallel (ulysses): {what} has {heads} head(s), which do not divide over context size "
                f"{size} ({heads} % {size} = {heads % size}): each rank attends with an equal share of the heads. "
                f"Choose a context size that divides the number of heads (key/value heads too)")

    def to_sequence(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """(..., heads, shard, d) → (..., heads / N, whole sequence in order, d)."""
        size = self.shards.size
        *lead, heads, shard, width = x.shape
        self.check_heads(heads, what)
        parts = x.reshape(*lead, size, heads // size, shard, width).movedim(len(lead), 0)
        received = all_to_all(parts, self.group)  # (N, ..., heads / N, shard, d): rank j's shard
        whole = received.movedim(0, len(lead) + 1).reshape(*lead, heads // size, size * shard, width)
        natural, _ = self._order(size * shard, x.device)
        return whole.index_select(-2, natural)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(..., heads / N, whole sequence in order, d) → (..., heads, shard, d): the inverse."""
        size = self.shards.size
        *lead, heads, length, width = x.shape
        _, gathered = self._order(length, x.device)
        parts = x.index_select(-2, gathered).reshape(*lead, heads, size, length // size, width)
        received = all_to_all(parts.movedim(len(lead) + 1, 0), self.group)  # rank j's heads of my shard
        return received.movedim(0, len(lead)).reshape(*lead, size * heads, length // size, width)


class Activity:
    """Whether the engine is inside a micro-step's forward or backward (when the exchanges run)."""

    def __init__(self):
        self.depth = 0

    @property
    def on(self) -> bool:
        return self.depth > 0

    def __enter__(self):
        self.depth += 1
        return self

    def __exit__(self, *exc):
        self.depth -= 1


def causal_mask(length: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An additive causal mask (1, 1, length, length): 0 on and below the diagonal, the dtype's
    most negative value above (not -inf: a row of padding alone stays finite)."""
    above = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(length, length, dtype=dtype, device=device).masked_fill(above, torch.finfo(dtype).min)[None, None]


def window_mask(length: int, window: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An additive causal mask (1, 1, length, length) within a sliding window: a query sees itself and
    the ``window`` - 1 tokens before it (transformers' rule for ``sliding_window``)."""
    queries = torch.arange(length, device=device)[:, None]
    keys = torch.arange(length, device=device)[None, :]
    allowed = (keys <= queries) & (keys > queries - window)
    return torch.zeros(length, length, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def document_mask(documents: torch.Tensor, dtype: torch.dtype, causal: bool) -> torch.Tensor:
    """An additive mask (rows, 1, S, S) for packed rows (``documents``: (rows, S) document ids of
    the whole sequence): a token attends within its own document (and, ``causal``, not ahead)."""
    allowed = documents[:, :, None] == documents[:, None, :]
    if causal:
        length = documents.shape[-1]
        allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()
    return torch.zeros(allowed.shape, dtype=dtype, device=documents.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]


def varlen_arguments(documents: torch.Tensor, what: str) -> dict:
    """Flash attention's variable-length arguments for one packed row of documents (the whole
    sequence): where each document starts and the longest one."""
    if documents.shape[0] != 1:
        raise EngineUsageError(
            f"context_parallel: {what} runs flash attention on packed rows, whose variable-length kernel takes one "
            f"row of documents end to end, but a micro-batch holds {documents.shape[0]} packed rows; put each "
            "micro-batch's documents in one row (packing: true does), or load the model with attn_implementation='sdpa'")
    row = documents[0]
    starts = torch.nonzero(torch.diff(row, prepend=row[:1] - 1)).flatten()
    bounds = torch.cat([starts, starts.new_tensor([row.numel()])]).to(torch.int32)
    longest = int(bounds.diff().max())
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}


# What a batch may carry about its documents for flash attention; the exchange derives them from the
# whole sequence's documents instead (a part's would describe the part).
_VARLEN_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def hugging_face_attention(inner, implementation: str, exchange: UlyssesExchange, activity: Activity):
    """A transformers attention function: ``inner`` (the model's own, ``implementation``) over
    the whole sequence of 1/N of the heads while ``activity`` is on; ``inner`` alone otherwise.
    Packed rows (``exchange.documents``) keep every token within its document, as the model
    alone does from their ``position_ids``."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if not activity.on:
            return inner(module, query, key, value, attention_mask, **kwargs)
        what = type(module).__name__
        causal = getattr(module, "is_causal", True)
        exchange.check_causal(causal, what)
        query, key, value = (exchange.to_sequence(t, what) for t in (query, key, value))
        # The shard's positions: flash attention would read their jumps as packed sequences.
        for name in _VARLEN_KEYS:
            kwargs.pop(name, None)
        documents, length = exchange.documents, query.shape[-2]
        # A sliding window shorter than the sequence: flash takes it as an argument, the others from the mask.
        window = kwargs.get("sliding_window")
        window = window if isinstance(window, int) and causal and window < length else None
        # flash attention and packing's attention per document (engine.attention) take the documents' bounds
        by_bounds = implementation.startswith("flash") or takes_document_bounds(implementation)
        if documents is not None and by_bounds:
            kwargs.update(varlen_arguments(documents, what))
            mask = None
        elif documents is not None:
            mask = document_mask(documents, query.dtype, causal)
        else:
            mask = None if implementation in SELF_MASKING or by_bounds or not causal else causal_mask(
                length, query.dtype, query.device)
        if window is not None and not implementation.startswith("flash"):
            windowed = window_mask(length, window, query.dtype, query.device)
            mask = windowed if mask is None else torch.minimum(mask, windowed)
        output, _ = inner(module, query, key, value, mask, **kwargs)  # (batch, sequence, heads / N, d)
        return exchange.to_heads(output.transpose(1, 2)).transpose(1, 2), None

    return attention


class SequenceAttention(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` through the exchange (one attention module's forward)."""

    def __init__(self, exchange: UlyssesExchange, what: str):
        super().__init__()
        self.exchange, self.what, self.calls = exchange, what, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        if (rest and rest[0] is not None) or kwargs.get("attn_mask") is not None:
            raise EngineUsageError(
                f"context_parallel: {self.what} passes an attn_mask to scaled_dot_product_attention; its "
                "rows and columns cover one rank's shard of the sequence, not the whole sequence the exchange "
                "attends over. Use is_causal=True (right padding needs no mask under causal attention)")
        self.calls += 1
        self.exchange.check_causal(kwargs.get("is_causal", rest[2] if len(rest) > 2 else False), self.what)
        return self.exchange.sdpa(self.what, func, query, key, value, *rest, **kwargs)


def sequence_attention_forward(forward, exchange: UlyssesExchange, activity: Activity, what: str):
    """``forward`` of an attention module, its SDPA calls exchanged while ``activity`` is on."""

    def run(*args, **kwargs):
        if not activity.on:
            return forward(*args, **kwargs)
        mode = SequenceAttention(exchange, what)
        with mode:
            output = forward(*args, **kwargs)
        if not mode.calls:
            raise EngineUsageError(
                f"context_parallel: {what}.forward computed its attention without "
                "torch.nn.functional.scaled_dot_product_attention, so it saw one rank's shard of the sequence "
                "alone. Call scaled_dot_product_attention there (the exchange wraps it), or use a Hugging Face "
                "model (any attention implementation)")
        return output

    return run
