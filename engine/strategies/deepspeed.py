"""``backend: deepspeed``: the model held by DeepSpeed's engine (ZeRO 0–3, offload, its
precision), with Microstep keeping the boundaries and the weights.

DeepSpeed is told micro batch 1 and accumulation 1, so it never divides a loss by a fixed
accumulation count: every loss reaches ``backward(..., scale_wrt_gas=False)`` already
weighted by the engine, and ``set_gradient_accumulation_boundary`` is set before every
micro-step. Gradient reduction per window:

* stage 0: all-reduce in the backward of the closing micro-step;
* stages 1–3: backwards run inside DeepSpeed's ``coalesce_grad_reduction`` (gradients stay
  local, full size) and one reduction pass runs at the boundary — as on the torch backend.
  ``reduce_every_micro_step: true`` at stages 2/3 gives DeepSpeed's native behaviour:
  reduce after every micro-step, partitioned gradients.

A gradient multiplier known only at the boundary (short windows, token counts) goes
through DeepSpeed's loss scale at stages 1–3 (it divides gradients by it before clipping
and stepping; no extra communication) and straight into ``.grad`` at stage 0.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings

import torch
import torch.distributed as dist

from engine.config import ConfigError
from engine.strategies.base import StepResult, Strategy, failure_vote

log = logging.getLogger("engine")

# Microstep keys that do not exist in DeepSpeed's zero_optimization section.
_OUR_ZERO_KEYS = {"reduce_every_micro_step"}


def deepspeed_config(config, world_size: int) -> dict:
    """The DeepSpeed config for a Microstep config: batch keys that leave accumulation to
    Microstep, clipping stated explicitly (DeepSpeed's default is 1.0), DeepSpeed-only keys
    passed through. Optimizer and scheduler are not translated: Microstep builds torch ones
    and hands the instances over, so both backends train identically."""
    zero = config.zero_optimization.model_dump()
    for key in _OUR_ZERO_KEYS:
        zero.pop(key, None)
    if zero["stage"] == 3:
        # Otherwise ZeRO-3 patches torch.nn.functional.linear for the whole process.
        zero.setdefault("memory_efficient_linear", False)
    ds = dict(config.deepspeed_extras)
    ds.update({
        "train_batch_size": world_size,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.gradient_clipping,
        "zero_optimization": zero,
    })
    if config.fp16.enabled:
        ds["fp16"] = config.fp16.model_dump()
    if config.bf16.enabled:
        ds["bf16"] = config.bf16.model_dump()
    # Any torch optimizer is fine with us (DeepSpeed refuses untested ones at ZeRO-1..3).
    ds.setdefault("zero_allow_untested_optimizer", True)
    return ds


def _import_deepspeed():
    try:
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    except ImportError:
        raise ConfigError(["backend: deepspeed needs the deepspeed package: "
                           "pip install 'microstep[deepspeed]' (or set backend: torch)"]) from None
    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    return deepspeed


@contextlib.contextmanager
def _quiet_stdout():
    """DeepSpeed prints (not logs) a line each time it loads its compiled comm op."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    checkpoint_format = "deepspeed"

    def __init__(self, config, device: torch.device, world_size: int, rank: int):
        self.config = config
        self.device = device
        self.world_size, self.rank = world_size, rank
        self.stage = config.zero_optimization.stage
        self.coalesce = self.stage >= 1 and not (config.zero_optimization.reduce_every_micro_step and self.stage >= 2)
        self.deepspeed = _import_deepspeed()
        self._window = None  # the open coalesce_grad_reduction block
        self._closes = True
        self._defer_reduction = False

    # -- setup ------------------------------------------------------------------------------
    def setup(self, module, optimizer):
        if not dist.is_initialized():
            _init_single_process_group()
        with _quiet_stdout():
            self.engine, *_ = self.deepspeed.initialize(
                model=module, optimizer=optimizer, config=deepspeed_config(self.config, self.world_size),
                dist_init_required=False)
        self.module = self.engine.module
        self.forward_module = self.engine
        self.optimizer = optimizer  # DeepSpeed steps it; schedulers and the monitor read its lr
        self._cast_inputs = torch.bfloat16 if self.config.bf16.enabled else \
            torch.float16 if self.config.fp16.enabled else None
        if self.coalesce and not hasattr(self.engine.optimizer, "_coalesce_grad_reduction"):
            raise ConfigError([f"backend deepspeed: the {type(self.engine.optimizer).__name__} that DeepSpeed chose "
                               "cannot defer gradient reduction to the window's end; remove "
                               "data_types.grad_accum_dtype, or set zero_optimization.reduce_every_micro_step: true"])

    def forward(self, *args, **kwargs):
        if self._cast_inputs is not None:  # DeepSpeed's half-precision models want half inputs
            args, kwargs = _cast_floating((args, kwargs), self._cast_inputs)
        return self.engine(*args, **kwargs)

    # -- a window -----------------------------------------------------------------------------
    def prepare_micro_step(self, closes_window):
        self._closes = closes_window and not self._defer_reduction
        self.engine.set_gradient_accumulation_boundary(self._closes)

    def backward(self, loss, weight):
        if self.coalesce and self._window is None:
            self._window = self.engine.coalesce_grad_reduction()
            self._window.__enter__()
        self.engine.backward(loss * weight, scale_wrt_gas=False)

    def reduce_gradients(self):
        if self._window is not None:  # leaving the block runs the one reduction pass
            window, self._window = self._window, None
            window.__exit__(None, None, None)
            self.engine.set_gradient_accumulation_boundary(True)  # the block restored its own value
        elif not self._closes:  # a window closed early, or reduction deferred
            self.engine.set_gradient_accumulation_boundary(True)
            self.engine.allreduce_gradients()

    def step(self, multiplier, max_norm, want_norm=False):
        factor = float(multiplier)
        if factor != 1.0 and self.stage == 0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
        norm = self._stage0_norm() if self.stage == 0 and (want_norm or max_norm > 0) else None
        scaler = self.engine.optimizer if self.stage > 0 else None
        if scaler is not None and factor != 1.0:
            scaler.loss_scale = scaler.loss_scale / factor  # gradients are divided by it
        try:
            self.engine.step()
        finally:
            if scaler is not None and factor != 1.0:
                scaler.loss_scale = scaler.loss_scale * factor  # keep DeepSpeed's own updates
        if norm is None and self.stage > 0 and (want_norm or max_norm > 0):
            value = self.engine.get_global_grad_norm()
            norm = None if value is None else torch.tensor(float(value))
        return StepResult(applied=self.engine.was_step_applied(), grad_norm=norm)

    def _stage0_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        norms = torch._foreach_norm(grads, 2.0) if grads else []
        return torch.stack([n.double() for n in norms]).square().sum().sqrt() if grads else torch.zeros((), dtype=torch.float64)

    def zero_grad(self):
        pass  # DeepSpeed clears gradients inside step()

    # -- collectives for the engine's statistics ------------------------------------------------
    def all_reduce_sum(self, tensor):
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_reduce_max(self, tensor):
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    # -- surviving a failed micro-step ------------------------------------------------------------
    def enable_failure_guard(self):
        if self.stage == 3 or not self.coalesce and self.stage >= 2:
            raise ConfigError([
                "train_micro_batch_size_per_gpu: auto/explore with backend deepspeed needs ZeRO stage 0, 1 or 2 "
                "without reduce_every_micro_step: DeepSpeed communicates inside every ZeRO-3 forward (and "
                "inside every backward with reduce_every_micro_step), where one rank's out-of-memory "
                "cannot be agreed on. Use backend: torch for automatic micro-batch sizes at ZeRO-3."])
        self._defer_reduction = True

    def agree_on_failures(self, failed):
        if self.world_size == 1:
            return super().agree_on_failures(failed)
        return failure_vote(failed, self.rank, self.world_size, self.device)

    def discard_window(self):
        if self._window is not None:  # the block's reduction runs on every rank alike
            window, self._window = self._window, None
            window.__exit__(None, None, None)
        self.engine.zero_grad()

    # -- state ------------------------------------------------------------------------------------
    def full_state_dict(self):
        with self.deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None,
                                                    enabled=self.stage == 3):
            return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def save_training_state(self, directory):
        self.engine.save_checkpoint(str(directory), tag="deepspeed", client_state={}, save_latest=False)

    def load_training_state(self, directory):
        from engine.checkpoint import CheckpointError

        try:
            path, _ = self.engine.load_checkpoint(str(directory), tag="deepspeed", load_optimizer_states=True,
                                                  load_lr_scheduler_states=False)
        except Exception as error:  # DeepSpeed raises many kinds; say what to do
            raise CheckpointError(
                f"DeepSpeed could not load {directory}: {error}. A DeepSpeed checkpoint at ZeRO-1/2/3 resumes on "
                "the world size it was saved with; for another one, convert it with `python -m "
                "deepspeed.checkpoint.ds_to_universal --inject_missing_state` and load with "
                "checkpoint: {load_universal: true}") from None
        if path is None:
            raise CheckpointError(f"{directory} holds no DeepSpeed model state")

    def close(self):
        self.engine.destroy()


def _cast_floating(tree, dtype):
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, dict):
        return {k: _cast_floating(v, dtype) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cast_floating(v, dtype) for v in tree)
    return tree


def _init_single_process_group() -> None:
    """DeepSpeed needs a process group even for one process: a local one-rank gloo group."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                        ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
