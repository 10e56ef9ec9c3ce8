"""Global load balancing under a pipeline: every stage's router counts, exchanged before the window's
first backward.

Hugging Face's term pools the routers of every layer, aux = E · Σᵢ Cᵢ · Sᵢ / R² (C, S, R summed
over the layers and rows: ``engine.experts.balance``), and a stage holds some of the layers: no
rank sees the others' routers, and under 1F1B the last stage's first backward comes before the
first stage's later forwards. So a window under ``moe.load_balance: global`` runs:

1. **the counting schedule** (1F1B and interleaved; GPipe: the training schedule's own forwards, below):
   every micro-batch forward through the stages without gradients
   (random generators saved and restored, so dropout and router jitter draw the same numbers
   again); each stage adds its routers' C, S and R, pooled over its layers, each row weighted by
   the micro-batch's attention mask (and 0 on the rows that only pad a micro-batch to the
   schedule's shape); the last stage calls ``loss_fn`` for the items each micro-batch's own loss
   stands for. One small sum over the world (every stage, data and context rank; one rank of each
   tensor group) gives every rank the window's C, R, S and items U.
2. **the training schedule**: each stage's base-model output carries the term's gradient into its
   own routers' probabilities (``balance.with_term_gradient``): λ · E · Cᵢ / R², times the weight
   that makes a gradient added beside the loss enter the window's once
   (``Accounting.outside_loss_weight``: U · W / G) and the loss scale. The last stage's loss is the
   model's own; λ · aux of the window is added to each micro-batch's recorded loss after the schedule
   (``engine.window.executor``): weighted as each micro-batch's loss is (its items / U), those values
   add up to λ · aux once, so the reported loss is the global batch's.

Cost: one forward of the window without gradients (about a third of a step), the pipeline's bubble
once more, and one reduction of 2E + 6 numbers. GPipe runs every forward of the window before any
backward, on every stage, so there the forwards are held instead (``holding``, ``moe.global_counts:
hold_forwards``, what ``auto`` picks): the training schedule's forwards count, the sum runs between
its forwards and its backwards (``engine.window.executor``), and the gradient's coefficients are filled
in before the first backward reads them (``fill``). No counting schedule, no second bubble; 1F1B and
the interleaved schedules start backwards before the last forwards and keep the counting schedule.

The model's own loss carries the term (``loss_fn(model, micro_batch)`` returning ``m(**b).loss``):
a ``loss_fn(outputs, labels)`` sees the logits alone and adds no term, so nothing is counted for
it; a ``loss_fn(model, micro_batch)`` returning something else than the own loss is refused (the
term's gradient would reach the routers whatever the loss made of its value).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping
from typing import Callable, Iterator, Sequence

import torch

from engine.accounting import loss_tensor, losses_with_window_term, mean_items
from engine.config.schema import torch_sections
from engine.distributed.collectives import small_sum
from engine.errors import EngineUsageError
from engine.experts import balance
from engine.experts.balance import (RouterCounts, gradient_coefficients, pooled, router_counts, term_value,
                                    with_term_gradient)
from engine.experts.hf import RouterTerm, router_term_of
from engine.schedule import counted_through_stages, through_stages
from engine.state.rng import restore_rng_state, rng_state

log = logging.getLogger("engine")

NOT_OWN_LOSS = (
    "moe.load_balance: global under a pipeline: the routers' term of the window enters through the model's own "
    "loss, and loss_fn(model, micro_batch) returned something else than the model's .loss (its term's gradient "
    "reaches every stage's routers beside the loss, whatever loss_fn made of its value): return "
    "model(**micro_batch).loss unchanged, or write loss_fn(outputs, labels) for the language-model part "
    "(without the term), or set moe.load_balance: micro_batch and model.config.output_router_logits = False")


class StageRouters:
    """The routers of this rank's pipeline stages (Hugging Face stages: ``base_model()`` returns
    their copy of the base model, whose output holds the stage's ``router_logits``)."""

    def __init__(self, stages: Sequence, term: RouterTerm, counts_here: bool, stood_in: Callable[[], bool]):
        """``counts_here``: whether this rank adds its counts to the window's sum (one rank of each
        tensor group: its ranks see the same rows and routers); ``stood_in``: whether a stage of this rank
        failed in the run and stands in for the rest of it (its forwards then stop: not counted)."""
        self.term = term
        self.counts_here, self._stood_in = counts_here, stood_in
        self._mode: str | None = None
        self._weights: list[torch.Tensor] = []
        self._forwards = [0] * len(stages)
        self._sum: RouterCounts | None = None  # this rank's stages over the window, pooled
        self._coefficients: torch.Tensor | None = None
        self._trained: torch.Tensor | None = None  # the training forwards' assignments, pooled
        self.routing_differences = 0.0  # assignments the training forwards chose otherwise than the counting one
        self._stages = list(stages)
        for index, stage in enumerate(stages):
            stage.base_model().register_forward_hook(functools.partial(self._forward_seen, index))

    @staticmethod
    def of(stages: Sequence, term: RouterTerm | None, counts_here: bool,
           stood_in: Callable[[], bool]) -> "StageRouters | None":
        """The stages' routers when the model adds a term and its stages are cut by its own plan."""
        if term is None or not all(hasattr(stage, "base_model") for stage in stages):
            return None
        return StageRouters(stages, term, counts_here, stood_in)

    @contextlib.contextmanager
    def counting(self, weights: list[torch.Tensor]) -> Iterator[None]:
        """A counting schedule: each stage's forward of micro-batch k adds its routers' counts over the
        rows of ``weights[k]`` ((rows, sequence) weights: attention mask, 0 on padding rows)."""
        self._sum = None
        with self._running("count", weights):
            yield

    @contextlib.contextmanager
    def holding(self, weights: list[torch.Tensor]) -> Iterator[None]:
        """A held window (a schedule that runs every forward of the window before its first backward:
        GPipe): each stage's forward adds its routers' counts, as in a counting schedule, and its output
        carries the term's gradient with coefficients known once every forward has run (``fill``)."""
        self._sum, self._coefficients = None, None  # made at the first forward, in its probabilities' dtype
        try:
            with self._running("hold", weights):
                yield
        finally:
            self._coefficients = None

    def fill(self, coefficients: torch.Tensor) -> None:
        """The held window's gradient coefficients, before its first backward reads them."""
        if self._coefficients is not None:
            self._coefficients.copy_(coefficients)

    def learning_shapes(self) -> bool:
        """Whether a stage of this rank runs the schedule's shape inference (its forward is no micro-batch's)."""
        return any(getattr(stage, "learning_shapes", False) for stage in self._stages)

    def window_counts(self) -> torch.Tensor:
        """This rank's part of the window's [C (E), S (E), R], float64, for the sum over the world."""
        experts = self.term.num_experts
        if self._sum is None or not self.counts_here:
            return torch.zeros(2 * experts + 1, dtype=torch.float64)
        total = self._sum
        return torch.cat([total.assignments[0], total.probabilities[0], total.rows]).double()

    def window_assignments(self, counts: torch.Tensor) -> torch.Tensor:
        """The window's top-k assignments per expert (C) of its summed ``counts`` ([C, S, R])."""
        return counts[:self.term.num_experts]

    def weighted_term(self, counts: torch.Tensor) -> torch.Tensor:
        """λ · aux of the window's summed ``counts`` ([C, S, R]): what the model's own loss adds."""
        return self.term.coefficient * self.window_term(counts, 1.0)[0]

    def window_term(self, counts: torch.Tensor, weight) -> tuple[torch.Tensor, torch.Tensor]:
        """From the window's summed ``counts`` ([C, S, R]): (its term aux, the gradient's coefficients
        λ · E · Cᵢ / R² × ``weight``, what a gradient beside the loss is multiplied by)."""
        experts = self.term.num_experts
        window = RouterCounts(counts[:experts][None], counts[experts:2 * experts][None], counts[2 * experts:])
        return term_value(window, experts), self.term.coefficient * gradient_coefficients(window, experts) * weight

    @contextlib.contextmanager
    def training(self, weights: list[torch.Tensor], coefficients: torch.Tensor) -> Iterator[None]:
        """The training schedule: each stage's output carries the term's gradient into its routers."""
        self._coefficients, self._trained = coefficients, None
        try:
            with self._running("train", weights):
                yield
        finally:
            self._coefficients = None
        counted, trained = self._sum, self._trained
        if counted is not None and trained is not None and not self._stood_in():  # one host read, after the run
            self._check_routing(float((counted.assignments - trained).abs().sum()))

    @staticmethod
    def not_own_loss() -> EngineUsageError:
        """The error of a window whose ``loss_fn(model, micro_batch)`` returned another loss than the model's."""
        return EngineUsageError(NOT_OWN_LOSS)

    def window_sums(self, counted: list, failed: bool, schedules):
        """The window's router counts [C, S, R], its items U, whether a loss was not the model's own and
        whether a rank failed, summed over the world (one small reduction). ``counted``: per micro-batch on
        the last stage, (items, not the own loss); ``schedules``: the stages' (``engine.strategies.stage_schedules``)."""
        units = torch.zeros(3, dtype=torch.float64, device=schedules.device)  # items U, not the own loss, failed
        if schedules.last_stage is not None and self.counts_here:  # one rank of each replica adds its loss
            units[0] = sum(torch.as_tensor(count, dtype=torch.float64).to(units.device) for count, _ in counted)
            units[1] = float(any(not_own for _, not_own in counted))
        units[2] = float(failed)
        total = small_sum(torch.cat([self.window_counts().to(units.device), units]))
        return total[:-3], total[-3], bool(total[-2] > 0), bool(total[-1] > 0)

    def term_and_coefficients(self, counts: torch.Tensor, items: torch.Tensor, weight_of, balance):
        """From the window's summed counts and items: λ · aux of the window and the coefficients of the
        term's gradient beside the loss, times ``weight_of(items)`` (the engine's accounting, in the loss
        scale); ``balance`` (``engine.experts.window.ExpertBalance``) keeps the window's load for the monitor."""
        aux, coefficients = self.window_term(counts, weight_of(items))
        balance.counted_by_stages(self.window_assignments(counts))
        return self.term.coefficient * aux, coefficients

    @contextlib.contextmanager
    def _running(self, mode: str, weights: list[torch.Tensor]) -> Iterator[None]:
        self._mode, self._weights, self._forwards = mode, weights, [0] * len(self._forwards)
        try:
            yield
        finally:
            self._mode, self._weights = None, []
        # not after a failure: raised above, or kept by a stage standing in (raised after the window's collectives)
        if any(count != len(weights) for count in self._forwards) and not self._stood_in():
            raise EngineUsageError(
                f"moe.load_balance: global under a pipeline: the stages ran {self._forwards} forwards with router "
                f"logits in a schedule of {len(weights)} micro-batches: every forward of a stage must record its "
                "routers' logits (model.config.output_router_logits = True, not changed per call)")

    def _forward_seen(self, index: int, module, args, output):
        """The hook on stage ``index``'s base model: count its routers, or attach their term's gradient."""
        logits = getattr(output, "router_logits", None)
        if self._mode is None or not isinstance(logits, tuple) or not logits:
            return None
        # the schedule's shape inference, or a failed stage learning its stand-in's shapes from one row
        if getattr(self._stages[index], "learning_shapes", False) or self._stood_in():
            return None
        k = self._forwards[index]
        self._forwards[index] += 1
        if k >= len(self._weights):
            return None  # reported after the schedule
        counts = pooled(router_counts(tuple(logits), self.term.num_experts, self.term.top_k, self._weights[k]))
        if self._mode in ("count", "hold"):
            self._sum = counts.detached() if self._sum is None else RouterCounts(
                self._sum.assignments + counts.assignments, self._sum.probabilities + counts.probabilities.detach(),
                self._sum.rows + counts.rows)
        if self._mode == "count":
            return None
        if self._mode == "hold":
            if self._coefficients is None:  # filled in place before the backwards (the gradient reads it then)
                self._coefficients = counts.probabilities.new_zeros(self.term.num_experts)
        else:
            self._trained = counts.assignments if self._trained is None else self._trained + counts.assignments
        output.last_hidden_state = with_term_gradient(output.last_hidden_state, counts, self._coefficients)
        return output

    def _check_routing(self, difference: float) -> None:
        self.routing_differences += difference
        balance.warn_routing_difference("moe.load_balance: global under a pipeline", difference)


