"""The DeepSpeed internals Microstep uses, checked once when the DeepSpeed strategy is built.

Tested: DeepSpeed 0.19.8 (``TESTED``: 0.19.x). The strategy calls DeepSpeed's public engine
methods directly (``initialize``, ``backward``, ``step``, ``set_gradient_accumulation_boundary``,
``coalesce_grad_reduction``, ``save_checkpoint``...); everything else is here:

* the window multiplier rides on the ZeRO optimizer's loss scale (``scaled_step``): DeepSpeed
  divides the reduced gradient by it before clipping and stepping. If a DeepSpeed release
  changed that, gradients would be silently wrong — hence the version fence, and the
  exactness tests that apply a multiplier (short windows, token counts) on the pinned version;
* discarding a window abandoned mid-way clears the ZeRO optimizers' accumulation state;
* the universal-checkpoint switch and converter for resuming on another world size;
* the tensors a ZeRO optimizer holds, for memory accounting.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import warnings

import torch

from engine.errors import ConfigError, UnsupportedFrameworkError

TESTED = (0, 19)  # major, minor
INSTALL_HINT = ("backend: deepspeed needs the deepspeed package: pip install 'microstep[deepspeed]' "
                "(or set backend: torch)")
# The optimizers DeepSpeed wraps a torch optimizer in at ZeRO-1/2/3 whose loss scale divides
# the gradient before clipping and stepping (how a window's multiplier is applied).
ZERO_OPTIMIZERS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")


def import_deepspeed():
    """``import deepspeed`` (on the CPU accelerator when there is no GPU), quietened, with its
    version checked; a missing package is a ConfigError naming the install."""
    try:
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    except ImportError:
        raise ConfigError([INSTALL_HINT]) from None
    found = tuple(int(part) for part in deepspeed.__version__.split(".")[:2])
    if found != TESTED:
        raise UnsupportedFrameworkError(
            f"deepspeed {deepspeed.__version__} is not supported: Microstep's DeepSpeed backend is tested with "
            f"deepspeed {TESTED[0]}.{TESTED[1]}.x and relies on its ZeRO optimizers' internals; "
            "pip install 'deepspeed>=0.19.8,<0.20', or use backend: torch")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    return deepspeed


def check_optimizer(optimizer, stage: int) -> str | None:
    """At ZeRO-1..3: a problem when DeepSpeed chose an optimizer whose loss scale is not the
    one ``scaled_step`` relies on (or that lacks the attributes ``drop_window_gradients`` uses)."""
    name = type(optimizer).__name__
    if stage >= 1 and name not in ZERO_OPTIMIZERS:
        return (f"at ZeRO stage {stage} DeepSpeed chose {name} instead of its ZeRO optimizer (bf16 with "
                "data_types.grad_accum_dtype: fp32 does that at stage 1). Microstep applies a window's exact "
                "weight through the ZeRO optimizer's loss scale, which this optimizer ignores, and it cannot "
                "defer gradient reduction to the window's end: remove data_types.grad_accum_dtype")
    needed = {0: [], 1: ["loss_scale", "micro_step_id", "averaged_gradients", "_release_preflattened_grad_buffers"],
              3: ["loss_scale", "averaged_gradients", "finalize_gradient_accumulation_boundary"]}
    needed[2] = needed[1] + ["finalize_gradient_accumulation_boundary"]
    needed = needed[stage]
    missing = [attribute for attribute in needed if not hasattr(optimizer, attribute)]
    if missing:
        return (f"DeepSpeed's {name} lacks {', '.join(missing)}, which Microstep relies on (tested with "
                f"deepspeed {TESTED[0]}.{TESTED[1]}.x)")
    return None


@contextlib.contextmanager
def scaled_step(ds_engine, factor: float):
    """Inside the block the ZeRO optimizer's step multiplies the reduced gradient by
    ``factor`` (before clipping): its loss scale, which it divides the gradient by, is divided
    by ``factor``; DeepSpeed's own loss-scale update during the step is kept."""
    scaler = ds_engine.optimizer
    if factor != 1.0:
        scaler.loss_scale = scaler.loss_scale / factor
    try:
        yield
    finally:
        if factor != 1.0:
            scaler.loss_scale = scaler.loss_scale * factor


def stage0_loss_scale(optimizer) -> float:
    """The loss scale of DeepSpeed's stage-0 fp16 optimizers (1 for a plain torch optimizer).
    DeepSpeed 0.19's ``engine.backward`` does not apply it (it scales losses for its ZeRO
    optimizers only) while their ``step`` divides the gradient by it: the caller multiplies
    the loss by it before ``engine.backward``."""
    for owner in (optimizer, getattr(optimizer, "loss_scale_config", None)):
        scale = getattr(owner, "cur_scale", None)
        if isinstance(scale, (int, float)):
            return float(scale)
    return 1.0


def drop_window_gradients(ds_engine, stage: int) -> None:
    """Forget this rank's gradients of a window in progress, without any collective: the
    clean-up DeepSpeed itself runs when it skips an overflowing step."""
    optimizer = ds_engine.optimizer
    ds_engine.zero_grad()  # parameters' .grad (first: ZeRO-3's zero_grad fails on CPU gradients)
    if stage == 0:
        return
    optimizer.zero_grad(set_to_none=True)  # grad_accum; ZeRO-3: its micro-step count
    if stage <= 2:
        optimizer.micro_step_id = -1  # as after step(): the next reduction copies, not adds
        optimizer._release_preflattened_grad_buffers()
    if getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "offload_optimizer", False):
        optimizer.reset_cpu_buffers()  # offload: the accumulated CPU copies
    elif stage <= 2:
        for key in list(optimizer.averaged_gradients):
            optimizer.averaged_gradients[key] = None
            optimizer.all_grad_tensors[key] = None
    else:
        optimizer.averaged_gradients = {}


def finish_reduced_boundary(ds_engine) -> None:
    """ZeRO-2/3 whose backwards each reduced already, closed without a boundary backward: run
    only the boundary's bookkeeping (moving the reduced partitions where ``step`` reads them)."""
    ds_engine.optimizer.finalize_gradient_accumulation_boundary()


@contextlib.contextmanager
def universal_checkpoint_loading(ds_engine):
    """Make ``load_checkpoint`` read a universal checkpoint (a config flag DeepSpeed reads then)."""
    config = ds_engine._config
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = False


def to_universal(source: str, target: str) -> None:
    """DeepSpeed's ``ds_to_universal`` (missing universal metadata injected), in-process."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=source, output_folder=target, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    ds_to_universal.main(args)


def held_tensors(ds_engine):
    """The tensors DeepSpeed holds for training: the module's parameters (at ZeRO-3 their
    partitions) and gradients, and every tensor the ZeRO optimizer keeps in its attributes
    (master partitions, reduced gradients, buckets, the wrapped optimizer's state)."""
    for p in ds_engine.module.parameters():
        yield p
        yield p.grad
        yield getattr(p, "ds_tensor", None)
    yield from _tensors_in(vars(ds_engine.optimizer), depth=3)
    inner = getattr(ds_engine.optimizer, "optimizer", None)
    if inner is not None:
        for state in inner.state.values():
            yield from _tensors_in(state, depth=1)


def _tensors_in(value, depth: int):
    if torch.is_tensor(value):
        yield value
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth - 1)
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth - 1)
