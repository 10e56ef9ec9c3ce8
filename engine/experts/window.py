"""Global-batch load balancing: a window's router counts over every micro-batch and data rank,
known before the window's first backward.

A model with routers gives the window executor (``engine.window.executor``) its hooks,
:class:`ExpertBalance`: the schedule of a ``train_batch`` window (``engine.schedule``) and what its
forwards, counting forwards and exchange do. Under ``moe.load_balance: global``, for a model that
computes a load-balancing term, two ways to learn the window's assignments Cᵢ and rows R before any
backward (``moe.global_counts``):

* ``count_forward`` (``counted_first``): a forward of every micro-batch without gradients first (random generators
  saved before and restored after, so dropout and router jitter draw the same numbers again),
  one all-reduce of the counts over the data ranks, then the usual forward and backward of each
  micro-batch. No memory beyond one micro-batch; one more forward per micro-batch.
* ``hold_forwards`` (``held_forwards``): every micro-batch's forward first, their graphs held, the all-reduce, then
  every backward. No extra FLOPs; holds every micro-batch's activations at once (under
  activation checkpointing: every micro-batch's checkpoints; of a Hugging Face language model's
  output head and loss only the head's input, and of its output only the loss:
  ``engine.experts.held_forward``). Where the holder allows it (``WindowCapabilities.can_hold_forwards``, which
  is then told, ``hold_forwards``): one process; ZeRO 0 / 1, which reduce the window after its last
  backward (DDP pairs each forward with its backward); ZeRO 2 / 3, whose backwards each gather again
  and reduce into shards, as every micro-step does; a pipeline's GPipe schedule (the counts exchanged
  between its forwards and its backwards: ``engine.window.stages``). Not DeepSpeed's engine on
  several ranks, nor 1F1B or the interleaved schedules.
* ``auto``: ``hold_forwards`` under activation checkpointing where the strategy allows it (the
  memory it holds is the checkpoints'), and under a GPipe schedule (which holds every forward
  anyway: ``engine.window.stages``); ``count_forward`` otherwise.

The micro-batch's term then carries the gradient of the global term through its own router
probabilities (``engine.experts.balance``), divided by the weight the engine gives the loss it
sits in: a mean loss of ``n`` of the window's ``N`` samples (over every rank) is weighted
``n / N``, an item-weighted ``(sum, count)`` loss ``1 / U`` (U the window's items): the factor is
``N / n`` or ``U``. A term added to the loss with a coefficient λ (``loss + λ·aux``, as Hugging
Face's ``.loss``, or ``(lm_sum + λ·aux, count)``) thus enters the window's gradient as λ times
the global batch's term, once. Its value, weighted the same way and summed over the window, is the
global batch's term too, so the window's reported loss is the full batch's (counting forward); held
forwards report each micro-batch's own term (the coefficients arrive after the forward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from engine.accounting import MIXED_KINDS, loss_and_units, mean_items, term_factors
from engine.errors import EngineUsageError
from engine.experts import balance, hf
from engine.experts.balance import RouterCounts, WindowLoad
from engine.experts.bias import BiasRouters
from engine.experts.held_forward import HeldForward
from engine.experts.terms import LoadBalancingLoss, Scope, scoped
from engine.schedule import counted_first, held_forwards, one_after_another
from engine.state.rng import restore_rng_state, rng_state


class _Counting(Scope):
    """The counting forward: statistics kept, the micro-batch's value returned (no graph)."""

    def term(self, counts, num_experts):
        return balance.term_value(counts, num_experts)


class _OwnTerms(Scope):
    """``micro_batch``: each forward's term as the model computes it; the load is counted."""

    keeps_models_own = True