class WindowTerm:
    """A routed window's term in the last stage's recorded losses: the losses are computed without it
    (it may be known only after them: held forwards), and λ · aux of the window is added to each after
    the schedule, as the model's own loss would add it (``engine.accounting.losses_with_window_term``). It also
    keeps what the window's exchange sums of the last stage's losses (their items, whether each is the own
    loss), from the counting run or from held forwards."""

    def __init__(self, micro_batches: int):
        self.units: list = [(0, False)] * micro_batches  # per micro-batch: (items, not the own loss)
        self.multipliers = [1.0] * micro_batches  # what each own mean loss was multiplied by to be read as a sum
        self.value: torch.Tensor | None = None  # λ · aux of the window
        self.seen: set[int] = set()  # held: the micro-batches whose loss the last stage computed
        self.exchanged = self.not_own_loss = False  # held: the exchange ran; a loss was not the model's own

    def record(self, k: int, output, count) -> None:
        """Micro-batch ``k``'s loss as ``loss_fn`` returned it, and the items it stands for."""
        read = mean_items(loss_tensor(output))  # None: not the model's own loss
        self.units[k] = (count, read is None)
        if read is not None:
            self.multipliers[k] = read[0]


def schedule_for_global_balance(model: torch.nn.Module, config, checkpointing: bool) -> str | None:
    """``gpipe`` where no ``pipeline.schedule`` was set and GPipe learns a routed model's window counts at no
    extra forward (its forwards all run before its backwards: held, ``moe.global_counts`` auto or
    hold_forwards) while holding little: no more than 1F1B would where the window has no more micro-batches
    than stages, else only every micro-batch's checkpoints (activation checkpointing; 1F1B keeps at most one
    micro-batch's per stage in flight); None: the config's schedule stays (1F1B then
    counts first, a forward of the window without gradients and its bubble)."""
    pipeline, moe = config.pipeline, config.moe
    if pipeline.stages <= 1 or "schedule" in pipeline.model_fields_set or moe.load_balance != "global" \
            or moe.global_counts == "count_forward" or router_term_of(model) is None:
        return None
    accumulation = config.gradient_accumulation_steps
    fits = checkpointing or (accumulation is not None and accumulation <= pipeline.stages)
    return "gpipe" if fits else None


