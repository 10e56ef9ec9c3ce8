"""``colossalai.context`` and the global context ``gpc``: the launched config (``gpc.config``)
and this process's place in the job, on the config's mesh (``engine.distributed.mesh``):
pipeline × data × tensor; sequence modes have one rank."""
from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from engine.config.schema import ALIASES, Config
from engine.config.setup import mesh_layout
from engine.distributed.process_group import get_rank, get_world_size
from engine.errors import EngineUsageError

__all__ = ["ParallelMode", "ConfigView", "GlobalContext", "gpc"]


class ParallelMode(enum.Enum):
    """Colossal-AI's parallel modes, for ``gpc.get_world_size(ParallelMode.DATA)`` and the like."""

    GLOBAL = "global"
    DATA = "data"
    PIPELINE = "pipe"
    TENSOR = "tensor"
    SEQUENCE = "sequence"


_ONE_RANK_MODES = ("PIPELINE", "TENSOR", "SEQUENCE")  # modes get_world_size does not count over every rank


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

    def load(self, config: Config) -> None:
        """Set ``gpc.config`` (``launch_from_torch`` does)."""
        self._config = ConfigView(config)

    def get_global_rank(self) -> int:
        return get_rank()

    def get_local_rank(self, parallel_mode=None) -> int:
        """This process's rank inside ``parallel_mode``'s group, as Colossal-AI numbers it (not
        its index on the node): the global rank (GLOBAL, the default), its data-parallel index
        (DATA, the rank a data sampler shards by), its place in the tensor group or the
        pipeline; 0 for sequence modes."""
        name = _mode_name(parallel_mode)
        rank = get_rank()
        if name in (None, "GLOBAL"):
            return rank
        if name not in ("DATA", "TENSOR", "PARALLEL_1D", "PIPELINE"):
            return 0  # sequence modes: one rank
        config = self._config.microstep if self._config is not None else None
        if config is None:
            return rank if name == "DATA" else 0
        place = mesh_layout(config, get_world_size()).coordinates(rank)
        return {"DATA": place.data, "PIPELINE": place.pipeline}.get(name, place.tensor)

    def get_world_size(self, parallel_mode=None) -> int:
        """The number of processes in ``parallel_mode``'s group: every process (GLOBAL, the
        default), the data-parallel ranks (DATA), the tensor group (TENSOR, from the config's
        tensor size), the pipeline (PIPELINE, its stages); 1 for sequence modes."""
        name = _mode_name(parallel_mode)
        config = self._config.microstep if self._config is not None else None
        tensor = config.tensor_parallel.size if config is not None else 1
        pipeline = config.pipeline.stages if config is not None else 1
        if name in ("TENSOR", "PARALLEL_1D"):
            return tensor
        if name == "PIPELINE":
            return pipeline
        if name == "DATA":
            return mesh_layout(config, get_world_size()).data if config is not None else get_world_size()
        return get_world_size() if _splits_over_ranks(parallel_mode) else 1


def _mode_name(parallel_mode):
    name = getattr(parallel_mode, "name", parallel_mode)
    return name.upper() if isinstance(name, str) else name


def _splits_over_ranks(parallel_mode) -> bool:
    name = _mode_name(parallel_mode)
    return not (isinstance(name, str) and name in _ONE_RANK_MODES)


gpc = GlobalContext()
