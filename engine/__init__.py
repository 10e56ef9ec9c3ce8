"""Microstep: a config-first PyTorch training engine with exact gradient accumulation."""

from engine.autotune import OutOfMemoryAtMicroBatchOne
from engine.batch_plan import BatchConfigError, BatchPlan, plan_from_config, resolve_batch_plan
from engine.build import initialize
from engine.checkpoint import CheckpointError
from engine.config import Config, ConfigError, load_config
from engine.data import DistributedBatches
from engine.distributed import init_distributed, strip_local_rank_arg
from engine.engine import Engine, EngineUsageError
from engine.microbatch import BatchError

__all__ = [
    "initialize",
    "Engine",
    "Config",
    "ConfigError",
    "load_config",
    "BatchPlan",
    "BatchConfigError",
    "resolve_batch_plan",
    "plan_from_config",
    "DistributedBatches",
    "init_distributed",
    "strip_local_rank_arg",
    "EngineUsageError",
    "BatchError",
    "CheckpointError",
    "OutOfMemoryAtMicroBatchOne",
]