class _Global(Scope):
    """A training forward once the window's counts are known."""

    def __init__(self, window: Sequence[RouterCounts], factor: torch.Tensor | float):
        super().__init__()
        self.window, self.factor = window, factor

    def term(self, counts, num_experts):
        index = len(self.calls) - 1
        if index >= len(self.window):
            raise EngineUsageError(
                f"the model computed {index + 1} load-balancing terms in a forward, but {len(self.window)} in the "
                "counting forward of the same micro-batch: a forward must compute the same terms each time")
        return balance.global_term(counts, self.window[index], num_experts, self.factor)


class _Deferred(Scope):
    """A held forward: the gradient's coefficients are read from ``holder`` at its backward."""

    def __init__(self, holder: "_WindowCounts", micro_step: int):
        super().__init__()
        self.holder, self.micro_step = holder, micro_step

    def term(self, counts, num_experts):
        index, holder, k = len(self.calls) - 1, self.holder, self.micro_step
        return balance.deferred_term(counts, num_experts, lambda: holder.coefficients(index, k, num_experts))


class _Refused(Scope):
    def __init__(self, why: str):
        super().__init__()
        self.why = why

    def term(self, counts, num_experts):
        raise EngineUsageError(self.why)


@dataclass
class _WindowCounts:
    """One window's counts: per micro-batch the counting (or held) forwards' router counts and units, the
    training forwards' own terms (``micro_batch``); after the exchange, the window's terms and each
    micro-step's factor; the training forwards' routing difference from the counting ones."""

    micro_batches: int = 0
    counted: list = field(default_factory=list)
    sizes: list = field(default_factory=list)
    own: list = field(default_factory=list)
    terms: list | None = None
    factors: list | None = None
    difference: torch.Tensor | None = None
    saved_rng: Any = None

    def coefficients(self, index: int, micro_step: int, num_experts: int) -> torch.Tensor:
        """A held forward's gradient coefficients, read at its backward (after the exchange)."""
        return self.factors[micro_step] * balance.gradient_coefficients(self.terms[index], num_experts)


