"""Who runs a window's micro-steps on an engine: the runner protocol.

The plain runner below hands the window to the engine's window executor (``engine.window.executor``).
The automatic micro-batch size (``engine.autotune.tuner``) re-runs a window smaller after an
out-of-memory every rank agreed on; a pipeline's schedule (``engine.window.pipeline``) runs the
micro-steps through its stages and tells the engine's window machine (``engine.window.machine``) with
``start_check_posted`` / ``planned`` / ``fingerprint_batch`` / ``weighed_loss`` / ``record`` / ``fail``;
every weight comes from ``engine.accounting``. A runner drives the engine through those calls only.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol

LossFn = Callable[[Any, Any], Any]


class Windows(Protocol):
    """What a runner that runs micro-steps itself tells the engine's windows (``WindowMachine``)."""

    def start_check_posted(self) -> Callable[[], None]:
        """A window's micro-steps begin; the ranks' position check is waited for by the call it returns."""

    def planned(self, split) -> None:
        """The window is cut as ``split`` says."""

    def weighed_loss(self, output, samples: int) -> tuple:
        """A micro-batch loss read, checked and weighted as the window's backwards weigh one: (weighted loss,
        what ``record`` counts of it, units)."""

    def record(self, output, samples: int) -> None:
        """A micro-step ran (its loss as ``loss_fn`` returned it, None where this rank holds no
        loss of it) and counts now."""

    def fingerprint_batch(self) -> None:
        """Fingerprint the window's batch now, where this rank would wait anyway."""

    def fail(self, error: Exception) -> None:
        """This rank's loss failed in the window: every rank abandons it at its statistics."""

    def measured_forwards(self) -> ContextManager:
        """Forwards whose saved activations a recorded window counts."""


class Engine(Protocol):
    """What a runner may use of the engine it runs windows for (``engine.engine.Engine``)."""

    module: Any  # the model as the strategy holds it
    plan: Any  # the batch plan (``engine.batching.plan.BatchPlan``)
    window_split: Any  # how a window is cut (``engine.batching.window_split``)
    windows: Windows  # the window machine
    executor: Any  # the window executor (``engine.window.executor.WindowExecutor``)
    accounting: Any  # the window's weights (``engine.accounting.Accounting``)
    context: Any  # the sequences' split over context ranks (``engine.context.parallel``; size 1: whole)
    window_hooks: Any  # the routers' hooks of a model with routers (None: a dense model)


class WindowRunner:
    """Runs a training or evaluation window on an engine: this plain one runs it once, on its executor."""

    chooses_micro_size = False  # True for the automatic micro-batch size
    calls_loss_on_outputs = False  # True under a pipeline: loss_fn(outputs, labels)

    def runs_plan(self, plan) -> bool:
        """Whether this runner can run windows of ``plan`` (a pipeline schedule has a rule on its
        number of micro-batches)."""
        return True

    def run_window(self, engine: Engine, batch, loss_fn: LossFn) -> None:
        engine.executor.run_window(batch, loss_fn, engine.plan)

    def run_eval(self, engine: Engine, batch, loss_fn: LossFn) -> float:
        return self.evaluate(engine, batch, loss_fn)

    def evaluate(self, engine: Engine, batch, loss_fn: LossFn, size: int | None = None) -> float:
        """The mean loss over every rank's ``batch``, in micro-batches of at most ``size`` samples."""
        return engine.executor.evaluate(batch, loss_fn, engine.plan, size)

    def guard(self, work: Callable[[], None]) -> None:
        """Run the micro-steps ``work`` of one window (training or evaluation)."""
        work()
