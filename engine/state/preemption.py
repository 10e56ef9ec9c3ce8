"""Stop signals: a SIGTERM or SIGUSR1 (a scheduler's warning before it kills the job), or a
SIGINT (a person's Ctrl-C), is only remembered when it arrives; the ranks act on it together
at a window boundary.

A signal may reach some ranks and not others, or reach them in different micro-steps, so no
rank may decide alone where to stop. At every boundary each rank adds what it has received
to one all-reduce of a single integer on the control group (a maximum over ranks): every rank
gets the same answer at the same boundary. That small CPU collective is the whole cost of
watching for signals (bench/checkpoint_cost.py measures it against a step); a single process
needs none. A peer that never comes makes it raise ``PeerLostError`` after
``distributed.agreement_timeout_seconds``.

The handlers are process-wide: every open engine that watches a signal hears it, and the
handler the signal had before the first of them is put back when the last one closes. A
boundary may never come (a rank hung in a collective, a long evaluation, the script past its
loop), so the same signal delivered again more than ``REPEAT_AFTER_SECONDS`` after the first
is given to that earlier handler (by default: the process ends); repeats closer together are
one event sent twice (a launcher and the scheduler both forwarding it). A person who presses
Ctrl-C twice means "stop now", so for SIGINT that interval is ``INTERACTIVE_REPEAT_SECONDS``:
the second Ctrl-C raises ``KeyboardInterrupt`` (its default handler) at once. Once the ranks have
saved for a signal and raised ``Preempted``, that signal is ignored for the rest of the process
(even after the engine closes), so that the exit code stays ``stop_exit_code``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from engine.distributed.collectives import max_over_ranks, peer_lost_as_error

log = logging.getLogger("engine")

REPEAT_AFTER_SECONDS = 5.0
# SIGINT comes from a terminal, once per key press (`python -m launch` passes a Ctrl-C on once):
# a repeat is a person asking to stop now, unless it comes faster than a key can be pressed twice.
INTERACTIVE_REPEAT_SECONDS = 0.3
# `python -m launch` names a directory here; each rank that stops for a signal writes its exit
# code into it, so the launcher can report the workers' code (torchrun, signalled, exits 1).
STOP_REPORT_DIR = "MICROSTEP_STOP_REPORT_DIR"


def repeat_after(sig: signal.Signals) -> float:
    """Seconds after a first delivery of ``sig`` from which a repeat is a new request to stop
    at once rather than the same event delivered twice."""
    return INTERACTIVE_REPEAT_SECONDS if sig == signal.SIGINT else REPEAT_AFTER_SECONDS


class Preempted(SystemExit):
    """Raised by ``step()`` / ``train_batch()`` on every rank at the boundary where the run
    stopped for a stop signal, after the checkpoint was saved. A ``SystemExit``: unless the
    script catches it, the process exits with ``code`` (``checkpoint.stop_exit_code``), and an
    ``except Exception`` in the script does not swallow it."""

    def __init__(self, code: int, signal_name: str, checkpoint: str):
        super().__init__(code)
        self.signal_name = signal_name
        self.checkpoint = checkpoint


def report_stop(rank: int, code: int) -> None:
    """Tell the launcher (when it asked, through ``STOP_REPORT_DIR``) that this rank stops with
    ``code`` after a stop signal."""
    directory = os.environ.get(STOP_REPORT_DIR)
    if not directory:
        return
    try:
        with open(os.path.join(directory, f"rank{rank}"), "w") as f:
            f.write(str(code))
    except OSError as error:
        log.warning("could not report the stop to the launcher (%s): %s", directory, error)


class StopSignals:
    """Remembers the first of ``names`` this process receives, once installed. ``says``: this process
    tells the person at the terminal what a Ctrl-C does (rank 0: one line per run, not one per rank)."""

    def __init__(self, names: list[str], says: bool = True):
        self.signals = [signal.Signals[name] for name in names]
        self.says = says
        self.received: signal.Signals | None = None
        self._installed = False

    def install(self) -> None:
        """Handle the signals from now on (they no longer end the process by themselves)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("stop signals (%s) are not handled: Python handles signals on the main thread "
                        "only, and the engine was built on another", ", ".join(s.name for s in self.signals))
            return
        for sig in self.signals:
            _HANDLERS.add(sig, self)
        self._installed = True

    def uninstall(self) -> None:
        """Stop listening; the last listener of a signal gives it back to its earlier handler."""
        if self._installed:
            for sig in self.signals:
                _HANDLERS.remove(sig, self)
            self._installed = False

    def stopping(self) -> None:
        """The run has saved and is stopping for the received signal: from now on, for the rest
        of the process, these signals are ignored (a launcher or scheduler repeating one must not
        turn the stop's exit code into death by signal)."""
        for sig in self.signals:
            _HANDLERS.stopping(sig)

    def agreed(self) -> signal.Signals | None:
        """At a boundary, on every rank: a signal some rank received (the same on every rank),
        or None. Collective: one all-reduce of one integer."""
        mine = int(self.received or 0)
        with peer_lost_as_error("checking for stop signals at the window boundary"):
            everyone = max_over_ranks([mine])[0]
        return signal.Signals(everyone) if everyone else None


