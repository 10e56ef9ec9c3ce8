"""``engine.initialize``: config → resolved setup → process group → strategy → plan → Engine,
every collaborator built here and handed to the Engine's constructor."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.autosave import automatic_checkpoints
from engine.autotune.tuner import MicroBatchTuner
from engine.batching.mesh_plan import plan_for_mesh
from engine.config.schema import ConfigError, load_config
from engine.config.checks import check_without_model
from engine.distributed.process_group import init_distributed
from engine.engine import Engine
from engine.window.executor import LossFn
from engine.experts.stages import config_for_global_balance, stage_balance
from engine.experts.window import expert_balance
from engine.monitor.startup import STARTUP_LOGGER, startup_lines
from engine.window.model_loss import LossReading, model_loss, packing_seams
from engine.monitor import Monitor
from engine.window.stages import stage_windows
from engine.precision.policy import check_autocast_computes
from engine.config.optim import OptimizerArg, build_optimizer, build_scheduler
from engine.distributed.rank_consistency import check_same_settings
from engine.state.rng import seed_everything
from engine.config.setup import process_group_request, resolve_setup
from engine.strategies import make_strategy
from engine.batching.token_budget import LengthsFn
from engine.batching.window_split import MANUAL_SIZES, window_split_for

log = logging.getLogger("engine")

# Layers whose forward computes statistics over the batch dimension: with accumulation
# they see one micro-batch, not the global batch.
_BATCH_STATISTICS_LAYERS = (torch.nn.modules.batchnorm._BatchNorm,)


def initialize(model: torch.nn.Module, config, *, optimizer: OptimizerArg = None,
               lr_scheduler: Any = None, loss_fn: LossFn | None = None,
               overrides=None, lengths: LengthsFn | None = None, manual_sizes: str = "plan",
               grad_norm_every_step: bool = False, tensor_plan=None) -> Engine:
    """Build an :class:`Engine` for ``model`` from ``config`` (a path, a dict or a Config).

    ``optimizer``: an optimizer instance built on ``model.parameters()``, a factory
    ``callable(params) -> Optimizer``, or None to build the config's ``optimizer`` section.
    ``lr_scheduler``: a scheduler instance built on that optimizer, a factory
    ``callable(optimizer) -> scheduler``, or None for the config's ``scheduler`` section.
    ``overrides``: dotted ``key=value`` strings applied on top of ``config``.
    ``lengths``: with ``micro_batch_tokens``, ``lengths(batch) -> 1-D int tensor`` of each
    row's real tokens, for batches without an ``attention_mask`` (see engine.batching.token_budget).
    ``manual_sizes``: what a manual loop's micro-batch counts for when the plan has sizes:
    ``"plan"`` (its planned size) or ``"inputs"`` (the batch size of what ``eng(...)`` was
    given; see engine.batching.window_split). A config giving only the accumulation steps always reads
    the inputs.
    ``grad_norm_every_step``: compute the gradient norm at every boundary
    (``eng.last_window.step.grad_norm``), even without clipping or a monitor that asks for it.
    ``tensor_plan``: how layers are split under ``tensor_parallel.size`` > 1, replacing the
    config's ``tensor_parallel.plan``: ``{module pattern: style}``, a style being a name
    (``colwise``, ``rowwise``, ``colwise_rep``) or a ``torch.distributed.tensor.parallel.ParallelStyle``
    (see engine.strategies.parallelize).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"engine.initialize needs a torch.nn.Module; got {type(model).__name__}")
    if lengths is not None and not callable(lengths):
        raise TypeError(f"lengths must be a function lengths(batch) -> 1-D int tensor; got {type(lengths).__name__}")
    if manual_sizes not in MANUAL_SIZES:
        raise ValueError(f"manual_sizes must be one of {', '.join(map(repr, MANUAL_SIZES))}; got {manual_sizes!r}")
    config = load_config(config, overrides)
    if config.seed is not None:
        seed_everything(config.seed)
    problems = check_without_model(config)
    if lengths is not None and config.micro_batch_tokens is None:
        problems.append("micro_batch_tokens: initialize(lengths=...) was given, but lengths are read only when "
                        "micro-batches are formed by tokens; set micro_batch_tokens, or drop lengths=")
    if problems:
        raise ConfigError(problems)
    group = process_group_request(config)
    dist_info = init_distributed(group.timeout_seconds, group.backend, group_for_one_process=group.group_for_one_process,
                                 agreement_timeout_seconds=group.agreement_timeout_seconds)
    _configure_logging(dist_info.rank)
    check_same_settings(config)  # before any group is built: a mesh of different shapes would hang
    config = config_for_global_balance(model, config)
    setup = resolve_setup(config, dist_info, tensor_plan)
    if setup.mesh.tensor == 1 and setup.tensor_parallel.plan != "auto":
        log.warning("a tensor-parallel plan was given (tensor_plan= or tensor_parallel.plan) but tensor_parallel.size "
                    "is 1: nothing is split; set tensor_parallel.size to split the model")
    check_autocast_computes(model, setup.precision, "with torch_autocast" if setup.mesh.is_data_parallel_only
                            else f"under {setup.mesh.describe()}")
    strategy = make_strategy(setup, dist_info)
    plan = plan_for_mesh(config, setup.mesh, dist_info.rank)
    # auto / explore may grow the accumulation later, token budgets choose it per window:
    # check as if it were > 1
    fixed = not plan.is_provisional and plan.micro_batch_tokens is None
    _check_batch_statistics(model, config, plan.gradient_accumulation_steps if fixed else None)
    optimizer = _materialise_optimizer(optimizer, model, config)
    strategy.setup(model, optimizer)
    context = strategy.context  # context_parallel: installed by the strategy's parallelize
    monitor = Monitor(config.monitor, rank=dist_info.rank) if config.monitor.enabled else None
    autosave = automatic_checkpoints(config.checkpoint, dist_info.rank)
    own_loss = model_loss(model)  # the model's own loss, read as (sum, count) (engine.window.model_loss)
    stages = stage_windows(strategy, plan, own_loss)  # None without a pipeline
    experts = expert_balance(model, config.moe, strategy=strategy, checkpointing=setup.checkpointing is not None,
                             stages_run_micro_steps=stages is not None)
    schedule_steps = stages.fitting_micro_batches if stages is not None else None
    # under a pipeline the window's hooks are its stages' routers (None: none counted there)
    window_hooks = experts if stages is None else stage_balance(model, config.moe, strategy, experts)
    tuner = MicroBatchTuner(strategy, plan, memory_limit=config.auto_memory_limit, stages=stages) \
        if plan.is_provisional else None
    window_split = window_split_for(plan, manual_sizes=manual_sizes, lengths=lengths,
                                    sequence_keys=config.sequence_keys, schedule_steps=schedule_steps,
                                    length_multiple=context.shards.chunks if context is not None else 1,
                                    packing=packing_seams(model, own_loss) if config.packing else None)
    eng = Engine(config=config, plan=plan, strategy=strategy, window_split=window_split,
                 tuner=tuner, stages=stages,  # None: each window runs once
                 monitor=monitor, autosave=autosave, checkpoint_states={"micro_batch_tuner": tuner},
                 lr_scheduler=_materialise_scheduler(lr_scheduler, strategy.optimizer, config),
                 loss_fn=loss_fn, grad_norm_every_step=grad_norm_every_step, window_hooks=window_hooks,
                 experts=experts, context=context, losses=LossReading(own_loss, strict=config.strict))
    if dist_info.rank == 0:  # what is on, once
        logging.getLogger(STARTUP_LOGGER).info("start-up:\n  %s", "\n  ".join(startup_lines(config, setup, plan, own_loss_type=own_loss.loss_type,
                                                                 routes=experts is not None)))
    if monitor is not None:
        monitor.attach(eng)  # starts the first step's clock, watches the learning rate
    if autosave is not None:
        autosave.start(eng)  # may resume: last
    return eng


