"""The engine: counts micro-steps, weights losses, and updates only at window boundaries.

Weighting. The strategies leave the mean over ranks of each rank's accumulated gradient,
so a micro-batch loss is multiplied by ``units · W / G`` before its backward, where
``units`` is its number of samples (a mean loss) or 1 (a ``(sum, count)`` loss), W the
world size and G the planned global batch. At the boundary the gradient is multiplied by
``G / U``, U being the window's real total of units over every rank. For a full window of
mean losses U = G and nothing is done; a short window, unequal batches or token counts get
one in-place multiply of the gradient, once per optimizer step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine import checkpoint
from engine.batch_plan import BatchPlan, split_evenly
from engine.microbatch import batch_size, split_batch
from engine.strategies.base import StepResult, Strategy

log = logging.getLogger("engine")

LossFn = Callable[[Any, Any], Any]


class EngineUsageError(RuntimeError):
    """The engine was driven in an order it cannot honour (e.g. ``step`` without ``backward``)."""


@dataclass
class _Window:
    """One accumulation window in progress on this rank."""

    micro_steps: int = 0
    samples: int = 0  # local samples seen (as planned in the manual loop, real in train_batch)
    item_weighted: bool | None = None  # (sum, count) losses
    # Kept as lists and summed at the boundary: no tensor op per micro-step besides backward.
    losses: list = field(default_factory=list)  # detached micro-batch losses
    loss_weights: list = field(default_factory=list)  # samples (mean losses) or 1 (sums)
    counts: list = field(default_factory=list)  # items of (sum, count) losses
    exact_counts: bool = False  # units must be summed over ranks at the boundary

    def loss_total(self) -> torch.Tensor:
        """Σ loss × weight over the window's micro-steps (0-dim, float64)."""
        losses = torch.stack(self.losses).double()
        return losses @ torch.tensor(self.loss_weights, dtype=torch.float64, device=losses.device)

    def units(self):
        """What the window's mean divides by: local samples, or local items."""
        if not self.item_weighted:
            return self.samples
        return sum(torch.as_tensor(c, dtype=torch.float64) for c in self.counts)
    backward_since_step: bool = False
    forwarded: bool = False


@dataclass
class WindowReport:
    """Statistics of the last closed window (for logging; the loss is read lazily)."""

    loss: torch.Tensor | None = None
    samples: int = 0
    items: torch.Tensor | None = None
    step: StepResult = field(default_factory=lambda: StepResult(applied=False))
    lr: float | None = None  # the learning rate this window's update used (first param group)


