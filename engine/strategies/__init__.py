"""Choosing the strategy: ``backend`` and ``zero_optimization.stage`` decide."""

from __future__ import annotations

import logging

import torch

from engine.precision import Precision
from engine.strategies.base import StepResult, Strategy, TorchStrategy

log = logging.getLogger("engine")

__all__ = ["make_strategy", "Strategy", "StepResult", "TorchStrategy"]


def make_strategy(config) -> tuple[Strategy, int, int]:
    """The strategy for ``config`` in this process, with the data-parallel world size and rank."""
    from engine.strategies.single import SingleProcess

    device = torch.device("cpu")
    precision = Precision(config, device.type)
    if config.zero_optimization.stage > 0:
        log.info("ZeRO stage %d has nothing to shard in a single process; running unsharded",
                 config.zero_optimization.stage)
    return SingleProcess(precision, device), 1, 0
