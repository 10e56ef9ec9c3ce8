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
from engine.config.offload import TorchOffload
from engine.config.schema import Config, half_precision, torch_sections
from engine.config.sharding import shard_size, shard_size_key
from engine.config.torch_features import CheckpointingRequest, CompileRequest, TorchOverlap
from engine.distributed.mesh import GRADIENT_REDUCTION, MeshLayout
from engine.distributed.process_group import DistInfo

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ProcessGroupRequest:
    """How to join the process group (``engine.distributed.process_group.init_distributed``'s arguments)."""

    timeout_seconds: float
    backend: str
    agreement_timeout_seconds: float
    group_for_one_process: bool  # DeepSpeed and FSDP2 offload need a group even alone


@dataclass(frozen=True)
class HalfPrecision:
    """The half precision of the forward and backward and, for fp16, the loss scaler's settings.

    Two ways (docs/config.md): by default (``autocast`` false) the parameters are gathered and
    computed in ``dtype`` from fp32 masters, their gradients reduced in fp32 and accumulated over
    the window in ``grad_accum_dtype``; with ``torch_autocast`` the fp32 parameters stay as they
    are and autocast casts each op's inputs."""

    dtype: torch.dtype | None = None  # None: full precision
    loss_scaling: Any = None  # the fp16 section (initial_scale_power, loss_scale_window, ...), or None
    autocast: bool = False
    grad_accum_dtype: torch.dtype = torch.float32

    @property
    def low_precision_parameters(self) -> bool:
        """Parameters computed in ``dtype`` (from fp32 masters), not autocast."""
        return self.dtype is not None and not self.autocast


@dataclass(frozen=True)
class PipelineSetup:
    """How the model is cut into stages and which schedule runs them (stages: ``mesh.pipeline``)."""

    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zero_bubble
    split: str | tuple[str, ...] = "auto"  # auto | uniform | names of the modules starting stages 2, 3, ...


@dataclass(frozen=True)
class TensorParallelSetup:
    """How layers are split over the mesh's tensor dimension (``engine.strategies.parallelize``)."""

    plan: Any = "auto"  # "auto", or {module pattern: style name or a ParallelStyle}
    check_batches: int = 0  # optimizer steps whose inputs are compared inside each tensor group


@dataclass(frozen=True)
class ContextParallelSetup:
    """How sequences are split over the mesh's context dimension (``engine.context.parallel``)."""

    method: str = "auto"  # ulysses | ring | auto
    labels: str = "auto"  # auto | shift | aligned
    check_micro_batches: int = 0  # micro-batches whose rows are compared inside each context group


@dataclass(frozen=True)
class Setup:
    """Every decision a strategy is built from."""

    backend: str  # "torch" | "deepspeed"
    # Which holder of ``engine.strategies`` holds the model (recorded in checkpoints): ``deepspeed``,
    # ``pipeline``, ``fsdp`` (FSDP2 over the data dimension), ``ddp`` (DDP on a mesh of data ranks,
    # full-precision or autocast parameters) or ``replicas`` (replicas averaged after each window); the
    # other dimensions are the mesh's
    holder: str
    stage: int  # ZeRO stage
    # ZeRO 1 over several unsharded replicas: each rank keeps and steps the optimizer state of the
    # parameters it owns (``engine.strategies.zero1``); whether the data dimension shards: ``mesh.data_sharded``
    owns_optimizer_state: bool
    mesh: MeshLayout
    precision: HalfPrecision
    offload: TorchOffload  # the torch backend's reading of DeepSpeed's offload keys
    defer_reduction: bool | str  # False | True | "auto"
    shard_unit_size: int | None
    memory_limit: float | None  # what "auto" deferral and micro sizes may fill (fraction or bytes)
    pipeline: PipelineSetup = PipelineSetup()
    tensor_parallel: TensorParallelSetup = TensorParallelSetup()
    context_parallel: ContextParallelSetup = ContextParallelSetup()
    expert_modules: tuple[str, ...] | None = None  # expert_parallel.modules (None: the Hugging Face plan's)
    checkpointing: CheckpointingRequest | None = None  # activation checkpointing of the model's blocks
    compile: CompileRequest | None = None  # torch.compile of the model's blocks
    packing: bool = False  # packing: true: each micro-batch's documents in one row (attention per document)
    overlap: TorchOverlap = TorchOverlap()  # bucket and prefetch sizes (torch backend)
    deepspeed: dict | None = None  # backend deepspeed: the config DeepSpeed is started with
    # backend deepspeed: Microstep (not the user) allowed untested optimizers, so DeepSpeed's warning is noise
    deepspeed_allows_untested_optimizer: bool = False


def _fsdp_even_alone(config: Config) -> bool:
    """CPU offload is FSDP2's, which needs a process group even in one process."""
    return config.backend == "torch" and torch_sections(config).offload.to_host


def process_group_request(config: Config) -> ProcessGroupRequest:
    section = config.distributed
    return ProcessGroupRequest(section.timeout_seconds, section.backend, section.agreement_timeout_seconds,
                               group_for_one_process=config.backend == "deepspeed" or _fsdp_even_alone(config))


