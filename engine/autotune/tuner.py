"""Automatic micro-batch size: ``auto`` (out-of-memory adaptive) and ``explore`` (measured).

Changing the micro-batch size never changes the training: the global batch and the exact
weighting stay, only the accumulation steps change.

``auto`` starts at the per-device batch (or ``auto_max``). When a forward or backward runs
out of memory, or a micro-step's measured peak exceeds ``auto_memory_limit``, the window is
discarded and re-run with the next smaller size. Ranks agree on every failure before anyone
continues, including when only one rank fails, in its forward or its backward:

* the strategy's failure guard (``Strategy.enable_failure_guard``) puts a check of the
  peers' flags before every collective a window issues and defers the gradient reduction
  until after the window;
* a rank that fails votes once (``agree_on_failures``): its vote answers whichever check
  its peers reach next, or their end-of-window vote. Nobody is ever left waiting in a
  collective the failed rank will not join.

``explore`` measures every candidate size on the first batch (forward and backward of a
whole window, warm-up then timed, gradients discarded, model and RNG restored), keeps the
fastest one that fits, then behaves like ``auto``.

With ``micro_batch_tokens`` the same machinery moves the token budget instead of the micro
size (``TokenBudget``): out-of-memory halves the largest micro-batch of two or more rows on
any rank, and ``explore`` measures the budget halved while it still holds the longest row.

Under a pipeline (``auto`` only) an attempt is one run of the stages' order (``engine.window.stages``,
handed in as ``stages``), guarded whole by the executor: a stage that fails stands in for the
rest of the schedule and raises after the window's collectives
(``engine.strategies.stage_failures``), then the vote above decides; sizes are limited to
those whose number of micro-batches the schedule runs.

With ``activation_checkpointing: auto`` checkpointing is a second lever (the holder's
``capabilities().checkpoint_switch``, flipped between windows): ``explore`` measures every candidate with it
off and on and keeps the fastest pair that fits; ``auto`` walks down the ladder (size, off) ->
(size, on) -> (next smaller size, off) -> ... Every rank flips it at the same agreed point, so
the choice is the same everywhere.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from engine.distributed.collectives import MEMORY_LIMIT, OTHER_ERROR, OUT_OF_MEMORY, max_over_ranks
from engine.errors import ConfigError, OutOfMemoryAtMicroBatchOne, PeerError
from engine.memory import PeakMeter, memory_limit_bytes
from engine.batching.token_budget import budget_candidates

log = logging.getLogger("engine")

_OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "can't allocate memory",
                 "Failed to allocate", "DefaultCPUAllocator: not enough memory")
MAX_CANDIDATES = 12
_REASONS = {OUT_OF_MEMORY: "out of memory", MEMORY_LIMIT: "memory limit exceeded"}


class MemoryLimitExceeded(RuntimeError):
    """A micro-step's measured peak memory exceeded ``auto_memory_limit``."""


class WindowFailed(Exception):
    """Some rank failed in this window attempt; every rank raises it after the agreement."""

    def __init__(self, ranks: tuple[int, ...], reason: str):
        super().__init__(f"{reason} on rank(s) {', '.join(map(str, ranks))}")
        self.ranks = ranks
        self.reason = reason


def is_out_of_memory(error: BaseException) -> bool:
    """``torch.OutOfMemoryError``, a memory-limit breach, or an allocator's out-of-memory."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryLimitExceeded)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OOM_MESSAGES)


def _release_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Candidate:
    """One measured micro-batch size (or token budget)."""

    micro_batch_size: int  # with a token budget: the cap on rows per micro-batch
    accumulation_steps: int  # micro-steps per window (with a token budget: as the ranks agreed)
    fits: bool
    samples_per_second: float | None = None
    peak_memory_bytes: int | None = None
    relative_speed: float | None = None
    recommended: bool = False
    micro_batch_tokens: int | None = None
    checkpointing: bool | None = None  # activation checkpointing on / off (None: not a lever, not auto)


class MicroSize:
    """What auto / explore move by default: the micro-batch size."""

    name = "micro-batch size"
    eval_attribute = "eval_micro_batch_size"
    smallest = "micro-batch size 1"

    def value(self, plan) -> int:
        return plan.train_micro_batch_size_per_gpu

    def with_value(self, plan, value: int):
        return plan.with_micro_batch_size(value)

    def smaller(self, engine) -> int | None:
        """The next size after the plan's failed in training."""
        return engine.plan.next_smaller_micro_size()

    def smaller_for_eval(self, engine, value: int) -> int | None:
        return value // 2 or None

    def candidates(self, engine, batch) -> list[int]:
        plan = engine.plan
        return _thin(_capped(plan.candidate_micro_sizes(), plan))

    def planned_micro_steps(self, engine) -> int:
        return engine.plan.gradient_accumulation_steps

    def consequence(self, old, new) -> str:
        return f"accumulation steps {old.gradient_accumulation_steps} -> {new.gradient_accumulation_steps}, "