class Engine:
    """Returned by :func:`engine.initialize`; see DESIGN.md for the contract."""

    def __init__(self, *, config, plan: BatchPlan, strategy: Strategy, lr_scheduler=None,
                 loss_fn: LossFn | None = None, monitor=None):
        self.config = config
        self.plan = plan
        self.strategy = strategy
        self.lr_scheduler = lr_scheduler
        self.loss_fn = loss_fn
        self.monitor = monitor  # told about every closed window (engine.monitor)
        self.micro_batch_tuner = None  # set for "auto" / "explore" micro sizes (engine.autotune)
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.last_window = WindowReport()
        self._window = _Window()
        self._splitting = False  # inside train_batch: micro-batch sizes are the engine's own
        self._size_warned = False

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

    # -- the manual loop ----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Forward through the wrapped model. Tells the strategy whether the micro-step in
        progress closes the window (DDP decides gradient sync in the forward)."""
        if torch.is_grad_enabled():  # a forward for a backward: plan its gradient sync
            window = self._window
            self.strategy.prepare_micro_step(window.micro_steps + 1 >= self.plan.gradient_accumulation_steps)
            window.forwarded = True
            if not self._splitting:
                self._check_manual_micro_batch(args)
        return self.strategy.forward(*args, **kwargs)

    def _check_manual_micro_batch(self, args) -> None:
        """The manual loop weights the k-th micro-step as the plan's k-th micro-batch: say so
        (once) when the data disagrees, since the weighting would then be off."""
        k = self._window.micro_steps
        first = args[0] if args else None
        if (self._size_warned or not isinstance(first, torch.Tensor) or first.dim() == 0
                or k >= self.plan.gradient_accumulation_steps):
            return
        planned = self.plan.micro_batch_sizes[k]
        if first.shape[0] != planned:
            self._size_warned = True
            log.warning("micro-step %d of the window got %d samples but the plan expects %d; in a manual "
                        "loop each micro-batch is weighted by the plan's size (eng.plan.micro_batch_sizes) — "
                        "feed those sizes, or use train_batch() with the whole per-device batch",
                        k, first.shape[0], planned)

    def backward(self, loss) -> None:
        """Backward of one micro-batch loss, weighted by its share of the global batch.

        ``loss`` is the mean over the micro-batch's samples, or a pair ``(loss_sum,
        num_items)`` for item-weighted losses. In this manual loop the k-th micro-step of a
        window is taken to hold ``plan.micro_batch_sizes[k]`` samples."""
        if self.micro_batch_tuner is not None:
            raise EngineUsageError(
                f"train_micro_batch_size_per_gpu: {self.plan.micro_batch_mode} lets train_batch() choose "
                "the micro-batches; a manual loop (eng(x), backward, step) needs a number there"
            )
        k = self._window.micro_steps
        if k >= self.plan.gradient_accumulation_steps:
            raise EngineUsageError(
                f"backward() called {k + 1} times in a window of {self.plan.gradient_accumulation_steps} "
                "micro-steps: call step() after every backward()"
            )
        self._backward(loss, self.plan.micro_batch_sizes[k], exact_counts=False)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the micro-step in progress (or just back-propagated) is the last of its window."""
        window = self._window
        done = window.micro_steps if window.backward_since_step else window.micro_steps + 1
        return done >= self.plan.gradient_accumulation_steps

    def step(self, flush: bool = False) -> bool:
        """Close the window if this micro-step is its last; otherwise change nothing.

        ``flush=True`` closes a window that holds fewer micro-steps than planned (end of the
        data in a manual loop); it is weighted by the samples it really holds. Returns True
        when a window was closed (``skipped_steps`` tells whether fp16 overflow discarded it).
        """
        window = self._window
        if flush:
            return self._flush()
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

    def _flush(self) -> bool:
        """Close a window early. Every rank must call it, holding the same number of
        micro-steps (sharded models reduce gradients collectively)."""
        window = self._window
        fewest, most = window.micro_steps, window.micro_steps
        if self.world_size > 1:  # one tiny collective: flushes are rare
            counts = self.strategy.all_reduce_max(torch.tensor([-fewest, most], device=self.strategy.device))
            fewest, most = -int(counts[0]), int(counts[1])
        if most == 0:
            return False
        if fewest != most:
            raise EngineUsageError(
                f"step(flush=True): the ranks hold between {fewest} and {most} micro-steps in this window; "
                "every rank must run the same number of micro-steps (give each rank the same number of "
                "batches, e.g. engine.data.DistributedBatches)")
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
        try:
            if self.micro_batch_tuner is not None:
                self.micro_batch_tuner.run_window(batch, loss_fn)
            else:
                self._run_window(batch, loss_fn)
        except BaseException:
            self._discard_window()  # a failed batch leaves no half window behind
            raise
        self._close_window()
        return float(self.last_window.loss)

    def eval_batch(self, batch, loss_fn: LossFn | None = None) -> float:
        """Micro-batched evaluation (module in eval mode, no gradients); returns the mean loss
        over every rank's batch, per sample or per item like ``train_batch``."""
        loss_fn = self._loss_fn(loss_fn)
        if self.micro_batch_tuner is not None:
            return self.micro_batch_tuner.run_eval(batch, loss_fn)
        return self._evaluate(batch, loss_fn, self.plan.train_micro_batch_size_per_gpu)

    # -- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole, unsharded model state as CPU tensors, on every rank."""
        return self.strategy.full_state_dict()

    def save_checkpoint(self, path, *, data=None, client_state: dict | None = None):
        """Save everything needed to resume at this boundary (see engine.checkpoint). ``data``:
        an object with ``state_dict()`` (e.g. DistributedBatches) whose position is saved."""
        return checkpoint.save_checkpoint(self, path, data=data, client_state=client_state)

    def load_checkpoint(self, path, *, data=None) -> dict:
        """Restore a checkpoint written by ``save_checkpoint``; returns its ``client_state``."""
        return checkpoint.load_checkpoint(self, path, data=data)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        self.strategy.close()

    # -- internals --------------------------------------------------------------------------
    def _loss_fn(self, loss_fn: LossFn | None) -> LossFn:
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise EngineUsageError(
                "no loss function: pass loss_fn(model, micro_batch) to train_batch()/eval_batch() "
                "or to engine.initialize(..., loss_fn=...)"
            )
        return loss_fn

    def _run_window(self, batch, loss_fn: LossFn) -> None:
        """Forward and backward of every micro-batch of one window (no optimizer step)."""
        self._splitting = True
        try:
            for micro_batch, size in self._split_for_window(batch):
                self._backward(loss_fn(self, micro_batch), size, exact_counts=True)
        finally:
            self._splitting = False

    def _discard_window(self) -> None:
        """Abandon the window in progress: its gradients, counters and partial reductions."""
        self.strategy.discard_window()
        self.micro_steps -= self._window.micro_steps
        self._window = _Window()

    @torch.no_grad()
    def _evaluate(self, batch, loss_fn: LossFn, micro: int, guarded=None) -> float:
        """Evaluate in micro-batches of at most ``micro``; ``guarded(work)`` runs the forwards
        (the micro-batch tuner's failure agreement), plain call by default."""
        size = batch_size(batch)
        # Every rank runs the same number of forwards (sharded models gather parameters in
        # each); a rank with fewer samples repeats its last micro-batch with weight 0.
        counts = self.strategy.all_reduce_max(torch.tensor([-(-size // micro), -size], device=self.strategy.device))
        parts, fewest = int(counts[0]), -int(counts[1])
        if fewest == 0:
            raise EngineUsageError("eval_batch(): some rank got an empty batch; every rank needs at least one sample")
        sizes = [n for n in split_evenly(size, parts) if n]
        pieces = list(zip(split_batch(batch, sizes), sizes))
        pieces += [(pieces[-1][0], 0)] * (parts - len(pieces))
        total = torch.zeros(2, dtype=torch.float64)  # Σ loss × units, Σ units

        def forwards():
            total.zero_()
            for micro_batch, n in pieces:
                loss, count, item_weighted = self._loss_and_units(loss_fn(self, micro_batch), n)
                if n:
                    total[0] += loss.double().cpu() * (1 if item_weighted else n)
                    total[1] += torch.as_tensor(count, dtype=torch.float64).cpu()

        was_training = self.module.training
        self.module.eval()
        try:
            (guarded or _call)(forwards)
        finally:
            self.module.train(was_training)
            self.strategy.release_gathered_parameters()
        stats = self.strategy.all_reduce_sum(total.to(self.strategy.device))
        return float(stats[0] / stats[1])

    def _split_for_window(self, batch):
        plan = self.plan
        accumulation = plan.gradient_accumulation_steps
        size = batch_size(batch)
        if size == plan.per_device_batch_size:
            sizes = plan.micro_batch_sizes
        elif accumulation <= size < plan.per_device_batch_size:
            sizes = split_evenly(size, accumulation)
        else:
            shorter = (f" (a shorter last batch of {accumulation} to {plan.per_device_batch_size - 1} samples "
                       "is run as a short window)" if accumulation < plan.per_device_batch_size else "")
            raise EngineUsageError(
                f"train_batch() got a batch of {size} samples but the plan gives this rank (rank "
                f"{plan.rank}) {plan.per_device_batch_size} per optimizer step in {accumulation} "
                f"micro-batches; pass exactly {plan.per_device_batch_size} samples{shorter}"
            )
        return zip(split_batch(batch, sizes), sizes)

    def _loss_and_units(self, output, samples: int):
        """(loss, the units the window's mean divides by, item-weighted?): a mean loss
        stands for its samples, a ``(sum, count)`` pair for its count."""
        if isinstance(getattr(output, "loss", None), torch.Tensor):  # e.g. a Hugging Face ModelOutput
            output = output.loss
        if isinstance(output, torch.Tensor):
            return output, samples, False
        if isinstance(output, (tuple, list)) and len(output) == 2:
            loss_sum, count = output
            if isinstance(loss_sum, torch.Tensor):
                return loss_sum, count, True
        raise EngineUsageError(
            "the loss must be a scalar tensor (the mean over the micro-batch) or a pair "
            f"(loss_sum, num_items); got {type(output).__name__}"
        )

    def _backward(self, output, samples: int, *, exact_counts: bool) -> None:
        window = self._window
        if self.world_size > 1 and not window.forwarded:
            raise EngineUsageError(
                "backward() without a forward through the engine: call eng(x), not eng.module(x), "
                "so that gradient synchronisation is planned for this micro-step"
            )
        loss, units, item_weighted = self._loss_and_units(output, samples)
        _check_loss(loss)
        if window.item_weighted is None:
            window.item_weighted = item_weighted
        elif window.item_weighted != item_weighted:
            raise EngineUsageError(
                "one window mixes mean losses and (sum, count) losses; use one kind per window"
            )
        # Before backward: a failing backward must leave the window as it was.
        weight = (1 if item_weighted else samples) * self.world_size / self.plan.train_batch_size
        self.strategy.backward(loss, weight)
        window.micro_steps += 1
        window.samples += samples
        window.losses.append(loss.detach())
        window.loss_weights.append(1 if item_weighted else samples)
        if item_weighted:
            window.counts.append(units)
        window.exact_counts = window.exact_counts or exact_counts or item_weighted
        window.backward_since_step = True
        window.forwarded = False
        self.micro_steps += 1

    def _close_window(self) -> None:
        window, plan = self._window, self.plan
        self.strategy.reduce_gradients()
        if window.exact_counts or self.monitor is not None:
            loss, units, samples = self._global_window_stats(window)
        else:  # the manual loop's planned sizes: no collective, no host sync
            samples = plan.window_samples(window.micro_steps)
            loss, units = window.loss_total() / window.samples, samples
        target = plan.train_batch_size
        lr = float(self.optimizer.param_groups[0]["lr"])  # the one this window's update uses
        if window.item_weighted and float(units) == 0:
            # Nothing to average (every label ignored): a step would divide by zero.
            result = StepResult(applied=False)
            self.strategy.discard_window()
            log.warning("the window of global step %d holds no items (e.g. every label is -100): skipped",
                        self.global_steps + 1)
        else:
            if window.item_weighted:
                multiplier = target / units
            else:
                multiplier = 1.0 if samples == target else target / samples
            result = self.strategy.step(multiplier, self.config.gradient_clipping,
                                        want_norm=self.monitor is not None and self.monitor.wants_grad_norm)
            self.strategy.zero_grad()
            if not result.applied:
                log.warning("overflow (a non-finite gradient): the window of global step %d is discarded",
                            self.global_steps + 1)
        if result.applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += samples
        self.last_window = WindowReport(loss=loss, samples=samples, step=result, lr=lr,
                                        items=units if window.item_weighted else None)
        self._window = _Window()
        if self.monitor is not None:
            self.monitor.on_window(self, self.last_window)

    def _global_window_stats(self, window: _Window):
        """(mean loss, units, samples) of the window over every rank: one small all-reduce."""
        device = self.strategy.device
        stats = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=device).reshape(())
                             for value in (window.loss_total(), window.units(), float(window.samples))])
        stats = self.strategy.all_reduce_sum(stats)
        return stats[0] / stats[1], stats[1], int(stats[2].item())


def _call(work) -> None:
    work()


def _check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor):
        raise EngineUsageError(f"the loss must be a tensor; got {type(loss).__name__}")
    if loss.dim() != 0:
        raise EngineUsageError(
            f"the loss must be a scalar (0-dim) tensor, the mean over the micro-batch; got shape "
            f"{tuple(loss.shape)} — reduce it with .mean() (or return (loss.sum(), count))"
        )
    if not loss.requires_grad:
        raise EngineUsageError(
            "the loss does not require grad: it was computed without the model's parameters, or "
            "under torch.no_grad()"
        )
