"""Who runs a window's micro-steps on an engine: the runner protocol.

Every window runs on the engine's window executor (``engine.window.executor``), a pipeline's too. The plain
runner below runs it once; the automatic micro-batch size (``engine.autotune.tuner``) re-runs a window
smaller after an out-of-memory every rank agreed on, and guards its micro-steps.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

LossFn = Callable[[Any, Any], Any]


class Engine(Protocol):
    """What the plain runner uses of the engine it runs windows for (``engine.engine.Engine``)."""

    plan: Any  # the batch plan (``engine.batching.plan.BatchPlan``)
    executor: Any  # the window executor (``engine.window.executor.WindowExecutor``)


class WindowRunner:
    """Runs a training or evaluation window on an engine: this plain one runs it once, on its executor."""

    chooses_micro_size = False  # True for the automatic micro-batch size

    def run_window(self, engine: Engine, batch, loss_fn: LossFn) -> None:
        engine.executor.run_window(batch, loss_fn, engine.plan)

    def run_eval(self, engine: Engine, batch, loss_fn: LossFn) -> float:
        return engine.executor.evaluate(batch, loss_fn, engine.plan)

    def guard(self, work: Callable[[], None]) -> None:
        """Run the micro-steps ``work`` of one window (training or evaluation)."""
        work()
