"""Global-batch load balancing: a window's router counts over every micro-batch and data rank,
known before the window's first backward.

The engine hands a ``train_batch`` window's micro-batches to :meth:`ExpertBalance.run_window`
(``moe.load_balance: global`` and a model that computes a load-balancing term). Two ways to
learn the window's assignments Cᵢ and rows R before any backward (``moe.global_counts``):

* ``count_forward``: a forward of every micro-batch without gradients first (random generators
  saved before and restored after, so dropout and router jitter draw the same numbers again),
  one all-reduce of the counts over the data ranks, then the usual forward and backward of each
  micro-batch. No memory beyond one micro-batch; one more forward per micro-batch.
* ``hold_forwards``: every micro-batch's forward first, their graphs held, the all-reduce, then
  every backward. No extra FLOPs; holds every micro-batch's activations at once (under
  activation checkpointing: every micro-batch's checkpoints; of a Hugging Face language model's
  output head and loss only the head's input, and of its output only the loss:
  ``engine.window.held_forward``). Where the holder allows it (``Strategy.can_hold_forwards``, which
  is then told, ``hold_forwards``): one process; ZeRO 0 / 1, which reduce the window after its last
  backward (DDP pairs each forward with its backward); ZeRO 2 / 3, whose backwards each gather again
  and reduce into shards, as every micro-step does; a pipeline's GPipe schedule (the counts exchanged
  between its forwards and its backwards: ``engine.window.pipeline``). Not DeepSpeed's engine on
  several ranks, nor 1F1B or the interleaved schedules.
* ``auto``: ``hold_forwards`` under activation checkpointing where the strategy allows it (the
  memory it holds is the checkpoints'), and under a GPipe schedule (which holds every forward
  anyway: ``engine.window.pipeline``); ``count_forward`` otherwise.

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
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from engine.errors import EngineUsageError
from engine.experts import balance, hf
from engine.experts.balance import RouterCounts, WindowLoad
from engine.experts.bias import BiasRouters
from engine.experts.terms import LoadBalancingLoss, Scope, scoped
from engine.window.hooks import EngineHook
from engine.window.accounting import term_factors
from engine.window.held_forward import HeldForward
from engine.window.model_loss import mean_items
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

    def __init__(self, holder: "_HeldWindow", micro_step: int):
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
class _HeldWindow:
    """The window's counts and the micro-steps' factors, filled in after the held forwards."""

    window: list | None = None
    factors: list | None = None

    def coefficients(self, index: int, micro_step: int, num_experts: int) -> torch.Tensor:
        return self.factors[micro_step] * balance.gradient_coefficients(self.window[index], num_experts)


def one_after_another(pieces: Sequence[tuple[Any, int]], forward: Callable[[Any], Any],
                      backward: Callable[[Any, int], None]) -> None:
    """Each ``(micro_batch, samples)`` piece's forward, then its backward: a window with no counts to learn first."""
    for micro_batch, samples in pieces:
        backward(forward(micro_batch), samples)


class NoRouters(EngineHook):
    """The window runner's part for a model without load-balancing terms or biased routers: its
    micro-steps run one after another, and nothing is counted."""

    routes = False
    holds_forwards = False
    last_load: WindowLoad | None = None
    routing_differences = 0.0

    @contextlib.contextmanager
    def manual_forward(self) -> Any:
        yield

    def run_window(self, pieces: Sequence[tuple[Any, int]], *, forward: Callable[[Any], Any],
                   backward: Callable[[Any, int], None], units: Callable[[Any, int], tuple],
                   before_counting: Callable[[], None] = lambda: None) -> None:
        one_after_another(pieces, forward, backward)