def config_for_global_balance(model: torch.nn.Module, config):
    """``config`` with ``pipeline.schedule: gpipe`` where :func:`schedule_for_global_balance` chooses it, said
    once; else ``config`` as it is."""
    checkpointing = torch_sections(config).features.checkpointing is not None
    if schedule_for_global_balance(model, config, checkpointing) is None:
        return config
    log.info("pipeline.schedule: gpipe (none was set): under moe.load_balance: global the window's router counts "
             "are learnt between GPipe's forwards and its backwards, at no extra forward; 1F1B would first run every "
             "micro-batch's forward without gradients (about 1.4x a step in bench/moe_pipeline.py). GPipe holds %s "
             "until its backwards; set pipeline.schedule: 1f1b to keep 1F1B",
             "every micro-batch's checkpoints" if checkpointing else "no more micro-batches than 1F1B")
    return config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"schedule": "gpipe"})})


class StageBalance:
    """The window hooks of a routed model under a pipeline (``engine.window.executor`` asks them): the
    window's schedule (counted first, or its forwards held), the term its last stage's losses are recorded
    with, and what its counting run, its exchange and its stages' training and evaluating forwards do."""

    counts_routers = True  # the model's own loss is read without its term: the window's is added

    def __init__(self, routers: StageRouters, balance, holds_forwards: bool, schedules):
        """``balance``: the model's ``engine.experts.window.ExpertBalance``, which keeps the window's load for
        the monitor; ``holds_forwards``: the stages' order runs every forward first (GPipe), which counts;
        ``schedules``: the stages' (``engine.strategies.stage_schedules``)."""
        self.routers, self.balance, self.holds_forwards, self.schedules = routers, balance, holds_forwards, schedules
        self.term: WindowTerm | None = None
        self._weights: list[torch.Tensor] = []
        self._coefficients: torch.Tensor | None = None
        self._term_weight = self._window = None

    def schedule(self, micro_batches: int) -> list:
        """The window's actions (``engine.schedule``): through the stages, counted first unless held."""
        return (through_stages if self.holds_forwards else counted_through_stages)(micro_batches)

    @contextlib.contextmanager
    def window(self, window, term_weight) -> Iterator[None]:
        """Around one window's actions (``window``: its micro-batches as the stages take them,
        ``engine.window.stages.StageWindow``): a new term, each micro-batch's router weights;
        ``term_weight(items)``: what the term's gradient beside the loss is multiplied by."""
        self.term, self._term_weight, self._window = WindowTerm(len(window.pieces)), term_weight, window
        self._weights = row_weights(window.pieces, window.sizes, window.rows, window.device)
        try:
            yield
        finally:
            self._weights, self._coefficients, self._window = [], None, None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """The counting run: every stage's router counts, no gradients, the random generators restored after
        (the training forwards draw the same numbers)."""
        saved = rng_state()
        try:
            with torch.no_grad(), self.routers.counting(self._weights):
                yield
        finally:
            restore_rng_state(saved)

    def counted(self, k: int, output, units, item_weighted: bool) -> None:
        """Micro-batch ``k``'s loss in the counting run (as ``loss_fn`` returned it, read as ``units`` of a mean or
        item-weighted loss): the items it stands for, whether it is the own loss."""
        self.term.units[k] = (units, not item_weighted or mean_items(loss_tensor(output)) is None)

    def exchange(self) -> bool:
        """The window's counts, items and failures summed over the world (once): its term's value and the
        coefficients its backwards read. Returns whether a rank failed (its counting run, or a stage standing
        in for the rest of the window; then no term is set, and the failure is raised after the window's
        collectives). A loss that is not the model's own is refused (counted first), or abandons the window
        after its backwards (held)."""
        term = self.term
        if term.exchanged:
            return False
        term.exchanged = True
        failed = self._window.failure is not None or self.schedules.stage_failed
        counts, items, term.not_own_loss, failed = self.routers.window_sums(term.units, failed, self.schedules)
        if failed:
            return True
        if term.not_own_loss:
            if self.holds_forwards:
                return False
            raise self.routers.not_own_loss()
        term.value, coefficients = self.routers.term_and_coefficients(counts, items, self._term_weight, self.balance)
        if self.holds_forwards:
            self.routers.fill(coefficients)
        else:
            self._coefficients = coefficients
        return False

    def training(self):
        """The training run: each stage's output carries the term's gradient into its routers (held: with
        coefficients filled in at the exchange)."""
        if self.holds_forwards:
            return self.routers.holding(self._weights)
        return self.routers.training(self._weights, self._coefficients)

    def record(self, k: int, output, count) -> None:
        """Micro-batch ``k``'s loss on the last stage as ``loss_fn`` returned it, and the items it stands for."""
        self.term.record(k, output, count)

    def last_stage_read(self, k: int) -> None:
        """The last stage is done with micro-batch ``k``'s loss (read, or not called: a zero-weight step, a
        failure); held: after the window's last, the counts' exchange (its backwards follow)."""
        if self.holds_forwards and not self.routers.learning_shapes():
            self.term.seen.add(k)
            if len(self.term.seen) == len(self.term.units):
                self.exchange()

    def before_gradients(self) -> None:
        """Before a stage receives its first gradient: held, every forward has run; the counts' exchange."""
        if self.holds_forwards:
            self.exchange()

    def recorded(self, outputs: list) -> list:
        """The last stage's losses with λ · aux of the window added (weighted as each loss is)."""
        term = self.term
        return losses_with_window_term(outputs, term.value, term.multipliers)

    def failure(self) -> Exception | None:
        """The window's refusal, known on every rank at the held exchange (a loss not the model's own)."""
        return self.routers.not_own_loss() if self.term.not_own_loss else None

    def closed(self, applied: bool) -> None:
        """The boundary, told to the model's balance."""
        self.balance.closed(applied)

    def manual_forward(self):
        """A forward of the manual loop (which a pipeline refuses): as the model's balance says."""
        return self.balance.manual_forward()

    # -- an evaluation -------------------------------------------------------------------------------
    def evaluating(self, window):
        """An evaluation run: every stage's router counts over ``window``'s rows."""
        return self.routers.counting(row_weights(window.pieces, window.sizes, window.rows, window.device))

    @staticmethod
    def evaluated_own_loss(output) -> bool:
        """Whether an evaluated micro-batch's loss is the model's own (carrying its items)."""
        return mean_items(loss_tensor(output)) is not None

    def evaluation_counts(self) -> torch.Tensor:
        """This rank's part of the evaluated batch's router counts, for the evaluation's one sum."""
        return self.routers.window_counts()

    def evaluation_term(self, counts: torch.Tensor) -> float:
        """λ · aux of the evaluated batch's summed ``counts``."""
        return float(self.routers.weighted_term(counts))

    def not_own_loss(self) -> EngineUsageError:
        return self.routers.not_own_loss()


