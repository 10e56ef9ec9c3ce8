"""One rank's accumulation windows as a state machine: a window starts, counts micro-steps,
closes (reduce → totals over the ranks → multiply → clip → step) or is discarded. The
``Engine`` is the public front over it and the window executor (``engine.window.executor``) runs
its micro-steps; it holds no engine: the hooks it tells (``engine.window.hooks.Hooks``) and the
scheduler it steps are handed in, the plan comes with each call that reads it.

Ranks in step. Before the backward that closes a window, before a window's first forward
when its strategy communicates earlier in the window (ZeRO-2's reduction in every backward, a
gather in a forward, DDP's buffer broadcast) or a micro size is being chosen, before every
forward whose strategy gathers parameters in it (ZeRO-3), in a flush and at close, the ranks
compare where they are (global step, windows begun, micro-steps and forwards in the window: one
small all-gather on the control group, ``engine.window.positions``). A rank whose data ended, or
that skipped a window or micro-step after catching its own error, is found there, before the
windows' collectives pair up: every rank raises ``RankDisagreementError``. (A pipeline's window
posts its check and waits for it before the rank's first message of the schedule: the first
stage's first forward hides the wait.) Each check is a point where every rank waits for the
slowest, so none is made that an earlier or later one covers: at ZeRO-0/1 the check before the
closing backward is the window's only one.

The non-finite gradient check (``faults.non_finite_gradient``) reads the global gradient norm;
where the window's statistics are summed over ranks anyway (``train_batch``, exact counts), the
strategy's share of the squared norm travels in that all-reduce and the one host read of the
statistics decides both (no pass, collective or sync of its own in the step). Every number that
weighs the window comes from ``engine.accounting``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from engine.accounting import Accounting, loss_and_units, share, window_totals
from engine.distributed.batch_fingerprint import ReplicaBatchCheck, batch_fingerprint
from engine.errors import EngineUsageError, PeerLostError, RankDisagreementError
from engine.memory import PeakMeter
from engine.strategies.base import StepResult
from engine.window import non_finite
from engine.window.loss_checks import check_loss, failed_on_another_rank
from engine.window.hooks import Hooks
from engine.window.positions import CLOSED, CLOSING_MICRO_STEP, FLUSH, FORWARD, WINDOW_START, post_position
from engine.window.records import Window, WindowReport

log = logging.getLogger("engine")

def _nothing_posted() -> None:
    """The wait of a position check that was not needed."""


class WindowMachine:
    """The windows of one engine: ``hooks`` (``engine.window.hooks.Hooks``, whose list a script may
    change) are told when a window starts and closes, ``lr_scheduler`` steps with each applied update."""

    def __init__(self, *, strategy, accounting: Accounting, window_split, context, losses, hooks: Hooks,
                 lr_scheduler, chooses_micro_size: bool, clipping: float, non_finite_policy: str,
                 grad_norm_every_step: bool):
        self.strategy, self.accounting, self.hooks, self.lr_scheduler = strategy, accounting, hooks, lr_scheduler
        # what the holder does in a window (engine.strategies.capabilities), asked once: it is set up
        self.capabilities = strategy.capabilities()
        self.window_split, self.context, self.losses = window_split, context, losses
        self.chooses_micro_size = chooses_micro_size
        self.clipping, self.non_finite_policy = clipping, non_finite_policy
        self.grad_norm_every_step = grad_norm_every_step  # even without clipping or a monitor
        mesh = strategy.settings.mesh  # ranks of a replica must see one batch: checked at every window
        self.same_batch = ReplicaBatchCheck(mesh, strategy.rank) if ReplicaBatchCheck.needed(mesh) else None
        self.batch_fingerprint = None  # this train_batch's, until its window statistics are reduced
        self.batch_to_fingerprint = None  # this train_batch's batch, until fingerprint_batch()
        self.micro_steps = self.global_steps = self.global_samples = self.skipped_steps = 0
        self.windows_started = 0  # on this rank, failed and discarded ones included (not checkpointed)
        self.agreeing = True  # False once closed or after a RankDisagreementError: no agreement could pair
        self.last = WindowReport()
        self.current = Window()
        self._peak = PeakMeter(strategy)  # a recorded window's peak memory (engine.memory)
        self._recording = False

    # -- positions --------------------------------------------------------------------------------
    def agree(self, point: int) -> None:
        """The ranks compare where they are; after a disagreement or a lost peer no further
        agreement could pair."""
        self.post(point)()

    def post(self, point: int) -> Callable[[], None]:
        """``agree`` posted: the returned call waits for the comparison (once: later calls return at once)."""
        if self.strategy.world_size == 1:
            return _nothing_posted
        window = self.current
        posted = post_position(self.strategy.rank, point, self.global_steps, self.windows_started,
                               window.micro_steps, window.training_forwards)

        def confirm() -> None:
            try:
                posted.confirm()
            except (PeerLostError, RankDisagreementError):
                self.agreeing = False
                raise

        return confirm

    def agree_before_counting(self) -> None:
        """A counting forward's collectives (ZeRO-3's gathers, DDP's buffer broadcast) come before the
        window's first training forward: the ranks compare positions before them too."""
        if self.capabilities.communicates_before_closing_backward():
            self.agree(WINDOW_START)

    def leave(self) -> None:
        """The engine closes: a peer still training (its data lasted longer) learns here that this rank
        has stopped, and both raise RankDisagreementError; not after a disagreement, nor twice."""
        try:
            if self.agreeing:
                self.agree(CLOSED)
        except PeerLostError as error:  # gone or stuck: nothing to tell it any more
            log.warning("close(): %s", error)
        finally:
            self.agreeing = False

    # -- a window starts ----------------------------------------------------------------------------
    def start(self) -> None:
        """A training window starts: agree on where every rank is, tell the hooks, start measuring
        memory when it is recorded."""
        self.windows_started += 1
        if self._checks_start():
            self.agree(WINDOW_START)
        self._started()

    def start_check_posted(self) -> Callable[[], None]:
        """``start`` with the ranks' position check posted, not waited for; returns the call that waits for
        it and raises as the check does. For a window whose micro-steps exchange nothing that could pair
        another window's collectives and be applied before that call (a pipeline schedule's point-to-point
        messages: a window whose check fails is thrown away): the check's wait then leaves the window's
        critical path. Call it before the micro-steps' first exchange, and again after them whatever they
        did (a second call returns at once)."""
        self.windows_started += 1
        confirm = self.post(WINDOW_START) if self._checks_start() else _nothing_posted
        self._started()
        return confirm

    def _checks_start(self) -> bool:
        # Before the window's first collective. Otherwise the check before the closing backward
        # (which the automatic micro size replaces by its failure votes) comes first.
        return self.capabilities.communicates_before_closing_backward() or self.chooses_micro_size

    def _started(self) -> None:
        self.hooks.tell("on_window_start")
        self._recording = self.hooks.records(self.global_steps + 1)
        if self._recording:
            self._peak.start()

    def before_training_forward(self, planned_default: int) -> None:
        """A forward for a backward: start the window at its first, agree before a forward that
        gathers, plan the micro-step's gradient synchronisation."""
        window = self.current
        planned = window.planned_steps or planned_default
        if window.micro_steps == 0 and not window.forwarded:
            self.start()
        elif self.capabilities.forward_communicates():
            self.agree(FORWARD)  # before the forward's collectives (ZeRO-3 gathers parameters there)
        self.strategy.prepare_micro_step(window.micro_steps + 1 >= planned)
        window.forwarded += 1
        window.training_forwards += 1

    def planned(self, split) -> None:
        """The window's micro-steps and token cost as the window split cut its batch (the executor tells
        them here, for the window's report)."""
        self.current.planned_steps, self.current.tokens = split.micro_steps, split.tokens

    def measured_forwards(self):
        """A context for the forwards of a recorded window: its peak memory is measured there."""
        return self._peak.forward() if self._recording else contextlib.nullcontext()

    def check_batch(self, batch) -> None:
        """This ``train_batch``'s batch, checked in the window statistics' reduction (the same batch if
        the window is re-run)."""
        self.batch_fingerprint, self.batch_to_fingerprint = None, batch if self.same_batch is not None else None

    def check_manual_batch(self, args: tuple, kwargs: dict) -> None:
        """A manual-loop forward's whole micro-batch (before any context split): its fingerprint, keyed
        by its place in the window, is added to the window's, which the ranks of a replica compare in
        the window statistics' reduction at the close (every micro-batch of every window checked)."""
        if self.same_batch is None:
            return
        place = torch.tensor(self.current.training_forwards)
        mine = batch_fingerprint((place, args, kwargs), self.strategy.device)
        self.batch_fingerprint = mine if self.batch_fingerprint is None else self.batch_fingerprint + mine

    def fingerprint_batch(self) -> None:
        """Fingerprint this ``train_batch``'s batch for the check that the ranks of a replica saw the same
        one, once; the executor calls it where this rank would wait anyway (a pipeline stage before its first
        gradient from the next stage), the window's end otherwise."""
        if self.batch_to_fingerprint is not None:
            self.batch_fingerprint = batch_fingerprint(self.batch_to_fingerprint, self.strategy.device)
            self.batch_to_fingerprint = None

    # -- micro-steps ---------------------------------------------------------------------------------
    def backward(self, output, samples: int, planned_default: int, *, exact_counts: bool) -> None:
        """Weigh ``output`` (what ``loss_fn`` or the script returned) and run its backward."""
        window = self.current
        output = self.context.item_weighted(output)  # each rank's part of the sequences weighs by its tokens
        loss, units, item_weighted = loss_and_units(output, samples)
        check_loss(loss)  # first: what is wrong with the loss itself is said alike on any number of ranks
        self.losses.backward_of(item_weighted, samples)
        if self.strategy.world_size > 1 and not window.forwarded:
            raise EngineUsageError(
                "backward() without a forward through the engine: call eng(x), not eng.module(x), "
                "so that gradient synchronisation is planned for this micro-step"
            )

        window.check_same_kind(item_weighted)
        planned = window.planned_steps or planned_default
        if window.micro_steps + 1 >= planned and not self.chooses_micro_size \
                and self.capabilities.reduces_gradients_over_ranks:
            # Before the backward that reduces the window's gradient (ZeRO-0/1: its first collective).
            # The automatic micro size agrees on each window's failures instead; with one data rank
            # nothing is reduced (a split model's exchanges come after the window start's check).
            self.agree(CLOSING_MICRO_STEP)
        # Before backward: a failing backward must leave the window as it was.
        with self.context.running():
            self.strategy.backward(loss, self.accounting.micro_step_weight(samples, item_weighted))
        self.count(loss, units, samples, item_weighted, exact_counts=exact_counts)

    def weighed_loss(self, output, samples: int):
        """A micro-batch loss whose backward runs elsewhere (a pipeline's last stage), as ``loss_fn`` returned
        it: checked, read and weighted as :meth:`backward` weighs one. Returns (the weighted loss, what
        :meth:`record` counts of it after the schedule — detached —, its units)."""
        loss, units, item_weighted = loss_and_units(output, samples)
        check_loss(loss)
        self.current.check_same_kind(item_weighted)  # said here: the other stages learn the kind at the close
        recorded = (loss.detach(), units) if item_weighted else loss.detach()
        return loss * self.accounting.micro_step_weight(samples, item_weighted), recorded, units

    def record(self, output, samples: int) -> None:
        """Count a micro-step whose weighted backward ran elsewhere (a pipeline schedule): ``output`` is
        its loss as ``loss_fn`` returned it, None where this rank holds no loss of it (a stage before the
        last, a zero-weight step: the window's statistics bring it, ``WindowCapabilities.loss_copies``)."""
        if output is None:
            self.count(None, 0, samples, None, exact_counts=True)
            return
        loss, units, item_weighted = loss_and_units(output, samples)
        self.current.check_same_kind(item_weighted)
        self.count(loss, units, samples, item_weighted, exact_counts=True)

    def count(self, loss, units, samples: int, item_weighted: bool | None, *, exact_counts: bool) -> None:
        window = self.current
        if samples == 0:  # a zero-weight step: it only keeps the ranks' micro-step counts equal
            units = 0
        window.micro_steps += 1
        window.samples += samples
        if loss is not None:
            window.losses.append(loss.detach())
            window.loss_weights.append(share(samples, bool(item_weighted)))
        if item_weighted:
            window.counts.append(units)
        window.exact_counts = window.exact_counts or exact_counts or item_weighted
        window.backward_since_step = True
        window.forwarded, window.forwards = max(0, window.forwarded - 1), []
        self.micro_steps += 1

    def fail(self, error: Exception) -> None:
        """This rank's loss failed in a window whose micro-steps ran on (a pipeline's last stage stands in
        for the rest of its schedule): the window is counted, then abandoned on every rank at its
        statistics' reduction, this one raising ``error``."""
        self.current.failure = self.current.failure or error

    # -- a window ends ------------------------------------------------------------------------------
    def is_boundary(self, planned: int) -> bool:
        """Whether the micro-step in progress (or just back-propagated) is the last of its window."""
        window = self.current
        return (window.micro_steps if window.backward_since_step else window.micro_steps + 1) >= planned

    def step(self, plan) -> bool:
        """The manual loop's step: close the window if its ``plan``'s micro-steps are done."""
        window = self.current
        if not window.backward_since_step:
            plain = (" A plain loss.backward() is not one: the engine weights each micro-batch by its share of the "
                     "global batch and plans its gradient synchronisation in its own backward, so it cannot count a "
                     "backward it does not run (DeepSpeed 0.18's loss.backward() on engine outputs is not supported); "
                     "the gradients it left are discarded" if window.forwarded else "")
            if window.forwarded:
                self.discard()
            raise EngineUsageError("step() called without a backward() since the last step(): each micro-step is "
                                   f"forward, eng.backward(loss), eng.step().{plain}")
        window.backward_since_step = False
        if window.micro_steps < plan.gradient_accumulation_steps:
            return False
        self.close(plan)
        return True

    def flush(self, plan) -> bool:
        """Close a short window (the end of the data), weighted by what it really holds."""
        window = self.current
        # On the control group: a peer still inside a micro-step's collective times out clearly.
        self.agree(FLUSH)
        if window.micro_steps == 0:
            return False
        window.backward_since_step = False
        window.exact_counts = True  # weighted by what every rank really ran
        self.close(plan)
        return True

    def discard(self) -> None:
        """Abandon the window in progress: its gradients, counters and partial reductions."""
        self.strategy.discard_window()
        self.losses.forget_window()
        self.micro_steps -= self.current.micro_steps
        self.current = Window()

    def close(self, plan) -> None:
        """Reduce, weigh and apply the window's gradient, then count and report it (``plan``: the manual
        loop's planned sizes, where the window's statistics are not reduced)."""
        window = self.current
        self.strategy.reduce_gradients()
        step = self.global_steps + 1
        recorded = self.hooks.records(step)
        self.fingerprint_batch()
        fingerprint, self.batch_fingerprint = self.batch_fingerprint, None
        try:  # a fingerprint to compare makes the statistics travel over the ranks (the manual loop's too)
            over_all_ranks = window.exact_counts or recorded or fingerprint is not None
            totals = window_totals(window, plan, self.strategy, self.capabilities, over_all_ranks=over_all_ranks,
                                   same_batch=(self.same_batch, fingerprint) if fingerprint is not None else None,
                                   holders=self.context.size, unread=self.losses.unread_sums())
        except EngineUsageError:  # a replica's ranks were given different batches: nothing applied
            self.discard()
            raise
        if totals.failed:
            self.discard()
            raise window.failure or failed_on_another_rank("window")
        self.losses.window_closed(totals.unread, over_ranks=over_all_ranks)
        window.item_weighted = totals.item_weighted  # a rank that computes no loss learns its kind here
        samples = totals.samples
        lr = float(self.strategy.optimizer.param_groups[0]["lr"])  # the one this window's update uses
        result = self._apply_update(window, totals.units, samples, totals.squares,
                                    want_norm=self.grad_norm_every_step or self.hooks.needs_grad_norm(step))
        self.window_split.window_closed(samples)
        if result.applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += samples
        self.last = WindowReport(loss=totals.loss, samples=samples, step=result, lr=lr,
                                 items=totals.units if window.item_weighted else None,
                                 peak_memory_bytes=self._peak.peak if self._recording else None,
                                 micro_steps=window.micro_steps, real_tokens=totals.tokens[0],
                                 padded_tokens=totals.tokens[1])
        self.current, self._recording = Window(), False
        self.hooks.tell("on_window_closed", self.last)

    def _apply_update(self, window: Window, units, samples: int, squares: float | None, *,
                      want_norm: bool) -> StepResult:
        """Multiply the reduced gradient to the global mean, clip, step — or skip the window
        when it holds nothing to average or overflowed. ``squares``: the reduced gradient's sum
        of squares over ranks, when the window's statistics brought it."""
        multiplier = self.accounting.boundary_multiplier(window.item_weighted, units, samples)
        if multiplier is None:  # nothing to average (every label ignored): a step would divide by zero
            self.strategy.discard_window()
            log.warning("the window of global step %d holds no items (e.g. every label is -100): skipped",
                        self.global_steps + 1)
            return StepResult(applied=False)
        result = self.strategy.step(multiplier, self.clipping, want_norm=want_norm, grad_squares=squares)
        self.strategy.zero_grad()
        step = self.global_steps + 1
        if non_finite.raises(self.non_finite_policy, result.non_finite):
            self.discard()  # gradients and the window's micro-steps: the engine stays usable here
            self._recording = False
            raise non_finite.non_finite_error(step)
        non_finite.warn_skipped(result.applied, result.non_finite, step)
        return result
