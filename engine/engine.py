"""The engine: counts micro-steps, weights losses, and updates only at window boundaries.

Weighting. Every weight, count and divisor of a window is computed by ``engine.accounting``
(what a loss stands for, a micro-step's weight ``share · W / G``, the boundary multiplier ``G / U``,
the window's totals over the ranks, evaluation's totals); the engine and every window runner ask
it. A model's own ``.loss`` is read as its sum over the items its labels hold
(``engine.window.model_loss``).

Micro-batches and what they count for. How ``train_batch`` / ``eval_batch`` cut a batch and
what a manual-loop micro-batch counts for depend on the kind of plan — planned sizes, sizes
read from the inputs, a data-defined plan, a token budget — and are decided by the window
split ``engine.initialize`` chose (``engine.batching.window_split``); the engine itself does not ask
which kind it runs. A micro-batch of 0 samples is a zero-weight step: its loss counts for
nothing, its collectives still run (ranks with fewer micro-batches than their peers). When
the counts are real rather than planned, U is summed over the ranks at the boundary.

The window's state machine — counters, the ranks' position checks, a window's close (reduce,
totals, multiply, clip, step) and discard — is ``engine.window.machine``; the window executor
(``engine.window.executor``) runs every window's forwards and backwards as a schedule
(``engine.schedule``), evaluation's too; this class is the public front over both.

Collaborators are handed in by ``engine.initialize``, never attached afterwards: the strategy
(how the model is held), the automatic micro-batch size when the plan has one (``engine.autotune.tuner``:
it retries a window on the executor smaller after an out-of-memory and guards its micro-steps; without
it each window runs once), a pipeline's windows (``engine.window.stages``: what the executor's stage actions run;
None for a model held whole), the window's hooks (a model with routers: ``engine.experts.window``, under a
pipeline ``engine.experts.stages``; None for a dense model) and the model's routers as ``eng.experts``
reads them, the engine's hooks (``engine.window.hooks``: the monitor and automatic checkpoints, told
when ``batches()`` makes data, a training window starts or closes, state is loaded and the engine
closes) and the stateful parts a checkpoint holds besides the engine's own counters (scheduler, loss
scaler, tuner), which the engine hands with itself and its strategy to one
``engine.state.checkpoint.CheckpointManager``.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch

from engine.accounting import Accounting, loss_tensor
from engine.batching.data import DistributedBatches, batches_for
from engine.batching.microbatch import to_device
from engine.batching.plan import BatchPlan
from engine.batching.window_split import PlannedSplit
from engine.context.parallel import ContextParallel, WholeSequences
from engine.errors import EngineUsageError
from engine.experts.window import NO_ROUTERS
from engine.state.checkpoint import CheckpointManager, CheckpointPosition
from engine.state.engine_state import EngineState
from engine.strategies.base import Strategy
from engine.window.executor import LossFn, WindowExecutor, WindowHooks
from engine.window.hooks import EngineHook, Hooks
from engine.window.loss_checks import check_loss, check_loss_signature
from engine.window.machine import WindowMachine
from engine.window.model_loss import LossReading, NoModelLoss
from engine.window.stages import StageWindows

log = logging.getLogger("engine")


class MicroSizeTuner(Protocol):
    """What the engine asks of its automatic micro-batch size (``engine.autotune.tuner.MicroBatchTuner``)."""

    def retry_window(self, engine: "Engine", batch, loss_fn: LossFn) -> None: ...
    def retry_eval(self, engine: "Engine", batch, loss_fn: LossFn) -> float: ...
    def guard(self, work: Callable[[], None]) -> None: ...


def _run(work: Callable[[], None]) -> None:
    """A window's micro-steps without the automatic micro size: run once."""
    work()


