"""``import engine.compat.deepspeed as deepspeed``: a DeepSpeed training script, unchanged,
trained by Microstep.

DeepSpeed's entry points with DeepSpeed's signatures: ``add_config_arguments``,
``init_distributed``, ``initialize`` → ``(engine, optimizer, training_dataloader,
lr_scheduler)``. The engine returned is a thin facade, :class:`DeepSpeedEngine`, over one
:class:`engine.Engine`; every training decision (windows, weighting, clipping, stepping,
checkpoints) is that Engine's.

DeepSpeed's semantics, kept:

* ``backward(loss)`` takes the micro-batch's mean loss, unscaled; ``step()`` follows every
  ``backward`` and updates the parameters only at the window's boundary. Each micro-batch
  is weighted by its real size (the batch size of what ``engine(...)`` was given), which
  for equal micro-batches is DeepSpeed's 1/A, and exact for a short last one.
* A config without ``gradient_clipping`` clips at 1.0, DeepSpeed's default.
* The config's ``optimizer`` is built on ``model_parameters`` (parameter groups included);
  its ``WarmupLR`` / ``WarmupDecayLR`` / ``WarmupCosineLR`` step as DeepSpeed's do, one step
  late. An ``optimizer`` or ``lr_scheduler`` passed in (instance or callable) wins over the
  config's.
* ``save_checkpoint(save_dir, tag)`` writes ``save_dir/tag`` (default
  ``global_step<N>``) and the ``latest`` file; ``load_checkpoint(load_dir, tag=None)``
  follows ``latest`` and returns ``(path, client_state)``, or ``(None, None)`` without one.

The other names DeepSpeed's examples import live in this package's modules, under the
same names: ``accelerator`` (``get_accelerator``), ``checkpointing`` (``configure``, ``checkpoint``,
``is_configured``), ``comm``, ``moe.utils``, ``utils`` (``logger``,
``log_dist``, ``RepeatingLoader``, ``zero_to_fp32``) and ``zero`` (``GatheredParameters``, ``Init``).

What differs from DeepSpeed: docs/migrating.md.
"""
from __future__ import annotations

import argparse
import logging
import os

import torch

import engine
from engine.batching.plan import split_evenly
from engine.distributed.collectives import from_rank0
from engine.compat import refuse_engine_formed_micro_batches
from engine.config.schema import Config, load_config
from engine.config.checks import check_without_model
from engine.batching.data import DistributedBatches
from engine.distributed.process_group import barrier, read_launch_env
from engine.errors import ConfigError, EngineUsageError
from engine.batching.microbatch import batch_size, split_batch
from engine.config.optim import build_deepspeed_scheduler, build_optimizer
from engine.compat.deepspeed import accelerator, checkpointing, comm, moe, utils, zero
from engine.compat.deepspeed.accelerator import get_accelerator
from engine.compat.deepspeed.comm import init_distributed

__all__ = ["add_config_arguments", "init_distributed", "initialize", "DeepSpeedEngine", "MicroBatchLoader",
           "get_accelerator", "accelerator", "checkpointing", "comm", "moe", "utils", "zero"]

log = logging.getLogger("engine")

DEFAULT_GRADIENT_CLIPPING = 1.0  # DeepSpeed's, when a config does not set gradient_clipping
LATEST = "latest"  # the file naming the newest checkpoint tag in a save_dir


