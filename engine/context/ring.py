"""Ring attention: attention over whole sequences on ranks that each hold a part of every sequence,
without ever holding the whole sequence's keys and values.

Each rank of a context group of N keeps its head–tail part of the queries, keys and values
(``engine.context.sharding``: chunks r and 2N−1−r of 2N). Round a ring of N steps, each rank
attends its queries to one part of keys and values at a time — its own first, then the part the
previous rank passes on — and merges the blocks by their log-sum-exp: a block's output o_b and
log-sum-exp λ_b join the running (o, λ) as

    λ' = log(e^λ + e^λ_b),  o' = o·e^(λ − λ') + o_b·e^(λ_b − λ').

Under the causal mask by global positions the head–tail layout makes every block a plain one:
the own part is causal in its local order (its positions ascend), an earlier rank's part is seen
whole by every query but only through its head chunk (its tail lies after all of ours), a later
rank's part is seen whole by our tail chunk alone (its head lies after ours, its tail before our
tail). So a block is one kernel call on half the scores of a part × part product, no mask built,
every rank the same work. Packed rows' documents (``exchange.documents``, numbered over the whole
sequence before the split) add a mask inside those blocks; a query row that meets no key of its
document in a block counts nothing there (log-sum-exp −∞).

The backward runs the ring again, in the same order: a block's gradients come from the saved
output and log-sum-exp of the whole row (the flash-attention backward), the query gradient
accumulates here, and the key and value gradients of a passed part start at the first rank it
reaches, travel with it, and arrive home after one more step (the own block's stay home). So a
rank saves its own part only (queries, keys, values, output, log-sum-exp): activations are 1/N of
one process's, whatever the length, and the heads need not divide by N (Ulysses' limit);
grouped-query attention's keys and values go round with their own heads and reach the fused
kernel so (where it takes them: torch 2.13's does), repeated to the queries' inside a block
otherwise.

A block runs PyTorch's fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward, which take and give the log-sum-exp; a private op, reached through
``engine.adapters.torch_internals.fused_cpu_attention``) on the CPU, and the same equations written in
matmuls (:class:`MatmulBlocks`) on other devices and on a torch without that kernel (or with
another signature for it). Works on any backend (point-to-point sends round
the group, gloo included) and any model whose attention the context module can reach: a Hugging
Face model through its attention interface (the model's implementation is replaced by this one:
dropout, sliding windows, soft caps and attention sinks inside attention are refused), any other
through its ``scaled_dot_product_attention`` calls.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from engine.adapters.torch_internals import FusedCpuAttention, fused_cpu_attention
from engine.context.sharding import ContextShards
from engine.context.ulysses import Activity, refuse_non_causal_over_padding
from engine.distributed.collectives import pass_along
from engine.errors import EngineUsageError

log = logging.getLogger("engine")

# What a Hugging Face model may hand its attention function that changes what attention computes
# and that a ring's blocks do not (the value that changes nothing: None).
_UNSUPPORTED = {"softcap": "soft-capped scores", "s_aux": "attention sinks"}


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
        and values, of which this rank holds ``key`` / ``value`` (the same layout, the same heads or
        a divisor of them: grouped-query attention)."""
        if query.shape[1] % key.shape[1]:
            raise EngineUsageError(
                f"context_parallel (ring): {query.shape[1]} query heads cannot share {key.shape[1]} key/value heads "
                "equally (grouped-query attention repeats each key/value head to heads / key-value heads queries)")
        scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        blocks = RingBlocks(self.shards, query.shape[-2], causal, self.documents)
        return _RingAttention.apply(query, key, value, self, blocks, scale)

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
            self._refuse_what_blocks_ignore(what, query.shape[-2] * self.shards.size, kwargs)
            causal = getattr(module, "is_causal", True)
            self.check_causal(causal, what)
            output = self.attend(query, key, value, scale=scaling, causal=causal)
            return output.transpose(1, 2).contiguous(), None  # (batch, part, heads, d)

        return attention

    def _refuse_what_blocks_ignore(self, what: str, length: int, kwargs: dict) -> None:
        window = kwargs.get("sliding_window")
        if window is not None and window < length:
            raise EngineUsageError(
                f"context_parallel (ring): {what} attends within a sliding window of {window} tokens, shorter than "
                f"the sequence's {length}; ring attention's blocks attend causally over the whole sequence. Use "
                "context_parallel.method: ulysses (the model's own attention on whole sequences)")
        for name, meaning in _UNSUPPORTED.items():
            if kwargs.get(name) is not None:
                raise EngineUsageError(
                    f"context_parallel (ring): {what} computes its attention with {meaning} ({name}), which ring "
                    "attention's blocks do not; use context_parallel.method: ulysses (the model's own attention on "
                    "whole sequences)")

    def sdpa(self, what: str, func, query, key, value, *rest, **kwargs):
        """``what``'s ``scaled_dot_product_attention`` call (``is_causal``, ``scale``, ``enable_gqa``; no mask or
        dropout) as ring attention (``func`` is not called)."""
        causal = kwargs.get("is_causal", rest[2] if len(rest) > 2 else False)
        dropout = kwargs.get("dropout_p", rest[1] if len(rest) > 1 else 0.0)
        if dropout:
            raise EngineUsageError(
                f"context_parallel (ring): {what} calls scaled_dot_product_attention with dropout_p {dropout}: ring "
                "attention does not drop attention probabilities; pass dropout_p=0, or use context_parallel.method: "
                "ulysses")
        return self.attend(query, key, value, scale=kwargs.get("scale"), causal=causal)


