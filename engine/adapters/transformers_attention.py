"""Transformers' attention registry as ``engine.attention`` uses it for packed rows, checked when a
strategy is built.

Supported: transformers 5 (tested 5.23, the version CI pins). Outside it the packed rows keep
transformers' own per-document mask (exact, slower): ``unsupported`` says why, and nothing here is
touched. What is used, and why it is version-dependent:

* ``AttentionInterface.register`` / ``AttentionMaskInterface.register`` (public): a new
  implementation name, its attention function and its mask function;
* ``config._attn_implementation`` (private attribute): which implementation a model runs now;
* ``_supports_attention_backend`` (private class attribute): whether the model calls its
  attention through the registry at all (a model that computes attention itself would get the
  new mask function's output without the new attention);
* the eager implementation is no registry entry: it is the modeling file's
  ``eager_attention_forward``, found next to the model's attention class;
* the mask-function protocol: transformers composes an index-based
  ``mask_function(batch_idx, head_idx, q_idx, kv_idx)`` (causal, per document for rows with
  restarting ``position_ids``) and hands it to the registered mask function, which may evaluate it
  on broadcast index tensors.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

SUPPORTED = ((5, 0), (6, 0))  # [oldest, first unsupported) major.minor


def version() -> tuple[int, int] | None:
    """The installed transformers' (major, minor), None when it is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def unsupported() -> str | None:
    """Why this transformers cannot take Microstep's attention registration (None: it can)."""
    found = version()
    if found is None:
        return "transformers is not installed"
    if not SUPPORTED[0] <= found < SUPPORTED[1]:
        return (f"transformers {found[0]}.{found[1]} is outside the tested {SUPPORTED[0][0]}.x "
                f"(Microstep registers attention through its AttentionInterface there)")
    return None


def implementation(model: torch.nn.Module) -> str | None:
    """A Hugging Face model's attention implementation name; None for any other model."""
    if not callable(getattr(model, "set_attn_implementation", None)):
        return None
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def routes_attention(model: torch.nn.Module) -> bool:
    """Whether the model calls its attention through transformers' registry."""
    return bool(getattr(model, "_supports_attention_backend", False))


def own_attention(model: torch.nn.Module, name: str) -> Callable | None:
    """The attention function ``name`` stands for in ``model``: the registry's entry, or the
    modeling file's ``eager_attention_forward`` for ``eager``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name != "eager":
        return ALL_ATTENTION_FUNCTIONS.get(name)
    attention = next((m for m in model.modules() if type(m).__name__.endswith("Attention")), None)
    return getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None) \
        if attention is not None else None


def own_mask(name: str) -> Callable:
    """The mask function transformers uses for implementation ``name``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS[name]


def install(model: torch.nn.Module, name: str, attention: Callable, mask: Callable) -> None:
    """Register ``attention`` and ``mask`` under ``name`` and switch ``model`` (and its submodels) to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    model.set_attn_implementation(name)
