"""Attention per document for a Hugging Face decoder trained on packed rows (``packing: true``).

transformers reads a packed row's documents from its restarting ``position_ids`` and builds, for
SDPA and eager attention, a dense ``(length, length)`` mask over the row, so every layer computes
the whole row's attention and masks most of it away. :func:`apply_document_attention` registers
an implementation of the model's own (``microstep_documents_<sdpa|eager>``) through transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` (``engine.adapters.transformers_attention``):

* its mask function reads the documents from the mask transformers composed (three diagonals of
  it, ``engine.attention.documents``) and hands the layers their ids instead of the dense mask —
  or ``None`` for rows of one document each (plain causal);
* its attention function runs each document's causal attention on its own
  (``engine.attention.kernels``: grouped SDPA, or flash-attention's varlen kernel on CUDA);
* anything else — a padding mask, a key/value cache (generation), a query shorter than its keys —
  goes to the model's own mask and attention functions, as before (the mask is then always
  materialised, so that ``None`` keeps meaning "whole rows, causal").

Under Ulysses context parallelism the model's implementation is wrapped by the exchange, which hands
this attention the whole sequence's document bounds as ``cu_seq_lens_q`` (as it does for flash
attention); ring attention computes its own blocks and does not call it.

Applied only where it computes what transformers' mask does: a causal decoder calling its attention
through the registry, on ``sdpa`` or ``eager``, with full attention in every layer (no sliding
window, chunked attention or logit soft-capping: their masks are not documents alone) and no
sub-models (vision, audio). Elsewhere the model keeps transformers' mask, said once.
"""

from __future__ import annotations

import logging

import torch

from engine.adapters import transformers_attention as hf
from engine.attention.documents import (document_ids_mask, is_document_ids, lengths_of_bounds, lengths_of_mask,
                                        probe_documents)
from engine.attention.kernels import choose_kernel, find_flash_varlen

log = logging.getLogger("engine")

PREFIX = "microstep_documents_"
OWN = ("sdpa", "eager")  # the implementations whose documents become a dense mask in transformers


def takes_document_bounds(implementation: str) -> bool:
    """Whether a model's attention implementation is this module's: it takes ``cu_seq_lens_q``."""
    return implementation.startswith(PREFIX)


def why_not(model: torch.nn.Module) -> str | None:
    """Why ``model`` keeps transformers' own per-document mask (None: the documents' attention applies)."""
    implementation = hf.implementation(model)
    if implementation is None:
        return f"{type(model).__name__} is not a Hugging Face model"
    if implementation not in OWN:
        return f"its attention implementation is {implementation!r} (only sdpa and eager build a dense mask)"
    reason = hf.unsupported()
    if reason:
        return reason
    if not hf.routes_attention(model):
        return "it does not call its attention through transformers' AttentionInterface"
    config = model.config
    partial = [name for name in ("sliding_window", "attention_chunk_size", "attn_logit_softcapping")
               if getattr(config, name, None) is not None]
    partial += [f"layer_types {kind}" for kind in sorted(set(getattr(config, "layer_types", None) or ()))
                if kind != "full_attention"]
    if partial:
        return f"its attention is more than causal within documents ({', '.join(partial)})"
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", True):
        return "it is not a causal decoder"
    if getattr(config, "sub_configs", None):
        return f"it is made of several models ({', '.join(config.sub_configs)})"
    return None


def document_mask_function(own_mask):
    """A transformers mask function: the document ids of a packed row (None: one document per row),
    ``own_mask``'s materialised mask for anything else."""

    def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
             **kwargs):
        whole = attention_mask is None and q_length == kv_length and isinstance(q_offset, int) \
            and isinstance(kv_offset, int) and q_offset == kv_offset == 0 and mask_function is not None
        starts = probe_documents(mask_function, batch_size, q_length, kwargs.get("device", "cpu")) if whole else None
        if starts is None:
            kwargs["allow_is_causal_skip"] = False  # None would read as "whole rows, causal"
            return own_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
        marker = document_ids_mask(starts)
        return marker if any(len(row) > 1 for row in lengths_of_mask(marker)) else None

    return mask


def document_attention(own_attention, varlen):
    """A transformers attention function: each document on its own for document ids (or
    ``cu_seq_lens_q``, from the Ulysses exchange) and for no mask (whole rows); ``own_attention``
    with any other mask."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if is_document_ids(attention_mask):
            lengths = lengths_of_mask(attention_mask)
        elif attention_mask is None and kwargs.get("cu_seq_lens_q") is not None:
            lengths = lengths_of_bounds(kwargs["cu_seq_lens_q"])
        elif attention_mask is None and query.shape[-2] == key.shape[-2]:
            lengths = ((query.shape[-2],),) * query.shape[0]
        else:
            return own_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 **kwargs)
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        kernel = choose_kernel(query.device.type, query.dtype, varlen)
        return kernel(query, key, value, lengths, scale=scaling, dropout=dropout, causal=causal), None

    return attention


def apply_document_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` to attention per document where it applies (see the module docstring);
    whether it did. Said once either way for a Hugging Face model (any other has no mask of
    transformers' to replace)."""
    if hf.implementation(model) is None:
        return False
    reason = why_not(model)
    if reason is not None:
        log.info("packing: %s keeps transformers' per-document mask over each packed row (%s)",
                 type(model).__name__, reason)
        return False
    implementation = hf.implementation(model)
    own = hf.own_attention(model, implementation)
    if own is None:
        log.info("packing: %s keeps transformers' per-document mask over each packed row (its %s attention "
                 "function was not found)", type(model).__name__, implementation)
        return False
    varlen = find_flash_varlen()
    name = f"{PREFIX}{implementation}_{type(model).__module__.replace('.', '_')}"
    hf.install(model, name, document_attention(own, varlen), document_mask_function(hf.own_mask(implementation)))
    log.info("packing: attention within each document of a packed row, no mask over the row (%s)",
             "flash-attention varlen on CUDA in half precision, else one SDPA call per document length"
             if varlen is not None else "one SDPA call per run of equal-length documents")
    return True