class _Counter:
    """An engine counter, kept by its window machine."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, engine, owner=None):
        return self if engine is None else getattr(engine.windows, self.name)

    def __set__(self, engine, value):
        setattr(engine.windows, self.name, value)


class Engine:
    """Returned by :func:`engine.initialize`; the public contract is in README.md and docs/."""

    micro_steps, global_steps, global_samples, skipped_steps = _Counter(), _Counter(), _Counter(), _Counter()

    def __init__(self, *, config, plan: BatchPlan, strategy: Strategy, window_split: PlannedSplit,
                 tuner: MicroSizeTuner | None = None, monitor: EngineHook | None = None,
                 autosave: EngineHook | None = None, hooks: tuple[EngineHook, ...] = (),
                 checkpoint_states: dict | None = None, lr_scheduler=None, loss_fn: LossFn | None = None,
                 grad_norm_every_step: bool = False, window_hooks: WindowHooks | None = None, experts=None,
                 stages: StageWindows | None = None, context: ContextParallel | None = None,
                 losses: LossReading | None = None):
        self.config, self.plan, self.strategy = config, plan, strategy
        # how windows are cut and what a micro-batch counts for (engine.batching.window_split)
        self.window_split, self._tuner = window_split, tuner
        # Hooks, told in this order at every point; the monitor and the automatic checkpoints are kept
        # by name too (scripts read eng.monitor, eng.autosave); the checkpoints go last: a stop signal ends
        # the run there.
        self._monitor, self.autosave = monitor, autosave
        self._hooks = Hooks(self, tuple(hook for hook in (monitor, *hooks, autosave) if hook is not None))
        self.loss_fn = loss_fn
        # Null objects where a dimension is absent: whole sequences without context_parallel
        # (engine.context.parallel), a model whose loss is not read as (sum, count) (engine.window.model_loss);
        # a window without hooks (a dense model: engine.window.executor) asks none. ``experts``: a model's
        # routers as eng.experts reads them (engine.experts.window), None without any.
        self.window_hooks, self._experts = window_hooks, experts
        self.context = context if context is not None else WholeSequences()
        self.losses = losses or LossReading(NoModelLoss(), strict=False)
        # every weight, count and divisor of a window (engine.accounting); G is the window split's
        self.accounting = Accounting(mesh=strategy.settings.mesh,
                                     weighting_batch=lambda: self.window_split.weighting_batch(self.plan))
        self.windows = WindowMachine(
            strategy=strategy, accounting=self.accounting, window_split=window_split, context=self.context,
            losses=self.losses, hooks=self._hooks, lr_scheduler=lr_scheduler,
            chooses_micro_size=tuner is not None, clipping=config.gradient_clipping,
            non_finite_policy=config.faults.non_finite_gradient, grad_norm_every_step=grad_norm_every_step)
        self.executor = WindowExecutor(model=self, strategy=strategy, windows=self.windows, window_split=window_split,
                                       context=self.context, losses=self.losses, accounting=self.accounting,
                                       hooks=window_hooks, stages=stages,
                                       guard=tuner.guard if tuner is not None else _run)
        # A checkpoint holds the strategy's model and optimizer, the parts handed in, and this engine's
        # counters and plan, loaded last so that its hooks see the whole restored state.
        self.checkpoints = CheckpointManager(
            {"lr_scheduler": lr_scheduler, "loss_scaler": strategy.loss_scaler, **(checkpoint_states or {}),
             "engine": EngineState(self)},
            training_state=strategy, position=self._checkpoint_position, rank=strategy.rank,
            world_size=strategy.world_size, seed=config.seed, config_record=config.to_dict())
        self._batches: DistributedBatches | None = None  # of batches()

    # -- what the model is ------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.strategy.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    @property
    def lr_scheduler(self):
        """The scheduler stepped with each applied update (None without one)."""
        return self.windows.lr_scheduler

    @property
    def experts(self):
        """A model's routers as its windows balance them (``engine.experts.window``: ``last_load``,
        ``routing_differences``, ``global_counts``); for a model without routers, a record of none."""
        return self._experts if self._experts is not None else NO_ROUTERS

    @property
    def hooks(self) -> tuple[EngineHook, ...]:
        """The hooks told at every point, in order (``engine.window.hooks``)."""
        return self._hooks.all

    def parameters(self, recurse: bool = True):
        """The model's parameters as this rank holds them (``loss_fn(model, micro_batch)`` is handed the
        engine: a term written ``model.parameters()`` works): whole tensors at ZeRO 0-2, this rank's
        shard (a DTensor) at ZeRO 3, a stage's own under a pipeline (docs/config.md, "loss_fn's model")."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """``(name, parameter)`` pairs with the user's module's names (see :meth:`parameters`)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

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
        return self._tuner

    @property
    def monitor(self):
        """The ``engine.monitor.Monitor`` among the hooks (None without one). A script may set
        another: ``eng.monitor = Monitor(...).attach(eng)`` replaces it among the hooks."""
        return self._monitor

    @monitor.setter
    def monitor(self, monitor) -> None:
        others = tuple(hook for hook in self.hooks if hook is not self._monitor)
        self._hooks.all = ((monitor,) if monitor is not None else ()) + others
        self._monitor = monitor

    @property
    def last_window(self):
        """The last closed window's report (``engine.window.records.WindowReport``)."""
        return self.windows.last

    @property
    def window_micro_steps(self) -> int:
        """Micro-steps done in the window in progress (0 at a boundary)."""
        return self.windows.current.micro_steps

    # -- the manual loop ----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Forward through the wrapped model. Tells the strategy whether the micro-step in
        progress closes the window (DDP decides gradient sync in the forward)."""
        self.strategy.check_manual_loop()  # before a window starts: a pipeline refuses eng(x)
        if not self.executor.runs_own_micro_batches:  # train_batch / eval_batch moved their batch already
            args, kwargs = self._on_device(args), self._on_device(kwargs)
        return self.executor.forward(args, kwargs, self.plan)

    def backward(self, loss) -> None:
        """Backward of one micro-batch loss (a mean over its samples, ``(loss_sum, num_items)``, or the
        model's own ``.loss``), weighted by its share of the global batch: the k-th micro-step of a window
        holds ``plan.micro_batch_sizes[k]`` samples, or what ``eng(...)`` was given when sizes are read."""
        self.strategy.check_manual_loop()
        window = self.windows.current
        k = window.micro_steps
        if k >= self.plan.gradient_accumulation_steps:
            raise EngineUsageError(
                f"backward() called {k + 1} times in a window of {self.plan.gradient_accumulation_steps} "
                "micro-steps: call step() after every backward()"
            )
        tensor = loss_tensor(loss)  # read and weighed once, by the window machine
        check_loss(tensor)
        samples = self.window_split.manual_samples(window.forwards, self.plan, k, tensor)
        self.windows.backward(loss, samples, self.plan.gradient_accumulation_steps,
                              exact_counts=self.window_split.counts_exactly)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the micro-step in progress (or just back-propagated) is the last of its window."""
        return self.windows.is_boundary(self.plan.gradient_accumulation_steps)

    def step(self, flush: bool = False) -> bool:
        """Close the window if this micro-step is its last; otherwise change nothing.
        Returns True when a window was closed (``skipped_steps`` tells whether a non-finite
        gradient, e.g. an fp16 overflow, discarded it). ``step(flush=True)`` is :meth:`flush`."""
        return self.flush() if flush else self.windows.step(self.plan)

    def flush(self) -> bool:
        """Close a window holding fewer micro-steps than planned (the end of the data), weighted by what
        it holds; on every rank, with the same micro-steps. False when there was nothing to close."""
        return self.windows.flush(self.plan)

    def zero_grad(self) -> None:
        """For Colossal-style loops: never wipes a window in progress (boundaries clear gradients)."""
        if self.windows.current.micro_steps == 0:
            self.strategy.zero_grad()

    @property
    def gradient_clipping(self) -> float:
        """The 2-norm the whole window's gradient is clipped to at each boundary (0: off), the config's
        ``gradient_clipping`` until set; setting it changes the boundaries that follow, the one closing the
        window in progress included (Accelerate's ``clip_grad_norm_`` sets it inside a window)."""
        return self.windows.clipping

    @gradient_clipping.setter
    def gradient_clipping(self, max_norm: float) -> None:
        if not float(max_norm) >= 0:
            raise EngineUsageError(f"gradient_clipping must be a number >= 0 (0: off); got {max_norm}")
        self.windows.clipping = float(max_norm)

    # -- whole batches ------------------------------------------------------------------
    def train_batch(self, batch, loss_fn: LossFn | None = None) -> float:
        """Run this rank's per-device ``batch`` as one window: split into the plan's
        micro-batches, backward each, take one optimizer step. Returns the window's loss over
        all ranks, weighted exactly as the gradient was.

        A batch smaller than the planned per-device batch (the end of an epoch) is run as a
        short window of the same number of micro-steps, weighted by its real size.
        ``engine.MicroBatches([...])``: the window's micro-batches as collated, run as they are."""
        loss_fn = self._loss_fn(loss_fn)
        if self.windows.current.micro_steps:
            raise EngineUsageError(
                f"train_batch() called in the middle of a manual-loop window "
                f"({self.windows.current.micro_steps} micro-steps done): finish it with step() first"
            )
        batch = self._on_device(batch)
        self.windows.check_batch(batch)  # in the window statistics' reduction
        try:
            if self._tuner is None:
                self.executor.run_window(batch, loss_fn, self.plan)
            else:  # attempts, smaller after an out-of-memory every rank agreed on
                self._tuner.retry_window(self, batch, loss_fn)
        except BaseException:
            self.discard_window()  # a failed batch leaves no half window behind
            self.windows.check_batch(None)
            raise
        self.executor.close_window(self.plan)
        return float(self.last_window.loss)

    def eval_batch(self, batch, loss_fn: LossFn | None = None) -> float:
        """Micro-batched evaluation (module in eval mode, no gradients); returns the mean loss
        over every rank's batch, per sample or per item like ``train_batch``."""
        batch, loss_fn = self._on_device(batch), self._loss_fn(loss_fn)
        if self._tuner is None:
            return self.executor.evaluate(batch, loss_fn, self.plan)
        return self._tuner.retry_eval(self, batch, loss_fn)

    def _on_device(self, batch):
        """A host batch copied to where this rank computes: the loss meets outputs and labels on one device."""
        return batch if self.device.type == "cpu" else to_device(batch, self.device)

    def batches(self, dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                collate_fn=None) -> DistributedBatches:
        """This rank's per-device batches of a map-style ``dataset``, one per optimizer step
        (``engine.batching.data.DistributedBatches``; automatic checkpoints save its position). Called again
        for the same data (``batches_for``: its length and order options) it goes on where it was."""
        data = batches_for(self._batches, dataset, self.plan, shuffle=shuffle, seed=seed, drop_last=drop_last,
                           collate_fn=collate_fn)
        if data is not self._batches:
            self._batches = data
            self._hooks.tell("on_batches", data)
        return data

    # -- for the automatic micro size (engine.autotune.tuner) ----------------------------------
    def discard_window(self) -> None:
        """Abandon the window in progress: its gradients, counters and partial reductions."""
        self.windows.discard()

    def replan(self, plan: BatchPlan) -> None:
        """Run from the next window on with ``plan``: another micro-batch size for the same
        global batch, world size and rank (an automatic size, or a resumed run's)."""
        old = self.plan
        if (plan.train_batch_size, plan.world_size, plan.rank) != (old.train_batch_size, old.world_size, old.rank):
            raise EngineUsageError(
                f"replan() keeps the global batch, world size and rank ({old.train_batch_size}, "
                f"{old.world_size}, {old.rank}); got ({plan.train_batch_size}, {plan.world_size}, {plan.rank})")
        if self.windows.current.micro_steps:
            raise EngineUsageError("replan() called in the middle of a window: call it between windows")
        self.plan = plan

    # -- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole, unsharded model state as CPU tensors, on every rank."""
        return self.strategy.full_state_dict()

    def gathered_parameters(self, modifier_rank: int | None = None):
        """A context manager (collective, between windows): inside it every rank's ``eng.module`` holds
        whole parameters; with ``modifier_rank``, that rank's values at the end of the block become every
        rank's (DeepSpeed's ``zero.GatheredParameters``)."""
        if self.windows.current.micro_steps:
            raise EngineUsageError("gathered_parameters() inside an accumulation window: use it between windows "
                                   "(after the step that closes one)")
        return self.strategy.gathered(modifier_rank)

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
                                  self.windows.current.micro_steps, self.plan.gradient_accumulation_steps)

    def close(self) -> None:
        """Release the engine. Collective: a peer still training (its data lasted longer) learns
        here that this rank has stopped, and both raise RankDisagreementError."""
        try:
            self.windows.leave()
        finally:
            self._hooks.tell("on_close")
            self.strategy.close()

    # -- internals --------------------------------------------------------------------------
    def _loss_fn(self, loss_fn: LossFn | None) -> LossFn:
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise EngineUsageError("no loss function: pass loss_fn(model, micro_batch) to train_batch()/eval_batch() "
                                   "or to engine.initialize(..., loss_fn=...)")
        check_loss_signature(loss_fn, on_outputs=self.executor.calls_loss_on_outputs)  # engine.window.loss_checks
        return loss_fn
