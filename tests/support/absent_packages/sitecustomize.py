"""Make installed packages absent from this interpreter: put this folder first on PYTHONPATH and
name them in MICROSTEP_ABSENT_PACKAGES (comma-separated top-level names, e.g. "deepspeed,accelerate").

Python imports ``sitecustomize`` at start-up. Here it makes the path finder find neither the named
packages' modules nor their distributions' metadata: ``import deepspeed`` raises
ModuleNotFoundError, ``importlib.util.find_spec("deepspeed")`` is None and
``importlib.metadata.version("deepspeed")`` raises PackageNotFoundError, as on a machine where they
were never installed. Child processes (torchrun's workers) inherit the environment, so the
packages are absent there too. See tests/support/absent.py."""

import importlib.machinery
import os

ABSENT = frozenset(filter(None, os.environ.get("MICROSTEP_ABSENT_PACKAGES", "").split(",")))

if ABSENT:
    _find_spec = importlib.machinery.PathFinder.find_spec
    _find_distributions = importlib.machinery.PathFinder.find_distributions

    def _absent_name(name) -> bool:
        return (name or "").partition(".")[0].replace("-", "_").lower() in ABSENT

    def _find_spec_present(cls, fullname, path=None, target=None):
        return None if _absent_name(fullname) else _find_spec(fullname, path, target)

    def _find_distributions_present(cls, *args, **kwargs):
        return (dist for dist in _find_distributions(*args, **kwargs) if not _absent_name(dist.name))

    importlib.machinery.PathFinder.find_spec = classmethod(_find_spec_present)
    importlib.machinery.PathFinder.find_distributions = classmethod(_find_distributions_present)
