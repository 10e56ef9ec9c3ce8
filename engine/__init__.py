"""Microstep: a config-first PyTorch training engine with exact gradient accumulation.

The errors are imported at once; every other public name is imported on first use (PEP 562
``__getattr__``), so ``python -m engine validate`` does not load torch.distributed.tensor and
the whole engine to check a config. ``engine.X`` and ``from engine import X`` work as before.
"""

import importlib
import sys
import types

from engine.errors import (
    BatchConfigError, BatchError, CheckpointError, ConfigError, EngineUsageError, MicrostepError,
    NonFiniteGradientError, OutOfMemoryAtMicroBatchOne, PeerError, PeerLostError, RankDisagreementError,
    UntestedFrameworkWarning,
)
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

# public name -> the module that defines it, imported when the name is first read
_LAZY_EXPORTS = {
    "initialize": "engine.build",
    "Engine": "engine.engine",
    "loss_on_outputs": "engine.losses",
    "LoadBalancingLoss": "engine.experts",
    "Config": "engine.config.schema",
    "load_config": "engine.config.schema",
    "BatchPlan": "engine.batching.plan",
    "resolve_batch_plan": "engine.batching.plan",
    "plan_from_config": "engine.batching.plan",
    "DistributedBatches": "engine.batching.data",
    "MicroBatches": "engine.batching.micro_batches",
    "init_distributed": "engine.distributed.process_group",
    "strip_local_rank_arg": "engine.distributed.process_group",
    "Preempted": "engine.state.preemption",
    "verify": "engine.verify",
    "VerifyResult": "engine.verify",
    "VerifyError": "engine.verify",
}


def __getattr__(name: str):
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    setattr(sys.modules[__name__], name, value)  # later reads find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_EXPORTS))


class _Package(types.ModuleType):
    """``engine.verify`` names both a submodule and the function it defines. Importing the
    submodule (``from engine.verify import ...``) makes the import system bind it on the package,
    which would hide the public function: the function is bound in its place."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}" \
                and _LAZY_EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