@dataclass(frozen=True)
class Block:
    """Where this rank's queries meet one part's keys: the queries and keys that can meet at all
    (slices of the two parts), causal in their local order or not, and the documents' mask over
    them ((rows, 1, queries, keys), True where allowed; None: none needed)."""

    queries: slice
    keys: slice
    causal: bool
    allowed: torch.Tensor | None


class RingBlocks:
    """The blocks of one rank's ring (module docstring): which queries meet which keys of part j
    (the own part's block: every query and every key, causal or not)."""

    def __init__(self, shards: ContextShards, part_length: int, causal: bool, documents: torch.Tensor | None):
        self.shards, self.part_length, self.causal, self.documents = shards, part_length, causal, documents
        self._made: dict[int, Block] = {}  # the forward's blocks, which the backward meets again

    def block(self, part: int) -> Block:
        made = self._made.get(part)
        if made is None:
            made = self._made[part] = self._block(part)
        return made

    def _block(self, part: int) -> Block:
        everything, chunk = slice(0, self.part_length), self.part_length // 2
        index = self.shards.index
        if not self.causal:
            queries, keys, causal = everything, everything, False
        elif part == index:
            queries, keys, causal = everything, everything, True
        elif part < index:  # an earlier rank's: its head chunk lies before all of ours, its tail after
            queries, keys, causal = everything, slice(0, chunk), False
        else:  # a later rank's: both its chunks lie after our head chunk and before our tail chunk
            queries, keys, causal = slice(chunk, self.part_length), everything, False
        if self.documents is None:
            return Block(queries, keys, causal, None)
        length = self.part_length * self.shards.size
        mine = self.shards.positions(length, device=self.documents.device)[queries]
        theirs = self.shards.positions(length, part, self.documents.device)[keys]
        allowed = (self.documents[:, mine, None] == self.documents[:, None, theirs])[:, None]
        if causal:
            allowed = allowed & (mine[:, None] >= theirs[None, :])
        return Block(queries, keys, False, allowed)


