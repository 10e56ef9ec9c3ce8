"""Ring attention: attention over whole sequences on ranks that each hold a part of every sequence,
without ever holding the whole sequence's keys and values.

Each rank of a context group of N keeps its head–tail part of the queries, keys and values
(``engine.context.sharding``). Round a ring of N steps, each rank attends its queries to one part
of keys and values at a time — its own first, then the part the previous rank passes on — and
merges the partial results by their log-sum-exp: with m the running row maximum and l the running
sum of exponentials, a block of scores s updates

    m' = max(m, max s),  l' = l·e^(m − m') + Σ e^(s − m'),  o' = o·e^(m − m') + e^(s − m')·v,

and the output is o / l, the row's log-sum-exp m + log l (kept for the backward). The causal mask
is by global positions (a part's head and tail chunks sit far apart in the sequence); packed rows'
documents (``exchange.documents``, numbered over the whole sequence before the split) keep every
token within its document. The backward runs the ring again, in the same order: each block's
probabilities come back from the saved log-sum-exp (e^(s − lse)), the query gradient accumulates
here, and the key and value gradients travel with their part and arrive home after one more step.
So a rank saves its own part only (queries, keys, values, output, log-sum-exp): activations are
1/N of one process's, whatever the length, and the heads need not divide by N (Ulysses' limit).

Works on any backend (point-to-point sends round the group, gloo included) and any model whose
attention the context module can reach: a Hugging Face model through its attention interface
(the model's implementation is replaced by this one: dropout inside attention is refused), any
other through its ``scaled_dot_product_attention`` calls.
"""

from __future__ import annotations

import math

import torch

from engine.context.sharding import ContextShards
from engine.context.ulysses import Activity, refuse_non_causal_over_padding
from engine.distributed.collectives import pass_along
from engine.errors import EngineUsageError


class RingExchange:
    """One rank's place in its context group's ring: which part it holds, where parts come from."""

    def __init__(self, shards: ContextShards, group, ranks: list[int]):
        self.shards, self.group = shards, group
        size, index = shards.size, shards.index
        self.send_to, self.receive_from = ranks[(index + 1) % size], ranks[(index - 1) % size]
        self.padded = False  # the micro-step's sequences were padded to cut into equal chunks
        self.documents: torch.Tensor | None = None  # the whole sequence's documents (packed rows)

    def check_causal(self, causal: bool, what: str) -> None:
        refuse_non_causal_over_padding(self.padded, causal, what, self.shards.chunks)

    def check_heads(self, heads: int, what: str) -> None:
        """Ring attention splits the sequence, not the heads: any count works."""

    def pass_along(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return pass_along(tensors, self.send_to, self.receive_from, self.group)

    def attend(self, query, key, value, *, scale: float | None, causal: bool) -> torch.Tensor:
        """Attention of this part's ``query`` (batch, heads, part, d) over the whole sequence's keys
        and values, of which this rank holds ``key`` / ``value`` (the same layout; key/value heads
        are repeated to the query's)."""
        if key.shape[1] != query.shape[1]:
            key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))
        scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        length = query.shape[-2] * self.shards.size
        parts = [self.shards.positions(length, index, query.device) for index in range(self.shards.size)]
        masks = BlockMasks(parts, self.shards.index, causal, self.documents)
        return _RingAttention.apply(query, key, value, self, masks, scale)

    def hugging_face_attention(self, inner, implementation: str, activity: Activity):
        """A transformers attention function: ring attention while ``activity`` is on, ``inner``
        (the model's own) otherwise."""

        def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
            if not activity.on:
                return inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
            what = type(module).__name__
            if dropout:
                raise EngineUsageError(
                    f"context_parallel (ring): {what} applies dropout {dropout} to its attention probabilities, which "
                    "ring attention does not compute as such (it merges blocks by their log-sum-exp); set the "
                    "model's attention_dropout to 0, or use context_parallel.method: ulysses")
            causal = getattr(module, "is_causal", True)
            self.check_causal(causal, what)
            output = self.attend(query, key, value, scale=scaling, causal=causal)
            return output.transpose(1, 2).contiguous(), None  # (batch, part, heads, d)

        return attention

    def sdpa(self, what: str, func, query, key, value, *rest, **kwargs):
        """``what``'s ``scaled_dot_product_attention`` call (``is_causal``, ``scale``; no mask or dropout) as
        ring attention (``func`` is not called)."""
        causal = kwargs.get("is_causal", rest[2] if len(rest) > 2 else False)
        dropout = kwargs.get("dropout_p", rest[1] if len(rest) > 1 else 0.0)
        if dropout:
            raise EngineUsageError(
                f"context_parallel (ring): {what} calls scaled_dot_product_attention with dropout_p {dropout}: ring "
                "attention does not drop attention probabilities; pass dropout_p=0, or use context_parallel.method: "
                "ulysses")
        return self.attend(query, key, value, scale=kwargs.get("scale"), causal=causal)


