"""``import engine.compat.colossalai as colossalai``: a legacy Colossal-AI training script,
with that import changed, trained by Microstep.

Colossal-AI's legacy entry points: ``launch_from_torch(config=...)``, ``gpc`` (its global
context: ``gpc.config``), ``initialize(model, optimizer, criterion, train_dataloader,
test_dataloader, lr_scheduler)`` → ``(engine, train_dataloader, test_dataloader,
lr_scheduler)``. The engine, :class:`ColossalEngine`, is a thin facade over one
:class:`engine.Engine`: ``zero_grad``, ``engine(x)``, ``criterion``, ``backward``,
``step``, ``train``, ``eval``.

Colossal-AI's semantics, kept:

* ``gradient_accumulation = A``: ``step()`` updates the parameters at every A-th call
  only, and ``zero_grad()`` at the top of each iteration never clears a window in progress.
  Each micro-batch is weighted by its real size (Colossal-AI divides every loss by A: the
  same for equal batches, exact for a short one).
* The config's batch size (``BATCH_SIZE``) is the script's data loader's, per process: a
  config giving only ``gradient_accumulation`` has a data-defined plan; one without it
  accumulates nothing (A = 1).
* The train data loader is cut to whole windows per epoch, as Colossal-AI's
  ``GradAccumDataloader`` does (the last ``len % A`` batches are dropped), and the scheduler
  the script steps every iteration moves once per window (``GradAccumLrSchedulerByStep``).

What differs: docs/migrating.md.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

import engine
from engine.compat import refuse_engine_formed_micro_batches
from engine.config.schema import ALIASES, Config, load_config
from engine.distributed.process_group import get_rank, get_world_size, init_distributed, read_launch_env
from engine.errors import EngineUsageError
from engine.state.rng import seed_everything

__all__ = ["launch_from_torch", "gpc", "initialize", "ColossalEngine", "ConfigView", "GlobalContext"]

log = logging.getLogger("engine")

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_ONE_RANK_MODES = ("PIPELINE", "TENSOR", "SEQUENCE")  # parallel modes Microstep does not split over


class ConfigView(Mapping):
    """``gpc.config``: a loaded config read the way Colossal-AI scripts read theirs, by
    attribute or key, with the names the file uses: its UPPER_CASE constants, its legacy keys
    (``num_epochs``, ``logging``...), aliases (``gradient_accumulation``, ``clip_grad_norm``)
    and the settings it gave. A name the file did not set is missing (``in`` is False,
    ``.get(name, default)`` gives the default)."""

    def __init__(self, config: Config):
        self._config = config

    def _names(self) -> dict[str, Any]:
        config = self._config
        names = {field: getattr(config, field) for field in config.model_fields_set
                 if field not in ("constants", "colossalai_extras", "deepspeed_extras")}
        names.update({alias: names[canonical] for alias, canonical in ALIASES.items() if canonical in names})
        return {**names, **config.deepspeed_extras, **config.colossalai_extras, **config.constants}

    def __getitem__(self, name: str):
        return self._names()[name]

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"gpc.config has no {name!r}: the config ({self._config.source}) does not set it"
                                 ) from None

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @property
    def microstep(self) -> Config:
        """The validated Microstep config behind this view."""
        return self._config


class GlobalContext:
    """Colossal-AI's ``gpc``: the launched config and this process's place in the job."""

    def __init__(self):
        self._config: ConfigView | None = None

    @property
    def config(self) -> ConfigView:
        if self._config is None:
            raise EngineUsageError("gpc.config is set by colossalai.launch_from_torch(config=...): call it first")
        return self._config

    def get_global_rank(self) -> int:
        return get_rank()

    def get_local_rank(self, parallel_mode=None) -> int:
        return read_launch_env().local_rank if _splits_over_ranks(parallel_mode) else 0

    def get_world_size(self, parallel_mode=None) -> int:
        """The number of processes in ``parallel_mode``'s group: every process (GLOBAL, the
        default), the data-parallel ranks (DATA), the tensor group (TENSOR, from the config's
        tensor size); 1 for pipeline / sequence modes."""
        name = _mode_name(parallel_mode)
        tensor = self._config.microstep.tensor_parallel.size if self._config is not None else 1
        if name in ("TENSOR", "PARALLEL_1D"):
            return tensor
        if name == "DATA":
            return get_world_size() // tensor
        return get_world_size() if _splits_over_ranks(parallel_mode) else 1


def _mode_name(parallel_mode):
    name = getattr(parallel_mode, "name", parallel_mode)
    return name.upper() if isinstance(name, str) else name


def _splits_over_ranks(parallel_mode) -> bool:
    name = _mode_name(parallel_mode)
    return not (isinstance(name, str) and name in _ONE_RANK_MODES)


gpc = GlobalContext()


def launch_from_torch(config, backend: str | None = None, seed: int = 1024, verbose: bool = True) -> None:
    """Read ``config`` (a path, a dict or an ``engine.Config``) into ``gpc.config``, join the
    process group torchrun (or ``python -m launch``) describes, and seed every generator with
    ``seed`` as Colossal-AI does. ``backend``: nccl or gloo; None picks the config's
    ``distributed.backend`` (nccl with CUDA, else gloo)."""
    loaded = load_config(config)
    if not loaded.model_fields_set & set(_BATCH_KEYS):
        loaded = loaded.model_copy(update={"gradient_accumulation_steps": 1})  # Colossal-AI: no accumulation
    init_distributed(loaded.distributed.timeout_seconds, backend or loaded.distributed.backend,
                     agreement_timeout_seconds=loaded.distributed.agreement_timeout_seconds)
    seed_everything(seed)
    gpc._config = ConfigView(loaded)
    if verbose and get_rank() == 0:
        log.info("launched from torch: %d process(es), config %s", get_world_size(), loaded.source)


def initialize(model: torch.nn.Module, optimizer, criterion=None, train_dataloader=None, test_dataloader=None,
               lr_scheduler=None, ophooks=None, verbose: bool = True):
    """Colossal-AI's ``initialize``: ``(engine, train_dataloader, test_dataloader,
    lr_scheduler)`` for the launched config. ``optimizer``: an optimizer built on
    ``model.parameters()`` (or a callable given them, or None for the config's section)."""
    if ophooks:
        raise EngineUsageError("initialize(ophooks=...): Colossal-AI's operator hooks are not supported")
    refuse_engine_formed_micro_batches(gpc.config.microstep, "Colossal-AI-style")
    # each micro-batch weighted by its real size
    eng = engine.initialize(model, gpc.config.microstep, optimizer=optimizer, manual_sizes="inputs")
    accumulation = eng.plan.gradient_accumulation_steps
    if train_dataloader is not None:
        train_dataloader = WholeWindows(train_dataloader, accumulation)
    if lr_scheduler is not None:
        lr_scheduler = OncePerWindow(lr_scheduler, accumulation)
    return ColossalEngine(eng, criterion), train_dataloader, test_dataloader, lr_scheduler


class ColossalEngine:
    """What ``initialize`` returns: Colossal-AI's engine methods over one
    :class:`engine.Engine` (``.engine``)."""

    def __init__(self, eng: engine.Engine, criterion=None):
        self.engine = eng
        self.criterion = criterion

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def zero_grad(self) -> None:
        """Clears gradients between windows; never a window in progress."""
        self.engine.zero_grad()

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        """Call after every ``backward``: updates the parameters at the window's boundary only."""
        self.engine.step()

    def train(self) -> None:
        self.engine.module.train()

    def eval(self) -> None:
        self.engine.module.eval()


class WholeWindows:
    """The train data loader cut to whole accumulation windows per epoch, as Colossal-AI's
    ``GradAccumDataloader``: the last ``len % A`` batches of an epoch are dropped. A loader
    without a length is passed through whole. Other attributes are the loader's."""

    def __init__(self, loader, accumulation: int):
        self.loader = loader
        self.accumulation = accumulation
        if hasattr(loader, "__len__") and len(loader) < accumulation:
            log.warning("the train data loader holds %d batch(es), fewer than gradient_accumulation %d: an epoch "
                        "takes no optimizer step", len(loader), accumulation)

    def __len__(self) -> int:
        return len(self.loader) // self.accumulation * self.accumulation

    def __iter__(self):
        if not hasattr(self.loader, "__len__"):
            yield from self.loader
            return
        for _, batch in zip(range(len(self)), self.loader):
            yield batch

    def __getattr__(self, name: str):
        if name.startswith("__") or "loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.loader, name)


class OncePerWindow:
    """The script's scheduler, stepped by the script every iteration, moving once per
    accumulation window (Colossal-AI's ``GradAccumLrSchedulerByStep``). Other attributes
    are the scheduler's."""

    def __init__(self, scheduler, accumulation: int):
        self.scheduler = scheduler
        self.accumulation = accumulation
        self.calls = 0  # step() calls since the scheduler last moved

    def step(self, *args, **kwargs) -> None:
        self.calls += 1
        if self.calls == self.accumulation:
            self.calls = 0
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.calls = state["calls"]

    def __getattr__(self, name: str):
        if name.startswith("__") or "scheduler" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.scheduler, name)