class ExpertBalance:
    """A window's hooks for a model with routers (``engine.window.executor`` asks them): the schedule
    that makes the model's load-balancing terms the global batch's (``global``), or keeps them as the
    model computes them (``micro_batch``), and what each forward, counting forward and the exchange
    between them do; counts the load of aux-loss-free routers over the window and moves their bias at
    its boundary; keeps the window's router load for the monitor."""

    def __init__(self, model: torch.nn.Module, *, load_balance: str, global_counts: str, can_hold_forwards: bool,
                 holding_is_cheap: bool, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                 bias_update_speed: float = 0.0):
        """``holding_is_cheap``: holding every forward of a window costs little memory here (activation
        checkpointing; a GPipe schedule holds them anyway), so ``auto`` holds where it can."""
        found = hf.find(model)
        self.hf_modules = found.modules
        self.own_terms = any(isinstance(m, LoadBalancingLoss) for m in model.modules())
        if load_balance == "global" and found.other_signatures and not found.modules:
            raise EngineUsageError(
                f"moe.load_balance: global: the model's load-balancing term comes from "
                f"{', '.join(found.other_signatures)}.{hf.FUNCTION}, whose definition Microstep does not know "
                "(it knows the one of Mixtral, Qwen2/3-MoE, OLMoE, ...: load_balancing_loss_func(gate_logits, "
                "num_experts, top_k, attention_mask)); set moe.load_balance: micro_batch to keep the model's own "
                "per-forward term")
        self.load_balance = load_balance
        # Whether the windows need the counts first: a term is computed in every training forward.
        self.computes_terms = self.own_terms or (bool(found.modules) and found.router_logits_by_default)
        if global_counts == "hold_forwards" and not can_hold_forwards:
            raise EngineUsageError(
                "moe.global_counts: hold_forwards runs every forward of a window before its backwards; DeepSpeed's "
                "engine on several ranks reduces in step with each forward's backward, and a pipeline's 1F1B and "
                "interleaved schedules start backwards before the last forwards: use count_forward (or auto), the "
                "torch backend, or pipeline.schedule: gpipe")
        if global_counts == "auto":
            global_counts = "hold_forwards" if can_hold_forwards and holding_is_cheap else "count_forward"
        self.global_counts = global_counts
        self._all_reduce_sum = all_reduce_sum
        self.bias_routers = BiasRouters(model, bias_update_speed)
        self.held_forward = HeldForward(model)  # what a held forward keeps until the backwards
        self.last_load: WindowLoad | None = None
        self.routing_differences = 0.0  # assignments the training forwards chose otherwise than the counting one
        self._window = _WindowCounts()

    @property
    def balances_globally(self) -> bool:
        return self.load_balance == "global" and self.computes_terms

    @property
    def holds_forwards(self) -> bool:
        """Whether a window's forwards all run before its backwards, its counts learnt between them."""
        return self.balances_globally and self.global_counts == "hold_forwards"

    @property
    def routes(self) -> bool:
        """Whether the model has anything for a window's hooks: a load-balancing term or a bias to move."""
        return bool(self.hf_modules or self.own_terms or self.bias_routers.updating)

    @property
    def _terms(self) -> bool:
        return bool(self.hf_modules or self.own_terms)

    # -- the schedule and its points ----------------------------------------------------------
    def schedule(self, micro_batches: int) -> list:
        """The window's actions (``engine.schedule``): counted first, forwards held, or one after another."""
        if self._terms and self.balances_globally:
            return (held_forwards if self.global_counts == "hold_forwards" else counted_first)(micro_batches)
        return one_after_another(micro_batches)

    @contextlib.contextmanager
    def window(self, micro_batches: int) -> Iterator[None]:
        """Around one ``train_batch`` window's actions; the window's load is kept after them."""
        self._window = _WindowCounts(micro_batches)
        self.bias_routers.start_window()
        with hf.computing_here(self.hf_modules) if self._terms else contextlib.nullcontext():
            yield
        if self._terms and self.load_balance != "global":
            self._keep_load(self._window_counts(self._window.own, [])[0])
        elif self._window.difference is not None:  # read after the backwards: no host sync inside the window
            self._check_routing(float(self._window.difference))
        bias_load = self.bias_routers.window_load(self._all_reduce_sum)
        if bias_load is not None and not self._terms:
            self.last_load = bias_load

    def forward(self, k: int, micro_batch, samples: int, run: Callable[[Any], Any]):
        """Micro-batch ``k``'s training forward, ``run(micro_batch)`` returning what ``loss_fn`` returns;
        a held forward returns what its backward reads of it."""
        run = self.bias_routers.counting(run)  # the training forwards' load, for the bias update
        if not self._terms:
            return run(micro_batch)
        if self.load_balance != "global":
            with scoped(_OwnTerms()) as scope:
                output = run(micro_batch)
            self._window.own.append(scope.calls)
            return output
        if not self.computes_terms:
            with scoped(_Refused(_NO_ROUTER_LOGITS)):
                return run(micro_batch)
        if self.global_counts == "hold_forwards":
            return self._held(k, micro_batch, samples, run)
        return self._counted_forward(k, micro_batch, run)

    def count(self, k: int, micro_batch, samples: int, run: Callable[[Any], Any]) -> None:
        """Micro-batch ``k``'s counting forward (no gradients; random generators restored at the exchange,
        so the training forwards draw the same numbers)."""
        if k == 0:
            self._window.saved_rng = rng_state()
        with torch.no_grad(), self.bias_routers.paused(), scoped(_Counting()) as scope:
            output = run(micro_batch)
        self._window.counted.append(scope.calls)
        self._window.sizes.append(self._units(output, samples))

    def exchange(self) -> None:
        """The window's counts over every micro-batch and data rank (one all-reduce), and each
        micro-step's factor; after a counting pass the random generators are restored."""
        window = self._window
        if window.saved_rng is not None:
            restore_rng_state(window.saved_rng)
            window.saved_rng = None
        window.terms, window.factors = self._window_and_factors(window.counted, window.sizes)

    def closed(self, applied: bool) -> None:
        """The boundary: an applied step moves the aux-loss-free routers' bias (a discarded window does not)."""
        self.bias_routers.update(applied=applied)

    @contextlib.contextmanager
    def manual_forward(self) -> Any:
        """A forward of the manual loop: its micro-batch's term alone cannot be the window's."""
        if self.bias_routers.updating:
            raise EngineUsageError(
                f"moe.bias_update_speed: {self.bias_routers.speed}: the routers' e_score_correction_bias is moved "
                "from the load of a whole train_batch window; the manual loop (eng(x), eng.backward, eng.step) does "
                "not count it; train with eng.train_batch(batch, loss_fn), or set moe.bias_update_speed: 0")
        if self.load_balance != "global" or not self._terms:
            yield
            return
        with hf.computing_here(self.hf_modules), scoped(_Refused(_MANUAL_LOOP)):
            yield

    # -- the ways --------------------------------------------------------------------------
    def _counted_forward(self, k: int, micro_batch, run):
        """A training forward once the window's counts are known; how differently it routed is kept."""
        window = self._window
        with scoped(_Global(window.terms, window.factors[k])) as scope:
            output = run(micro_batch)
        for now, then in zip(scope.calls, window.counted[k]):
            step = (now.assignments - then.assignments).abs().sum()
            window.difference = step if window.difference is None else window.difference + step
        return output

    def _held(self, k: int, micro_batch, samples: int, run):
        """One held forward: what its backward reads of its output (nothing else of the output stays
        alive); its router counts and units are kept for the exchange."""
        with scoped(_Deferred(self._window, k)) as scope, self.held_forward.running():
            output = run(micro_batch)
        self._window.counted.append([c.detached() for c in scope.calls])
        self._window.sizes.append(self._units(output, samples))
        return self.held_forward.kept(output)

    # -- counts ----------------------------------------------------------------------------
    @staticmethod
    def _units(output, samples: int) -> tuple[float, int, bool, object]:
        """(items, samples, item-weighted?, what a model's own mean loss was multiplied by to be read as
        a sum, or 1)."""
        _, count, item_weighted = loss_and_units(output, samples)
        read = mean_items(getattr(output, "loss", output))
        multiplier = torch.as_tensor(read[0] if read is not None else 1.0, dtype=torch.float64).reshape(())
        return torch.as_tensor(count, dtype=torch.float64).reshape(()), samples, item_weighted, multiplier

    def _window_counts(self, counted: list[list[RouterCounts]], extra: list[torch.Tensor]):
        """The terms' statistics summed over the micro-steps and the data ranks (one all-reduce,
        which carries ``extra`` too); returns (terms, extra summed)."""
        if not counted or not counted[0]:
            return [], extra
        shapes = [tuple(c.assignments.shape) for c in counted[0]]
        for k, calls in enumerate(counted):
            if [tuple(c.assignments.shape) for c in calls] != shapes:
                raise EngineUsageError(
                    f"micro-batch {k + 1} of the window computed load-balancing terms of (layers, experts) "
                    f"{[tuple(c.assignments.shape) for c in calls]}, the first one {shapes}: every forward must "
                    "compute the same terms")
        flat = sum(balance.stack_counts(calls) for calls in counted)
        device = flat.device
        flat = torch.cat([flat] + [e.to(device=device, dtype=torch.float64).reshape(1) for e in extra])
        flat = self._all_reduce_sum(flat)
        size = flat.numel() - len(extra)
        return balance.unstack_counts(flat[:size], shapes), list(flat[size:])

    def _window_and_factors(self, counted, sizes):
        """The window's terms over every rank, and each micro-step's factor (N / n for a mean loss,
        U for an item-weighted one, U / c for a model's own mean over c items read as its sum)."""
        item_weighted = {kind for _, _, kind, _ in sizes}
        if len(item_weighted) > 1:
            raise EngineUsageError(MIXED_KINDS)
        items = sum(count for count, _, _, _ in sizes)
        samples = torch.tensor(float(sum(n for _, n, _, _ in sizes)), dtype=torch.float64)
        window, (total_items, total_samples) = self._window_counts(counted, [torch.as_tensor(items), samples])
        self._keep_load(window)
        return window, term_factors(item_weighted == {True}, total_items, total_samples, [(n, c) for _, n, _, c in sizes])

    def _keep_load(self, window: list[RouterCounts]) -> None:
        self.last_load = WindowLoad([term.assignments for term in window]) if window else None

    def counted_by_stages(self, assignments: torch.Tensor) -> None:
        """Under a pipeline: the window's top-k assignments per expert over every rank, pooled over the
        stages' layers (``engine.experts.stages`` counts them), kept for the monitor."""
        self.last_load = WindowLoad([assignments.reshape(1, -1)])

    def _check_routing(self, difference: float) -> None:
        self.routing_differences += difference
        balance.warn_routing_difference("moe.global_counts: count_forward", difference)