class TokenBudget:
    """What auto / explore move when micro-batches are formed by tokens: the budget. Its
    smaller values are agreed over ranks (every rank calls these after an agreed failure)."""

    name = "micro_batch_tokens"
    eval_attribute = "eval_micro_batch_tokens"
    smallest = "one sequence per micro-batch"

    def value(self, plan) -> int:
        return plan.micro_batch_tokens

    def with_value(self, plan, value: int):
        return plan.with_micro_batch_tokens(value)

    def smaller(self, engine) -> int | None:
        """Half the largest micro-batch of two or more rows that any rank just ran."""
        return max_over_ranks([engine.window_split.smaller_budget()])[0] or None

    def smaller_for_eval(self, engine, value: int) -> int | None:
        """As in training: from the micro-batches the failed evaluation ran (within ``value``)."""
        return self.smaller(engine)

    def candidates(self, engine, batch) -> list[int]:
        longest = engine.window_split.longest_row(batch, engine.plan)  # 0 when unreadable: the split says why
        return budget_candidates(engine.plan.micro_batch_tokens, max_over_ranks([longest])[0])[-MAX_CANDIDATES:]

    def planned_micro_steps(self, engine) -> int:
        return engine.window_split.micro_steps

    def consequence(self, old, new) -> str:
        return "micro-steps follow from the lengths, "