class ExpertBalance(EngineHook):
    """Runs the micro-steps of a ``train_batch`` window so that the model's load-balancing terms
    are the global batch's (``global``), or as the model computes them (``micro_batch``); counts the
    load of aux-loss-free routers over the window and moves their bias at its boundary; keeps the
    window's router load for the monitor."""

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

    @property
    def balances_globally(self) -> bool:
        return self.load_balance == "global" and self.computes_terms

    @property
    def holds_forwards(self) -> bool:
        """Whether a window's forwards all run before its backwards, its counts learnt between them."""
        return self.balances_globally and self.global_counts == "hold_forwards"

    @property
    def routes(self) -> bool:
        """Whether the model has anything for this runner: a load-balancing term or a bias to move."""
        return bool(self.hf_modules or self.own_terms or self.bias_routers.updating)

    # -- the hook points -------------------------------------------------------------------
    @contextlib.contextmanager
    def manual_forward(self) -> Any:
        """A forward of the manual loop: its micro-batch's term alone cannot be the window's."""
        if self.bias_routers.updating:
            raise EngineUsageError(
                f"moe.bias_update_speed: {self.bias_routers.speed}: the routers' e_score_correction_bias is moved "
                "from the load of a whole train_batch window; the manual loop (eng(x), eng.backward, eng.step) does "
                "not count it; train with eng.train_batch(batch, loss_fn), or set moe.bias_update_speed: 0")
        if self.load_balance != "global" or not (self.hf_modules or self.own_terms):
            yield
            return
        why = ("moe.load_balance: global: the model computed a load-balancing term in a forward of the manual loop "
               "(eng(x), eng.backward, eng.step), where the window's other micro-batches are not known before this "
               "backward, and the term's gradient through this micro-batch's routers needs their counts (keeping it "
               "for later would hold every micro-batch's activations until the window's last forward). Train with "
               "eng.train_batch(batch, loss_fn), which is exact: it counts the whole window first (one forward "
               "without gradients per micro-batch, about a third of a step more; none under activation "
               "checkpointing on the torch backend, which holds the window's checkpoints instead), or set "
               "moe.load_balance: micro_batch to keep the model's per-forward term")
        with hf.computing_here(self.hf_modules), scoped(_Refused(why)):
            yield

    def run_window(self, pieces: Sequence[tuple[Any, int]], *, forward: Callable[[Any], Any],
                   backward: Callable[[Any, int], None], units: Callable[[Any, int], tuple],
                   before_counting: Callable[[], None] = lambda: None) -> None:
        """Forward and backward of every ``(micro_batch, samples)`` piece: ``forward(micro_batch)``
        returns what ``loss_fn`` returns, ``backward(output, samples)`` weights it and runs its
        backward; ``units(output, samples)`` is the engine's ``(loss, units, item_weighted)``;
        ``before_counting()`` runs before a counting forward (the ranks' position check)."""
        pieces = list(pieces)
        forward = self.bias_routers.counting(forward)  # the training forwards' load, for the bias update
        self.bias_routers.start_window()
        if not self.hf_modules and not self.own_terms:
            one_after_another(pieces, forward, backward)
        else:
            self._run_terms(pieces, forward, backward, units, before_counting)
        bias_load = self.bias_routers.window_load(self._all_reduce_sum)
        if bias_load is not None and not (self.hf_modules or self.own_terms):
            self.last_load = bias_load

    def on_window_closed(self, engine, report) -> None:
        """The boundary: an applied step moves the aux-loss-free routers' bias (a discarded window does not)."""
        self.bias_routers.update(applied=report.step.applied)

    def _run_terms(self, pieces, forward, backward, units, before_counting) -> None:
        with hf.computing_here(self.hf_modules):
            if self.load_balance != "global":
                self._micro_batch_window(pieces, forward, backward)
            elif not self.computes_terms:
                why = ("the model computed a load-balancing term although its config has output_router_logits "
                       "false, so the engine did not count the window first: set model.config.output_router_logits "
                       "= True before engine.initialize (or moe.load_balance: micro_batch)")
                with scoped(_Refused(why)):
                    one_after_another(pieces, forward, backward)
            elif self.global_counts == "hold_forwards":
                self._held_window(pieces, forward, backward, units)
            else:
                before_counting()
                self._counted_window(pieces, forward, backward, units)

    # -- the ways --------------------------------------------------------------------------
    def _micro_batch_window(self, pieces, forward, backward) -> None:
        """Each forward's own term (as the model computes it); the window's load is kept."""
        loads = []
        for micro_batch, samples in pieces:
            with scoped(_OwnTerms()) as scope:
                output = forward(micro_batch)
            loads.append(scope.calls)
            backward(output, samples)
        self._keep_load(self._window_counts(loads, [])[0])

    def _counting_pass(self, pieces, forward, units) -> tuple[list, list]:
        """Every micro-batch's forward without gradients, random generators restored after (the
        training forwards draw the same numbers): each one's router counts and units."""
        saved = rng_state()
        counted, sizes = [], []
        with torch.no_grad(), self.bias_routers.paused():
            for micro_batch, samples in pieces:
                with scoped(_Counting()) as scope:
                    output = forward(micro_batch)
                counted.append(scope.calls)
                sizes.append(self._units(units, output, samples))
        restore_rng_state(saved)
        return counted, sizes

    def _counted_window(self, pieces, forward, backward, units) -> None:
        counted, sizes = self._counting_pass(pieces, forward, units)
        window, factors = self._window_and_factors(counted, sizes)
        difference = None
        for (micro_batch, samples), before, factor in zip(pieces, counted, factors):
            with scoped(_Global(window, factor)) as scope:
                output = forward(micro_batch)
            for now, then in zip(scope.calls, before):
                step = (now.assignments - then.assignments).abs().sum()
                difference = step if difference is None else difference + step
            backward(output, samples)
        if difference is not None:  # read after the backwards: no host sync inside the window
            self._check_routing(float(difference))

    def _held_window(self, pieces, forward, backward, units) -> None:
        holder = _HeldWindow()
        outputs, counted, sizes = [], [], []
        for k, (micro_batch, samples) in enumerate(pieces):
            kept, calls, size = self._held(forward, micro_batch, samples, _Deferred(holder, k), units)
            outputs.append(kept)
            counted.append(calls)
            sizes.append(size)
        holder.window, holder.factors = self._window_and_factors(counted, sizes)
        for output, (_, samples) in zip(outputs, pieces):
            backward(output, samples)

    def _held(self, forward, micro_batch, samples: int, scope: _Deferred, units):
        """One held forward: what its backward reads of its output (nothing else of the output stays
        alive), its router counts and its units."""
        with scoped(scope), self.held_forward.running():
            output = forward(micro_batch)
        return self.held_forward.kept(output), [c.detached() for c in scope.calls], self._units(units, output, samples)

    # -- counts ----------------------------------------------------------------------------
    @staticmethod
    def _units(units, output, samples: int) -> tuple[float, int, bool, object]:
        """(items, samples, item-weighted?, what a model's own mean loss was multiplied by to be read as
        a sum, or 1)."""
        _, count, item_weighted = units(output, samples)
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
            raise EngineUsageError("one window mixes mean losses and (sum, count) losses; use one kind per window")
        items = sum(count for count, _, _, _ in sizes)
        samples = torch.tensor(float(sum(n for _, n, _, _ in sizes)), dtype=torch.float64)
        window, (total_items, total_samples) = self._window_counts(counted, [torch.as_tensor(items), samples])
        self._keep_load(window)
        return window, term_factors(item_weighted == {True}, total_items, total_samples, [(n, c) for _, n, _, c in sizes])

    def _keep_load(self, window: list[RouterCounts]) -> None:
        self.last_load = WindowLoad([term.assignments for term in window]) if window else None

    def counted_by_stages(self, assignments: torch.Tensor) -> None:
        """Under a pipeline: the window's top-k assignments per expert over every rank, pooled over the
        stages' layers (``engine.window.stage_routers`` counts them), kept for the monitor."""
        self.last_load = WindowLoad([assignments.reshape(1, -1)])

    def _check_routing(self, difference: float) -> None:
        self.routing_differences += difference
        balance.warn_routing_difference("moe.global_counts: count_forward", difference)