class NoRouters:
    """What ``eng.experts`` answers for a model without routers (docs/moe.md): no load, nothing routed
    differently. The windows of such a model have no hooks; this is only read."""

    routes = False
    last_load: WindowLoad | None = None
    routing_differences = 0.0


NO_ROUTERS = NoRouters()


_NO_ROUTER_LOGITS = (
    "the model computed a load-balancing term although its config has output_router_logits false, so the engine "
    "did not count the window first: set model.config.output_router_logits = True before engine.initialize (or "
    "moe.load_balance: micro_batch)")
_MANUAL_LOOP = (
    "moe.load_balance: global: the model computed a load-balancing term in a forward of the manual loop (eng(x), "
    "eng.backward, eng.step), where the window's other micro-batches are not known before this backward, and the "
    "term's gradient through this micro-batch's routers needs their counts (keeping it for later would hold every "
    "micro-batch's activations until the window's last forward). Train with eng.train_batch(batch, loss_fn), which "
    "is exact: it counts the whole window first (one forward without gradients per micro-batch, about a third of a "
    "step more; none under activation checkpointing on the torch backend, which holds the window's checkpoints "
    "instead), or set moe.load_balance: micro_batch to keep the model's per-forward term")


def expert_balance(model: torch.nn.Module, section, *, strategy, checkpointing: bool,
                   stages_run_micro_steps: bool) -> ExpertBalance | None:
    """A window's hooks for ``model``'s routers under the config's ``moe`` ``section``; None for a model
    without a load-balancing term or a bias to move (its windows run as any other's, with no hook).
    ``stages_run_micro_steps``: a pipeline's stages run the micro-steps in their order, not the
    executor's per-micro-batch actions: a Hugging Face model's routers are counted over its stages
    (``engine.experts.stages``); a term of the user's own or a bias to move is refused there."""
    experts = ExpertBalance(model, load_balance=section.load_balance, global_counts=section.global_counts,
                            can_hold_forwards=strategy.capabilities().can_hold_forwards,
                            # GPipe holds every micro-batch's activations until its backwards anyway
                            holding_is_cheap=checkpointing or stages_run_micro_steps,
                            all_reduce_sum=strategy.all_reduce_sum,
                            bias_update_speed=section.bias_update_speed)
    if not experts.routes:
        return None
    own_term_globally = experts.balances_globally and experts.own_terms
    if stages_run_micro_steps and (own_term_globally or experts.bias_routers.updating):
        raise EngineUsageError(
            "moe.load_balance: global with an engine.LoadBalancingLoss of the model's own (or moe.bias_update_speed) "
            "under a pipeline: the stages run parts of the model, not its forward where the term is added to the "
            "loss (a Hugging Face model's term is counted over its stages: its .loss adds it), and the bias moves "
            "by the load of a window the stages' schedule does not count; set moe.load_balance: micro_batch and "
            "moe.bias_update_speed: 0, or train without pipeline.stages")
    if experts.holds_forwards:
        strategy.hold_forwards()
    return experts
