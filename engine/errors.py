"""Every error Microstep raises on purpose, under one base class.

``except engine.MicrostepError`` catches a user's mistake or an environment problem that
Microstep found and explained; anything else is a bug (ours or a library's). Each class
also derives from the built-in exception its callers would expect (``ValueError`` for bad
input, ``RuntimeError`` for a run that cannot go on).
"""

from __future__ import annotations


class MicrostepError(Exception):
    """Base of the errors Microstep raises with an explanation and a fix."""


class ConfigError(MicrostepError, ValueError):
    """An invalid config. ``problems`` holds one line per problem:
    ``<source>[:line]: <key.path>: <problem>``."""

    def __init__(self, problems):
        # A str (also what unpickling passes back) is split into its lines.
        self.problems = problems.splitlines() if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class BatchConfigError(MicrostepError, ValueError):
    """The batch numbers cannot form a valid plan."""


class BatchError(MicrostepError, ValueError):
    """A batch cannot be split: no tensors, or tensors that disagree on the batch size."""


class EngineUsageError(MicrostepError, RuntimeError):
    """The engine was driven in an order it cannot honour (e.g. ``step`` without ``backward``)."""


class CheckpointError(MicrostepError, RuntimeError):
    """A checkpoint cannot be written or read: incomplete, corrupt, or not this run's."""


class NonFiniteGradientError(MicrostepError, FloatingPointError):
    """A window's gradient held an inf or nan and ``faults.non_finite_gradient: raise`` was set.
    Raised on every rank at the same boundary; the weights, the optimizer and the scheduler are
    as before the window."""


class RankDisagreementError(EngineUsageError):
    """The ranks are not in the same window or micro-step (a rank's data ran out sooner, or it
    skipped a window or a micro-step): their collectives would pair different windows. Raised on
    every rank, naming each rank's position."""


class PeerLostError(MicrostepError, RuntimeError):
    """A peer rank never joined an agreement (a checkpoint's, the stop-signal check at a
    boundary) within ``distributed.agreement_timeout_seconds``: it died, or is stuck."""


class DistributedEnvError(MicrostepError, RuntimeError):
    """The launch environment is incomplete or inconsistent."""


class UnsupportedFrameworkError(MicrostepError, RuntimeError):
    """An installed framework (torch, DeepSpeed) is a version Microstep cannot run on: older
    than supported, outside DeepSpeed's fence, or lacking an internal Microstep relies on."""


class UntestedFrameworkWarning(UserWarning):
    """An installed torch is newer than Microstep was tested with, and has every internal it
    uses: training goes on (filter it with ``warnings.filterwarnings``)."""


class OutOfMemoryAtMicroBatchOne(MicrostepError, RuntimeError):
    """Even one sample per micro-batch does not fit."""


class PeerError(MicrostepError, RuntimeError):
    """Another rank failed in this window; this rank stops with it instead of waiting.

    ``failures``: {rank: what it reported} (``collectives.OUT_OF_MEMORY``,
    ``collectives.MEMORY_LIMIT`` or ``collectives.OTHER_ERROR``), the same on every rank."""

    def __init__(self, failures: dict[int, int], message: str | None = None):
        super().__init__(message or f"rank(s) {', '.join(map(str, failures))} failed in this window")
        self.failures = failures

    def __reduce__(self):  # picklable with its failures (it crosses process boundaries in tests)
        return type(self), (self.failures, str(self))
