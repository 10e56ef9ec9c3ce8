"""Colossal-AI (legacy API) configs as written: what Microstep maps, checks, keeps or refuses.

* ``colossalai_imports()``: while a Python config runs without colossalai installed, its
  ``from colossalai... import ...`` lines get stand-ins (``AMP_TYPE`` is a real enum).
* ``translate(raw, problems)``: ``fp16 = dict(mode=AMP_TYPE.X, ...)`` becomes our fp16
  section; ``parallel`` is checked and dropped: ``pipeline=N`` becomes ``pipeline.stages: N``,
  a 1-D ``tensor`` size ``tensor_parallel.size``, other sizes must be 1. Returns the warnings to
  give once the config is valid.
* ``COLOSSALAI_TOP_LEVEL_KEYS``: legacy keys kept unused in ``colossalai_extras``, each with
  what to do instead. ``clip_grad_norm`` and ``gradient_accumulation`` are aliases
  (``engine.config.schema.ALIASES``).
"""
from __future__ import annotations

import contextlib
import difflib
import enum
import importlib.abc
import importlib.machinery
import importlib.util
import math
import sys
from typing import Any, Callable, Optional

from engine.config.raw import RawConfig


# -- imports while a config runs ----------------------------------------------------------
class AMP_TYPE(enum.Enum):  # noqa: N801 -- Colossal-AI's name, as configs import it
    """Colossal-AI's AMP modes, for configs read without colossalai installed."""

    APEX = "apex"
    TORCH = "torch"
    NAIVE = "naive"