# -- entry points ---------------------------------------------------------------------------
def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: ``--deepspeed`` (a switch for the script's own use),
    ``--deepspeed_config PATH``, and their deprecated ``--deepscale`` spellings."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (run by Microstep)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script; Microstep runs either way)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)``. The config comes from ``config`` / ``config_params`` (a path or a dict)
    or ``args.deepspeed_config``; ``training_dataloader`` (None without ``training_data``)
    yields this rank's micro-batches. The process group is joined here unless
    ``init_distributed`` (or the script) did already; ``distributed_port`` and
    ``dist_init_required`` change nothing: the launcher's environment decides."""
    if model is None:
        raise EngineUsageError("deepspeed.initialize requires a model")
    if mpu is not None or mesh_param is not None:
        raise EngineUsageError("initialize(mpu=/mesh_param=): Microstep builds its own mesh: tensor parallelism "
                               "from the config (tensor_parallel.autotp_size), data parallelism and ZeRO over the "
                               "rest, a pipeline from its pipeline section (trained with engine.initialize's "
                               "train_batch); it has no sequence parallelism")
    config = load_config(_config_source(args, config, config_params), caller_reads={"dataloader_drop_last"})
    default_clipping = "gradient_clipping" not in config.model_fields_set
    if default_clipping:
        config = config.model_copy(update={"gradient_clipping": DEFAULT_GRADIENT_CLIPPING})
    problems = check_without_model(config)
    if problems:
        raise ConfigError(problems)
    refuse_engine_formed_micro_batches(config, "DeepSpeed-style")
    params = list(model.parameters() if model_parameters is None else model_parameters)
    optimizer, config = _client_or_config_optimizer(optimizer, params, config)
    lr_scheduler, config = _client_or_config_scheduler(lr_scheduler, config)
    # Each micro-batch weighted by its real size; get_global_grad_norm() answers at every stage.
    eng = engine.initialize(model, config, optimizer=optimizer, lr_scheduler=lr_scheduler, manual_sizes="inputs",
                            grad_norm_every_step=True)
    zero.register(eng)  # deepspeed.zero.GatheredParameters finds it by its parameters
    if default_clipping:
        log.info("gradient_clipping: %g (DeepSpeed's default; the config does not set it)", DEFAULT_GRADIENT_CLIPPING)
    loader = None
    if training_data is not None:
        loader = MicroBatchLoader(training_data, eng.plan, collate_fn=collate_fn,
                                  drop_last=bool(config.deepspeed_extras.get("dataloader_drop_last", False)))
    return DeepSpeedEngine(eng), eng.optimizer, loader, eng.lr_scheduler


def _config_source(args, config, config_params):
    config = config_params if config is None else config
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise EngineUsageError("a config came both from --deepspeed_config and from initialize(config=...): "
                                   "pass one of them")
        config = from_args
    if config is None:
        raise EngineUsageError("deepspeed.initialize needs a config: --deepspeed_config PATH on the command line "
                               "(with deepspeed.add_config_arguments(parser)), or config=PATH or a dict")
    return config


def _client_or_config_optimizer(optimizer, params: list, config: Config):
    """DeepSpeed's precedence: the client's optimizer (an instance, or a callable given
    ``model_parameters``), else the config's section built on ``model_parameters``."""
    if optimizer is not None:
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            return (lambda _: optimizer(params)), config
        return optimizer, config
    if config.optimizer is None:
        return None, config  # engine.initialize says what is missing
    return build_optimizer(config.optimizer, params), config.model_copy(update={"optimizer": None})


def _client_or_config_scheduler(lr_scheduler, config: Config):
    if lr_scheduler is not None or config.scheduler is None:
        return lr_scheduler, config
    section = config.scheduler
    return (lambda optimizer: build_deepspeed_scheduler(section, optimizer)), \
        config.model_copy(update={"scheduler": None})


# -- the engine -------------------------------------------------------------------------------
_FACADE_LOOP = "model_engine(batch), model_engine.backward(loss), model_engine.step()"


class DeepSpeedEngine:
    """What ``initialize`` returns: DeepSpeed's engine methods, each a call into one
    :class:`engine.Engine` (``.engine``). Attributes it does not define are looked up on the
    model, as DeepSpeed's engine does."""

    def __init__(self, eng: engine.Engine):
        self.engine = eng
        self._step_applied = False

    def __getattr__(self, name: str):
        if name.startswith("__") or "engine" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.engine.module, name)

    # -- a micro-step ---------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
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


# -- data ---------------------------------------------------------------------------------------
class MicroBatchLoader:
    """DeepSpeed's ``training_dataloader``: this rank's micro-batches of a map-style dataset,
    window after window. Each global batch is ``engine.batching.data.DistributedBatches``', cut
    into the plan's A micro-batches. As with DeepSpeed's loader (a ``DistributedSampler``,
    seed 0), every optimizer step sees the samples DeepSpeed's would (split between the ranks
    differently), and a pass starts over in the sampler's epoch, which only ``set_epoch``
    changes: without it every epoch has epoch 0's order, as in DeepSpeed. A pass stopped
    early (``break``) resumes where it stopped."""

    def __init__(self, dataset, plan, *, collate_fn=None, drop_last: bool = False, seed: int = 0):
        if plan.is_data_defined:
            raise ConfigError(["training_data: batching a dataset needs train_batch_size or "
                               "train_micro_batch_size_per_gpu in the config"])
        try:
            self.batches = DistributedBatches(dataset, plan, shuffle=True, seed=seed, drop_last=drop_last,
                                              collate_fn=collate_fn)
        except ValueError as error:
            raise ConfigError([f"training_data: {error} (drop_last is the config's dataloader_drop_last)"]) from None
        self.accumulation = plan.gradient_accumulation_steps
        self.sampler_epoch = 0  # DeepSpeed's sampler's epoch: set_epoch alone changes it

    @property
    def data_sampler(self) -> MicroBatchLoader:
        """What DeepSpeed's loader calls its sampler: ``set_epoch(e)`` (and ``epoch``) here."""
        return self

    @property
    def epoch(self) -> int:
        return self.sampler_epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler_epoch = epoch
        self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches) * self.accumulation

    def __iter__(self):
        if self.batches.step == 0:  # a new pass: the sampler's epoch again, not the next one
            self.batches.set_epoch(self.sampler_epoch)
        for batch in self.batches:
            yield from split_batch(batch, split_evenly(batch_size(batch), self.accumulation))
