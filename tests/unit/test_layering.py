"""The library's import structure: its folders are its layers. Every module lives in one unit
(a folder of ``engine/``, or a module at its root), every unit in one layer; imports point down
or stay in their layer, units import each other in no cycle, modules in no cycle (function-level
imports counted), and every module imports on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "engine"

# Lower layers never import higher ones; README.md's Layout section describes the same. A new
# folder or root module must be placed here.
LAYERS = {
    0: ["engine.errors", "engine.memory", "engine.losses", "engine.schedule",  # leaves (a schedule is data)
        "engine.adapters", "engine.distributed"],
    # the planner: batch arithmetic, needs no config object; a window's arithmetic
    1: ["engine.batching", "engine.accounting"],
    2: ["engine.config", "engine.state"],  # config resolved once (its checks use the planner); state files
    3: ["engine.precision", "engine.attention", "engine.context", "engine.experts", "engine.pipeline",  # parallelisms
        "engine.strategies"],  # and the backends that hold the model
    4: ["engine.window", "engine.engine"],  # the engine and its window parts and runners
    5: ["engine.autosave", "engine.autotune", "engine.monitor"],  # hooks and tuners around an engine
    6: ["engine.build", "engine.verify", "engine.cli", "engine", "engine.__main__", "engine.compat"],
}
LAYER_OF = {unit: layer for layer, units in LAYERS.items() for unit in units}


def unit_of(module: str) -> str:
    """The folder (``engine.window``) or root module (``engine.engine``) a module belongs to."""
    return ".".join(module.split(".")[:2])


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names[name] = path
    return names


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under ``if TYPE_CHECKING:`` (never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """module -> the engine modules it imports anywhere in its text (functions included)."""
    names = module_names()
    graph = {name: set() for name in names}
    for name, path in names.items():
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in names and target != name}
    return graph


def test_every_module_has_a_layer():
    missing = sorted({unit_of(module) for module in module_names()} - set(LAYER_OF))
    assert not missing, f"place these folders or root modules in tests/unit/test_layering.py LAYERS: {missing}"


def test_imports_point_down():
    upward = [(module, target) for module, targets in import_graph().items() for target in targets
              if LAYER_OF.get(unit_of(target), 0) > LAYER_OF.get(unit_of(module), 0)]
    assert not upward, f"imports from a lower layer to a higher one: {upward}"


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_cycle_between_folders():
    units: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        units.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets if unit_of(t) != unit_of(module))
    cycles = cycles_of(units)
    assert not cycles, f"folders (or root modules) that import each other in a loop: {cycles}"


def test_no_import_cycle():
    cycles = cycles_of(import_graph())
    assert not cycles, cycles


def test_every_module_imports_on_its_own():
    """Each module in an interpreter where no other engine module was imported first. Importing any
    module imports the package first, so a module the package itself loads is imported in exactly
    the sequence of a fresh ``import engine``: that runs once, then each module it leaves out."""
    code = ("import importlib, sys\n"
            "def fresh(name):\n"
            "    for loaded in [m for m in sys.modules if m == 'engine' or m.startswith('engine.')]:\n"
            "        del sys.modules[loaded]\n"
            "    importlib.import_module(name)\n"
            "fresh('engine')\n"
            f"for name in [n for n in {sorted(set(module_names()) - {'engine.__main__'})!r} if n not in sys.modules]:  # __main__ runs the CLI\n"
            "    fresh(name)\n"
            "assert 'deepspeed' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
