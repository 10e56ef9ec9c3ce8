"""What is on, said once at start-up by rank 0: one block, in the words ``python -m engine plan`` uses.

Every switch that changes how the model is held or what a window computes says so here, with the
key it came from where that is not the obvious one (DeepSpeed's ``mics_shard_size`` read as hybrid
sharding): the mesh, the holder, the batch plan, packing, hybrid sharding, the context method, the
experts' balance, precision, and whether the model's own loss is read.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from engine.config.setup import Setup
from engine.config.sharding import shard_size_key

STARTUP_LOGGER = "engine.startup"
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _precision(setup: Setup) -> str:
    precision = setup.precision
    if precision.dtype is None:
        return "full (the parameters' own dtype)"
    half = _DTYPE_NAMES.get(precision.dtype, str(precision.dtype))
    how = "autocast over fp32 parameters" if precision.autocast else "parameters computed in it from fp32 masters"
    scaled = ", loss scaling" if precision.loss_scaling is not None else ""
    return f"{half}, {how}{scaled}; gradients accumulated in {_DTYPE_NAMES.get(precision.grad_accum_dtype)}"


def _holder(setup: Setup) -> str:
    if setup.mesh.world_size == 1 and setup.holder in ("ddp", "replicas"):
        return f"one process, ZeRO {setup.stage} (backend {setup.backend})"
    names = {"deepspeed": "DeepSpeed's engine", "pipeline": "pipeline stages", "fsdp": "FSDP2 (sharded)",
             "ddp": "DDP", "replicas": "replicas averaged after each window"}
    return f"{names.get(setup.holder, setup.holder)}, ZeRO {setup.stage} (backend {setup.backend})"


@contextlib.contextmanager
def quiet_startup():
    """Engines built inside say nothing at start-up: a tool that builds one to measure it (``explore``)
    prints its own summary."""
    logger = logging.getLogger(STARTUP_LOGGER)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def startup_lines(config, setup: Setup, plan, *, own_loss_type: str | None, routes: bool) -> list[str]:
    """The block's lines: always the mesh, holder, batch and precision; every other feature only when on."""
    mesh = setup.mesh
    lines = [f"mesh:               {mesh.describe()}",
             f"holder:             {_holder(setup)}",
             f"global batch:       {plan.train_batch_size} = micro {plan.train_micro_batch_size_per_gpu} × "
             f"accumulation {plan.gradient_accumulation_steps} × data ranks {plan.world_size}"
             if plan.micro_batch_tokens is None else
             f"global batch:       {plan.train_batch_size} rows, micro-batches of at most {plan.micro_batch_tokens} "
             "tokens (micro_batch_tokens)",
             f"precision:          {_precision(setup)}"]
    if config.packing:
        lines.append(f"packing:            on: each micro-batch's documents in one row of at most "
                     f"{plan.micro_batch_tokens} tokens, position_ids restarting per document")
    if mesh.hybrid:
        key = shard_size_key(config)
        source = "" if key == "shard_size" else f" (from zero_optimization.{key})"
        lines.append(f"hybrid sharding:    shard groups of {mesh.data_shard} data ranks, {mesh.data_replicate} "
                     f"replicas across{source}")
    if mesh.context > 1:
        lines.append(f"context parallel:   {mesh.context} ranks per sequence, method {setup.context_parallel.method}")
    if routes:
        lines.append(f"experts:            load balance {config.moe.load_balance} (moe.load_balance), counts "
                     f"{config.moe.global_counts}")
    if own_loss_type is not None:
        lines.append(f"model's own loss:   read as (sum, count) by its labels (loss type {own_loss_type})")
    return lines