def resolve_setup(config: Config, dist_info: DistInfo, tensor_plan=None) -> Setup:
    """The setup of ``config`` on the process group ``dist_info`` describes; ``tensor_plan``
    (``engine.initialize``'s) replaces the config's ``tensor_parallel.plan``."""
    zero = config.zero_optimization
    stage = zero.stage
    mesh = mesh_layout(config, dist_info.world_size)
    deepspeed = config.backend == "deepspeed"
    sections = torch_sections(config)
    features = sections.features
    half = half_precision(config) if deepspeed else features.autocast or half_precision(config)
    # Under a pipeline or a tensor mesh, half precision is autocast over fp32 parameters: the
    # policy's half-precision copy (ZeRO 0/1) and per-stage FSDP2 policies are not built there
    # yet (torch's schedules send activations in the parameters' dtype).
    precision = HalfPrecision(_DTYPES.get(half), config.fp16 if half == "fp16" else None,
                              autocast=not deepspeed and (features.autocast is not None
                                                          or not mesh.is_data_parallel_only),
                              grad_accum_dtype=_DTYPES[features.grad_accum_dtype])
    offload = sections.offload
    owns_optimizer_state = not deepspeed and stage == 1 and mesh.size(GRADIENT_REDUCTION) > 1 and not mesh.data_sharded
    return Setup(
        backend=config.backend,
        holder=_holder(config, mesh, precision),
        stage=stage,
        owns_optimizer_state=owns_optimizer_state,
        mesh=mesh,
        precision=precision,
        offload=offload,
        defer_reduction=zero.defer_reduction if not deepspeed or stage >= 2 else False,
        shard_unit_size=zero.shard_unit_size,
        memory_limit=config.auto_memory_limit,
        pipeline=PipelineSetup(config.pipeline.schedule, config.pipeline.split if isinstance(config.pipeline.split, str)
                               else tuple(config.pipeline.split)),
        expert_modules=tuple(config.expert_parallel.modules) if config.expert_parallel.modules else None,
        checkpointing=features.checkpointing,
        compile=features.compile,
        packing=config.packing,
        overlap=sections.overlap,
        tensor_parallel=TensorParallelSetup(tensor_plan if tensor_plan is not None else config.tensor_parallel.plan,
                                            config.tensor_parallel.check_batches),
        context_parallel=ContextParallelSetup(config.context_parallel.method, config.context_parallel.labels,
                                              config.context_parallel.check_micro_batches),
        deepspeed=deepspeed_config(config, mesh.data) if deepspeed else None,
        deepspeed_allows_untested_optimizer=deepspeed and "zero_allow_untested_optimizer" not in config.deepspeed_extras,
    )


def model_parallel_dimensions(config: Config) -> list[str]:
    """The model-parallel dimensions a config splits, in words (``python -m engine plan``'s summary)."""
    pipeline, tensor, context = config.pipeline, config.tensor_parallel, config.context_parallel
    split = pipeline.split if isinstance(pipeline.split, str) else ",".join(pipeline.split)
    return [*([f"pipeline {pipeline.stages} stages ({pipeline.schedule}, split {split})"] if pipeline.stages > 1 else []),
            *([f"tensor parallel {tensor.size}"] if tensor.size > 1 else []),
            *([f"context parallel {context.size} ({context.method})"] if context.size > 1 else []),
            *([f"expert parallel {config.expert_parallel.size}"] if config.expert_parallel.size > 1 else [])]


def mesh_layout(config: Config, world_size: int) -> MeshLayout:
    """The mesh a loaded config asks for on ``world_size`` ranks: the data dimension shards at
    ZeRO 2 / 3, and wherever the torch backend offloads (FSDP2 does) — on the torch backend within
    groups of ``zero_optimization.shard_size`` data ranks, or a DeepSpeed key read as it
    (``engine.config.sharding``)."""
    sharded = config.zero_optimization.stage >= 2 or (config.backend == "torch"
                                                      and torch_sections(config).offload.to_host)
    return MeshLayout(world_size, tensor=config.tensor_parallel.size, pipeline=config.pipeline.stages,
                      context=config.context_parallel.size, expert=config.expert_parallel.size, data_sharded=sharded,
                      shard_size=shard_size(config), shard_size_key=shard_size_key(config))


def _holder(config: Config, mesh: MeshLayout, precision: HalfPrecision) -> str:
    """What holds the model (``Setup.holder``). A pipeline's stages are each sharded by FSDP2 wherever the
    data dimension shards; one process shards nothing unless it offloads (FSDP2's offload, at any stage)."""
    if config.backend == "deepspeed":
        return "deepspeed"
    if mesh.pipeline > 1:
        return "pipeline"
    if _fsdp_even_alone(config) or mesh.data_sharded and mesh.world_size > 1:
        return "fsdp"
    # DDP's buckets would hold (and all-reduce) half-precision gradients; a tensor split's replicas
    # are averaged after the window (engine.strategies.replicas)
    if mesh.world_size > 1 and mesh.tensor == 1 and not precision.low_precision_parameters:
        return "ddp"
    return "replicas"
