"""The window executor: runs every window of one engine as a schedule (``engine.schedule``).

A ``train_batch`` window is cut into micro-batches by the window split, then its schedule's actions
run in order: forwards (``loss_fn(model, micro_batch)``, each micro-batch as this rank's part of its
sequences, ``engine.context``), weighted backwards (the window machine, ``engine.window.machine``,
reads, weighs and counts each loss), and — for a model with routers — counting forwards and the
window's exchange. The schedule and what those actions do come from the window's hooks: a model with
routers has them (``engine.experts.window``), a dense model has none, and its window is each forward
then its backward with no hook asked. Evaluation runs the same executor with a schedule of forwards
only, its totals weighed by ``engine.accounting``. A pipeline's stages run their micro-batches through
their own schedule (``engine.window.pipeline``), whose last stage has each loss weighed by the same
window machine.

Every forward of a window the executor cut itself is its own (no manual-loop bookkeeping); a forward
of the manual loop (``eng(x)``) comes here too, through :meth:`forward`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import torch

from engine.accounting import evaluation_mean, evaluation_terms
from engine.batching.micro_batches import MicroBatches
from engine.schedule import BACKWARD, COUNT, EXCHANGE, FORWARD, forwards_only, one_after_another

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


class WindowExecutor:
    """Runs one engine's windows. ``model``: what ``loss_fn(model, micro_batch)`` is handed (the engine's
    front); ``hooks``: the windows' hooks, None for a dense model; ``guard``: runs a window's micro-steps
    (the window runner's: the automatic micro size's catches an out-of-memory on any rank)."""

    def __init__(self, *, model, strategy, windows, window_split, context, losses,
                 hooks: WindowHooks | None, guard: Callable[[Callable[[], None]], None]):
        self.model, self.strategy, self.windows = model, strategy, windows
        self.window_split, self.context, self.losses = window_split, context, losses
        self.hooks, self.guard = hooks, guard
        self._own = False  # inside a window the executor cut: its forwards are no manual loop's

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
        split = batch.split(plan) if isinstance(batch, MicroBatches) else self.window_split.split(batch, plan)
        self.windows.planned(split)
        pieces = list(split.pieces)
        planned = plan.gradient_accumulation_steps
        hooks = self.hooks
        actions = one_after_another(len(pieces)) if hooks is None else hooks.schedule(len(pieces))
        with self._own_micro_batches():
            self.guard(lambda: self._run(actions, pieces, loss_fn, planned))

    def _run(self, actions: list, pieces: list, loss_fn: LossFn, planned: int) -> None:
        hooks, windows = self.hooks, self.windows

        def run(micro_batch):  # loss_fn on this rank's part of the micro-batch's sequences
            return loss_fn(self.model, self.context.shard(micro_batch))

        held: dict[int, Any] = {}  # forwards' outputs until their backwards
        with hooks.window(len(pieces)) if hooks is not None else contextlib.nullcontext():
            for kind, k in actions:
                micro_batch, samples = pieces[k] if k >= 0 else (None, 0)
                if kind == FORWARD:
                    held[k] = run(micro_batch) if hooks is None else hooks.forward(k, micro_batch, samples, run)
                elif kind == BACKWARD:
                    windows.backward(held.pop(k), samples, planned, exact_counts=True)
                elif kind == COUNT:
                    if k == 0:  # a counting forward's collectives come before the window's first training one
                        windows.agree_before_counting()
                    hooks.count(k, micro_batch, samples, run)
                elif kind == EXCHANGE:
                    hooks.exchange()
                else:
                    raise ValueError(f"a training window's schedule holds {kind!r}")

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
        pieces = list(self.window_split.eval_pieces(batch, plan, size))
        total = torch.zeros(2, dtype=torch.float64, device=self.strategy.device)  # Σ loss × share, Σ units
        actions = forwards_only(len(pieces))

        def forwards():
            total.zero_()
            for _, k in actions:
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
        return evaluation_mean(self.strategy.all_reduce_sum(total))

    @contextlib.contextmanager
    def _own_micro_batches(self):
        self._own = True
        try:
            yield
        finally:
            self._own = False