@dataclass
class _Slot:
    previous: object  # the handler before the first listener: put back after the last
    listeners: list[StopSignals] = field(default_factory=list)
    first: float | None = None  # time.monotonic() of the first delivery
    stopping: bool = False  # saved and stopping for it: later deliveries are ignored


def _after_stop(signum, frame) -> None:
    """The handler of a stop signal once the run saved and is stopping for it (also after the
    engine closed): the process is already on its way out with the stop's exit code."""
    os.write(2, f"[microstep] {signal.Signals(signum).name} again after the stop: ignored, the run has saved "
                "and exits with its stop code\n".encode())


class _Handlers:
    """The process's handlers of stop signals: one per signal, shared by the open engines."""

    def __init__(self):
        self.slots: dict[signal.Signals, _Slot] = {}

    def add(self, sig: signal.Signals, listener: StopSignals) -> None:
        if sig in self.slots:
            self.slots[sig].listeners.append(listener)
            return
        slot = self.slots[sig] = _Slot(signal.SIG_DFL, [listener])  # before the handler: it may run at once
        previous = signal.signal(sig, self._deliver)
        # None: set outside Python; _after_stop: an earlier engine's stop. The default is what can be put back.
        if previous is not None and previous is not _after_stop:
            slot.previous = previous
        if slot.previous not in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler):
            log.warning("%s already had a handler (%r): while the engine is open it saves and stops at the next "
                        "boundary instead; a second %s more than %g s after the first goes to that handler, "
                        "which gets the signal back when the engine closes",
                        sig.name, slot.previous, sig.name, repeat_after(sig))

    def remove(self, sig: signal.Signals, listener: StopSignals) -> None:
        slot = self.slots.get(sig)
        if slot is None or listener not in slot.listeners:
            return
        slot.listeners.remove(listener)
        if not slot.listeners:
            self._give_back(sig)

    def stopping(self, sig: signal.Signals) -> None:
        slot = self.slots.get(sig)
        if slot is not None:
            slot.stopping = True

    def _give_back(self, sig: signal.Signals) -> object:
        slot = self.slots.pop(sig)
        if signal.getsignal(sig) == self._deliver:  # unless the script has set one of its own since
            signal.signal(sig, _after_stop if slot.stopping else slot.previous)
        return slot.previous

    def _deliver(self, signum, frame) -> None:
        # Little here: the main thread may be anywhere (inside logging, a save, ...).
        sig = signal.Signals(signum)
        slot = self.slots.get(sig)
        if slot is None:  # given back already, while this delivery was pending
            return
        if slot.stopping:
            _after_stop(signum, frame)
            return
        now = time.monotonic()
        if slot.first is None:
            slot.first = now
            for listener in slot.listeners:
                if listener.received is None:
                    listener.received = sig
            if sig == signal.SIGINT and any(listener.says for listener in slot.listeners):
                os.write(2, b"[microstep] Ctrl-C (SIGINT): saving at the next window boundary, then stopping; "
                            b"Ctrl-C again to stop at once without saving\n")
            return
        if now - slot.first <= repeat_after(sig):
            return  # the same event, sent twice
        os.write(2, f"[microstep] {sig.name} again, {now - slot.first:.1f} s after the first, which no window "
                    "boundary has acted on: handing it to the handler it had before the engine\n".encode())
        previous = self._give_back(sig)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(sig)


_HANDLERS = _Handlers()
