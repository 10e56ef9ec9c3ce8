"""Reading config sources into plain dicts, remembering where each key came from.

Every file-level mistake (missing file, malformed JSON / YAML, an exception inside a Python
config) becomes a ``ConfigError`` that names the file and line, never a traceback.
"""
from __future__ import annotations

import ast
import inspect
import json
import re
import traceback
from pathlib import Path
from typing import Any

import yaml

from engine.config.colossalai import StandIn, colossalai_imports
from engine.config.raw import KeyPath, RawConfig
from engine.errors import ConfigError

__all__ = ["ConfigError", "parse_scalar", "read_file"]

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.1 insists on ``1.0e-3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def parse_scalar(text: str) -> Any:
    """An override value: YAML scalar rules (``true``, ``2``, ``1e-3``, ``null``)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text  # not valid YAML on its own (e.g. "a: b: c"): keep the literal text


def read_file(path) -> RawConfig:
    path = Path(path)
    readers = {".yaml": _read_yaml, ".yml": _read_yaml, ".json": _read_json, ".py": _read_python}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise ConfigError(f"{path}: unsupported config format {path.suffix or '(no extension)'!r}"
                          "; use .yaml, .yml, .json or .py")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found" if not path.exists()
                          else f"{path}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read config: {error}") from None
    raw = reader(text, str(path))
    if raw.data is None:  # an empty YAML file
        raw.data = {}
    if not isinstance(raw.data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, "
                          f"got {type(raw.data).__name__}")
    return raw


# -- YAML and JSON ---------------------------------------------------------------------
def _read_yaml(text: str, source: str) -> RawConfig:
    try:
        data = yaml.load(text, Loader=_Loader)
        lines = _yaml_key_lines(yaml.compose(text, Loader=_Loader))
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_error_message(error, text, source)) from None
    return RawConfig.with_lines(data, source, lines)


def _yaml_error_message(error: yaml.YAMLError, text: str, source: str) -> str:
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f"{source}: invalid YAML: {error}"
    problem = getattr(error, "problem", None) or str(error)
    message = f"{source}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {problem}"
    bad_line = text.splitlines()[mark.line] if mark.line < len(text.splitlines()) else ""
    if "\t" in bad_line or "\\t" in problem:
        message += " (YAML forbids tabs for indentation; indent with spaces)"
    return message


def _yaml_key_lines(node, path: KeyPath = ()) -> dict[KeyPath, int]:
    """Key path → 1-based line, from the node tree of a composed YAML (or JSON) document."""
    lines: dict[KeyPath, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key_path = path + (str(key_node.value),)
            lines[key_path] = key_node.start_mark.line + 1
            lines.update(_yaml_key_lines(value_node, key_path))
    return lines


def _read_json(text: str, source: str) -> RawConfig:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(_json_error_message(error, text, source)) from None
    try:  # JSON is (nearly) YAML: composing it gives key lines for later messages
        lines = _yaml_key_lines(yaml.compose(text, Loader=_Loader))
    except yaml.YAMLError:
        lines = {}
    return RawConfig.with_lines(data, source, lines)


def _json_error_message(error: json.JSONDecodeError, text: str, source: str) -> str:
    message = f"{source}:{error.lineno}:{error.colno}: invalid JSON: {error.msg}"
    before = text[:error.pos].rstrip()
    if before.endswith(",") and text[error.pos:error.pos + 1] in "}]":
        comma_line = before.count("\n") + 1
        message += f" (trailing comma? JSON allows no comma after the last item, line {comma_line})"
    elif text[error.pos:error.pos + 2] in ("//", "/*"):
        message += " (JSON does not allow comments)"
    return message


# -- Python ----------------------------------------------------------------------------
def _read_python(text: str, source: str) -> RawConfig:
    """Execute a Colossal-AI style config: lower-case globals are engine keys,
    UPPER_CASE globals are the user's constants. Imports (also of colossalai names) are
    skipped."""
    namespace: dict[str, Any] = {"__file__": source, "__name__": "__microstep_config__"}
    try:
        tree = ast.parse(text, source)
    except SyntaxError as error:
        raise ConfigError(f"{source}:{error.lineno}: SyntaxError: {error.msg}") from None
    try:
        with colossalai_imports():
            exec(compile(tree, source, "exec"), namespace)
    except (Exception, SystemExit) as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == source]
        line = f":{frames[-1].lineno}" if frames else ""
        raise ConfigError(f"{source}{line}: {type(error).__name__}: {error}") from None

    imported = _imported_names(tree)
    data: dict[str, Any] = {}
    constants: dict[str, Any] = {}
    for name, value in namespace.items():
        if name.startswith("_") or name in imported or inspect.ismodule(value) or inspect.isclass(value) \
                or inspect.isroutine(value) or isinstance(value, StandIn):
            continue
        if name.isupper():
            constants[name] = value
        else:
            data[name] = value
    if constants:
        if isinstance(data.get("constants"), dict):
            constants = {**data["constants"], **constants}
        data["constants"] = constants
    return RawConfig.with_lines(data, source, _python_key_lines(tree))


def _imported_names(tree: ast.Module) -> set[str]:
    """Names a module-level ``import`` or ``from ... import`` binds (``from math import pi``
    gives a value, not a config key)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name != "*")
    return names


def _python_key_lines(tree: ast.Module) -> dict[KeyPath, int]:
    """Key path → line for module-level assignments and the dict literals they hold."""
    lines: dict[KeyPath, int] = {}

    def visit(value: ast.AST, path: KeyPath) -> None:
        if isinstance(value, ast.Dict):
            items = [(k.value, v) for k, v in zip(value.keys, value.values)
                     if isinstance(k, ast.Constant)]
        elif isinstance(value, ast.Call) and getattr(value.func, "id", None) == "dict":
            items = [(kw.arg, kw.value) for kw in value.keywords if kw.arg]
        else:
            return
        for key, item in items:
            lines[path + (str(key),)] = item.lineno
            visit(item, path + (str(key),))

    for statement in tree.body:
        targets = (statement.targets if isinstance(statement, ast.Assign)
                   else [statement.target] if isinstance(statement, ast.AnnAssign) else [])
        for target in targets:
            if isinstance(target, ast.Name):
                lines[(target.id,)] = statement.lineno
                if statement.value is not None:
                    visit(statement.value, (target.id,))
    return lines
