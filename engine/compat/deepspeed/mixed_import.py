"""A half-migrated script: its own code imports the real ``deepspeed`` package next to this facade.

Under ``backend: torch`` the two do not mix: a real ``FusedAdam`` or ``zero.GatheredParameters``
knows nothing of Microstep's shards, and a real ``deepspeed.comm`` call joins DeepSpeed's own
process group. ``initialize`` warns once, naming where the script's code holds the real package.
A library that imports deepspeed for itself (transformers, accelerate) is not the script's code:
only modules outside the Python installation's library folders count.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import types
import warnings

__all__ = ["real_deepspeed_holders", "warn_if_mixed"]

_LIBRARY_DIRS = tuple(os.path.realpath(path) + os.sep for path in
                      {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})
_FACADE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))) + os.sep  # engine/
_warned = False


def _is_real_deepspeed(value) -> bool:
    if isinstance(value, types.ModuleType):
        name = value.__name__
    elif isinstance(value, (type, types.FunctionType)):
        name = value.__module__ or ""
    else:
        return False
    return name == "deepspeed" or name.startswith("deepspeed.")


def _is_script_code(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return False
    path = os.path.realpath(path)
    return not path.startswith(_LIBRARY_DIRS) and not path.startswith(_FACADE_ROOT)


def _where(module: types.ModuleType) -> str:
    """The script's file for ``__main__``, else the module's name."""
    return os.path.basename(module.__file__) if module.__name__ == "__main__" else module.__name__


def real_deepspeed_holders() -> list[str]:
    """``name in module`` for each global of the script's own modules that is the real deepspeed
    package, one of its modules, classes or functions."""
    if "deepspeed" not in sys.modules:
        return []
    modules = {id(module): module for module in list(sys.modules.values())}  # one module may have two names
    return [f"{name} in {_where(module)}" for module in modules.values()
            if isinstance(module, types.ModuleType) and _is_script_code(module)
            for name, value in list(vars(module).items()) if _is_real_deepspeed(value)]


def warn_if_mixed(backend: str) -> None:
    """Once per process, on ``backend: torch``: warn when the script's code holds the real deepspeed."""
    global _warned
    if _warned or backend != "torch":
        return
    holders = real_deepspeed_holders()
    if holders:
        _warned = True
        warnings.warn(
            f"the script imports the real deepspeed package next to engine.compat.deepspeed ({', '.join(holders)}): "
            "on backend: torch its objects know nothing of Microstep's engine; change those imports to "
            "engine.compat.deepspeed too (or set backend: deepspeed)", UserWarning, stacklevel=3)
