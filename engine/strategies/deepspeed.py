"""``backend: deepspeed``: the model held by DeepSpeed's engine (ZeRO 0–3, offload, its
precision), with Microstep keeping the boundaries and the weights.

DeepSpeed is told micro batch 1 and accumulation 1, so it never divides a loss by a fixed
accumulation count: every loss reaches ``backward(..., scale_wrt_gas=False)`` already
weighted by the engine, and ``set_gradient_accumulation_boundary`` is set before every
micro-step. Gradient reduction per window:

* stage 0: all-reduce in the backward of the closing micro-step;
* stage 1: backwards run inside DeepSpeed's ``coalesce_grad_reduction`` (gradients stay
  local and full-size, as ZeRO-1 holds them anyway) and one reduction pass runs at the
  boundary;
* stages 2/3: DeepSpeed's own ZeRO — gradients reduced into partitions after every
  micro-step — unless ``defer_reduction`` holds them full-size for one coalesced reduction
  per window (``true``, or ``"auto"`` when it fits, see ``engine.strategies.deferral``).

A gradient multiplier known only at the boundary (short windows, token counts) goes
through the ZeRO optimizer's loss scale at stages 1–3 and straight into ``.grad`` at
stage 0 (``engine.adapters.deepspeed_internals``).

What DeepSpeed cannot do under this contract is refused when the engine is built, never
mid-training: see ``engine.config.deepspeed.deepspeed_backend_problems`` and docs/deepspeed.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
from dataclasses import replace

import torch
import torch.distributed as dist

from engine.adapters import deepspeed_internals as internals
from engine.adapters.torch_internals import foreach_mul_
from engine.distributed.collectives import sum_of_squares
from engine.errors import CheckpointError, ConfigError
from engine.strategies.model_transforms import transform_model
from engine.precision.compute_copy import cast_floating
from engine.strategies.base import StepResult, Strategy, cpu_state_dict
from engine.strategies.capabilities import fixed
from engine.strategies.deferral import ReductionDeferral

log = logging.getLogger("engine")

TAG = "deepspeed"  # the DeepSpeed checkpoint tag (a sub-directory of model_optimizer/)
STATE_FILE = "microstep_deepspeed.json"  # what the checkpoint was saved with
INSTALL_HINT = internals.INSTALL_HINT


@contextlib.contextmanager
def _quiet_stdout():
    """DeepSpeed prints (not logs) a line each time it loads its compiled comm op."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


@contextlib.contextmanager
def _without_log(logger, text: str, enabled: bool = True):
    """Drop ``logger``'s records containing ``text`` (a warning Microstep's own setting causes)."""
    def keep(record):
        return text not in record.getMessage()

    if enabled:
        logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