class FusedCpuBlocks:
    """A block through PyTorch's fused CPU attention kernel (``engine.adapters.torch_internals``),
    which gives the log-sum-exp and takes it back in its backward. Grouped-query keys and values
    reach it with their own heads where it takes them so (torch's own check), else repeated."""

    def __init__(self, kernel: FusedCpuAttention):
        self.kernel = kernel

    def forward(self, query, key, value, block: Block, scale: float):
        if not self.kernel.grouped_query:
            key, value = _repeated(key, query.shape[1]), _repeated(value, query.shape[1])
        mask = _additive(block.allowed, query.dtype)
        output, logsumexp = self.kernel.forward(query, key, value, 0.0, block.causal, attn_mask=mask, scale=scale)
        return output, _nothing_seen(logsumexp, block.allowed)

    def backward(self, grad_output, query, key, value, output, logsumexp, block: Block, scale: float):
        heads = key.shape[1]
        if not self.kernel.grouped_query:
            key, value = _repeated(key, query.shape[1]), _repeated(value, query.shape[1])
        grad_query, grad_key, grad_value = self.kernel.backward(
            grad_output, query, key, value, output, logsumexp, 0.0, block.causal,
            attn_mask=_additive(block.allowed, query.dtype), scale=scale)
        return grad_query, _folded(grad_key, heads), _folded(grad_value, heads)


class MatmulBlocks:
    """A block written in matmuls (any device; scores in at least float32): the kernel's equations,
    grouped-query keys and values repeated to the queries' heads inside the block."""

    @staticmethod
    def _scores(query, key, block: Block, scale: float):
        dtype = torch.promote_types(query.dtype, torch.float32)
        scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * scale
        allowed = block.allowed
        if block.causal:
            allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))

    @staticmethod
    def forward(query, key, value, block: Block, scale: float):
        heads = query.shape[1]
        scores = MatmulBlocks._scores(query, _repeated(key, heads), block, scale)
        logsumexp = torch.logsumexp(scores, dim=-1)
        probabilities = torch.exp(scores - _finite(logsumexp)[..., None])
        return torch.matmul(probabilities, _repeated(value, heads).to(scores.dtype)).to(query.dtype), logsumexp

    @staticmethod
    def backward(grad_output, query, key, value, output, logsumexp, block: Block, scale: float):
        heads, shared = query.shape[1], key.shape[1]
        key, value = _repeated(key, heads), _repeated(value, heads)
        scores = MatmulBlocks._scores(query, key, block, scale)
        dtype = scores.dtype
        probabilities = torch.exp(scores - logsumexp[..., None].to(dtype))
        grad_output = grad_output.to(dtype)
        delta = (grad_output * output.to(dtype)).sum(dim=-1, keepdim=True)
        grad_scores = probabilities * (torch.matmul(grad_output, value.to(dtype).transpose(-1, -2)) - delta)
        return (torch.matmul(grad_scores, key.to(dtype)) * scale,
                _folded(torch.matmul(grad_scores.transpose(-1, -2), query.to(dtype)) * scale, shared),
                _folded(torch.matmul(probabilities.transpose(-1, -2), grad_output), shared))


def block_kernel(device: torch.device):
    """How a block is computed on ``device``: the fused CPU kernel where this torch has it, matmuls
    elsewhere (and, said once, on a torch without it or with another signature for it)."""
    global _told_matmul_fallback
    if device.type != "cpu":
        return MatmulBlocks
    kernel = fused_cpu_attention()
    if kernel is not None:
        return FusedCpuBlocks(kernel)
    if not _told_matmul_fallback:
        _told_matmul_fallback = True
        log.warning("context_parallel ring: torch %s has no fused CPU attention kernel with its log-sum-exp "
                    "(aten._scaled_dot_product_flash_attention_for_cpu and its _backward, with the arguments the ring "
                    "passes): the ring's blocks run in matmuls, the same result, slower", torch.__version__)
    return MatmulBlocks


_told_matmul_fallback = False


