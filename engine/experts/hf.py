"""Hugging Face mixture-of-experts models: where their load-balancing term comes from.

A Hugging Face MoE model (Mixtral, Qwen2/3-MoE, OLMoE, ...) adds its router's term to ``.loss``
by calling its modeling module's ``load_balancing_loss_func(gate_logits, num_experts, top_k,
attention_mask)`` by name. During the engine's windows that name is pointed at
``engine.experts.terms.load_balancing_loss`` (same definition, same arguments) and restored
after, so that the user's ``m(**b).loss`` carries the term the window decides; outside the
engine's windows the model is left exactly as transformers wrote it. Modules whose function has
another signature (Switch Transformers, NLLB-MoE, Doge) are refused under global balance.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Iterator

import torch

from engine.experts.terms import keeps_models_own_term, load_balancing_loss, record_load

FUNCTION = "load_balancing_loss_func"
_ARGUMENTS = ("gate_logits", "num_experts", "top_k", "attention_mask")


@dataclass(frozen=True)
class HFBalancing:
    """The modeling modules whose term the model computes, and whether it computes it by default."""

    modules: tuple[ModuleType, ...]
    other_signatures: tuple[str, ...]  # modules with a function of another definition
    router_logits_by_default: bool  # config.output_router_logits of the model's configs


class _Replacement:
    """What a modeling module's ``load_balancing_loss_func`` is during the engine's windows."""

    def __init__(self, original):
        self.original = original

    def __call__(self, gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0  # as transformers: no logits recorded, no term
        if keeps_models_own_term():  # micro_batch: transformers' own value and gradient, the load counted
            record_load(gate_logits, num_experts, top_k, attention_mask)
            return self.original(gate_logits, num_experts, top_k, attention_mask)
        return load_balancing_loss(gate_logits, num_experts, top_k, attention_mask)


def find(model: torch.nn.Module) -> HFBalancing:
    """The Hugging Face modeling modules of ``model``'s submodules that define the term."""
    modules, others, by_default = {}, set(), False
    for submodule in model.modules():
        module = sys.modules.get(type(submodule).__module__)
        function = getattr(module, FUNCTION, None)
        if module is None or not callable(function) or not type(submodule).__module__.startswith("transformers."):
            continue
        config = getattr(submodule, "config", None)
        by_default = by_default or bool(getattr(config, "output_router_logits", False))
        if isinstance(function, _Replacement):  # another engine's window is running: the original is saved there
            modules[module.__name__] = module
        elif tuple(inspect.signature(function).parameters) == _ARGUMENTS:
            modules[module.__name__] = module
        else:
            others.add(module.__name__)
    return HFBalancing(tuple(modules.values()), tuple(sorted(others)), by_default)


@contextlib.contextmanager
def computing_here(modules: tuple[ModuleType, ...]) -> Iterator[None]:
    """Inside the block the modules' ``load_balancing_loss_func`` is Microstep's."""
    saved = [(module, getattr(module, FUNCTION)) for module in modules
             if not isinstance(getattr(module, FUNCTION), _Replacement)]
    for module, original in saved:
        setattr(module, FUNCTION, _Replacement(original))
    try:
        yield
    finally:
        for module, original in saved:
            setattr(module, FUNCTION, original)


@dataclass(frozen=True)
class RouterTerm:
    """How a Hugging Face mixture-of-experts language model adds its routers' term to ``.loss``:
    ``coefficient · load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)``."""

    num_experts: int
    top_k: int
    coefficient: float


def router_term_of(model: torch.nn.Module) -> RouterTerm | None:
    """The term ``model``'s ``.loss`` adds (its config has ``output_router_logits``), read from the
    attributes its forward passes (Mixtral, Qwen2/3-MoE, OLMoE: ``num_experts``,
    ``num_experts_per_tok``, ``router_aux_loss_coef``); None when it adds none or names them otherwise."""
    if not getattr(getattr(model, "config", None), "output_router_logits", False):
        return None
    values = [getattr(model, name, None) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if not all(isinstance(value, (int, float)) for value in values):
        return None
    return RouterTerm(int(values[0]), int(values[1]), float(values[2]))