def stage_balance(model: torch.nn.Module, section, strategy, balance) -> StageBalance | None:
    """The window hooks of a routed model's pipeline stages under the config's ``moe`` ``section``: under
    ``global`` balance, for a model whose ``.loss`` adds a term (``engine.experts.hf.router_term_of``) and whose
    stages are cut by its own plan; else None (a term is then the stage's own, or refused). ``balance``: the
    model's ``ExpertBalance``, whose choice of held forwards the window follows."""
    if section.load_balance != "global" or balance is None:
        return None
    schedules = strategy.schedules
    routers = StageRouters.of(schedules.stages, router_term_of(model),
                              counts_here=strategy.mesh.coordinates(strategy.rank).tensor == 0,
                              stood_in=lambda: schedules.stage_failed)
    if routers is None:
        return None
    holds = balance.holds_forwards
    if not holds and strategy.rank == 0:
        log.info("moe.load_balance: global under a pipeline: each window first runs a counting schedule (every "
                 "micro-batch forward without gradients, the bubble once more%s)",
                 "; pipeline.schedule: gpipe learns the counts in its own forwards instead, at no extra forward"
                 if not strategy.capabilities().can_hold_forwards else "")
    return StageBalance(routers, balance, holds, schedules)


def row_weights(pieces: Sequence, sizes: Sequence[int], rows: int, device) -> list[torch.Tensor]:
    """Each micro-batch's router weights, (``rows``, sequence): its attention mask (1 where it gives
    none) on its real rows, 0 on the rows that pad it to the schedule's shape."""
    weights = []
    for (piece, _), size in zip(pieces, sizes):
        ids, batch = piece
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        weight = torch.zeros(rows, ids.shape[-1], dtype=torch.float64, device=device)
        if size:
            weight[:size] = mask[:size].to(device=device, dtype=torch.float64) if isinstance(mask, torch.Tensor) else 1
        weights.append(weight)
    return weights
