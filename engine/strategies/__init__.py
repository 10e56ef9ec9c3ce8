"""Choosing the strategy: ``backend`` and ``zero_optimization.stage`` decide."""

from __future__ import annotations

import logging

from engine.distributed import init_distributed
from engine.precision import Precision
from engine.strategies.base import StepResult, Strategy, TorchStrategy

log = logging.getLogger("engine")

__all__ = ["make_strategy", "Strategy", "StepResult", "TorchStrategy"]


def make_strategy(config) -> tuple[Strategy, int, int]:
    """The strategy for ``config`` in this process (joining the process group that the
    launcher's environment describes), with the data-parallel world size and rank."""
    info = init_distributed(config.distributed.timeout_seconds, config.distributed.backend)
    if config.backend == "deepspeed":
        from engine.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(config, info.device, info.world_size, info.rank), info.world_size, info.rank
    precision = Precision(config, info.device.type)
    stage = config.zero_optimization.stage
    if info.world_size == 1:
        from engine.strategies.single import SingleProcess

        if stage > 0:
            log.info("ZeRO stage %d has nothing to shard in a single process; running unsharded", stage)
        strategy = SingleProcess(precision, info.device)
    elif stage == 0:
        from engine.strategies.ddp import DataParallel

        strategy = DataParallel(precision, info.device)
    elif stage == 1:
        from engine.strategies.zero1 import ShardedOptimizerDataParallel

        strategy = ShardedOptimizerDataParallel(precision, info.device)
    else:
        from engine.strategies.fsdp import FullyShardedDataParallel

        strategy = FullyShardedDataParallel(precision, info.device, stage=stage,
                                            reduce_every_micro_step=config.zero_optimization.reduce_every_micro_step)
    return strategy, info.world_size, info.rank