def expert_balance(model: torch.nn.Module, section, *, strategy, checkpointing: bool,
                   runner_runs_micro_steps: bool) -> ExpertBalance | NoRouters:
    """The window runner's part for ``model``'s routers under the config's ``moe`` ``section``;
    ``NoRouters`` for a model without a load-balancing term (its windows run as any other's).
    ``runner_runs_micro_steps``: a window runner (a pipeline's schedule) runs the micro-steps, not the
    engine: it counts a Hugging Face model's routers over its stages itself
    (``engine.window.stage_routers``); a term of the user's own or a bias to move is refused there."""
    experts = ExpertBalance(model, load_balance=section.load_balance, global_counts=section.global_counts,
                            can_hold_forwards=strategy.can_hold_forwards,
                            # GPipe holds every micro-batch's activations until its backwards anyway
                            holding_is_cheap=checkpointing or runner_runs_micro_steps,
                            all_reduce_sum=strategy.all_reduce_sum,
                            bias_update_speed=section.bias_update_speed)
    if not experts.routes:
        return NoRouters()
    own_term_globally = experts.balances_globally and experts.own_terms
    if runner_runs_micro_steps and (own_term_globally or experts.bias_routers.updating):
        raise EngineUsageError(
            "moe.load_balance: global with an engine.LoadBalancingLoss of the model's own (or moe.bias_update_speed) "
            "under a pipeline: the stages run parts of the model, not its forward where the term is added to the "
            "loss (a Hugging Face model's term is counted over its stages: its .loss adds it), and the bias moves "
            "by the load of a window the stages' schedule does not count; set moe.load_balance: micro_batch and "
            "moe.bias_update_speed: 0, or train without pipeline.stages")
    if experts.holds_forwards:
        strategy.hold_forwards()
    return experts