class MicroBatchTuner:
    """The ``auto`` / ``explore`` behaviour of one engine (``eng.micro_batch_tuner``), which
    ``engine.initialize`` builds the engine with when the plan's micro size is automatic: it retries the
    executor's windows (``engine.engine.MicroSizeTuner``)."""

    clock = staticmethod(time.perf_counter)  # what explore times candidate sizes with (seconds); set per instance

    def __init__(self, strategy, plan, *, memory_limit: float | None = None, warmup: int = 1, repeats: int = 2,
                 stages=None):
        self.strategy = strategy
        # A pipeline's windows (engine.window.stages): its schedule runs some numbers of micro-batches only.
        self.stages = stages
        if self._runnable(plan) is None:
            raise ConfigError([
                f"train_micro_batch_size_per_gpu: 'auto': no micro-batch size of at most "
                f"{plan.train_micro_batch_size_per_gpu} gives a number of micro-batches the pipeline schedule runs; "
                "give a larger per-device batch, or use pipeline.schedule gpipe"])
        self.meter = PeakMeter(strategy)
        self.limit = memory_limit_bytes(memory_limit, self.meter.device)
        self.warmup, self.repeats = warmup, repeats
        self.pending_explore = plan.micro_batch_mode == "explore"
        self.knob = TokenBudget() if plan.micro_batch_tokens is not None else MicroSize()
        self.eval_micro_batch_size: int | None = None
        self.eval_micro_batch_tokens: int | None = None
        self.changes: list[dict] = []  # every size change: step, old, new, ranks, reason
        self.explored: list[Candidate] = []
        self.last_memory_error = ""  # this rank's last out-of-memory message, for the error at the smallest size
        self.switch = strategy.capabilities().checkpoint_switch  # activation_checkpointing: auto (else None)
        strategy.enable_failure_guard()

    @property
    def checkpointing(self) -> bool | None:
        """Whether the model's blocks checkpoint now; None when that is not the tuner's choice."""
        return None if self.switch is None else self.switch.on

    def state_dict(self) -> dict:
        """What a checkpoint keeps (the current size itself lives in the plan)."""
        return {"pending_explore": self.pending_explore, "changes": list(self.changes),
                "eval_micro_batch_size": self.eval_micro_batch_size,
                "eval_micro_batch_tokens": self.eval_micro_batch_tokens, "checkpointing": self.checkpointing}

    def load_state_dict(self, state: dict) -> None:
        self.pending_explore = state["pending_explore"]
        self.changes = list(state["changes"])
        self.eval_micro_batch_size = state["eval_micro_batch_size"]
        self.eval_micro_batch_tokens = state.get("eval_micro_batch_tokens")
        if self.switch is not None:  # a run saved before checkpointing was a lever, or without it: off
            self.switch.on = bool(state.get("checkpointing"))

    # -- training -----------------------------------------------------------------------
    def retry_window(self, eng, batch, loss_fn) -> None:
        """Forward and backward of a whole window, shrinking the micro size until it fits."""
        if self.pending_explore:
            self.explore(eng, batch, loss_fn)
        self._fit_windows(eng)
        metered = self._metered(loss_fn)
        while True:
            try:
                self._attempt(eng, batch, metered)
                return
            except WindowFailed as failure:
                eng.discard_window()
                self._next_lever(eng, failure)

    def retry_eval(self, eng, batch, loss_fn) -> float:
        knob = self.knob
        value = getattr(self, knob.eval_attribute) or knob.value(eng.plan)
        while True:
            try:
                loss = self._evaluate(eng, batch, loss_fn, value)
            except WindowFailed as failure:
                eng.discard_window()
                smaller = knob.smaller_for_eval(eng, value)
                if smaller is None:
                    raise self._too_large(eng, failure) from None
                log.warning("eval %s %d -> %d after %s", knob.name, value, smaller, failure)
                value = smaller
                continue
            setattr(self, knob.eval_attribute, value)
            return loss

    def _attempt(self, eng, batch, loss_fn) -> None:
        eng.executor.run_window(batch, loss_fn, eng.plan)  # its micro-steps guarded by this tuner

    def _evaluate(self, eng, batch, loss_fn, value: int) -> float:
        return eng.executor.evaluate(batch, loss_fn, eng.plan, value)

    def _fit_windows(self, eng) -> None:
        """A plan whose windows ``self.stages`` runs (a pipeline schedule's rule on its number
        of micro-batches): the largest micro size at most the plan's (one exists: checked at
        construction, and every size the tuner moves to is one)."""
        old = eng.plan
        plan = self._runnable(old)
        if plan != old:
            eng.replan(plan)
            self._record(eng, old, plan, "a number of micro-batches the pipeline schedule runs")

    def _runnable(self, plan):
        """``plan``, or the next smaller micro size whose windows ``self.stages`` runs; None if none."""
        while self.stages is not None and not self.stages.runs(plan):
            smaller = plan.next_smaller_micro_size()
            if smaller is None:
                return None
            plan = plan.with_micro_batch_size(smaller)
        return plan

    # -- the agreement --------------------------------------------------------------------
    def guard(self, work) -> None:
        """Run ``work`` (no collectives of its own besides
        guarded ones) and vote: raises WindowFailed on every rank when any rank ran out of
        memory. Any other error is voted too, so the peers stop with PeerError instead of
        waiting, and is re-raised here."""
        failure = 0
        try:
            work()
        except PeerError as peer:
            self._raise_for(peer.failures)
        except BaseException as error:
            if not isinstance(error, Exception) or not is_out_of_memory(error):
                self.strategy.agree_on_failures(OTHER_ERROR)
                raise
            failure = MEMORY_LIMIT if isinstance(error, MemoryLimitExceeded) else OUT_OF_MEMORY
            message = str(error).strip()
            self.last_memory_error = message.splitlines()[0][:300] if message else _REASONS[failure]
        if failure:  # outside the except block: the traceback's activations are freed
            _release_memory()
        failures = self.strategy.agree_on_failures(failure)
        if failures:
            self._raise_for(failures)

    @staticmethod
    def _raise_for(failures: dict[int, int]):
        """WindowFailed with a reason every rank words alike (from the votes), or PeerError."""
        broken = [rank for rank, failure in failures.items() if failure == OTHER_ERROR]
        if broken:
            raise PeerError(failures, f"rank(s) {', '.join(map(str, broken))} stopped with an error in this "
                                      "window (see that rank's traceback); this rank stops too") from None
        reason = _REASONS[MEMORY_LIMIT] if set(failures.values()) == {MEMORY_LIMIT} else _REASONS[OUT_OF_MEMORY]
        raise WindowFailed(tuple(failures), reason) from None

    def _metered(self, loss_fn, *, track_peak: bool = False):
        """``loss_fn`` measuring each micro-step's peak memory when there is a limit to
        enforce (raising MemoryLimitExceeded) or a peak to report (``self.window_peak``)."""
        if self.limit is None and not track_peak:
            return loss_fn
        self.window_peak = 0

        def metered(model, micro_batch):
            self.meter.start()
            with self.meter.forward():
                output = loss_fn(model, micro_batch)
            peak = self.meter.peak
            self.window_peak = max(self.window_peak, peak)
            if self.limit is not None and peak > self.limit:
                raise MemoryLimitExceeded(
                    f"micro-step peak memory {peak / 2**20:.1f} MiB exceeds "
                    f"auto_memory_limit {self.limit / 2**20:.1f} MiB")
            return output

        return metered

    def _next_lever(self, eng, failure: WindowFailed) -> None:
        """After a failed window: checkpointing on at the same size when it is off and a lever,
        else the next smaller size (with checkpointing off again: at a size, off is faster)."""
        if self.switch is not None and not self.switch.on:
            self.switch.on = True
            self._record(eng, eng.plan, eng.plan, failure.reason, failure.ranks, checkpointing_was=False)
            return
        self._shrink(eng, failure)

    def _shrink(self, eng, failure: WindowFailed) -> None:
        knob = self.knob
        old, was = eng.plan, self.checkpointing
        smaller = knob.smaller(eng)
        new = None if smaller is None else self._runnable(knob.with_value(old, smaller))
        if new is None:
            raise self._too_large(eng, failure) from None
        eng.replan(new)
        if self.switch is not None:
            self.switch.on = False
        self._record(eng, old, eng.plan, failure.reason, failure.ranks, checkpointing_was=was)

    def _record(self, eng, old, new, reason: str, ranks=(), checkpointing_was: bool | None = None) -> None:
        step, knob, now = eng.global_steps + 1, self.knob, self.checkpointing
        change = {"global_step": step, "old": knob.value(old), "new": knob.value(new),
                  "ranks": list(ranks), "reason": reason}
        if now is not None:
            change["checkpointing"] = now
        self.changes.append(change)
        where = f" on rank(s) {', '.join(map(str, ranks))}" if ranks else ""
        resized = knob.value(old) != knob.value(new)
        what = f"{knob.name} {knob.value(old)} -> {knob.value(new)}" if resized else f"{knob.name} {knob.value(new)} kept"
        if now is not None and now != checkpointing_was:
            what += f", activation checkpointing {'on' if now else 'off'}"
        consequence = knob.consequence(old, new) if resized else ""
        log.warning("%s (%s%s, global step %d); %sglobal batch %d unchanged", what, reason, where, step,
                    consequence, new.train_batch_size)

    def _too_large(self, eng, failure: WindowFailed) -> OutOfMemoryAtMicroBatchOne:
        here = f" (this rank's last error: {self.last_memory_error})" if self.last_memory_error else ""
        checkpointed = " and activation checkpointing" if self.checkpointing else ""
        return OutOfMemoryAtMicroBatchOne(
            f"{failure.reason} on rank(s) {', '.join(map(str, failure.ranks))} even with {self.knob.smallest}{checkpointed} "
            f"(global step {eng.global_steps + 1}): one sample does not fit{here}. Use a higher "
            "zero_optimization.stage, bf16/fp16, shorter sequences, a smaller model, or raise auto_memory_limit"
        )

    # -- explore --------------------------------------------------------------------------
    def explore(self, eng, batch, loss_fn) -> list[Candidate]:
        """Measure the candidate micro sizes of engine ``eng`` on ``batch`` (each with
        checkpointing off and on when it is a lever) and switch to the fastest that fits.
        Parameters, buffers, optimizer state and RNG are left as they were."""
        knob = self.knob
        start, started_with = eng.plan, self.checkpointing
        snapshot = _Snapshot(eng.module)
        rows = []
        series = [False, True] if self.switch is not None else [None]  # checkpointing off, on
        try:
            for value in knob.candidates(eng, batch):
                eng.replan(knob.with_value(start, value))
                for checkpointing in list(series):
                    self._switch_to(checkpointing)
                    rows.append(self._measure(eng, batch, loss_fn))
                    if not rows[-1].fits:
                        series.remove(checkpointing)  # larger sizes need more memory still
                if not series:
                    break
        finally:
            eng.replan(start)
            self._switch_to(started_with)
            snapshot.restore()
        self.pending_explore = False
        fitting = [row for row in rows if row.fits]
        if not fitting:
            raise self._too_large(eng, WindowFailed((eng.rank,), "out of memory")) from None
        baseline = fitting[0].samples_per_second
        for row in fitting:
            row.relative_speed = row.samples_per_second / baseline
        best = max(fitting, key=lambda row: row.samples_per_second)
        best.recommended = True
        self.explored = rows
        chosen = knob.with_value(start, best.micro_batch_tokens or best.micro_batch_size)
        if chosen != start or best.checkpointing != started_with:
            eng.replan(chosen)
            self._switch_to(best.checkpointing)
            self._record(eng, start, eng.plan, "explore: fastest that fits", checkpointing_was=started_with)
        return rows

    def _switch_to(self, checkpointing: bool | None) -> None:
        if self.switch is not None:
            self.switch.on = checkpointing

    def _measure(self, eng, batch, loss_fn) -> Candidate:
        plan = eng.plan
        metered = self._metered(loss_fn, track_peak=True)
        seconds = []
        for attempt in range(self.warmup + self.repeats):
            began = self.clock()
            try:
                eng.executor.run_window(batch, metered, eng.plan)
            except WindowFailed:
                eng.discard_window()
                return Candidate(plan.train_micro_batch_size_per_gpu, self.knob.planned_micro_steps(eng), fits=False,
                                 micro_batch_tokens=plan.micro_batch_tokens, checkpointing=self.checkpointing)
            elapsed = self.clock() - began
            eng.discard_window()
            if attempt >= self.warmup:
                seconds.append(elapsed)
        # The slowest rank sets the pace; the fullest rank's peak is reported.
        stats = eng.strategy.all_reduce_max(torch.tensor([statistics.median(seconds), float(self.window_peak)],
                                                         dtype=torch.float64, device=self.meter.device))
        return Candidate(plan.train_micro_batch_size_per_gpu, self.knob.planned_micro_steps(eng), fits=True,
                         samples_per_second=plan.train_batch_size / float(stats[0]),
                         peak_memory_bytes=int(stats[1]), micro_batch_tokens=plan.micro_batch_tokens,
                         checkpointing=self.checkpointing)


def _capped(sizes: tuple[int, ...], plan) -> list[int]:
    """Candidates no larger than the starting size (which ``auto_max`` already capped)."""
    return [s for s in sizes if s <= plan.train_micro_batch_size_per_gpu]


def _thin(sizes: list[int]) -> list[int]:
    """At most MAX_CANDIDATES sizes: all of them, or powers of two plus the largest."""
    if len(sizes) <= MAX_CANDIDATES:
        return sizes
    largest = sizes[-1]
    keep = {s for s in sizes if s & (s - 1) == 0} | {largest}
    return sorted(keep)[-MAX_CANDIDATES:]


class _Snapshot:
    """Buffers (e.g. BatchNorm statistics) and RNG state, restored after exploring."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self) -> None:
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                buffer.copy_(self.buffers[name])
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
