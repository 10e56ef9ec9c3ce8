"""The names of docs/migrating.md's DeepSpeed survey table, resolved where a script reaches them.

Each row's first cell holds one or more names in backticks: ``deepspeed.a.b.C`` (imported as
``from deepspeed.a.b import C`` or reached as ``deepspeed.a.b.C``), ``transformers.integrations.deepspeed.X``
(the facade's ``engine.compat.deepspeed.hf.X``) or ``engine.a.b`` (an attribute of the engine
``deepspeed.initialize`` returns). A row whose last cell starts with "Not provided" refuses them.
"""
from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
SECTION = "#### Every name the surveyed scripts use"
FACADE_ROOTS = {"deepspeed": "engine.compat.deepspeed", "transformers.integrations.deepspeed": "engine.compat.deepspeed.hf"}


def survey_rows(doc: Path = DOC) -> list[tuple[str, bool]]:
    """(name, refused) for every name in the survey table."""
    text = doc.read_text()
    table = text[text.index(SECTION):].split("\n\n")[1]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        refused = cells[-1].startswith("Not provided")
        rows += [(name, refused) for name in re.findall(r"`([A-Za-z_][\w.]*)`", cells[0])]
    return rows


def _module_and_rest(name: str, facade: bool) -> tuple[str, list[str]]:
    for prefix in sorted(FACADE_ROOTS, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            root = FACADE_ROOTS[prefix] if facade else prefix
            return root, name[len(prefix):].strip(".").split(".") if name != prefix else []
    raise ValueError(f"{name}: not a deepspeed / transformers.integrations.deepspeed / engine name")


def resolve(name: str, ds_engine=None, facade: bool = True):
    """What a script gets for ``name``: imported or reached as an attribute (an engine attribute
    on ``ds_engine``); a refused callable is called, since its refusal comes with the call."""
    if name.startswith("engine."):
        value = ds_engine
        for part in name.split(".")[1:]:
            value = getattr(value, part)
        return value
    module_name, rest = _module_and_rest(name, facade)
    value = importlib.import_module(module_name)
    for part in rest:
        if not isinstance(value, types.ModuleType):
            value = getattr(value, part)
            continue
        try:
            value = getattr(value, part)
        except AttributeError:  # a submodule its package does not import: as `from package.sub import x` finds it
            value = importlib.import_module(f"{value.__name__}.{part}")
    return value


def outcome(name: str, refused: bool, ds_engine=None) -> str:
    """"provided", "refused: <message>" or "missing: <error>" for the facade."""
    try:
        value = resolve(name, ds_engine)
        if refused and callable(value) and name.startswith("engine."):
            value()
    except ImportError as error:  # the facade's NotProvidedError is one
        return f"refused: {type(error).__name__}: {error}"
    except AttributeError as error:
        return f"missing: {error}"
    return "provided"
