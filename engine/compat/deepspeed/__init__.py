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
``is_configured``), ``comm``, ``compression.helper``, ``moe.utils``, ``ops.adam`` (``FusedAdam``,
``DeepSpeedCPUAdam``: torch's Adam), ``runtime`` (``config``, ``engine``, ``utils``,
``zero.partition_parameters``), ``utils`` (``logger``, ``log_dist``, ``RepeatingLoader``,
``zero_to_fp32``) and ``zero`` (``GatheredParameters``, ``Init``, ``ZeroParamStatus``);
``hf`` answers transformers' ``HfDeepSpeedConfig`` / ``is_deepspeed_zero3_enabled`` without
DeepSpeed. The names Microstep does not provide raise ``NotProvidedError`` saying what to use
(``not_provided``).

What differs from DeepSpeed: docs/migrating.md.
"""
from __future__ import annotations

import argparse
import logging
import os

import torch

import engine
from engine.compat import refuse_engine_formed_micro_batches
from engine.config.schema import Config, load_config
from engine.config.checks import check_without_model
from engine.errors import ConfigError, EngineUsageError
from engine.config.optim import build_deepspeed_scheduler, build_optimizer
from engine.compat.deepspeed import accelerator, checkpointing, comm, compression, module_inject, moe, ops, pipe, \
    runtime, utils, zero
from engine.compat.deepspeed.accelerator import get_accelerator
from engine.compat.deepspeed.comm import init_distributed
from engine.compat.deepspeed.hf import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
from engine.compat.deepspeed.mixed_import import warn_if_mixed
from engine.compat.deepspeed.not_provided import NOT_PROVIDED, NotProvidedError, refusal
from engine.compat.deepspeed.runtime.dataloader import MicroBatchLoader
from engine.compat.deepspeed.runtime.engine import DeepSpeedEngine

__all__ = ["add_config_arguments", "init_distributed", "initialize", "DeepSpeedEngine", "MicroBatchLoader",
           "get_accelerator", "HfDeepSpeedConfig", "is_deepspeed_zero3_enabled", "NotProvidedError",
           "accelerator", "checkpointing", "comm", "compression", "module_inject", "moe", "ops", "pipe", "runtime",
           "utils", "zero"]

log = logging.getLogger("engine")

DEFAULT_GRADIENT_CLIPPING = 1.0  # DeepSpeed's, when a config does not set gradient_clipping


def __getattr__(name: str):
    """DeepSpeed's top-level names Microstep does not provide: an error saying what to use."""
    if f"deepspeed.{name}" in NOT_PROVIDED:
        raise refusal(f"deepspeed.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- entry points ---------------------------------------------------------------------------
def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: ``--deepspeed`` (a switch for the script's own use),
    ``--deepspeed_config PATH``, and their deprecated ``--deepscale`` spellings. Under a launcher
    that sets ``LOCAL_RANK`` (torchrun, ``python -m launch``) ``args.local_rank`` defaults to it,
    as the deepspeed launcher's ``--local_rank`` sets it: declare ``--local_rank`` before this call."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (run by Microstep)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script; Microstep runs either way)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    # The deepspeed launcher passes --local_rank; torchrun and `python -m launch` pass LOCAL_RANK in the
    # environment instead, so a script that declares --local_rank (default -1) reads the same value,
    # and one that does not is given no flag it cannot parse.
    if "LOCAL_RANK" in os.environ:
        parser.set_defaults(local_rank=int(os.environ["LOCAL_RANK"]))
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
    warn_if_mixed(config.backend)
    optimizer_name = _optimizer_name(optimizer, config)
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
    return DeepSpeedEngine(eng, optimizer_name), eng.optimizer, loader, eng.lr_scheduler


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


def _optimizer_name(optimizer, config: Config) -> str:
    """DeepSpeed's ``optimizer_name()``: the client optimizer's class name, else the config's type in lower case."""
    if optimizer is not None:
        return type(optimizer).__name__
    return "" if config.optimizer is None else config.optimizer.type.lower()


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


