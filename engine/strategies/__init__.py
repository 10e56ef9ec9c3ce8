"""The strategy a resolved ``engine.setup.Setup`` names, built on the joined process group."""

from __future__ import annotations

import logging

from engine.distributed.process_group import DistInfo
from engine.setup import Setup

log = logging.getLogger("engine")

__all__ = ["make_strategy"]


def make_strategy(setup: Setup, dist_info: DistInfo):
    """The strategy ``setup.strategy`` names (imported lazily: ``import engine`` never imports
    DeepSpeed or FSDP)."""
    if setup.strategy == "single" and setup.stage > 0:
        log.info("ZeRO stage %d has nothing to shard in a single process; running unsharded", setup.stage)
    if setup.strategy == "deepspeed":
        from engine.strategies.deepspeed import DeepSpeedStrategy as chosen
    elif setup.strategy in ("single", "ddp") and setup.precision.low_precision_parameters:
        from engine.strategies.low_precision import LowPrecisionReplicas as chosen
    elif setup.strategy == "zero1" and setup.precision.low_precision_parameters:
        from engine.strategies.low_precision import LowPrecisionShardedOptimizer as chosen
    elif setup.strategy == "single":
        from engine.strategies.single import SingleProcess as chosen
    elif setup.strategy == "pipeline":
        from engine.strategies.pipeline import PipelineParallel as chosen
    elif setup.strategy == "pipeline_fsdp":
        from engine.strategies.pipeline import ShardedPipelineParallel as chosen
    elif setup.strategy == "tensor_pipeline":
        from engine.strategies.tensor_pipeline import TensorPipelineParallel as chosen
    elif setup.strategy == "tensor_pipeline_fsdp":
        from engine.strategies.tensor_pipeline import ShardedTensorPipelineParallel as chosen
    elif setup.strategy == "ddp":
        from engine.strategies.ddp import DataParallel as chosen
    elif setup.strategy == "tensor":
        from engine.strategies.tensor_parallel import TensorParallel as chosen
    elif setup.strategy == "tensor_zero1":
        from engine.strategies.tensor_parallel import TensorParallelZero1 as chosen
    elif setup.strategy == "tensor_fsdp":
        from engine.strategies.tensor_parallel import TensorFullySharded as chosen
    elif setup.strategy == "zero1":
        from engine.strategies.zero1 import ShardedOptimizerDataParallel as chosen
    else:
        from engine.strategies.fsdp import FullyShardedDataParallel as chosen
    return chosen(setup, dist_info)