class StandIn:
    """Any other colossalai name a config mentions, e.g. ``TensorShardStrategy()`` inside a
    ``zero`` section Microstep does not use: it can be called and has stand-in attributes,
    so the config still loads; a stand-in where Microstep needs a value is a type error."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # copy / pickle probe dunders; keep the protocol defaults
            raise AttributeError(attr)
        return _stand_in(f"{self.name}.{attr}")

    def __call__(self, *args, **kwargs):
        return StandIn(f"{self.name}(...)")

    def __repr__(self) -> str:  # also what rank-consistency hashes: no object ids
        return f"<{self.name}: colossalai is not installed>"


def _stand_in(name: str):
    return AMP_TYPE if name.rpartition(".")[2] == "AMP_TYPE" else StandIn(name)


class _StandInModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``colossalai`` and every submodule; their attributes are stand-ins."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] != "colossalai":
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return None  # a plain module

    def exec_module(self, module) -> None:
        def stand_in(attr: str):
            if attr.startswith("_"):
                raise AttributeError(attr)
            return _stand_in(f"{module.__name__}.{attr}")
        module.__getattr__ = stand_in


@contextlib.contextmanager
def colossalai_imports():
    """Stand-in ``colossalai`` modules for the duration, unless colossalai is installed (then
    its own imports run). Nothing of the stand-ins stays in ``sys.modules`` afterwards."""
    if importlib.util.find_spec("colossalai") is not None:
        yield
        return
    finder = _StandInModules()
    sys.meta_path.append(finder)  # last: it answers only what no real finder found
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [name for name, module in sys.modules.items()
                     if getattr(getattr(module, "__spec__", None), "loader", None) is finder]:
            del sys.modules[name]


# -- legacy top-level keys --------------------------------------------------------------------
# Keys Colossal-AI's legacy engine, trainer and config builder read, which Microstep keeps in
# colossalai_extras without using them; the text says what to do instead (None: nothing,
# the value is the script's own).
COLOSSALAI_TOP_LEVEL_KEYS: dict[str, Optional[str]] = {
    "zero": "for ZeRO set zero_optimization: {stage: 0..3}",
    "gradient_handler": "Microstep synchronises gradients itself",
    "torch_ddp": "Microstep synchronises gradients itself",
    "engine": "write gradient_accumulation / clip_grad_norm at the top level",
    "cudnn_benchmark": "set torch.backends.cudnn.benchmark in the script",
    "cudnn_deterministic": "set torch.backends.cudnn.deterministic in the script",
    "lr_scheduler": "use scheduler: {type, params}",
    "model": "build it in the script",
    "loss": "build it in the script",
    "train_data": "build it in the script",
    "test_data": "build it in the script",
    "hooks": None,
    "num_epochs": None,
    "logging": None,
}


def unused_settings_warning(source: str, extras: dict) -> Optional[str]:
    """The one warning naming the legacy keys a config holds (None when it holds none)."""
    if not extras:
        return None
    names = [f"{key} ({COLOSSALAI_TOP_LEVEL_KEYS[key]})" if COLOSSALAI_TOP_LEVEL_KEYS.get(key) else key
             for key in sorted(extras)]
    return (f"{source}: Colossal-AI setting(s) not used by Microstep, kept in "
            f"config.colossalai_extras: {', '.join(names)}")


# -- fp16 -------------------------------------------------------------------------------------
class _NotUsed(Exception):
    """A Colossal-AI fp16 value Microstep cannot honour: a warning, not an error."""


def _to(key: str) -> Callable[[Any], dict]:
    return lambda value: {key: value}  # the schema checks the value


def _initial_scale(value) -> dict:
    power = math.log2(value) if isinstance(value, (int, float)) and value > 0 else 0.5
    if power != int(power):
        raise ValueError(f"{value!r} is not a power of 2; Microstep's dynamic loss scale starts "
                         "at 2**initial_scale_power: give a power of 2")
    return {"initial_scale_power": int(power)}


def _factor(expected: float, verb: str) -> Callable[[Any], dict]:
    def check(value) -> dict:
        if value != expected:
            raise _NotUsed(f"Microstep's loss scale always {verb}")
        return {}
    return check


def _torch_enabled(value) -> dict:
    # Colossal-AI's torch AMP passes `enabled` to the grad scaler only: autocast stays on.
    if not isinstance(value, bool):
        raise ValueError(f"expected True or False, got {value!r}")
    return {} if value else {"loss_scale": 1.0}  # a fixed scale of 1 = no scaling


def _apex_loss_scale(value) -> dict:
    return {} if value in (None, "dynamic") else {"loss_scale": value}


def _apex_min_loss_scale(value) -> dict:
    return {} if value is None else {"min_loss_scale": value}


_SCALE_STEPS = {"growth_factor": _factor(2.0, "doubles"), "backoff_factor": _factor(0.5, "halves"),
                "growth_interval": _to("loss_scale_window")}

# Per mode: Colossal-AI's defaults in our keys (so a section naming only the mode scales
# the loss as Colossal-AI would), and its keys: a converter to our keys, or None: not used.
_MODES: dict[str, tuple[dict, dict]] = {
    "torch": ({"initial_scale_power": 16, "loss_scale_window": 2000, "hysteresis": 1},
              {"init_scale": _initial_scale, "enabled": _torch_enabled, **_SCALE_STEPS}),
    "naive": ({"initial_scale_power": 32, "loss_scale_window": 1000, "hysteresis": 2,
               "min_loss_scale": 1.0},
              {"initial_scale": _initial_scale, "hysteresis": _to("hysteresis"),
               "min_scale": _to("min_loss_scale"), **_SCALE_STEPS, "max_scale": None,
               "log_num_zeros_in_grad": None, "verbose": None, "clip_grad_norm": None}),
    "apex": ({"initial_scale_power": 16, "loss_scale_window": 2000, "hysteresis": 1},
             {"enabled": _to("enabled"), "loss_scale": _apex_loss_scale,
              "min_loss_scale": _apex_min_loss_scale, "max_loss_scale": None, "opt_level": None,
              "cast_model_type": None, "patch_torch_functions": None, "keep_batchnorm_fp32": None,
              "master_weights": None, "cast_model_outputs": None, "num_losses": None,
              "verbosity": None}),
}
_MODE_NOTES = {
    "naive": "Colossal-AI's naive AMP casts the whole model to fp16; Microstep runs the forward "
             "under fp16 autocast with fp32 weights and its dynamic loss scaler",
    "apex": "apex is not used; Microstep runs the forward under fp16 autocast (like apex O1) "
            "with fp32 weights and its dynamic loss scaler",
}


def _mode_name(mode) -> Optional[str]:
    """'torch' / 'naive' / 'apex' for an AMP_TYPE member (ours or colossalai's) or its value."""
    value = getattr(mode, "value", mode)
    return value.lower() if isinstance(value, str) else value


def _translate_fp16(raw: RawConfig, problems: list[str], notes: list[str]) -> None:
    section = raw.data.get("fp16")
    if not isinstance(section, dict) or "mode" not in section:
        return  # a DeepSpeed-style section (or a type error the schema reports)
    where = raw.where(("fp16", "mode"))
    mode = _mode_name(section["mode"])
    if mode is not None and mode not in _MODES:
        problems.append(f"{where}: fp16.mode: {section['mode']!r} is not a Colossal-AI AMP mode; "
                        "use AMP_TYPE.TORCH, AMP_TYPE.NAIVE, AMP_TYPE.APEX or None (no fp16)")
        del raw.data["fp16"]
        return
    defaults, keys = _MODES.get(mode, ({}, {}))
    converted: dict[str, Any] = {}
    own: dict[str, Any] = {}  # our own keys (or unknown ones: the schema decides) win
    for key, value in section.items():
        path = ("fp16", key)
        if key == "mode":
            continue
        if mode is None or (key in keys and keys[key] is None):
            notes.append(f"{raw.where(path)}: fp16.{key}: not used by Microstep"
                         + (" (fp16.mode is None)" if mode is None else f" (Colossal-AI {mode} AMP setting)"))
        elif key in keys:
            try:
                settings = keys[key](value)
            except _NotUsed as reason:
                notes.append(f"{raw.where(path)}: fp16.{key}: {value!r} is not used: {reason}")
            except ValueError as error:
                problems.append(f"{raw.where(path)}: fp16.{key}: {error}")
            else:
                for ours in settings:  # errors in our key point at the line that set it
                    raw.locations.setdefault(("fp16", ours), raw.where(path))
                converted.update(settings)
        else:
            own[key] = value
    if mode in _MODE_NOTES:
        notes.append(f"{where}: fp16.mode {mode.upper()}: {_MODE_NOTES[mode]}")
    raw.data["fp16"] = {"enabled": mode is not None, **defaults, **converted, **own}


# -- parallel ---------------------------------------------------------------------------------
_PARALLEL_KEYS = ("data", "pipeline", "tensor")


def _check_parallel(raw: RawConfig, problems: list[str]) -> None:
    """Any data size, a pipeline size, a 1-D tensor size (mapped), every other size 1:
    accepted and dropped."""
    parallel = raw.data.pop("parallel", None)
    if parallel is None:
        return
    if not isinstance(parallel, dict):
        problems.append(f"{raw.where(('parallel',))}: parallel: expected a mapping such as "
                        f"dict(pipeline=1, tensor=dict(size=1, mode=None)), got {parallel!r}")
        return
    for kind, value in parallel.items():
        path = ("parallel", str(kind))
        where = raw.where(path)
        if kind not in _PARALLEL_KEYS:
            match = difflib.get_close_matches(str(kind), _PARALLEL_KEYS, n=1)
            hint = f"did you mean {match[0]}?" if match else f"expected one of: {', '.join(_PARALLEL_KEYS)}"
            problems.append(f"{where}: parallel.{kind}: unknown key; {hint}")
            continue
        size = value.get("size", 1) if isinstance(value, dict) else value
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            problems.append(f"{where}: parallel.{kind}: expected a size (an integer >= 1) or "
                            f"dict(size=...), got {value!r}")
        elif kind == "pipeline" and size > 1:
            _map_pipeline(raw, size, where, problems)
        elif kind == "tensor" and size > 1:
            _read_tensor(raw, value, size, where, problems)
        elif kind != "data" and size > 1:
            mode = value.get("mode") if isinstance(value, dict) else None
            problems.append(
                f"{where}: parallel.{kind}: size {size}{f' (mode {mode!r})' if mode else ''}: Microstep has "
                f"no {kind} parallelism; it trains with data parallelism over all ranks, sharded "
                "by ZeRO 0-3 (zero_optimization.stage; stage 3 also shards the parameters). Set "
                f"the {kind} size to 1 or remove it, or keep Colossal-AI for this model")
    raw.forget(("parallel",))


def _map_size(raw: RawConfig, kind: str, key: tuple[str, str], size: int, where: str, problems: list[str]) -> None:
    """``parallel.<kind>`` of ``size`` written as our ``key`` (a section there may say the same)."""
    section_name, field = key
    section = raw.data.setdefault(section_name, {})
    if not isinstance(section, dict):
        return  # the schema reports the malformed section
    if section.get(field, size) != size:
        problems.append(f"{where}: parallel.{kind}: size {size} conflicts with {section_name}.{field}: "
                        f"{section[field]!r}; keep one")
        return
    section[field] = size
    raw.locations.setdefault(key, where)


def _map_pipeline(raw: RawConfig, size: int, where: str, problems: list[str]) -> None:
    """``parallel.pipeline = N`` is our ``pipeline.stages: N``."""
    _map_size(raw, "pipeline", ("pipeline", "stages"), size, where, problems)


_TENSOR_MODES = (None, "1d")


def _read_tensor(raw: RawConfig, value, size: int, where: str, problems: list[str]) -> None:
    """``parallel.tensor`` of size > 1 in mode 1d (Megatron's column / row split) is
    ``tensor_parallel.size``; Colossal-AI's 2d / 2.5d / 3d splits have no counterpart."""
    mode = value.get("mode") if isinstance(value, dict) else None
    if mode not in _TENSOR_MODES:
        problems.append(f"{where}: parallel.tensor: mode {mode!r}: Microstep's tensor parallelism is 1-D "
                        "(PyTorch's column / row split, Colossal-AI's mode '1d'); set mode='1d', or keep "
                        "Colossal-AI for its 2d / 2.5d / 3d modes")
        return
    _map_size(raw, "tensor", ("tensor_parallel", "size"), size, where, problems)


def translate(raw: RawConfig, problems: list[str]) -> list[str]:
    """Rewrite Colossal-AI sections of ``raw`` in Microstep's keys; returns warnings."""
    notes: list[str] = []
    _translate_fp16(raw, problems, notes)
    _check_parallel(raw, problems)
    return notes
