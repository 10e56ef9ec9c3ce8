"""The engine: counts micro-steps, weights losses, and updates only at window boundaries.

Weighting. The strategies leave the mean over ranks of each rank's accumulated gradient,
so a micro-batch loss is multiplied by ``units · W / G`` before its backward, where
``units`` is its number of samples (a mean loss) or 1 (a ``(sum, count)`` loss), W the
world size and G the planned global batch. At the boundary the gradient is multiplied by
``G / U``, U being the window's real total of units over every rank. For a full window of
mean losses U = G and nothing is done; a short window, unequal batches or token counts get
one in-place multiply of the gradient, once per optimizer step.

Micro-batches and what they count for. How ``train_batch`` / ``eval_batch`` cut a batch and
what a manual-loop micro-batch counts for depend on the kind of plan — planned sizes, sizes
read from the inputs, a data-defined plan, a token budget — and are decided by the window
split ``engine.initialize`` chose (``engine.batching.window_split``); the engine itself does not ask
which kind it runs. A micro-batch of 0 samples is a zero-weight step: its loss counts for
nothing, its collectives still run (ranks with fewer micro-batches than their peers). When
the counts are real rather than planned, U is summed over the ranks at the boundary.

Ranks in step. Before the backward that closes a window, before a window's first forward
when its strategy communicates earlier in the window (ZeRO-2's reduction in every backward, a
gather in a forward, DDP's buffer broadcast) or a micro size is being chosen, before every
forward whose strategy gathers parameters in it (ZeRO-3), in ``flush()`` and in ``close()``,
the ranks compare where they are (global step, windows begun, micro-steps and forwards in the
window: one small all-gather on the control group). A rank whose data ended, or that skipped a
window or micro-step after catching its own error, is found there, before the windows'
collectives pair up: every rank raises ``RankDisagreementError``. (A pipeline's window posts its
check and waits for it before the rank's first message of the schedule: the first stage's first
forward hides the wait.) Each check is a point where
every rank waits for the slowest, so the engine makes none that an earlier or later one covers:
at ZeRO-0/1 the check before the closing backward is the window's only one.

The non-finite gradient check (``faults.non_finite_gradient``) reads the global gradient norm;
where the window's statistics are summed over ranks anyway (``train_batch``, exact counts), the
strategy's share of the squared norm travels in that all-reduce and the one host read of the
statistics decides both (no pass, collective or sync of its own in the step).

Collaborators are handed in by ``engine.initialize``, never attached afterwards: the strategy
(how the model is held), the window runner (``engine.window.runner``: the plain one, the
automatic micro-batch size of ``engine.autotune.tuner``, which drives ``run_window`` /
``discard_window`` / ``replan`` / ``evaluate`` and guards every micro-step, or a pipeline's
schedule, ``engine.window.pipeline``, which runs a window's micro-steps itself and tells the
engine with ``start_window_check_posted`` / ``record_micro_step`` (``engine.window.runner``
lists the calls a runner may make); under a pipeline the tuner retries the
schedule's windows), the hooks
(``engine.window.hooks``: the monitor and automatic checkpoints, told when ``batches()`` makes data, a
training window starts or closes, state is loaded and the engine closes) and the stateful parts
a checkpoint holds besides the engine's own counters (scheduler, loss scaler, tuner), which the
engine hands with itself and its strategy to one ``engine.state.checkpoint.CheckpointManager``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable

import torch

from engine.batching.microbatch import to_device
from engine.batching.plan import BatchPlan
from engine.window.loss_checks import check_loss, check_loss_signature, failed_on_another_rank, loss_and_units
from engine.window.runner import LossFn, WindowRunner
from engine.batching.data import DistributedBatches
from engine.distributed.batch_fingerprint import ReplicaBatchCheck, batch_fingerprint
from engine.errors import EngineUsageError, PeerLostError, RankDisagreementError
from engine.window.experts import ExpertBalance, NoRouters
from engine.window.hooks import EngineHook
from engine.memory import PeakMeter
from engine.state.checkpoint import CheckpointManager, CheckpointPosition
from engine.strategies.base import StepResult, Strategy
from engine.batching.window_split import PlannedSplit, Split
from engine.context.parallel import ContextParallel, WholeSequences
from engine.window import non_finite
from engine.window.positions import CLOSED, CLOSING_MICRO_STEP, FLUSH, FORWARD, WINDOW_START, post_position
from engine.window.model_loss import LossReading, NoModelLoss
from engine.window.records import Window, WindowReport, window_totals

log = logging.getLogger("engine")

COUNTERS = ("micro_steps", "global_steps", "global_samples", "skipped_steps")


class Engine:
    """Returned by :func:`engine.initialize`; the public contract is in README.md and docs/."""

    def __init__(self, *, config, plan: BatchPlan, strategy: Strategy, window_split: PlannedSplit,
                 window_runner: WindowRunner | None = None, monitor: EngineHook | None = None,
                 autosave: EngineHook | None = None, hooks: tuple[EngineHook, ...] = (),
                 checkpoint_states: dict | None = None, lr_scheduler=None, loss_fn: LossFn | None = None,
                 grad_norm_every_step: bool = False, experts: ExpertBalance | NoRouters | None = None,
                 context: ContextParallel | None = None, losses: LossReading | None = None):
        self.config = config
        self.plan = plan
        self.strategy = strategy
        mesh = strategy.settings.mesh  # ranks of a replica must see one batch: checked at every window
        self._same_batch = ReplicaBatchCheck(mesh, strategy.rank) if ReplicaBatchCheck.needed(mesh) else None
        self._batch_fingerprint = None  # this train_batch's, until its window statistics are reduced
        self._batch_to_fingerprint = None  # this train_batch's batch, until fingerprint_window_batch()
        # How windows are cut and what a micro-batch counts for (engine.batching.window_split).
        self.window_split = window_split
        self.window_runner = window_runner or WindowRunner()
        # Hooks, called in this order at every point. The monitor (engine.monitor) and the automatic
        # checkpoints (engine.autosave) are kept by name too: scripts read eng.monitor
        # (history, log_eval) and eng.autosave (resumed_from); the checkpoints go last, since a
        # stop signal ends the run there.
        self._monitor, self.autosave = monitor, autosave
        self.hooks = tuple(hook for hook in (monitor, *hooks, autosave) if hook is not None)
        self.lr_scheduler = lr_scheduler
        self.loss_fn = loss_fn
        self.grad_norm_every_step = grad_norm_every_step  # even without clipping or a monitor
        # a mixture-of-experts model's load-balancing terms over the window (engine.window.experts);
        # without routers, NoRouters runs the micro-steps one after another
        self.experts = experts or NoRouters()
        # context_parallel (engine.context.parallel): splits each micro-batch's sequences over the
        # context ranks and weighs their losses by tokens; without it, whole sequences (no change).
        self.context = context if context is not None else WholeSequences()
        # the model's own loss read as (sum, count); means that cannot be read watched (engine.window.model_loss)
        self.losses = losses or LossReading(NoModelLoss(), strict=False)
        # What a checkpoint holds: the strategy's model and optimizer, the parts handed in
        # (scheduler, loss scaler, micro-size tuner), and this engine's counters and plan, loaded
        # last so that its hooks see the whole restored state.
        self.checkpoints = CheckpointManager(
            {"lr_scheduler": lr_scheduler, "loss_scaler": strategy.loss_scaler, **(checkpoint_states or {}),
             "engine": self},
            training_state=strategy, position=self._checkpoint_position, rank=strategy.rank,
            world_size=strategy.world_size, seed=config.seed, config_record=config.to_dict())
        self._batches = None  # (dataset, (length, shuffle, seed, drop_last), DistributedBatches) of batches()
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.windows_started = 0  # on this rank, failed and discarded ones included (not checkpointed)
        self._agreeing = True  # False once closed or after a RankDisagreementError: no agreement could pair
        self.last_window = WindowReport()
        self._window = Window()
        self._splitting = False  # inside run_window: micro-batch sizes are the engine's own
        self._peak = PeakMeter(strategy)  # a recorded window's peak memory (engine.memory)
        self._recording = False

    # -- what the model is ------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.strategy.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def device(self) -> torch.device:
        """Where this rank computes (move inputs here)."""
        return self.strategy.device

    @property
    def micro_batch_tuner(self):
        """The automatic micro-batch size (``engine.autotune.tuner``) when the plan has one, else None."""
        return self.window_runner if self.window_runner.chooses_micro_size else None

    @property
    def monitor(self):
        """The ``engine.monitor.Monitor`` among the hooks (None without one). A script may set
        another: ``eng.monitor = Monitor(...).attach(eng)`` replaces it among the hooks."""
        return self._monitor

    @monitor.setter
    def monitor(self, monitor) -> None:
        others = tuple(hook for hook in self.hooks if hook is not self._monitor)
        self.hooks = ((monitor,) if monitor is not None else ()) + others
        self._monitor = monitor

    @property
    def window_micro_steps(self) -> int:
        """Micro-steps done in the window in progress (0 at a boundary)."""
        return self._window.micro_steps

    # -- the manual loop ----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Forward through the wrapped model. Tells the strategy whether the micro-step in
        progress closes the window (DDP decides gradient sync in the forward)."""
        self.strategy.check_manual_loop()  # before a window starts: a pipeline refuses eng(x)
        if not self._splitting:  # train_batch / eval_batch moved their batch already
            args, kwargs = self.context.shard_call(self._on_device(args), self._on_device(kwargs))
        kwargs = self.losses.call_arguments(kwargs)
        if not torch.is_grad_enabled():
            with self.context.running():
                output = self.strategy.forward(*args, **kwargs)
            self.losses.observe(kwargs, output)
            return output
        window = self._window  # a forward for a backward: plan its gradient sync
        planned = window.planned_steps or self.plan.gradient_accumulation_steps
        if window.micro_steps == 0 and not window.forwarded:  # the window's first
            self.start_window()
        elif self.strategy.forward_communicates:
            # Before the forward's collectives (ZeRO-3 gathers parameters there).
            self._agree_on_position(FORWARD)
        self.strategy.prepare_micro_step(window.micro_steps + 1 >= planned)
        window.forwarded = True
        window.training_forwards += 1
        # a manual-loop forward cannot hold the window's load-balancing term
        manual = self.experts.manual_forward() if not self._splitting else contextlib.nullcontext()
        with manual, self.measured_forwards(), self.context.running():
            output = self.strategy.forward(*args, **kwargs)
        self.losses.observe(kwargs, output)
        if not self._splitting:  # the manual loop: what this forward tells about the micro-batch
            self.window_split.record_forward(window.forwards, self.plan, window.micro_steps, args, kwargs, output)
        return output

    def start_window(self) -> None:
        """A training window starts: agree with the peers on where every rank is, tell the
        hooks, start measuring memory when it is recorded. (Called at the window's first
        forward; a window runner whose micro-steps do not go through ``eng(...)`` calls
        ``start_window_check_posted``.)"""
        self.windows_started += 1
        if self._checks_window_start():
            self._agree_on_position(WINDOW_START)
        self._window_started()

    def start_window_check_posted(self) -> Callable[[], None]:
        """``start_window`` with the ranks' position check posted, not waited for; returns the call
        that waits for it and raises as the check does. For a runner whose micro-steps exchange
        nothing that could pair another window's collectives and be applied before that call (a
        pipeline schedule's point-to-point messages: a window whose check fails is thrown away):
        the check's wait then leaves the window's critical path. Call it before the micro-steps'
        first exchange, and again after them whatever they did (a second call returns at once)."""
        self.windows_started += 1
        confirm = self._post_position(WINDOW_START) if self._checks_window_start() else _nothing_posted
        self._window_started()
        return confirm

    def _checks_window_start(self) -> bool:
        # Before the window's first collective. Otherwise the check before the closing backward
        # (which the automatic micro size replaces by its failure votes) comes first.
        return self.strategy.communicates_before_closing_backward or self.window_runner.chooses_micro_size

    def _window_started(self) -> None:
        for hook in self.hooks:
            hook.on_window_start(self)
        self._recording = self._records(self.global_steps + 1)
        if self._recording:
            self._peak.start()

    def planned_window(self, split: Split) -> None:
        """The window's micro-steps and token cost as the window split cut its batch (a window
        runner that splits the batch itself tells them here, for the window's report)."""
        self._window.planned_steps, self._window.tokens = split.micro_steps, split.tokens

    def measured_forwards(self):
        """A context for the forwards of a window the monitor records: its peak memory is
        measured there (``engine.memory.PeakMeter``); otherwise nothing."""
        return self._peak.forward() if self._recording else contextlib.nullcontext()

    def micro_step_weight(self, samples: int, item_weighted: bool) -> float:
        """What a micro-batch's loss is multiplied by before its backward, in every window runner:
        its share (samples for a mean, 1 for a sum, 0 for a zero-weight step) × W / G, W the ranks
        the gradients are averaged over and G the planned (or nominal) global batch. W is the data
        ranks, times the context ranks under context parallelism: gradients are averaged over data
        × context ranks, and the parts of one sequence add up (engine.context.parallel)."""
        ranks = self.plan.world_size * self.context.size
        return _share(samples, item_weighted) * ranks / self._weighting_batch()

    def fingerprint_window_batch(self) -> None:
        """Fingerprint this ``train_batch``'s batch for the window statistics' check that the ranks
        of a replica saw the same one (``engine.distributed.batch_fingerprint``), once; the window's
        end does it otherwise. A runner calls it where this rank would wait anyway (a pipeline stage
        before its first gradient from the next stage)."""
        if self._batch_to_fingerprint is not None:
            self._batch_fingerprint = batch_fingerprint(self._batch_to_fingerprint, self.strategy.device)
            self._batch_to_fingerprint = None

    def record_micro_step(self, output, samples: int) -> None:
        """Count a micro-step whose weighted backward ran elsewhere (a pipeline schedule, see
        ``engine.window.pipeline``): ``output`` is its loss as ``loss_fn`` returned it (a mean,
        or ``(sum, count)``), ``samples`` its real samples. ``output`` None: this rank holds no
        loss of it (a stage before the last, a zero-weight step); the window's statistics bring
        the loss, its units and its kind from the ranks that do (``Strategy.loss_copies``)."""
        if output is None:
            self._count_micro_step(None, 0, samples, 0, None, exact_counts=True)
            return
        loss, units, item_weighted = loss_and_units(output, samples)
        self._window.check_same_kind(item_weighted)
        self._count_micro_step(loss, units, samples, _share(samples, item_weighted), item_weighted, exact_counts=True)

    def fail_window(self, error: Exception) -> None:
        """This rank's loss failed in a window whose micro-steps ran on (a pipeline's last stage
        stands in for the rest of its schedule): the window is counted, then abandoned on every
        rank at its statistics' reduction, this one raising ``error``."""
        self._window.failure = self._window.failure or error

    def backward(self, loss) -> None:
        """Backward of one micro-batch loss, weighted by its share of the global batch.

        ``loss`` is the mean over the micro-batch's samples, or a pair ``(loss_sum,
        num_items)`` for item-weighted losses. In this manual loop the k-th micro-step of a
        window is taken to hold ``plan.micro_batch_sizes[k]`` samples, or, when sizes are
        read from the inputs, the batch size of what was passed to ``eng(...)``."""
        self.strategy.check_manual_loop()
        window = self._window
        k = window.micro_steps
        if k >= self.plan.gradient_accumulation_steps:
            raise EngineUsageError(
                f"backward() called {k + 1} times in a window of {self.plan.gradient_accumulation_steps} "
                "micro-steps: call step() after every backward()"
            )
        tensor = loss_and_units(loss, 0)[0]
        check_loss(tensor)
        samples = self.window_split.manual_samples(window.forwards, self.plan, k, tensor)
        self._backward(loss, samples, exact_counts=self.window_split.counts_exactly)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the micro-step in progress (or just back-propagated) is the last of its window."""
        window = self._window
        done = window.micro_steps if window.backward_since_step else window.micro_steps + 1
        return done >= self.plan.gradient_accumulation_steps

    def step(self, flush: bool = False) -> bool:
        """Close the window if this micro-step is its last; otherwise change nothing.
        Returns True when a window was closed (``skipped_steps`` tells whether a non-finite
        gradient, e.g. an fp16 overflow, discarded it). ``step(flush=True)`` is :meth:`flush`."""
        if flush:
            return self.flush()
        window = self._window
        if not window.backward_since_step:
            raise EngineUsageError(
                "step() called without a backward() since the last step(): each micro-step is "
                "forward, eng.backward(loss), eng.step()"
            )
        window.backward_since_step = False
        if window.micro_steps < self.plan.gradient_accumulation_steps:
            return False
        self._close_window()
        return True

    def flush(self) -> bool:
        """Close a window that holds fewer micro-steps than planned (the end of the data in a
        manual loop), weighted by the samples it really holds. Every rank must call it,
        holding the same number of micro-steps (sharded models reduce collectively). Returns
        False when there was nothing to close."""
        window = self._window
        # On the control group: a peer still inside a micro-step's collective times out clearly.
        self._agree_on_position(FLUSH)
        if window.micro_steps == 0:
            return False
        window.backward_since_step = False
        window.exact_counts = True  # weighted by what every rank really ran
        self._close_window()
        return True

    def zero_grad(self) -> None:
        """For Colossal-style loops: gradients are cleared at every boundary already, so this
        never wipes a window in progress."""
        if self._window.micro_steps == 0:
            self.strategy.zero_grad()

    # -- whole batches ------------------------------------------------------------------
    def train_batch(self, batch, loss_fn: LossFn | None = None) -> float:
        """Run this rank's per-device ``batch`` as one window: split into the plan's
        micro-batches, backward each, take one optimizer step. Returns the window's loss over
        all ranks, weighted exactly as the gradient was.

        A batch smaller than the planned per-device batch (the end of an epoch) is run as a
        short window of the same number of micro-steps, weighted by its real size."""
        loss_fn = self._loss_fn(loss_fn)
        if self._window.micro_steps:
            raise EngineUsageError(
                f"train_batch() called in the middle of a manual-loop window "
                f"({self._window.micro_steps} micro-steps done): finish it with step() first"
            )
        batch = self._on_device(batch)
        # checked in the window statistics' reduction (issue 33); the same batch if the window is re-run
        self._batch_fingerprint, self._batch_to_fingerprint = None, batch if self._same_batch is not None else None
        try:
            self.window_runner.run_window(self, batch, loss_fn)
        except BaseException:
            self.discard_window()  # a failed batch leaves no half window behind
            self._batch_fingerprint = self._batch_to_fingerprint = None
            raise
        self._close_window()
        return float(self.last_window.loss)

    def eval_batch(self, batch, loss_fn: LossFn | None = None) -> float:
        """Micro-batched evaluation (module in eval mode, no gradients); returns the mean loss
        over every rank's batch, per sample or per item like ``train_batch``."""
        return self.window_runner.run_eval(self, self._on_device(batch), self._loss_fn(loss_fn))

    def _on_device(self, batch):
        """A host batch (a DataLoader's) copied to where this rank computes (tensors already there
        are not copied): the loss function then meets outputs and labels on one device."""
        return batch if self.device.type == "cpu" else to_device(batch, self.device)

    def batches(self, dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                collate_fn=None) -> DistributedBatches:
        """This rank's per-device batches of a map-style ``dataset`` for ``eng.plan``, one per
        optimizer step (``engine.batching.data.DistributedBatches``). Automatic checkpoints save its
        position, and after a resume it starts where the saved run was. Called again for the same
        data it returns the same object, which goes on with the next epoch: the data is known by its
        length and order options (``shuffle``, ``seed``, ``drop_last``), not by the Python object, so a
        dataset (or ``collate_fn``) made anew each epoch continues too; other data starts at epoch 0,
        with a warning when the previous data was under way."""
        key = (len(dataset), shuffle, seed, drop_last)
        if self._batches is not None and self._batches[1] == key:
            data = self._batches[2]
            data.use(dataset, collate_fn)  # the same data order: new objects, the position kept
            self._batches = (dataset, key, data)
            return data
        if self._batches is not None and (self._batches[2].epoch, self._batches[2].step) != (0, 0):
            was, now = self._batches[1], key
            log.warning("eng.batches(): other data (length %d, shuffle %s, seed %s, drop_last %s; was %d, %s, %s, "
                        "%s): it starts at epoch 0, batch 0, and automatic checkpoints save its position from now on "
                        "(the previous data stopped at epoch %d, batch %d). Pass the same data and options to go on "
                        "where it was", *now, *was, self._batches[2].epoch, self._batches[2].step)
        data = DistributedBatches(dataset, self.plan, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                  collate_fn=collate_fn)
        self._batches = (dataset, key, data)
        for hook in self.hooks:
            hook.on_batches(self, data)
        return data

    # -- windows, for the micro-batch tuner ---------------------------------------------
    def run_window(self, batch, loss_fn: LossFn) -> None:
        """Forward and backward of every micro-batch of one window as the plan splits
        ``batch`` (no optimizer step), guarded by the window runner."""
        self._splitting = True
        try:
            self.window_runner.guard(lambda: self._micro_steps(batch, loss_fn))
        finally:
            self._splitting = False

    def discard_window(self) -> None:
        """Abandon the window in progress: its gradients, counters and partial reductions."""
        self.strategy.discard_window()
        self.micro_steps -= self._window.micro_steps
        self._window = Window()

    def replan(self, plan: BatchPlan) -> None:
        """Run from the next window on with ``plan``: another micro-batch size for the same
        global batch, world size and rank (an automatic size, or a resumed run's)."""
        old = self.plan
        if (plan.train_batch_size, plan.world_size, plan.rank) != (old.train_batch_size, old.world_size, old.rank):
            raise EngineUsageError(
                f"replan() keeps the global batch, world size and rank ({old.train_batch_size}, "
                f"{old.world_size}, {old.rank}); got ({plan.train_batch_size}, {plan.world_size}, {plan.rank})")
        if self._window.micro_steps:
            raise EngineUsageError("replan() called in the middle of a window: call it between windows")
        self.plan = plan

    def evaluate(self, batch, loss_fn: LossFn, size: int | None = None) -> float:
        """Evaluate ``batch`` in the window split's micro-batches — of at most ``size`` samples,
        or padded tokens when split by tokens (default: the plan's) — the same number on every
        rank, forwards guarded by the window runner; the mean loss over every rank, per sample or
        per item."""
        return self._evaluate(self.window_split.eval_pieces(batch, self.plan, size), loss_fn)

    @torch.no_grad()
    def _evaluate(self, pieces, loss_fn: LossFn) -> float:
        """Forwards of ``(micro_batch, samples)`` pieces (0 samples: weight 0)."""
        total = torch.zeros(2, dtype=torch.float64)  # Σ loss × units, Σ units

        def forwards():
            total.zero_()
            for micro_batch, n in pieces:
                # this rank's part of each sequence, weighed by its tokens
                output = self.context.item_weighted(loss_fn(self, self.context.shard(micro_batch)))
                loss, count, item_weighted = loss_and_units(output, n)
                if n:
                    total[0] += loss.double().cpu() * (1 if item_weighted else n)
                    total[1] += torch.as_tensor(count, dtype=torch.float64).cpu()

        was_training = self.module.training
        self.module.eval()
        self._splitting = True  # the pieces are on the device (and split over the context ranks) already
        try:
            self.window_runner.guard(forwards)
        finally:
            self._splitting = False
            self.module.train(was_training)
            self.strategy.release_gathered_parameters()
        stats = self.strategy.all_reduce_sum(total.to(self.strategy.device))
        return float(stats[0] / stats[1])

    # -- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole, unsharded model state as CPU tensors, on every rank."""
        return self.strategy.full_state_dict()

    def gathered_parameters(self, modifier_rank: int | None = None):
        """A context manager: inside it every rank's ``eng.module`` holds whole parameters (at
        ZeRO-3 they are gathered; collective: enter it on every rank). With ``modifier_rank``,
        that rank's parameter values at the end of the block become every rank's (DeepSpeed's
        ``zero.GatheredParameters``); changes made elsewhere are dropped. Between windows only."""
        if self._window.micro_steps:
            raise EngineUsageError("gathered_parameters() inside an accumulation window: use it between windows "
                                   "(after the step that closes one)")
        return self.strategy.gathered(modifier_rank)

    def state_dict(self) -> dict:
        """The engine's own state at a boundary: counters, plan and micro-batch size (the model
        and optimizer are the strategy's; scheduler, loss scaler and tuner are parts of their own
        in ``self.checkpoints``)."""
        plan = self.plan
        return {
            "counters": {name: int(getattr(self, name)) for name in COUNTERS},
            "plan": dataclasses.asdict(plan.for_rank(0)),
            "micro_batch": {"size": plan.train_micro_batch_size_per_gpu, "mode": plan.micro_batch_mode,
                            "tokens": plan.micro_batch_tokens},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``, possibly saved on another world size (same global batch);
        then tell the hooks."""
        if self._window.micro_steps:
            raise EngineUsageError("load_state_dict() called in the middle of a window: call it between windows")
        for name in COUNTERS:
            setattr(self, name, state["counters"][name])
        self._restore_micro_batch(state["micro_batch"])
        saved, plan = state["plan"], self.plan
        if saved["world_size"] != plan.world_size:
            log.info("resuming a checkpoint of %d rank(s) on %d: global batch %s unchanged, gradient "
                     "accumulation %d -> %d, micro-batch %s -> %s", saved["world_size"], plan.world_size,
                     plan.train_batch_size, saved["gradient_accumulation_steps"],
                     plan.gradient_accumulation_steps, saved["train_micro_batch_size_per_gpu"],
                     plan.train_micro_batch_size_per_gpu)
        for hook in self.hooks:
            hook.on_state_loaded(self)

    def _restore_micro_batch(self, saved: dict) -> None:
        """A micro size (or token budget) found by auto / explore is kept when it suits the
        current plan."""
        plan = self.window_split.restored_plan(self.plan, saved)
        if plan != self.plan:
            self.replan(plan)

    def save_checkpoint(self, path, *, data=None, client_state: dict | None = None):
        """Save everything needed to resume at this boundary (see engine.state.checkpoint). ``data``:
        an object with ``state_dict()`` (e.g. DistributedBatches) whose position is saved."""
        return self.checkpoints.save(path, data=data, client_state=client_state)

    def load_checkpoint(self, path, *, data=None) -> dict:
        """Restore a checkpoint written by ``save_checkpoint``; returns its ``client_state``.
        It replaces an automatic resume (``checkpoint.resume``) not fully applied yet."""
        return self.checkpoints.load(path, data=data)

    def _checkpoint_position(self) -> CheckpointPosition:
        return CheckpointPosition(self.global_steps, self.global_samples, self.plan.train_batch_size,
                                  self._window.micro_steps, self.plan.gradient_accumulation_steps)

    def close(self) -> None:
        """Release the engine. Collective: a peer still training (its data lasted longer) learns
        here that this rank has stopped, and both raise RankDisagreementError."""
        try:
            if self._agreeing:  # not after a disagreement, which the ranks raised together, nor twice
                self._agree_on_position(CLOSED)
        except PeerLostError as error:  # gone or stuck: nothing to tell it any more
            log.warning("close(): %s", error)
        finally:
            self._agreeing = False
            for hook in self.hooks:
                hook.on_close(self)
            self.strategy.close()

    # -- internals --------------------------------------------------------------------------
    def _loss_fn(self, loss_fn: LossFn | None) -> LossFn:
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise EngineUsageError(
                "no loss function: pass loss_fn(model, micro_batch) to train_batch()/eval_batch() "
                "or to engine.initialize(..., loss_fn=...)"
            )
        check_loss_signature(loss_fn, on_outputs=self.window_runner.calls_loss_on_outputs)  # engine.window.loss_checks
        return loss_fn

    def _micro_steps(self, batch, loss_fn: LossFn) -> None:
        split = self.window_split.split(batch, self.plan)
        self.planned_window(split)
        # A model's load-balancing terms over the window are counted first (engine.window.experts);
        # each micro-batch's loss_fn sees this rank's part of its sequences (engine.context).
        self.experts.run_window(split.pieces,
                                forward=lambda micro_batch: loss_fn(self, self.context.shard(micro_batch)),
                                backward=lambda output, size: self._backward(output, size, exact_counts=True),
                                units=loss_and_units, before_counting=self._agree_before_counting)

    def _agree_before_counting(self) -> None:
        """A counting forward's collectives (ZeRO-3's gathers, DDP's buffer broadcast) come before
        the window's first training forward: the ranks compare positions before them too."""
        if self.strategy.communicates_before_closing_backward:
            self._agree_on_position(WINDOW_START)

    def _backward(self, output, samples: int, *, exact_counts: bool) -> None:
        window = self._window
        output = self.context.item_weighted(output)  # each rank's part of the sequences weighs by its tokens
        loss, units, item_weighted = loss_and_units(output, samples)
        check_loss(loss)  # first: what is wrong with the loss itself is said alike on any number of ranks
        self.losses.backward_of(item_weighted)
        if self.world_size > 1 and not window.forwarded:
            raise EngineUsageError(
                "backward() without a forward through the engine: call eng(x), not eng.module(x), "
                "so that gradient synchronisation is planned for this micro-step"
            )
        window.check_same_kind(item_weighted)
        planned = window.planned_steps or self.plan.gradient_accumulation_steps
        if window.micro_steps + 1 >= planned and not self.window_runner.chooses_micro_size \
                and self.strategy.reduces_gradients_over_ranks:
            # Before the backward that reduces the window's gradient (ZeRO-0/1: its first collective).
            # The automatic micro size agrees on each window's failures instead; with one data rank
            # nothing is reduced (a split model's exchanges come after the window start's check).
            self._agree_on_position(CLOSING_MICRO_STEP)
        # Before backward: a failing backward must leave the window as it was.
        with self.context.running():
            self.strategy.backward(loss, self.micro_step_weight(samples, item_weighted))
        self._count_micro_step(loss, units, samples, _share(samples, item_weighted), item_weighted,
                               exact_counts=exact_counts)

    def _count_micro_step(self, loss, units, samples: int, share: int, item_weighted: bool | None, *,
                          exact_counts: bool) -> None:
        window = self._window
        if samples == 0:  # a zero-weight step: it only keeps the ranks' micro-step counts equal
            units = 0
        window.micro_steps += 1
        window.samples += samples
        if loss is not None:
            window.losses.append(loss.detach())
            window.loss_weights.append(share)
        if item_weighted:
            window.counts.append(units)
        window.exact_counts = window.exact_counts or exact_counts or item_weighted
        window.backward_since_step = True
        window.forwarded, window.forwards = False, []
        self.micro_steps += 1

    def _close_window(self) -> None:
        """Reduce, weigh and apply the window's gradient, then count and report it."""
        window = self._window
        self.strategy.reduce_gradients()
        self.losses.window_closed()
        step = self.global_steps + 1
        recorded = self._records(step)
        self.fingerprint_window_batch()
        fingerprint, self._batch_fingerprint = self._batch_fingerprint, None
        try:
            totals = window_totals(window, self.plan, self.strategy, over_all_ranks=window.exact_counts or recorded,
                                   same_batch=(self._same_batch, fingerprint) if fingerprint is not None else None,
                                   holders=self.context.size)
        except EngineUsageError:  # a replica's ranks were given different batches: nothing applied
            self.discard_window()
            raise
        if totals.failed:
            self.discard_window()
            raise window.failure or failed_on_another_rank("window")
        window.item_weighted = totals.item_weighted  # a rank that computes no loss learns its kind here
        samples = totals.samples
        lr = float(self.optimizer.param_groups[0]["lr"])  # the one this window's update uses
        result = self._apply_update(window, totals.units, samples, totals.squares,
                                    want_norm=self.grad_norm_every_step or self._needs_grad_norm(step))
        self.window_split.window_closed(samples)
        if result.applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += samples
        self.last_window = WindowReport(loss=totals.loss, samples=samples, step=result, lr=lr,
                                        items=totals.units if window.item_weighted else None,
                                        peak_memory_bytes=self._peak.peak if self._recording else None,
                                        micro_steps=window.micro_steps, real_tokens=totals.tokens[0],
                                        padded_tokens=totals.tokens[1])
        self._window, self._recording = Window(), False
        for hook in self.hooks:
            hook.on_window_closed(self, self.last_window)

    def _agree_on_position(self, point: int) -> None:
        """The ranks compare where they are (``engine.window.positions``); after a disagreement or a
        lost peer no further agreement could pair."""
        self._post_position(point)()

    def _post_position(self, point: int) -> Callable[[], None]:
        """``_agree_on_position`` posted: the returned call waits for the comparison (once: later
        calls return at once)."""
        if self.world_size == 1:
            return _nothing_posted
        window = self._window
        posted = post_position(self.rank, point, self.global_steps, self.windows_started, window.micro_steps,
                               window.training_forwards)

        def confirm() -> None:
            try:
                posted.confirm()
            except (PeerLostError, RankDisagreementError):
                self._agreeing = False
                raise

        return confirm

    def _records(self, step: int) -> bool:
        return any(hook.records(step) for hook in self.hooks)

    def _needs_grad_norm(self, step: int) -> bool:
        return any(hook.needs_grad_norm(step) for hook in self.hooks)

    def _weighting_batch(self) -> int:
        """The G of the weights: the planned global batch, or a data-defined plan's nominal one."""
        return self.window_split.weighting_batch(self.plan)

    def _apply_update(self, window: Window, units, samples: int, squares: float | None, *,
                      want_norm: bool) -> StepResult:
        """Multiply the reduced gradient to the global mean, clip, step — or skip the window
        when it holds nothing to average or overflowed. ``squares``: the reduced gradient's sum
        of squares over ranks, when the window's statistics brought it."""
        if window.item_weighted and float(units) == 0:
            # Nothing to average (every label ignored): a step would divide by zero.
            self.strategy.discard_window()
            log.warning("the window of global step %d holds no items (e.g. every label is -100): skipped",
                        self.global_steps + 1)
            return StepResult(applied=False)
        target = self._weighting_batch()
        if window.item_weighted:
            multiplier = target / units
        else:
            multiplier = 1.0 if samples == target else target / samples
        result = self.strategy.step(multiplier, self.config.gradient_clipping, want_norm=want_norm,
                                    grad_squares=squares)
        self.strategy.zero_grad()
        step = self.global_steps + 1
        if non_finite.raises(self.config.faults.non_finite_gradient, result.non_finite):
            self.discard_window()  # gradients and the window's micro-steps: the engine stays usable here
            self._recording = False
            raise non_finite.non_finite_error(step)
        non_finite.warn_skipped(result.applied, result.non_finite, step)
        return result


def _nothing_posted() -> None:
    """The wait of a position check that was not needed."""


def _share(samples: int, item_weighted: bool) -> int:
    """What a micro-batch's loss is multiplied by before its weighting: its samples (a mean),
    1 (a sum), 0 (a zero-weight step)."""
    return (1 if item_weighted else samples) if samples else 0
