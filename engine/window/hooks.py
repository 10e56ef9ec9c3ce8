"""What an engine tells the collaborators it was built with, at fixed points of training.

A hook (the monitor, automatic checkpoints) subclasses :class:`EngineHook` and overrides the
points it cares about; ``engine.initialize`` hands the engine a list of them. The engine calls
every hook at every point, so its hot path holds no ``if monitor is not None`` ladder.
"""

from __future__ import annotations


class EngineHook:
    """Every point is a no-op here."""

    def records(self, step: int) -> bool:
        """Whether global step ``step`` is measured: its peak memory and its loss over every rank."""
        return False

    def needs_grad_norm(self, step: int) -> bool:
        """Whether global step ``step`` needs the gradient norm even without clipping."""
        return False

    def on_batches(self, engine, data) -> None:
        """``eng.batches()`` made ``data`` (an ``engine.batching.data.DistributedBatches``)."""

    def on_window_start(self, engine) -> None:
        """A training window's first forward."""

    def on_window_closed(self, engine, report) -> None:
        """A window closed (``report``: the engine's ``last_window``); counters are updated."""

    def on_state_loaded(self, engine) -> None:
        """A checkpoint restored the engine (``eng.load_checkpoint`` or an automatic resume)."""

    def on_close(self, engine) -> None:
        """``eng.close()``."""


class Hooks:
    """The hooks an engine was built with, in the order they are told, each told with the engine
    (``subject``, what a hook is handed) at each point; the window machine tells them through this, and
    holds no engine."""

    def __init__(self, subject, hooks: tuple[EngineHook, ...]):
        self.subject, self.all = subject, tuple(hooks)

    def records(self, step: int) -> bool:
        return any(hook.records(step) for hook in self.all)

    def needs_grad_norm(self, step: int) -> bool:
        return any(hook.needs_grad_norm(step) for hook in self.all)

    def tell(self, point: str, *args) -> None:
        """Every hook's ``point`` (``on_window_start``, ``on_window_closed``, ...), with the engine first."""
        for hook in self.all:
            getattr(hook, point)(self.subject, *args)
