"""Who runs a window's micro-steps on an engine: the runner protocol.

The plain runner below asks the engine to run the window itself. The automatic micro-batch
size (``engine.autotune.tuner``) re-runs a window smaller after an out-of-memory every rank
agreed on; a pipeline's schedule (``engine.window.pipeline``) runs the micro-steps itself and
tells the engine with ``start_window_check_posted`` / ``planned_window`` /
``fingerprint_window_batch`` / ``record_micro_step`` / ``fail_window``. A runner drives the
engine through those public calls only.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol

LossFn = Callable[[Any, Any], Any]


class Engine(Protocol):
    """What a runner may call on the engine it runs windows for (``engine.engine.Engine``)."""

    module: Any  # the model as the strategy holds it
    plan: Any  # the batch plan (``engine.batching.plan.BatchPlan``)
    window_split: Any  # how a window is cut (``engine.batching.window_split``)

    def run_window(self, batch, loss_fn: LossFn) -> None:
        """Run a whole training window itself (the plain runner)."""

    def evaluate(self, batch, loss_fn: LossFn, size: int | None = None) -> float:
        """The loss over ``batch`` without gradients."""

    def start_window_check_posted(self) -> Callable[[], None]:
        """A window's micro-steps begin (a runner that runs them itself); the ranks' position check
        is waited for by the call it returns."""

    def planned_window(self, split) -> None:
        """The window is cut as ``split`` says."""

    def micro_step_weight(self, samples: int, item_weighted: bool) -> float:
        """What a micro-batch's loss is multiplied by before its backward."""

    def record_micro_step(self, output, samples: int) -> None:
        """A micro-step ran (its loss as ``loss_fn`` returned it, None where this rank holds no
        loss of it) and counts now."""

    def fingerprint_window_batch(self) -> None:
        """Fingerprint the window's batch now, where this rank would wait anyway."""

    def fail_window(self, error: Exception) -> None:
        """This rank's loss failed in the window: every rank abandons it at its statistics."""

    def measured_forwards(self) -> ContextManager:
        """Forwards whose saved activations a recorded window counts."""


class WindowRunner:
    """Runs a training or evaluation window on an engine: this plain one runs it once."""

    chooses_micro_size = False  # True for the automatic micro-batch size
    calls_loss_on_outputs = False  # True under a pipeline: loss_fn(outputs, labels)

    def runs_plan(self, plan) -> bool:
        """Whether this runner can run windows of ``plan`` (a pipeline schedule has a rule on its
        number of micro-batches)."""
        return True

    def run_window(self, engine: Engine, batch, loss_fn: LossFn) -> None:
        engine.run_window(batch, loss_fn)

    def run_eval(self, engine: Engine, batch, loss_fn: LossFn) -> float:
        return self.evaluate(engine, batch, loss_fn)

    def evaluate(self, engine: Engine, batch, loss_fn: LossFn, size: int | None = None) -> float:
        """The mean loss over every rank's ``batch``, in micro-batches of at most ``size`` samples."""
        return engine.evaluate(batch, loss_fn, size)

    def guard(self, work: Callable[[], None]) -> None:
        """Run the micro-steps ``work`` of one window (training or evaluation)."""
        work()
