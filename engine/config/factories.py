"""``module:function`` references: how the command line names a user's model, batch and loss
functions, and how ``verify`` hands them to the processes it starts."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from engine.errors import MicrostepError


class FactoryError(MicrostepError, ValueError):
    """A ``module:function`` reference that cannot be loaded or made."""


_files: dict[Path, object] = {}  # path/to/file.py -> its module: a script's file runs once per process


def load_factory(reference: str):
    """``package.module:function`` or ``path/to/file.py:function`` → the callable."""
    where, colon, name = reference.rpartition(":")
    if not colon or not where or not name:
        raise FactoryError(f"{reference!r}: expected module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            if not path.is_file():
                raise FactoryError(f"{reference!r}: no file {where}")
            if path not in _files:
                spec = importlib.util.spec_from_file_location(path.stem, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                _files[path] = module
            module = _files[path]
        else:
            module = importlib.import_module(where)
    except ImportError as error:
        raise FactoryError(f"{reference!r}: cannot import {where}: {error}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise FactoryError(f"{reference!r}: {where} has no callable named {name}")
    return factory


def reference_of(function, role: str) -> str:
    """The ``module:name`` (or ``file.py:name``) reference another process loads ``function``
    by: a reference string as it is, or a callable bound to a name at a module's top level
    (a function, or an object such as ``@engine.loss_on_outputs``'s)."""
    if isinstance(function, str):
        return function
    if not callable(function):
        raise FactoryError(f"{role}: expected a function or a 'module:function' string; got {type(function).__name__}")
    module_name = getattr(function, "__module__", None) or getattr(getattr(function, "on_outputs", None),
                                                                   "__module__", None)
    module = sys.modules.get(module_name) if module_name else None
    names = [name for name, value in vars(module).items() if value is function] if module is not None else []
    if not names:
        shown = getattr(function, "__qualname__", type(function).__name__)
        raise FactoryError(
            f"{role}: {shown} is not bound to a name at the top level of its module, so the processes that "
            "verify starts cannot load it: define it with def at module level (not a lambda or a nested "
            "function), or pass 'module:function'")
    if module_name == "__main__":
        path = getattr(module, "__file__", None)
        if path is None:
            raise FactoryError(f"{role}: {names[0]} is defined in an interactive session; the processes that "
                               "verify starts cannot load it: put it in a module and pass 'module:function'")
        return f"{path}:{names[0]}"
    return f"{module_name}:{names[0]}"
