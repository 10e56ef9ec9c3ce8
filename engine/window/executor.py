"""The window executor: runs every window of one engine as a schedule (``engine.schedule``).

A ``train_batch`` window is cut into micro-batches by the window split, then its schedule's actions
run in order: forwards (``loss_fn(model, micro_batch)``, each micro-batch as this rank's part of its
sequences, ``engine.context``), weighted backwards (the window machine, ``engine.window.machine``,
reads, weighs and counts each loss), and — for a model with routers — counting forwards and the
window's exchange. The schedule and what those actions do come from the window's hooks: a model with
routers has them (``engine.experts.window``), a dense model has none, and its window is each forward
then its backward with no hook asked. Evaluation runs the same executor with a schedule of forwards
only, its totals weighed by ``engine.accounting``.

Under a pipeline (``stages``, ``engine.window.stages``; None for a model held whole on this rank) a
window is ``STAGES``: its micro-batches through the stages' order (GPipe, 1F1B, interleaved, zero-bubble:
``engine.schedule``), run by torch's runtime, whose last stage hands the executor each micro-batch's
loss to read and weigh; every stage counts every micro-step after it, and a failure is the window's on
every rank. A routed model's hooks there (``engine.experts.stages.StageBalance``) add the counting run
(``COUNT_STAGES``) and the exchange, or hold the order's forwards; an evaluation is the order's
forwards (``EVALUATE_STAGES``).

Every forward of a window the executor cut itself is its own (no manual-loop bookkeeping); a forward
of the manual loop (``eng(x)``) comes here too, through :meth:`forward`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import torch

from engine.accounting import evaluation_mean, evaluation_terms, loss_and_units
from engine.batching.micro_batches import MicroBatches
from engine.schedule import (BACKWARD, COUNT, COUNT_STAGES, EVALUATE_STAGES, EXCHANGE, FORWARD, STAGES,
                             evaluated_through_stages, forwards_only, one_after_another)
from engine.window.loss_checks import check_scalar_loss, failed_on_another_rank, written_for_model
from engine.window.stages import NO_STAGE_HOOKS, StageWindow, StageWindows

LossFn = Callable[[Any, Any], Any]


class WindowHooks(Protocol):
    """What a window's hooks (a model's routers: ``engine.experts.window.ExpertBalance``) answer."""

    def schedule(self, micro_batches: int) -> list: ...
    def window(self, micro_batches: int) -> contextlib.AbstractContextManager: ...
    def forward(self, k: int, micro_batch, samples: int, run: Callable[[Any], Any]): ...
    def count(self, k: int, micro_batch, samples: int, run: Callable[[Any], Any]) -> None: ...
    def exchange(self) -> None: ...
    def closed(self, applied: bool) -> None: ...
    def manual_forward(self) -> contextlib.AbstractContextManager: ...


class StageHooks(Protocol):
    """What a pipeline window's hooks (a routed model's stages: ``engine.experts.stages.StageBalance``; without
    routers to count, ``engine.window.stages.NO_STAGE_HOOKS``) answer."""

    counts_routers: bool  # the model's own loss is read without its term (the window's is added)

    def schedule(self, micro_batches: int) -> list: ...
    def window(self, window: StageWindow, term_weight: Callable) -> contextlib.AbstractContextManager: ...
    def counting(self) -> contextlib.AbstractContextManager: ...
    def counted(self, k: int, output, units, item_weighted: bool) -> None: ...
    def exchange(self) -> bool: ...  # whether a rank failed
    def training(self) -> contextlib.AbstractContextManager: ...
    def record(self, k: int, output, count) -> None: ...
    def last_stage_read(self, k: int) -> None: ...
    def before_gradients(self) -> None: ...
    def recorded(self, outputs: list) -> list: ...
    def failure(self) -> Exception | None: ...
    def evaluating(self, window: StageWindow) -> contextlib.AbstractContextManager: ...
    def evaluated_own_loss(self, output) -> bool: ...
    def evaluation_counts(self) -> torch.Tensor: ...
    def evaluation_term(self, counts: torch.Tensor) -> float: ...
    def not_own_loss(self) -> Exception: ...
    def closed(self, applied: bool) -> None: ...
    def manual_forward(self) -> contextlib.AbstractContextManager: ...


class WindowExecutor:
    """Runs one engine's windows. ``model``: what ``loss_fn(model, micro_batch)`` is handed (the engine's
    front); ``hooks``: the windows' hooks, None for a dense model (a pipeline's: its stages' hooks);
    ``stages``: a pipeline's windows, None for a model held whole; ``guard``: runs a window's micro-steps (the
    automatic micro size's catches an out-of-memory on any rank); ``accounting``: its weights."""

    def __init__(self, *, model, strategy, windows, window_split, context, losses, accounting,
                 hooks: WindowHooks | StageHooks | None, stages: StageWindows | None,
                 guard: Callable[[Callable[[], None]], None]):
        self.model, self.strategy, self.windows = model, strategy, windows
        self.window_split, self.context, self.losses = window_split, context, losses
        self.accounting, self.hooks, self.stages, self.guard = accounting, hooks, stages, guard
        self._own = False  # inside a window the executor cut: its forwards are no manual loop's

    @property
    def calls_loss_on_outputs(self) -> bool:
        """Whether ``loss_fn`` is called on outputs (a pipeline's last stage: ``loss_fn(outputs, labels)``)."""
        return self.stages is not None

    # -- forwards -----------------------------------------------------------------------------
    def forward(self, args: tuple, kwargs: dict, plan):
        """``eng(*args, **kwargs)``: a forward of a window the executor runs, or of the manual loop (moved to
        the device already, checked for the replica's batch, split over the context ranks, its micro-step's
        gradient sync planned)."""
        training = torch.is_grad_enabled()
        manual = not self._own
        if manual:
            if training:  # the manual loop's whole micro-batch, compared at the window's close
                self.windows.check_manual_batch(args, kwargs)
            args, kwargs = self.context.shard_call(args, kwargs)
        kwargs = self.losses.call_arguments(kwargs)
        if training:  # a forward for a backward: plan its gradient sync
            self.windows.before_training_forward(plan.gradient_accumulation_steps)
        # a manual-loop forward cannot hold the window's load-balancing term
        refusing = self.hooks.manual_forward() if training and manual and self.hooks is not None \
            else contextlib.nullcontext()
        measured = self.windows.measured_forwards() if training else contextlib.nullcontext()
        with refusing, measured, self.context.running():
            output = self.strategy.forward(*args, **kwargs)
        self.losses.observe(kwargs, output)
        if training and manual:  # the manual loop: what this forward tells about the micro-batch
            window = self.windows.current
            self.window_split.record_forward(window.forwards, plan, window.micro_steps, args, kwargs, output)
        return output

    @property
    def runs_own_micro_batches(self) -> bool:
        """Whether a window the executor cut is running (its forwards' batches are on the device already)."""
        return self._own

    # -- a training window --------------------------------------------------------------------------
    def run_window(self, batch, loss_fn: LossFn, plan) -> None:
        """Forward and backward of every micro-batch of one window (no step), as its schedule says.
        ``batch``: this rank's per-device batch, or ``engine.MicroBatches`` (run as collated)."""
        stages, hooks = self.stages, self._hooks_for(loss_fn)
        if stages is not None:
            batch, loss_fn = stages.schedule_form(batch, loss_fn, "train_batch", hooks.counts_routers)
        split = batch.split(plan) if isinstance(batch, MicroBatches) else self.window_split.split(batch, plan)
        self.windows.planned(split)
        pieces, window = list(split.pieces), None
        if stages is not None:
            window = stages.window(batch[0], pieces, loss_fn, self.context, self.window_split.schedule_rows())
            pieces = window.pieces
        actions = hooks.schedule(len(pieces)) if hooks is not None else one_after_another(len(pieces))
        with self._own_micro_batches():
            self.guard(lambda: self._run(actions, pieces, loss_fn, plan.gradient_accumulation_steps, hooks, window))

    def _hooks_for(self, loss_fn: LossFn):
        """The window's hooks: a pipeline's routers count only for the model's own loss, which adds their term
        (without them, the null ``NO_STAGE_HOOKS``)."""
        if self.stages is None:
            return self.hooks
        return self.hooks if self.hooks is not None and written_for_model(loss_fn) else NO_STAGE_HOOKS

    def _run(self, actions: list, pieces: list, loss_fn: LossFn, planned: int, hooks,
             window: StageWindow | None) -> None:
        """A window's actions; ``window``: a pipeline's, as its stages take it (None for a model held whole)."""
        windows = self.windows

        def run(micro_batch):  # loss_fn on this rank's part of the micro-batch's sequences
            return loss_fn(self.model, self.context.shard(micro_batch))

        held: dict[int, Any] = {}  # forwards' outputs until their backwards
        if window is not None:  # waited for before this rank's first message: the first forward hides the wait
            window.confirm_start = windows.start_check_posted()
        try:
            with self._hooks_window(hooks, pieces, window):
                for kind, k in actions:
                    micro_batch, samples = pieces[k] if k >= 0 else (None, 0)
                    if kind == FORWARD:
                        held[k] = run(micro_batch) if hooks is None else hooks.forward(k, micro_batch, samples, run)
                    elif kind == BACKWARD:
                        windows.backward(held.pop(k), samples, planned, exact_counts=True)
                    elif kind == STAGES:
                        self._train_through_stages(window, hooks)
                    elif kind == COUNT_STAGES:
                        self._count_through_stages(window, hooks)
                    elif kind == COUNT:
                        if k == 0:  # a counting forward's collectives come before the window's first training one
                            windows.agree_before_counting()
                        hooks.count(k, micro_batch, samples, run)
                    elif kind == EXCHANGE:
                        if hooks.exchange():  # a pipeline's counting run failed on a rank
                            self._counting_failed(window)
                            return
                    else:
                        raise ValueError(f"a training window's schedule holds {kind!r}")
        finally:  # (a pipeline window that failed before its first message)
            if window is not None:
                window.confirm_start()

    def _counting_failed(self, window: StageWindow) -> None:
        """A pipeline's counting run failed on some rank: raise this rank's failure, else another's; under a
        vote on failures (the automatic micro size) leave the window to the vote, which abandons it everywhere."""
        self.stages.raise_stage_failure()
        if window.failure is not None:
            raise window.failure
        if not self.stages.failures_voted:
            raise failed_on_another_rank("window")

    def _hooks_window(self, hooks, pieces: list, window: StageWindow | None):
        """Around a window's actions: its hooks' (a pipeline's: with its stages' form and the term's weight)."""
        if window is not None:
            return hooks.window(window, self._term_weight)
        return hooks.window(len(pieces)) if hooks is not None else contextlib.nullcontext()

    def _count_through_stages(self, window: StageWindow, hooks) -> None:
        """The counting run: the order's forwards without gradients, the last stage's items read."""
        def counted(k, output):
            loss, units, item_weighted = loss_and_units(output, window.sizes[k])
            check_scalar_loss(loss)
            hooks.counted(k, output, units, item_weighted)

        self._forwards_through_stages(window, counted, hooks.counting())
        window.confirm_start()  # the ranks' position check, before the window's first collective

    def _forwards_through_stages(self, window: StageWindow, use: Callable, around) -> None:
        """The order's forwards alone (inside ``around``), ``use(k, loss_fn's output)`` on the last stage; its
        first error kept in ``window.failure``."""
        losses = self.stages.losses(window)
        with around, self.context.running():
            self.stages.run(window, lambda outputs, index: losses.read(outputs, index, use), train=False)
        window.failure = losses.failure

    def _train_through_stages(self, window: StageWindow, hooks) -> None:
        """The order: the last stage's losses read and weighed as a backward weighs one, then every stage
        counts every micro-step (a stage before the last with no loss: the window's statistics bring it)."""
        windows, sizes = self.windows, window.sizes
        outputs: list = [None] * len(sizes)  # the last stage's losses, as loss_fn returned them (detached)
        losses = self.stages.losses(window)

        def weighed(k, output):
            weighted, outputs[k], count = windows.weighed_loss(output, sizes[k])
            hooks.record(k, output, count)
            return weighted

        def last_stage_loss(outputs_of_stage, index):
            loss = losses.read(outputs_of_stage, index, weighed)
            hooks.last_stage_read(int(index[0]))
            return loss

        def before_gradients():  # where this rank waits for the next stage's first gradient anyway
            windows.fingerprint_batch()
            hooks.before_gradients()

        # a recorded window: every micro-batch's saved activations count
        with windows.measured_forwards(), hooks.training(), self.context.running():
            self.stages.run(window, last_stage_loss, train=True, before_first_gradient_wait=before_gradients)
        failure = losses.failure or hooks.failure()
        outputs = hooks.recorded(outputs)
        self.stages.raise_stage_failure()  # kept by the failure guard: the tuner's vote follows
        for output, samples in zip(outputs, sizes):
            windows.record(output, samples)
        if failure is not None:
            windows.fail(failure)

    def _term_weight(self, items):
        """What a routed pipeline's term gradient beside the loss is multiplied by: U · W / G
        (``Accounting.outside_loss_weight``) in the loss scale."""
        one = torch.ones((), dtype=torch.float64, device=self.strategy.device)
        return self.accounting.outside_loss_weight(items) * self.strategy.precision.scale_loss(one, 1.0)

    def close_window(self, plan) -> None:
        """Reduce, weigh and apply the window's gradient; the hooks learn whether it was applied."""
        self.windows.close(plan)
        if self.hooks is not None:
            self.hooks.closed(self.windows.last.step.applied)

    # -- evaluation ---------------------------------------------------------------------------------
    def evaluate(self, batch, loss_fn: LossFn, plan, size: int | None = None) -> float:
        """The mean loss over every rank's ``batch`` (per sample or per item), in the window split's
        micro-batches of at most ``size`` samples or padded tokens (default: the plan's): a schedule of
        forwards only, in eval mode without gradients, guarded; one all-reduce of the totals."""
        stages, hooks = self.stages, self._hooks_for(loss_fn)
        if stages is not None:
            batch, loss_fn = stages.schedule_form(batch, loss_fn, "eval_batch", hooks.counts_routers)
        pieces = list(self.window_split.eval_pieces(batch, plan, size))
        # Σ loss × share, Σ units; under a pipeline also: a loss_fn failed, a loss not the model's own
        total = torch.zeros(2 if stages is None else 4, dtype=torch.float64, device=self.strategy.device)
        if stages is None:
            actions = forwards_only(len(pieces))
        else:
            window = stages.evaluation_window(pieces, loss_fn, self.context, self.window_split.schedule_rows())
            actions = evaluated_through_stages(len(window.pieces))

        means: list[float] = []

        def forwards():
            total.zero_()
            for kind, k in actions:
                if kind == EVALUATE_STAGES:
                    self._evaluate_through_stages(window, hooks, total)
                    # a pipeline's sum carries its failures: inside the guard, which votes on a stage's
                    means.append(self._stage_evaluation_mean(total, window, hooks))
                    continue
                micro_batch, n = pieces[k]
                # this rank's part of each sequence, weighed by its tokens
                output = self.context.item_weighted(loss_fn(self.model, self.context.shard(micro_batch)))
                total.add_(torch.stack(evaluation_terms(output, n)).to(total.device))

        module = self.strategy.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self._own_micro_batches():
                self.guard(forwards)
        finally:
            module.train(was_training)
            self.strategy.release_gathered_parameters()
        return means[0] if means else evaluation_mean(self.strategy.all_reduce_sum(total))

    def _evaluate_through_stages(self, window: StageWindow, hooks, total: torch.Tensor) -> None:
        """The order's forwards, the last stage's losses added to ``total``; a routed model's own loss without
        its term (the evaluated batch's, added once after the sum)."""
        def add(k, output):
            check_scalar_loss(loss_and_units(output, window.sizes[k])[0])
            total[:2] += torch.stack(evaluation_terms(output, window.sizes[k]))
            if not hooks.evaluated_own_loss(output):
                total[3] = 1.0

        self._forwards_through_stages(window, add, hooks.evaluating(window))

    def _stage_evaluation_mean(self, total: torch.Tensor, window: StageWindow, hooks) -> float:
        """A pipeline evaluation's mean: its totals (and a routed model's counts) summed over every rank in one
        reduction, a failure raised on every rank after it."""
        total[2] = float(window.failure is not None)
        # every stage's router counts ride the same reduction
        total = self.stages.evaluation_sum(torch.cat([total, hooks.evaluation_counts().to(total.device)])).cpu()
        if total[2] > 0:
            raise window.failure or failed_on_another_rank("evaluation")
        self.stages.raise_stage_failure()  # after the evaluation's collectives: the tuner's vote follows
        if total[3] > 0:
            raise hooks.not_own_loss()
        return evaluation_mean(total) + hooks.evaluation_term(total[4:])

    @contextlib.contextmanager
    def _own_micro_batches(self):
        self._own = True
        try:
            yield
        finally:
            self._own = False
