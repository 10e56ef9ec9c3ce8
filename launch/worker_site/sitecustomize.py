"""Started in every worker of ``python -m launch`` (the launcher puts this folder first on PYTHONPATH).

A Ctrl-C that reaches a worker before the engine handles it (while its script imports torch, or
forms the process group) would print Python's ``KeyboardInterrupt`` traceback once per worker; the
launcher says in one last line what the workers did, so here it ends the worker without one (the
worker still dies of the signal, as torchrun expects). The environment's own ``sitecustomize``, if
any, runs after this one.
"""

import os
import sys

_FOLDER = os.path.dirname(os.path.abspath(__file__))
_previous_hook = sys.excepthook


def _without_interrupt_traceback(kind, value, traceback):
    if issubclass(kind, KeyboardInterrupt):
        return  # the launcher's last line says it
    _previous_hook(kind, value, traceback)


def _run_the_environments_own() -> None:
    """Import the next ``sitecustomize`` on the path (this one shadows it)."""
    this = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _FOLDER]
    try:
        import sitecustomize  # noqa: F401  the environment's own, when it has one
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        sys.modules["sitecustomize"] = sys.modules.get("sitecustomize", this) or this


sys.excepthook = _without_interrupt_traceback
_run_the_environments_own()
