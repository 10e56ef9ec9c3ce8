"""Choosing the strategy: ``backend`` and ``zero_optimization.stage`` decide."""

from __future__ import annotations

import logging

from engine.config.offload import torch_offload
from engine.dist.process_group import DistInfo

log = logging.getLogger("engine")

__all__ = ["make_strategy"]


def make_strategy(config, dist_info: DistInfo):
    """The strategy for ``config`` on the process group ``dist_info`` describes (imported
    lazily: ``import engine`` never imports DeepSpeed or FSDP). CPU offload needs FSDP2,
    even in one process."""
    stage = config.zero_optimization.stage
    if config.backend == "deepspeed":
        from engine.strategies.deepspeed import DeepSpeedStrategy as chosen
    elif dist_info.world_size == 1 and not torch_offload(config.zero_optimization).to_host:
        from engine.strategies.single import SingleProcess as chosen

        if stage > 0:
            log.info("ZeRO stage %d has nothing to shard in a single process; running unsharded", stage)
    elif stage == 0:
        from engine.strategies.ddp import DataParallel as chosen
    elif stage == 1:
        from engine.strategies.zero1 import ShardedOptimizerDataParallel as chosen
    else:
        from engine.strategies.fsdp import FullyShardedDataParallel as chosen
    return chosen(config, dist_info)
