"""``zero_optimization.defer_reduction`` at ZeRO stages 2/3: reduce gradients into shards
after every micro-step (ZeRO memory, the default), or hold full-size local gradients for the
whole window and reduce once at its end (less traffic, more memory).

``"auto"`` starts every run reducing per micro-step and, at each window's end, predicts the
peak the next window would have if it deferred: the measured peak plus the full-size
gradient (and, at stage 3, the parameters deferral keeps gathered). It defers while that
prediction fits the memory limit and stops as soon as a deferred window's measured peak does
not. A window in which the optimizer created state (the first, for most optimizers) is not
used: its peak lacks that state. The limit is ``auto_memory_limit``, else the device's memory
on CUDA; on CPU without a configured limit nothing is known, so it keeps ZeRO memory. Ranks decide together (the
largest prediction counts) and rank 0 logs every decision with its numbers.
"""

from __future__ import annotations

import logging

import torch

from engine.memory import device_memory_bytes, format_bytes, held_bytes, memory_limit_bytes

log = logging.getLogger("engine")


class ReductionDeferral:
    def __init__(self, setting, strategy, *, extra_bytes: int, memory_limit: float | None):
        self.setting = setting
        self.strategy = strategy
        self.extra_bytes = extra_bytes  # what deferring adds to a window's peak
        self.deferring = setting is True
        self.limit = memory_limit_bytes(memory_limit, strategy.device)
        if self.limit is None and strategy.device.type == "cuda":
            self.limit = device_memory_bytes(strategy.device)
        if setting == "auto" and self.limit is None and strategy.rank == 0:
            log.info("defer_reduction: auto keeps reducing after every micro-step: no memory limit is "
                     "known on %s (set auto_memory_limit to let it defer when that fits)", strategy.device.type)
        self._start_measuring()

    def observe(self) -> None:
        """After each backward: on CPU under "auto", what is held now counts toward the peak."""
        if self.setting == "auto" and self.limit is not None and self.strategy.device.type != "cuda":
            self._cpu_peak = max(self._cpu_peak, held_bytes(self.strategy))

    def review(self) -> None:
        """At a window's end (every rank): measure, and decide whether the next window defers."""
        if self.setting != "auto" or self.limit is None:
            return
        if self._optimizer_state_size() != self._state_at_start:
            self._start_measuring()  # the optimizer just created state: measure the next window
            return
        peak = self._measured_peak()
        predicted = peak if self.deferring else peak + self.extra_bytes
        if self.strategy.world_size > 1:  # the fullest rank decides for all
            predicted = int(self.strategy.all_reduce_max(
                torch.tensor(predicted, dtype=torch.int64, device=self.strategy.device)))
        defer = predicted <= self.limit
        if defer != self.deferring and self.strategy.rank == 0:
            if defer:
                log.info("defer_reduction: auto: deferring gradient reduction to the window's end (peak %s "
                         "+ full-size gradient %s = %s fits the limit %s)", format_bytes(peak), format_bytes(self.extra_bytes),
                         format_bytes(predicted), format_bytes(self.limit))
            else:
                log.info("defer_reduction: auto: reducing after every micro-step (ZeRO memory): the %s "
                         "predicted with deferral exceeds the limit %s", format_bytes(predicted), format_bytes(self.limit))
        self.deferring = defer
        self._start_measuring()

    def _optimizer_state_size(self) -> int:
        return sum(len(state) for state in self.strategy.optimizer.state.values())

    def _start_measuring(self) -> None:
        self._cpu_peak = 0
        self._state_at_start = self._optimizer_state_size()
        if self.setting == "auto" and self.strategy.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.strategy.device)

    def _measured_peak(self) -> int:
        """CUDA: the allocator's peak over the window. CPU: the most bytes held after any of
        its backwards (``engine.memory.held_bytes``; activations are not counted)."""
        if self.strategy.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.strategy.device)
        return self._cpu_peak