class DeepSpeedStrategy(Strategy):
    checkpoint_format = "deepspeed"
    _checkpoint_switch = None  # activation_checkpointing: auto: the model transform's switch (set in setup)

    def __init__(self, setup, dist_info):
        super().__init__(setup, dist_info)
        self.stage = setup.stage
        self.deepspeed = internals.import_deepspeed()
        if setup.precision.dtype == torch.float16 and not self.deepspeed.get_accelerator().is_fp16_supported():
            raise ConfigError([(
                f"fp16.enabled: DeepSpeed's {self.deepspeed.get_accelerator().device_name()} accelerator has no "
                "fp16 support on this machine (DeepSpeed refuses to start); use bf16: {enabled: true}, or "
                "backend: torch (its fp16 autocast and loss scaler work here)")])
        self._block = None  # the open coalesce_grad_reduction block
        self._closes = True
        self._guarded = False
        self._window_coalesces = None  # decided at a window's first micro-step

    # -- setup ------------------------------------------------------------------------------
    def setup(self, module, optimizer):
        if any(p.dtype == torch.float64 for p in module.parameters()):
            raise ConfigError([(
                "backend deepspeed: the model has float64 parameters. DeepSpeed cannot reduce float64 gradients "
                "at ZeRO stage 0 (it fails in the first boundary's backward) and keeps fp32 master copies at "
                "stages 1-3 (float64 in name only): call model.float(), or use backend: torch")])
        gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        # Microstep's activation_checkpointing / compile keys: the blocks, before DeepSpeed wraps them.
        self._checkpoint_switch = transform_model(module, self.settings.checkpointing, self.settings.compile)
        ds_config = json.loads(json.dumps(self.settings.deepspeed))  # a deep copy: DeepSpeed may edit it
        try:
            # The untested-optimizer warning is about zero_allow_untested_optimizer, which Microstep sets
            # unless the config does: any torch optimizer steps exactly as on the torch backend.
            untested = self.settings.deepspeed_allows_untested_optimizer
            with _quiet_stdout(), _without_log(self.deepspeed.utils.logger, "untested optimizer", untested):
                self.ds_engine, *_ = self.deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config,
                                                               dist_init_required=False)
        except (AssertionError, ValueError, NotImplementedError) as error:
            raise ConfigError([(f"backend deepspeed: DeepSpeed refused the configuration: {error} "
                                f"(the DeepSpeed config Microstep built: {ds_config})")]) from error
        self.module = self.ds_engine.module
        self.forward_module = self.ds_engine
        self.optimizer = optimizer  # DeepSpeed steps it; schedulers and the monitor read its lr
        self._cast_inputs = self.settings.precision.dtype
        problem = internals.check_optimizer(self.ds_engine.optimizer, self.stage)
        if problem:
            self.ds_engine.destroy()
            raise ConfigError([f"backend deepspeed: {problem}"])
        self.deferral = ReductionDeferral(self.settings.defer_reduction, self, extra_bytes=gradient_bytes,
                                          memory_limit=self.settings.memory_limit)

    def capabilities(self):
        # ZeRO-3 gathers parameters in every forward.
        return replace(super().capabilities(), forward_communicates=fixed(self.stage == 3),
                       checkpoint_switch=self._checkpoint_switch)

    def forward(self, *args, **kwargs):
        if self._cast_inputs is not None:  # DeepSpeed's half-precision models want half inputs
            args, kwargs = cast_floating((args, kwargs), self._cast_inputs)
        return self.ds_engine(*args, **kwargs)

    # -- a window -----------------------------------------------------------------------------
    def _coalesces(self) -> bool:
        """Whether this window's backwards keep gradients local for one reduction at its end."""
        if self._window_coalesces is None:
            self._window_coalesces = self.stage == 1 or self.stage >= 2 and self.deferral.deferring
        return self._window_coalesces

    def prepare_micro_step(self, closes_window):
        # The block opens before the first forward, so that every rank that started a window
        # holds one, even when its forward then fails (see discard_window).
        self._open_block()
        self._closes = closes_window and not self._guarded
        self.ds_engine.set_gradient_accumulation_boundary(self._closes)

    def backward(self, loss, weight):
        self._open_block()
        if self.stage == 0:  # DeepSpeed leaves its stage-0 fp16 loss scale to us (see the adapter)
            scale = internals.stage0_loss_scale(self.ds_engine.optimizer)
            if scale != 1.0:  # in fp32, as DeepSpeed's own fp16 optimizers scale
                loss, weight = loss.float(), weight * scale
        self.ds_engine.backward(loss * weight, scale_wrt_gas=False)
        self.deferral.observe()

    def reduce_gradients(self):
        if self._block is not None:  # leaving the block runs the one reduction pass
            self._close_block()
            self.ds_engine.set_gradient_accumulation_boundary(True)  # the block restored its own value
        elif not self._closes:  # a window closed early, or reduction deferred
            self.ds_engine.set_gradient_accumulation_boundary(True)
            if self.stage >= 2:  # every backward reduced already: only the boundary's bookkeeping is left
                internals.finish_reduced_boundary(self.ds_engine)
            else:
                self.ds_engine.allreduce_gradients()

    def _open_block(self):
        if self._block is None and self._coalesces():
            self._block = self.ds_engine.coalesce_grad_reduction()
            self._block.__enter__()

    def _close_block(self):
        block, self._block = self._block, None
        block.__exit__(None, None, None)

    def step(self, multiplier, max_norm, want_norm=False, grad_squares=None):
        # grad_squares is never given: DeepSpeed's optimizers compute their norms themselves.
        factor = float(multiplier)
        wants_norm = want_norm or max_norm > 0
        fp16 = self.settings.precision.dtype == torch.float16
        norm = None
        if self.stage == 0:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            if factor != 1.0 and grads:
                foreach_mul_(grads, factor)
            if wants_norm or not fp16:  # DeepSpeed computes it at stage 0 but does not expose it
                norm = sum_of_squares(grads, self.device).sqrt() / internals.stage0_loss_scale(self.ds_engine.optimizer)
            # Its fp32 / bf16 stage-0 optimizer would apply an inf or nan: the norm (the same on every rank,
            # the gradient is all-reduced) decides, one host sync per step; fp16's optimizer checks itself.
            if not fp16 and not bool(torch.isfinite(norm)):
                internals.drop_window_gradients(self.ds_engine, self.stage)
                self._window_coalesces = None
                return StepResult(applied=False, grad_norm=norm, non_finite=True)
            self.ds_engine.step()
            norm = norm if wants_norm else None
        else:
            # DeepSpeed's ZeRO optimizers check the gradient for inf / nan in every precision and skip the step.
            with internals.scaled_step(self.ds_engine, factor):
                self.ds_engine.step()
            if wants_norm:
                value = self.ds_engine.get_global_grad_norm()
                norm = None if value is None else torch.as_tensor(float(value), dtype=torch.float64)
        self.deferral.review()
        self._window_coalesces = None
        applied = self.ds_engine.was_step_applied()
        return StepResult(applied=applied, grad_norm=norm, non_finite=not applied and not fp16)

    def zero_grad(self):
        pass  # DeepSpeed clears gradients inside step()

    # -- surviving a failed micro-step ------------------------------------------------------------
    def enable_failure_guard(self):
        # ``deepspeed_backend_problems`` leaves only windows that issue no collective once the reduction waits
        # for the boundary: stage 0 (no boundary backward), stage 1 and deferred stage 2 (coalesced).
        self._guarded = True

    def discard_window(self):
        """Forget this rank's gradients of the window in progress, without any collective (a
        failed window is discarded by every rank after a vote, or by one rank whose batch
        raised). A coalesce block stays open: the next window continues in it and its one
        reduction runs at that window's end."""
        internals.drop_window_gradients(self.ds_engine, self.stage)

    # -- state ------------------------------------------------------------------------------------
    def held_tensors(self):
        return list(internals.held_tensors(self.ds_engine))

    def gathered(self, modifier_rank):
        # DeepSpeed's own: at ZeRO-3 it gathers and, with a modifier rank, re-partitions its values
        return self.deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=modifier_rank,
                                                      enabled=self.stage == 3)

    def full_state_dict(self):
        with self.deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None,
                                                    enabled=self.stage == 3):
            return cpu_state_dict(self.module.state_dict())

    def save_training_state(self, directory):
        directory = str(directory)
        self.ds_engine.save_checkpoint(directory, tag=TAG, client_state={}, save_latest=False)
        if self.rank == 0:
            with open(os.path.join(directory, STATE_FILE), "w") as f:
                json.dump({"stage": self.stage, "world_size": self.world_size}, f)

    def load_training_state(self, directory):
        directory = str(directory)
        try:
            with open(os.path.join(directory, STATE_FILE)) as f:
                saved = json.load(f)
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{directory} is not a Microstep DeepSpeed state ({STATE_FILE}: {error})") from None
        if saved["stage"] != self.stage:
            raise CheckpointError(
                f"{directory} was saved by DeepSpeed at ZeRO stage {saved['stage']}; this engine runs stage "
                f"{self.stage}. DeepSpeed cannot load a checkpoint into another ZeRO stage: set "
                f"zero_optimization.stage: {saved['stage']} (to change stage, export the weights with "
                "full_state_dict() and start a new run)")
        if saved["world_size"] != self.world_size and self.stage >= 1:
            self._load_universal(directory, saved["world_size"])
            return
        try:
            path, _ = self.ds_engine.load_checkpoint(directory, tag=TAG, load_optimizer_states=True,
                                                     load_lr_scheduler_states=False)
        except Exception as error:  # DeepSpeed raises many kinds; say what it was
            raise CheckpointError(f"DeepSpeed could not load {directory}: {type(error).__name__}: {error}") from error
        if path is None:
            raise CheckpointError(f"{directory} holds no DeepSpeed model state")

    def _load_universal(self, directory: str, saved_world: int) -> None:
        """ZeRO-1/2/3 state saved on another number of ranks: rank 0 converts it to DeepSpeed's
        universal checkpoint (next to the checkpoint, removed afterwards), every rank loads it."""
        outcome = [None, None]  # [universal directory, error]
        if self.rank == 0:
            checkpoint = os.path.dirname(os.path.abspath(directory))
            try:
                outcome[0] = tempfile.mkdtemp(prefix=f".{os.path.basename(checkpoint)}.universal-",
                                              dir=os.path.dirname(checkpoint))
                with _quiet_stdout():
                    internals.to_universal(os.path.join(directory, TAG), os.path.join(outcome[0], TAG))
            except Exception as error:  # noqa: BLE001 - reported on every rank below
                outcome[1] = f"{type(error).__name__}: {error}"
        if self.world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        universal, problem = outcome
        try:
            if problem is None:
                try:
                    with internals.universal_checkpoint_loading(self.ds_engine):
                        path, _ = self.ds_engine.load_checkpoint(universal, tag=TAG, load_optimizer_states=True,
                                                                 load_lr_scheduler_states=False)
                    problem = None if path is not None else "no model state found"
                except Exception as error:  # noqa: BLE001
                    problem = f"{type(error).__name__}: {error}"
        finally:
            if self.world_size > 1:
                dist.barrier()
            if self.rank == 0 and universal is not None:
                shutil.rmtree(universal, ignore_errors=True)
        if problem is not None:
            raise CheckpointError(
                f"{directory} holds ZeRO-{self.stage} state of {saved_world} rank(s); this run has "
                f"{self.world_size}. Converting it to DeepSpeed's universal checkpoint failed: {problem}. "
                f"Resume on {saved_world} rank(s), or load the weights alone with full_state_dict() exports")
        log.info("resumed ZeRO-%d state of %d rank(s) on %d through DeepSpeed's universal checkpoint",
                 self.stage, saved_world, self.world_size)

    def close(self):
        if self._block is not None:  # a window abandoned with the engine
            self.discard_window()
            self._close_block()  # no gradient left: its flush reduces nothing
        self.ds_engine.destroy()
