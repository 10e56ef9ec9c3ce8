"""The resolved setup: what ``engine.initialize`` decides from the config, once.

A config says many things in many spellings (DeepSpeed's offload keys, a backend, a stage,
half-precision sections); a strategy needs a handful of decisions. ``process_group_request``
says which process group to join; ``resolve_setup`` turns the config and the joined group into
a frozen :class:`Setup` that the strategy is built from. Strategies never read the raw config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.config.deepspeed import deepspeed_config
from engine.config.offload import TorchOffload, torch_offload
from engine.config.schema import Config
from engine.distributed.mesh import MeshLayout
from engine.distributed.process_group import DistInfo

STRATEGIES = ("single", "ddp", "zero1", "fsdp", "tensor", "tensor_zero1", "tensor_fsdp", "deepspeed")


@dataclass(frozen=True)
class ProcessGroupRequest:
    """How to join the process group (``engine.distributed.process_group.init_distributed``'s arguments)."""

    timeout_seconds: float
    backend: str
    agreement_timeout_seconds: float
    group_for_one_process: bool  # DeepSpeed and FSDP2 offload need a group even alone


@dataclass(frozen=True)
class HalfPrecision:
    """The forward's half precision and, for fp16, the loss scaler's settings."""

    dtype: torch.dtype | None = None  # None: full precision
    loss_scaling: Any = None  # the fp16 section (initial_scale_power, loss_scale_window, ...), or None


@dataclass(frozen=True)
class TensorParallelSetup:
    """How layers are split over the mesh's tensor dimension (``engine.strategies.parallelize``)."""

    plan: Any = "auto"  # "auto", or {module pattern: style name or a ParallelStyle}
    check_batches: int = 0  # optimizer steps whose inputs are compared inside each tensor group


@dataclass(frozen=True)
class Setup:
    """Every decision a strategy is built from."""

    backend: str  # "torch" | "deepspeed"
    strategy: str  # one of STRATEGIES
    stage: int  # ZeRO stage
    mesh: MeshLayout
    precision: HalfPrecision
    offload: TorchOffload  # the torch backend's reading of DeepSpeed's offload keys
    defer_reduction: bool | str  # False | True | "auto"
    shard_unit_size: int | None
    memory_limit: float | None  # what "auto" deferral and micro sizes may fill (fraction or bytes)
    tensor_parallel: TensorParallelSetup = TensorParallelSetup()
    deepspeed: dict | None = None  # backend deepspeed: the config DeepSpeed is started with
    # backend deepspeed: Microstep (not the user) allowed untested optimizers, so DeepSpeed's warning is noise
    deepspeed_allows_untested_optimizer: bool = False


def _fsdp_even_alone(config: Config) -> bool:
    """CPU offload is FSDP2's, which needs a process group even in one process."""
    return config.backend == "torch" and torch_offload(config.zero_optimization).to_host


def process_group_request(config: Config) -> ProcessGroupRequest:
    section = config.distributed
    return ProcessGroupRequest(section.timeout_seconds, section.backend, section.agreement_timeout_seconds,
                               group_for_one_process=config.backend == "deepspeed" or _fsdp_even_alone(config))


def mesh_layout(config: Config, world_size: int) -> MeshLayout:
    """The mesh ``config`` asks for on ``world_size`` processes (ConfigError if they do not divide)."""
    return MeshLayout(world_size, tensor=config.tensor_parallel.size)


def resolve_setup(config: Config, dist_info: DistInfo, tensor_plan=None) -> Setup:
    """The setup of ``config`` on the process group ``dist_info`` describes; ``tensor_plan``
    (``engine.initialize``'s) replaces the config's ``tensor_parallel.plan``."""
    zero = config.zero_optimization
    stage = zero.stage
    mesh = mesh_layout(config, dist_info.world_size)
    dtype = torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else None
    precision = HalfPrecision(dtype, config.fp16 if config.fp16.enabled else None)
    deepspeed = config.backend == "deepspeed"
    offload = torch_offload(zero)
    return Setup(
        backend=config.backend,
        strategy=_strategy_name(config, mesh),
        stage=stage,
        mesh=mesh,
        precision=precision,
        offload=offload,
        defer_reduction=zero.defer_reduction if not deepspeed or stage >= 2 else False,
        shard_unit_size=zero.shard_unit_size,
        memory_limit=config.auto_memory_limit,
        tensor_parallel=TensorParallelSetup(tensor_plan if tensor_plan is not None else config.tensor_parallel.plan,
                                            config.tensor_parallel.check_batches),
        deepspeed=deepspeed_config(config, mesh.data) if deepspeed else None,
        deepspeed_allows_untested_optimizer=deepspeed and "zero_allow_untested_optimizer" not in config.deepspeed_extras,
    )


def _strategy_name(config: Config, mesh: MeshLayout) -> str:
    if config.backend == "deepspeed":
        return "deepspeed"
    if mesh.world_size == 1 and not _fsdp_even_alone(config):
        return "single"
    if mesh.tensor > 1:
        return ("tensor", "tensor_zero1", "tensor_fsdp", "tensor_fsdp")[config.zero_optimization.stage]
    return ("ddp", "zero1", "fsdp", "fsdp")[config.zero_optimization.stage]
