"""Stop signals: a SIGTERM or SIGUSR1 (a scheduler's warning before it kills the job) is only
remembered when it arrives; the ranks act on it together at a window boundary.

A signal may reach some ranks and not others, or reach them in different micro-steps, so no
rank may decide alone where to stop. At every boundary each rank adds what it has received
to one all-reduce of a single integer on the control group (a maximum over ranks): every rank
gets the same answer at the same boundary. That small CPU collective is the whole cost of
watching for signals (bench/checkpoint_cost.py measures it against a step); a single process
needs none. A peer that never comes makes it raise ``PeerLostError`` after
``distributed.agreement_timeout_seconds``.
"""

from __future__ import annotations

import logging
import signal
import threading

from engine.collectives import max_over_ranks, peer_lost_as_error

log = logging.getLogger("engine")


class Preempted(SystemExit):
    """Raised by ``step()`` / ``train_batch()`` on every rank at the boundary where the run
    stopped for a stop signal, after the checkpoint was saved. A ``SystemExit``: unless the
    script catches it, the process exits with ``code`` (``checkpoint.stop_exit_code``), and an
    ``except Exception`` in the script does not swallow it."""

    def __init__(self, code: int, signal_name: str, checkpoint: str):
        super().__init__(code)
        self.signal_name = signal_name
        self.checkpoint = checkpoint


class StopSignals:
    """Remembers the first of ``names`` this process receives, once installed."""

    def __init__(self, names: list[str]):
        self.signals = [signal.Signals[name] for name in names]
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> None:
        """Handle the signals from now on (they no longer end the process by themselves)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("stop signals (%s) are not handled: Python handles signals on the main thread "
                        "only, and the engine was built on another", ", ".join(s.name for s in self.signals))
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._remember)

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had before :meth:`install`."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._remember:
                signal.signal(sig, previous)
        self._previous.clear()

    def _remember(self, signum, _frame) -> None:
        # Nothing else here: the main thread may be anywhere (inside logging, a save, ...).
        # Repeats are ignored (a launcher and the scheduler often both forward the signal).
        if self.received is None:
            self.received = signal.Signals(signum)

    def agreed(self) -> signal.Signals | None:
        """At a boundary, on every rank: a signal some rank received (the same on every rank),
        or None. Collective: one all-reduce of one integer."""
        mine = int(self.received or 0)
        with peer_lost_as_error("checking for stop signals at the window boundary"):
            everyone = max_over_ranks([mine])[0]
        return signal.Signals(everyone) if everyone else None
