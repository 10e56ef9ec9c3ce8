"""``deepspeed.utils``: ``logger``, ``log_dist`` and ``RepeatingLoader`` as DeepSpeed's scripts
use them; ``zero_to_fp32`` consolidates a sharded checkpoint into one state dict."""
from __future__ import annotations

import logging

from engine.distributed.process_group import get_rank

__all__ = ["logger", "log_dist", "RepeatingLoader"]

logger = logging.getLogger("engine")


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks listed (None or containing -1: every rank)."""
    if ranks is None or -1 in ranks or get_rank() in ranks:
        logger.log(level, "[Rank %d] %s", get_rank(), message)


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
