"""Microstep: a config-first PyTorch training engine with exact gradient accumulation."""

from engine.batching.plan import BatchPlan, plan_from_config, resolve_batch_plan
from engine.build import initialize
from engine.config.schema import Config, load_config
from engine.batching.data import DistributedBatches
from engine.batching.micro_batches import MicroBatches
from engine.distributed.process_group import init_distributed, strip_local_rank_arg
from engine.engine import Engine
from engine.experts import LoadBalancingLoss
from engine.losses import loss_on_outputs
from engine.errors import (
    BatchConfigError, BatchError, CheckpointError, ConfigError, EngineUsageError, MicrostepError,
    NonFiniteGradientError, OutOfMemoryAtMicroBatchOne, PeerError, PeerLostError, RankDisagreementError,
    UntestedFrameworkWarning,
)
from engine.state.preemption import Preempted
from engine.verify import VerifyError, VerifyResult, verify
from engine.distributed.error_report import install_from_environment

install_from_environment()  # under `python -m launch`: a Microstep error is said once, by the launcher

__all__ = [
    "initialize",
    "Engine",
    "loss_on_outputs",
    "LoadBalancingLoss",
    "Config",
    "ConfigError",
    "load_config",
    "BatchPlan",
    "BatchConfigError",
    "resolve_batch_plan",
    "plan_from_config",
    "DistributedBatches",
    "MicroBatches",
    "init_distributed",
    "strip_local_rank_arg",
    "MicrostepError",
    "EngineUsageError",
    "BatchError",
    "CheckpointError",
    "OutOfMemoryAtMicroBatchOne",
    "PeerError",
    "PeerLostError",
    "NonFiniteGradientError",
    "RankDisagreementError",
    "UntestedFrameworkWarning",
    "Preempted",
    "verify",
    "VerifyResult",
    "VerifyError",
]