def _additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _nothing_seen(logsumexp: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """The log-sum-exp of rows that met no key (the kernel reports 0 for them) set to −∞."""
    if allowed is None:
        return logsumexp
    return logsumexp.masked_fill(~allowed.any(dim=-1), float("-inf"))


def _finite(logsumexp: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(logsumexp), logsumexp, torch.zeros_like(logsumexp))


def _placed(gradient: torch.Tensor, keys: slice, part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block's gradient of ``part``'s ``keys`` as one of the whole part (zero elsewhere), in ``dtype``."""
    if gradient.shape == part.shape:
        return gradient.to(dtype)
    whole = torch.zeros(part.shape, dtype=dtype, device=part.device)
    whole[..., keys, :] = gradient
    return whole


def merge_block(output, logsumexp, block_output, block_logsumexp):
    """A block's output and log-sum-exp merged into the running ones: what was summed before is
    rescaled by e^(λ − λ'), the block by e^(λ_b − λ'); a row that has met no key yet stays 0, −∞."""
    merged = torch.logaddexp(logsumexp, block_logsumexp)
    safe = _finite(merged)
    return (output * torch.exp(logsumexp - safe)[..., None]
            + block_output * torch.exp(block_logsumexp - safe)[..., None]), merged


def _repeated(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to the queries' ``heads`` (each serving heads / its heads queries)."""
    return tensor if tensor.shape[1] == heads else tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def _folded(gradient: torch.Tensor, heads: int) -> torch.Tensor:
    """A gradient over repeated key/value heads summed back onto their ``heads``."""
    if gradient.shape[1] == heads:
        return gradient
    return gradient.unflatten(1, (heads, gradient.shape[1] // heads)).sum(dim=2)


class _RingAttention(torch.autograd.Function):
    """Forward and backward round the ring (module docstring); the exchange's sends are not part
    of autograd's graph, so the backward is written out here. The own part's block comes first and
    covers every query and key (:meth:`RingBlocks.block`): it starts the output and the gradients."""

    @staticmethod
    def forward(ctx, query, key, value, ring: RingExchange, blocks: RingBlocks, scale: float):
        size, index = ring.shards.size, ring.shards.index
        kernel = block_kernel(query.device)
        dtype = torch.promote_types(query.dtype, torch.float32)
        output, logsumexp = kernel.forward(query, key, value, blocks.block(index), scale)
        output, logsumexp = output.to(dtype), logsumexp.to(dtype)
        k, v = key, value
        for step in range(1, size):
            k, v = ring.pass_along([k, v])
            block = blocks.block((index - step) % size)
            q = block.queries
            part_output, part_logsumexp = kernel.forward(query[..., q, :], k[..., block.keys, :],
                                                         v[..., block.keys, :], block, scale)
            output[..., q, :], logsumexp[..., q] = merge_block(output[..., q, :], logsumexp[..., q],
                                                               part_output, part_logsumexp)
        output = output.to(query.dtype)
        ctx.save_for_backward(query, key, value, output, logsumexp)
        ctx.ring, ctx.blocks, ctx.scale = ring, blocks, scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        """The own block's gradients stay home; a passed part's key and value gradients start at
        the first rank it reaches, travel on with it, and come home after its last block."""
        query, key, value, output, logsumexp = ctx.saved_tensors
        ring, blocks, scale = ctx.ring, ctx.blocks, ctx.scale
        size, index = ring.shards.size, ring.shards.index
        kernel = block_kernel(query.device)
        dtype = logsumexp.dtype
        grad_output = grad_output.contiguous()
        grad_query, grad_key, grad_value = (g.to(dtype) for g in kernel.backward(
            grad_output, query, key, value, output, logsumexp, blocks.block(index), scale))
        k, v = key, value
        travelling: list[torch.Tensor] = []  # the passed part's key and value gradients so far
        for step in range(1, size):
            k, v, *travelling = ring.pass_along([k, v, *travelling])
            block = blocks.block((index - step) % size)
            q, keys = block.queries, block.keys
            part_query, part_key, part_value = kernel.backward(
                grad_output[..., q, :], query[..., q, :], k[..., keys, :], v[..., keys, :], output[..., q, :],
                logsumexp[..., q], block, scale)
            grad_query[..., q, :] += part_query
            if not travelling:  # the part's first stop
                travelling = [_placed(part_key, keys, k, dtype), _placed(part_value, keys, v, dtype)]
            else:
                travelling[0][..., keys, :] += part_key
                travelling[1][..., keys, :] += part_value
        if travelling:  # home: the part of the next rank's keys came round to this one
            home_key, home_value = ring.pass_along(travelling)
            grad_key += home_key
            grad_value += home_value
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None)