class BlockMasks:
    """Which keys of part j the queries of this rank's part may attend to (None: all of them)."""

    def __init__(self, parts: list[torch.Tensor], index: int, causal: bool, documents: torch.Tensor | None):
        self.parts, self.index, self.causal, self.documents = parts, index, causal, documents

    def allowed(self, part: int) -> torch.Tensor | None:
        queries, keys = self.parts[self.index], self.parts[part]
        allowed = None
        if self.causal:
            allowed = (queries[:, None] >= keys[None, :])[None, None]  # (1, 1, part, part)
        if self.documents is not None:
            same = (self.documents[:, queries, None] == self.documents[:, None, keys])[:, None]  # (rows, 1, ...)
            allowed = same if allowed is None else allowed & same
        return allowed


def _scores(query, key, scale: float, allowed) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))


def merge_block(rows, total, output, scores, value):
    """One block of ``scores`` against its ``value`` merged into the running maximum ``rows``, sum of
    exponentials ``total`` and unnormalised ``output``: what was summed before is rescaled by
    e^(old maximum − new maximum)."""
    peak = torch.maximum(rows, scores.amax(dim=-1))
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # a row that saw no key yet
    keep = torch.exp(rows - safe)
    weights = torch.exp(scores - safe[..., None])
    return peak, total * keep + weights.sum(dim=-1), output * keep[..., None] + torch.matmul(weights, value)


class _RingAttention(torch.autograd.Function):
    """Forward and backward round the ring (module docstring); the exchange's sends are not part
    of autograd's graph, so the backward is written out here."""

    @staticmethod
    def forward(ctx, query, key, value, ring: RingExchange, masks: BlockMasks, scale: float):
        dtype = torch.promote_types(query.dtype, torch.float32)
        q = query.to(dtype)
        size, index = ring.shards.size, ring.shards.index
        rows = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)  # running maximum
        total = torch.zeros_like(rows)
        output = torch.zeros(q.shape[:-1] + (value.shape[-1],), dtype=dtype, device=q.device)
        k, v = key, value
        for step in range(size):
            if step:
                k, v = ring.pass_along([k, v])
            scores = _scores(q, k.to(dtype), scale, masks.allowed((index - step) % size))
            rows, total, output = merge_block(rows, total, output, scores, v.to(dtype))
        output = output / total[..., None]
        logsumexp = rows + torch.log(total)
        ctx.save_for_backward(query, key, value, output, logsumexp)
        ctx.ring, ctx.masks, ctx.scale = ring, masks, scale
        return output.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, logsumexp = ctx.saved_tensors
        ring, masks, scale = ctx.ring, ctx.masks, ctx.scale
        size, index = ring.shards.size, ring.shards.index
        dtype = output.dtype
        q, dout = query.to(dtype), grad_output.to(dtype)
        delta = (dout * output).sum(dim=-1, keepdim=True)
        grad_query = torch.zeros_like(q)
        k, v = key.to(dtype), value.to(dtype)
        grad_key, grad_value = torch.zeros_like(k), torch.zeros_like(v)
        for step in range(size):
            if step:  # the part and its gradients so far move on together
                k, v, grad_key, grad_value = ring.pass_along([k, v, grad_key, grad_value])
            probabilities = torch.exp(_scores(q, k, scale, masks.allowed((index - step) % size))
                                      - logsumexp[..., None])
            grad_value = grad_value + torch.matmul(probabilities.transpose(-1, -2), dout)
            grad_scores = probabilities * (torch.matmul(dout, v.transpose(-1, -2)) - delta)
            grad_query = grad_query + torch.matmul(grad_scores, k) * scale
            grad_key = grad_key + torch.matmul(grad_scores.transpose(-1, -2), q) * scale
        if size > 1:  # home: the part of the next rank's keys came round to this one
            grad_key, grad_value = ring.pass_along([grad_key, grad_value])
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None)

