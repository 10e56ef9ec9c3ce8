"""DeepSpeed's ``model_engine.tput_timer``: :class:`ThroughputTimer`, the training throughput
the engine measures. The engine starts it at each training forward and stops it at each
``step()``; scripts call ``update_epoch_count()`` at the end of an epoch and read
``avg_samples_per_sec()``."""
from __future__ import annotations

import time

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """Wall time of the micro-steps (forward to ``step()``), counted from the ``start_step``-th
    optimizer step on (the first ones include start-up work)."""

    def __init__(self, batch_size: int | None, start_step: int = 2):
        self.batch_size = batch_size  # the global batch of one optimizer step
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0  # in this epoch
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # seconds, over the steps counted
        self.step_elapsed_time = 0.0  # seconds, in the optimizer step under way
        self.start_time: float | None = None

    def update_epoch_count(self) -> None:
        """An epoch has ended."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if self.start_time is None:
            self.start_time = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """A micro-step has ended; ``global_step``: it closed a window (an optimizer step)."""
        if self.start_time is None:
            return
        self.step_elapsed_time += time.perf_counter() - self.start_time
        self.start_time = None
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
            if self.global_step_count > self.start_step:
                self.total_elapsed_time += self.step_elapsed_time
            self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Global samples per second over the optimizer steps after ``start_step`` (0.0 before any)."""
        counted = self.global_step_count - self.start_step
        if counted <= 0 or not self.batch_size or self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size * counted / self.total_elapsed_time
