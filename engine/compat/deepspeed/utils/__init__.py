"""``deepspeed.utils``: ``logger``, ``log_dist`` and ``RepeatingLoader`` as DeepSpeed's scripts
use them; ``logging`` (the same ``logger``), ``timer`` (``ThroughputTimer``); ``zero_to_fp32``
consolidates a sharded checkpoint into one state dict."""
from __future__ import annotations

from engine.compat.deepspeed.utils.logging import log_dist, logger
from engine.compat.deepspeed.utils.timer import ThroughputTimer

__all__ = ["logger", "log_dist", "RepeatingLoader", "ThroughputTimer"]


class RepeatingLoader:
    """Iterates ``loader`` over and over: a new pass starts where the last one ended."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
