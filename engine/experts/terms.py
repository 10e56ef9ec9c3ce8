"""Where a router's load-balancing term is computed, and what it is worth in the forward running now.

A model asks for its term through :func:`load_balancing_loss` — a Hugging Face model through its
modeling module's ``load_balancing_loss_func``, which the engine points here during its windows
(``engine.experts.hf``), a model of the user's own through :class:`LoadBalancingLoss`. Outside an
engine window (evaluation, a script of its own, a reference run) it is the micro-batch's term, as
the model would compute it. Inside, the window runner (``engine.experts.window``) sets a
:class:`Scope` saying what each call is worth: counted in a counting forward, the global batch's
term once the window's counts are known, refused in the manual loop.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from engine.experts.balance import micro_batch_term, router_counts, RouterCounts

__all__ = ["LoadBalancingLoss", "load_balancing_loss", "Scope"]


class Scope:
    """What the calls of one forward are worth. ``calls`` collects each call's statistics in order
    (a model may compute several terms: each call position is one term of its own)."""

    keeps_models_own = False  # True: a model's own function computes its term; the scope only counts

    def __init__(self):
        self.calls: list[RouterCounts] = []

    def term(self, counts: RouterCounts, num_experts: int) -> torch.Tensor:
        raise NotImplementedError


_scope: Scope | None = None


@contextlib.contextmanager
def scoped(scope: Scope | None) -> Iterator[Scope | None]:
    """Calls of :func:`load_balancing_loss` inside the block go to ``scope``."""
    global _scope
    previous, _scope = _scope, scope
    try:
        yield scope
    finally:
        _scope = previous


def load_balancing_loss(router_logits, num_experts: int, top_k: int = 2, attention_mask=None) -> torch.Tensor:
    """The load-balancing term of router logits ((rows, experts), or a tuple of them, one per
    layer; ``attention_mask`` (batch, seq) excludes padding rows), the definition of Hugging Face's
    ``load_balancing_loss_func``. In a ``train_batch`` window under ``moe.load_balance: global`` it
    is the global batch's term (see engine.experts.window); elsewhere the rows' own."""
    if _scope is None:
        return micro_batch_term(router_logits, num_experts, top_k, attention_mask)
    if _scope.keeps_models_own:
        record_load(router_logits, num_experts, top_k, attention_mask)
        return micro_batch_term(router_logits, num_experts, top_k, attention_mask)
    counts = router_counts(router_logits, num_experts, top_k, attention_mask)
    _scope.calls.append(counts)
    return _scope.term(counts, num_experts)


def keeps_models_own_term() -> bool:
    return _scope is not None and _scope.keeps_models_own


def record_load(router_logits, num_experts: int, top_k: int, attention_mask=None) -> None:
    """Count a term's router load in the scope without computing the term (a model computes its own)."""
    with torch.no_grad():
        _scope.calls.append(router_counts(router_logits, num_experts, top_k, attention_mask))


class LoadBalancingLoss(torch.nn.Module):
    """A router's load-balancing term for a model of your own: hold one as a submodule and call it
    in the forward, then add it to the loss with your coefficient::

        self.balance = engine.LoadBalancingLoss(num_experts=8, top_k=2)
        ...
        aux = self.balance(router_logits_per_layer, attention_mask)   # logits: (rows, experts) each
        loss = lm_loss + 0.01 * aux

    Under ``moe.load_balance: global`` the engine finds it at ``initialize`` and makes the term
    the global batch's in ``train_batch``; elsewhere it is the micro-batch's own."""

    def __init__(self, num_experts: int, top_k: int = 2):
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"LoadBalancingLoss(num_experts={num_experts}, top_k={top_k}): need "
                             "1 <= top_k <= num_experts")
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, router_logits, attention_mask=None) -> torch.Tensor:
        return load_balancing_loss(router_logits, self.num_experts, self.top_k, attention_mask)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}"
