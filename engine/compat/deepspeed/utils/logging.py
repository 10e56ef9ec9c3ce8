"""``from deepspeed.utils.logging import logger, log_dist``: Microstep's ``engine`` logger."""
from __future__ import annotations

import logging

from engine.distributed.process_group import get_rank

__all__ = ["logger", "log_dist"]

logger = logging.getLogger("engine")


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks listed (None or containing -1: every rank)."""
    if ranks is None or -1 in ranks or get_rank() in ranks:
        logger.log(level, "[Rank %d] %s", get_rank(), message)