def _configure_logging(rank: int) -> None:
    """Unless the application configured logging itself, show the engine's messages: INFO
    and up on rank 0, warnings and errors on the other ranks (prefixed by their rank)."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[microstep{f' rank {rank}' if rank else ''}] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False  # handlers the application adds later would print everything twice


def _materialise_optimizer(optimizer: OptimizerArg, model: torch.nn.Module, config) -> torch.optim.Optimizer:
    """An optimizer instance on the model's original parameters (strategies re-point it)."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no parameter that requires grad: there is nothing to train")
    if optimizer is None:
        if config.optimizer is None:
            raise ConfigError([
                "optimizer: no optimizer given: add an `optimizer: {type: AdamW, params: {lr: ...}}` "
                "section to the config, or pass optimizer= to initialize"
            ])
        return build_optimizer(config.optimizer, model.parameters())
    if config.optimizer is not None:
        log.warning("an optimizer was passed to engine.initialize; the config's optimizer section is ignored")
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, a callable(params) -> Optimizer, or None; "
                f"got {type(optimizer).__name__}"
            )
        optimizer = optimizer(model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not an Optimizer")
    model_params = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params)
    if foreign:
        raise ValueError(
            f"the optimizer holds {foreign} parameter(s) that are not the model's: build it on "
            "model.parameters() of the model passed to engine.initialize"
        )
    return optimizer


def _materialise_scheduler(lr_scheduler: Any, optimizer: torch.optim.Optimizer, config):
    if lr_scheduler is None:
        return build_scheduler(config.scheduler, optimizer) if config.scheduler is not None else None
    if config.scheduler is not None:
        log.warning("an lr_scheduler was passed to engine.initialize; the config's scheduler section is ignored")
    if hasattr(lr_scheduler, "step"):
        if getattr(lr_scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("lr_scheduler was built on a different optimizer than the engine's")
        return lr_scheduler
    if callable(lr_scheduler):
        return lr_scheduler(optimizer)
    raise TypeError(f"lr_scheduler must be a scheduler, a callable(optimizer), or None; got {type(lr_scheduler).__name__}")


def _check_batch_statistics(model: torch.nn.Module, config, accumulation: int | None) -> None:
    """``accumulation`` None: not known yet (automatic micro-batch size)."""
    if accumulation == 1 or config.batch_statistics == "ignore":
        return
    names = [name or type(model).__name__ for name, m in model.named_modules()
             if isinstance(m, _BATCH_STATISTICS_LAYERS) and m.training]
    if not names:
        return
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    message = (
        f"the model has layers that compute statistics over the batch ({shown}); with "
        f"gradient_accumulation_steps={accumulation or 'chosen automatically'} they see one micro-batch at a time, not the "
        "global batch, so training differs from a full-batch run. Alternatives: GroupNorm or "
        "LayerNorm (no batch statistics), SyncBatchNorm (statistics across ranks, still per "
        "micro-batch), or accumulation 1. Set batch_statistics: ignore to silence this, or "
        "batch_statistics: error to refuse such models."
    )
    if config.batch_statistics == "error":
        raise ConfigError([f"batch_statistics: {message}"])
    log.warning(message)
