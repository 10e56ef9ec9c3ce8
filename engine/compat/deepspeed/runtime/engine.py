"""DeepSpeed's engine as ``initialize`` returns it: :class:`DeepSpeedEngine`, each method a call
into one :class:`engine.Engine` (``.engine``)."""
from __future__ import annotations

import logging
import os

import torch

import engine
from engine.compat.deepspeed.not_provided import refusal
from engine.compat.deepspeed.utils.timer import ThroughputTimer
from engine.distributed.collectives import from_rank0
from engine.distributed.process_group import barrier, read_launch_env
from engine.errors import EngineUsageError

__all__ = ["DeepSpeedEngine", "LATEST"]

log = logging.getLogger("engine")

LATEST = "latest"  # the file naming the newest checkpoint tag in a save_dir
_FACADE_LOOP = "model_engine(batch), model_engine.backward(loss), model_engine.step()"


class DeepSpeedEngine:
    """What ``initialize`` returns: DeepSpeed's engine methods, each a call into one
    :class:`engine.Engine` (``.engine``). Attributes it does not define are looked up on the
    model, as DeepSpeed's engine does."""

    def __init__(self, eng: engine.Engine, optimizer_name: str):
        self.engine = eng
        self._optimizer_name = optimizer_name
        self._step_applied = False
        plan = eng.plan
        self.tput_timer = ThroughputTimer(None if plan.is_data_defined else plan.train_batch_size)

    def __getattr__(self, name: str):
        if name.startswith("__") or "engine" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.engine.module, name)

    # -- a micro-step ---------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.engine.module.training:
            self.tput_timer.start()
        return self.engine(*args, **kwargs)

    forward = __call__

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Back-propagate the micro-batch's mean loss; returns it divided by the accumulation
        steps, as DeepSpeed does (for logging)."""
        if retain_graph:
            raise EngineUsageError("backward(retain_graph=True) is not supported: the engine runs one backward per "
                                   "micro-batch loss")
        if not scale_wrt_gas:
            raise EngineUsageError(
                "backward(scale_wrt_gas=False): the engine weights every micro-batch by its share of the global "
                "batch itself; pass the micro-batch's mean loss with scale_wrt_gas left True")
        self.engine.backward(loss)
        return loss.detach() / self.gradient_accumulation_steps() if isinstance(loss, torch.Tensor) else loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Call after every ``backward``: updates the parameters at the window's boundary only."""
        if lr_kwargs:
            raise EngineUsageError("step(lr_kwargs=...) is not supported: the scheduler steps once per optimizer step")
        try:
            closed = self.engine.step()
        except EngineUsageError as error:  # the engine's words, with the facade's names
            raise EngineUsageError(str(error).replace("forward, eng.backward(loss), eng.step()", _FACADE_LOOP)
                                   .replace("eng.backward", "model_engine.backward")) from None
        self._step_applied = closed and self.engine.last_window.step.applied
        self.tput_timer.stop(global_step=closed)

    def zero_grad(self) -> None:
        """Clears gradients between windows; never a window in progress."""
        self.engine.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` changed the parameters (False inside a window or on an fp16 overflow)."""
        return self._step_applied

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.engine.module.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    # -- what the engine is -----------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self):
        return self.engine.lr_scheduler

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def local_rank(self) -> int:
        return read_launch_env().local_rank

    @property
    def global_rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        """The data-parallel ranks (world / tensor size), as the batch arithmetic counts them."""
        return self.engine.plan.world_size

    @property
    def dp_world_size(self) -> int:
        return self.engine.plan.world_size

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def global_samples(self) -> int:
        return self.engine.global_samples

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def train_batch_size(self) -> int:
        """The global batch. A config giving only ``gradient_accumulation_steps`` (which
        DeepSpeed itself refuses) plans none: the data defines it, and this is the last
        window's, every rank's samples summed; an error before the first window closed."""
        plan, last = self.engine.plan, self.engine.last_window
        if not plan.is_data_defined:
            return plan.train_batch_size
        if not last.samples:
            raise EngineUsageError(
                "train_batch_size(): the config gives only gradient_accumulation_steps, so the global batch is "
                "whatever the data loader yields, known once a window has closed (then: the last window's samples "
                "over every rank); set train_batch_size or train_micro_batch_size_per_gpu for a planned one")
        return last.samples

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """The planned micro-batch size (None when the config gives only the accumulation steps)."""
        return self.engine.plan.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.engine.plan.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.engine.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    def optimizer_name(self) -> str:
        """The config's optimizer type in lower case (``deepspeed.runtime.config``'s names, e.g. ``"adam"``),
        or the class name of the optimizer the script passed."""
        return self._optimizer_name

    def get_lr(self) -> list[float]:
        """The learning rate of every parameter group (what the next optimizer step uses)."""
        return [group["lr"] for group in self.engine.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The whole gradient's 2-norm before clipping, at the last boundary (None before one)."""
        norm = self.engine.last_window.step.grad_norm
        return None if norm is None else float(norm)

    # -- saving ---------------------------------------------------------------------------------
    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The whole model state (CPU tensors). Collective at ZeRO-3: call it on every rank."""
        state = self.engine.full_state_dict()
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.engine.module.named_parameters() if not p.requires_grad}
            state = {name: value for name, value in state.items() if name not in frozen}
        return state

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 saves the whole model state to ``save_dir/save_filename``, floating-point
        tensors in the half precision the model trains in (bf16 / fp16, as DeepSpeed's module
        holds them; fp32 without one). Gathered at ZeRO-3 whatever
        ``stage3_gather_16bit_weights_on_model_save`` says. Collective: call it on every rank."""
        state = self.module_state_dict(exclude_frozen_parameters)
        config = self.engine.config
        half = torch.bfloat16 if config.bf16.enabled else torch.float16 if config.fp16.enabled else None
        if half is not None:
            state = {name: value.to(half) if value.is_floating_point() else value for name, value in state.items()}
        if self.engine.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        barrier()
        return True

    def save_checkpoint(self, save_dir: str, tag=None, client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save at a window boundary into ``save_dir/tag`` (``global_step<N>`` by default) and
        name it in ``save_dir/latest``. Collective."""
        if exclude_frozen_parameters:
            log.warning("save_checkpoint(exclude_frozen_parameters=True): frozen parameters are saved too")
        tag = f"global_step{self.engine.global_steps}" if tag is None else str(tag)
        self.engine.save_checkpoint(os.path.join(save_dir, tag), client_state=dict(client_state or {}))
        if save_latest:
            if self.engine.rank == 0:
                _write_latest(save_dir, tag)
            barrier()  # every rank sees the new latest before it returns
        return True

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Restore ``load_dir/tag`` (``tag`` None: the one ``load_dir/latest`` names, as rank 0 reads it). Returns
        ``(path, client_state)``, or ``(None, None)`` when there is no ``latest``. Collective."""
        partial = {name: value for name, value, default in (
            ("load_module_strict", load_module_strict, True), ("load_optimizer_states", load_optimizer_states, True),
            ("load_lr_scheduler_states", load_lr_scheduler_states, True), ("load_module_only", load_module_only, False),
            ("custom_load_fn", custom_load_fn, None)) if value != default}
        if partial:
            raise EngineUsageError(
                f"load_checkpoint({', '.join(f'{k}={v!r}' for k, v in partial.items())}): Microstep restores the "
                "whole training state of a checkpoint; to start from a model's weights only, load them into the model "
                "before deepspeed.initialize")
        if tag is None:  # rank 0's reading, on every rank: another file system view would split the ranks
            tag = from_rank0(_read_latest(load_dir) if self.engine.rank == 0 else None)
            if tag is None:
                log.warning("no %s file in %s: nothing loaded (pass tag= to load a given checkpoint)", LATEST, load_dir)
                return None, None
        path = os.path.join(load_dir, str(tag))
        return path, self.engine.load_checkpoint(path)

    def destroy(self) -> None:
        self.engine.close()

    # -- DeepSpeed's pipeline engine --------------------------------------------------------------
    def train_batch(self, data_iter=None):
        raise refusal("engine.train_batch")

    def eval_batch(self, data_iter=None, *args, **kwargs):
        raise refusal("engine.eval_batch")


def _read_latest(load_dir: str) -> str | None:
    """The tag ``load_dir/latest`` names, or None without that file."""
    try:
        with open(os.path.join(load_dir, LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _write_latest(save_dir: str, tag: str) -> None:
    partial = os.path.join(save_dir, f".{LATEST}.tmp")
    with open(partial, "w") as f:
        f.write(tag)
    os.replace(partial, os.path.join(save_dir, LATEST))


