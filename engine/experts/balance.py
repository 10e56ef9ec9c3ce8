"""The load-balancing term of a mixture-of-experts router, over one micro-batch or the global batch.

The term is the Switch Transformer's, as Hugging Face's ``load_balancing_loss_func`` writes it
(Mixtral, Qwen2/3-MoE, OLMoE, ... share one definition): for router logits of L layers over
rows t (padding excluded through the attention mask),

    aux = E · Σᵢ (Cᵢ / R) · (Sᵢ / R),  Cᵢ = top-k assignments to expert i, Sᵢ = Σ router
    probabilities of expert i, R = rows, each summed over the layers.

Over a window of several micro-batches and data ranks the global batch's term needs C and R
of the whole window; only S carries a gradient, and it is a sum over micro-batches. So the
gradient of the global term splits into one part per micro-batch, linear in that micro-batch's
S with the global C and R as coefficients:

    ∂aux = E / R² · Σᵢ Cᵢ · ∂Sᵢ,  Sᵢ = Σ_k S_k,ᵢ.

A micro-batch's term is therefore E / R² · Σᵢ Cᵢ · S_k,ᵢ (the window's C and R) times ``factor``,
which undoes the weight the engine will give the micro-batch's loss (see ``engine.experts.window``):
weighted and summed over the window, both its gradient and its value are the window's term's. Where C and R are known only after every forward of the window
(forwards held, then backwards), the coefficients are read when the backward runs
(:class:`_DeferredCoefficients`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.errors import EngineUsageError

log = logging.getLogger("engine")


@dataclass
class RouterCounts:
    """One term's statistics over some rows: per layer, assignments (L, E), probability sums (L, E)
    and rows (L,). ``probabilities`` carries the gradient when built from a training forward."""

    assignments: torch.Tensor
    probabilities: torch.Tensor
    rows: torch.Tensor

    def detached(self) -> "RouterCounts":
        return RouterCounts(self.assignments.detach(), self.probabilities.detach(), self.rows.detach())


@dataclass
class WindowLoad:
    """The last window's router load over every micro-batch and data rank: top-k assignments per
    layer and expert ((layers, experts) per term, padding excluded)."""

    assignments: list[torch.Tensor]

    def per_expert(self) -> torch.Tensor:
        """Assignments per expert, every term and layer summed (the experts of the first term's size)."""
        return sum(a.sum(0) for a in self.assignments if a.shape[-1] == self.assignments[0].shape[-1])

    def imbalance(self) -> float:
        """Max / mean load over the layers' experts (1 = perfectly even); the worst layer."""
        worst = 1.0
        for layers in self.assignments:
            mean = layers.mean(-1)
            ratio = torch.where(mean > 0, layers.max(-1).values / mean.clamp_min(1e-30), torch.ones_like(mean))
            worst = max(worst, float(ratio.max()))
        return worst


def _layers(router_logits) -> tuple[torch.Tensor, ...]:
    if isinstance(router_logits, torch.Tensor):
        return (router_logits,)
    if isinstance(router_logits, (tuple, list)) and router_logits and all(
            isinstance(layer, torch.Tensor) for layer in router_logits):
        return tuple(router_logits)
    raise EngineUsageError("router logits must be a tensor (rows, experts) or a tuple of them, one per layer; "
                           f"got {type(router_logits).__name__}")


def router_counts(router_logits, num_experts: int, top_k: int, attention_mask=None) -> RouterCounts:
    """The term's statistics of one forward, as Hugging Face's definition counts them (softmax in
    at least float32, top-k of the probabilities, rows weighted by the flattened attention mask)."""
    layers = _layers(router_logits)
    device = layers[0].device
    dtype = torch.promote_types(layers[0].dtype, torch.float32)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=dtype)
    assignments, probabilities, rows = [], [], []
    for logits in layers:
        if logits.dim() != 2 or logits.shape[-1] != num_experts:
            raise EngineUsageError(f"router logits of shape {tuple(logits.shape)}: expected (rows, {num_experts}) "
                                   f"for {num_experts} experts")
        probs = torch.softmax(logits.to(device=device, dtype=dtype), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        weight = torch.ones(probs.shape[0], dtype=dtype, device=device) if mask is None else mask
        if weight.numel() != probs.shape[0]:
            raise EngineUsageError(f"the attention mask holds {weight.numel()} positions but the router saw "
                                   f"{probs.shape[0]} rows: pass the mask of the same batch")
        assignments.append(torch.zeros(num_experts, dtype=dtype, device=device).index_add_(
            0, chosen.reshape(-1), weight.repeat_interleave(top_k)))
        probabilities.append((probs * weight[:, None]).sum(0))
        rows.append(weight.sum())
    return RouterCounts(torch.stack(assignments).detach(), torch.stack(probabilities), torch.stack(rows).detach())


def term_value(counts: RouterCounts, num_experts: int) -> torch.Tensor:
    """E · Σᵢ (Cᵢ/R)(Sᵢ/R) with every layer pooled (0-dim)."""
    rows = counts.rows.sum()
    return num_experts * (counts.assignments.sum(0) * counts.probabilities.sum(0)).sum() / rows ** 2


def micro_batch_term(router_logits, num_experts: int, top_k: int = 2, attention_mask=None) -> torch.Tensor:
    """The term of these rows alone (what a model computes in each forward)."""
    return term_value(router_counts(router_logits, num_experts, top_k, attention_mask), num_experts)


def gradient_coefficients(window: RouterCounts, num_experts: int) -> torch.Tensor:
    """E · Cᵢ / R² of the window (E,): the term's gradient is Σᵢ of these times ∂Sᵢ."""
    return num_experts * window.assignments.sum(0) / window.rows.sum() ** 2


def global_term(mine: RouterCounts, window: RouterCounts, num_experts: int, factor) -> torch.Tensor:
    """This micro-batch's part of the window's term, times ``factor``: E / R² · Σᵢ Cᵢ · S_k,ᵢ with the
    window's C and R. Its gradient is the window's term's through this micro-batch's probabilities;
    its value, weighted as the engine weights the loss (``1 / factor``) and summed over the window,
    is the window's term."""
    coefficients = gradient_coefficients(window, num_experts).to(mine.probabilities.dtype)
    return factor * (coefficients * mine.probabilities.sum(0)).sum()


class _DeferredCoefficients(torch.autograd.Function):
    """Worth 0; its backward multiplies the incoming gradient by ``coefficients()`` read then."""

    @staticmethod
    def forward(ctx, probabilities, coefficients: Callable[[], torch.Tensor]):
        ctx.coefficients = coefficients
        return probabilities.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        coefficients = ctx.coefficients().to(device=grad.device, dtype=grad.dtype)
        return grad * coefficients, None


def deferred_term(mine: RouterCounts, num_experts: int, coefficients: Callable[[], torch.Tensor]) -> torch.Tensor:
    """This micro-batch's own value, with a gradient whose coefficients (``factor`` · E · Cᵢ / R²
    of the window, (E,)) are known only when its backward runs."""
    value = term_value(mine.detached(), num_experts)
    return value + _DeferredCoefficients.apply(mine.probabilities.sum(0), coefficients)


class _TermGradient(torch.autograd.Function):
    """Passes ``carrier`` on; its backward gives ``probabilities`` the gradient ``coefficients``, whatever
    gradient the carrier receives."""

    @staticmethod
    def forward(ctx, carrier, probabilities, coefficients):
        ctx.coefficients = coefficients
        return carrier.clone()  # a new tensor: a stage's output may be detached in place (zero-bubble)

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.coefficients, None


def with_term_gradient(carrier: torch.Tensor, mine: RouterCounts, coefficients: torch.Tensor) -> torch.Tensor:
    """``carrier`` (a tensor the loss depends on), through which the backward also adds Σᵢ coefficientsᵢ ·
    ∂S_k,ᵢ: the gradient of the window's term through these rows' router probabilities (pooled over
    their layers), for a term computed outside the loss (a pipeline stage's routers, whose loss is
    on another rank). ``coefficients`` (E,): the term's E · Cᵢ / R² of the window times its weight."""
    probabilities = mine.probabilities.sum(0)
    return _TermGradient.apply(carrier, probabilities, coefficients.to(probabilities.dtype))


def pooled(counts: RouterCounts) -> RouterCounts:
    """The statistics summed over the layers: one "layer" (1, E) holding Σ_layers C, S and R. The term
    pools its layers, so this is all a window needs of rows whose layers are spread over stages."""
    return RouterCounts(counts.assignments.sum(0, keepdim=True), counts.probabilities.sum(0, keepdim=True),
                        counts.rows.sum(0, keepdim=True))


def stack_counts(terms: Sequence[RouterCounts]) -> torch.Tensor:
    """The statistics of a micro-step's terms, flat (float64), to be summed over micro-steps and ranks."""
    return torch.cat([torch.cat([t.assignments.reshape(-1), t.probabilities.detach().reshape(-1), t.rows.reshape(-1)])
                      for t in terms]).double()


def unstack_counts(flat: torch.Tensor, shapes: Sequence[tuple[int, int]]) -> list[RouterCounts]:
    """The inverse of :func:`stack_counts` for terms of (layers, experts) ``shapes``."""
    terms, start = [], 0
    for layers, experts in shapes:
        size = layers * experts
        parts = flat[start:start + 2 * size + layers]
        terms.append(RouterCounts(parts[:size].reshape(layers, experts), parts[size:2 * size].reshape(layers, experts),
                                  parts[2 * size:]))
        start += 2 * size + layers
    return terms


def warn_routing_difference(where: str, difference: float) -> None:
    """Say that the training forwards of a window assigned ``difference`` top-k slots otherwise than
    its counting forward (``where``: which way of counting), whose assignments the gradient used."""
    if difference:
        log.warning("%s: the training forwards assigned %g top-k slot(s) to other experts than the counting forward "
                    "of the same micro-batches (a nondeterministic kernel, or randomness outside torch's, Python's "
                    "and NumPy's generators): the load-balancing gradient used the counting forward's assignments",
                    where, difference)
