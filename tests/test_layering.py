"""The library's import structure: layers point down, no cycle (function-level imports
counted), every module imports on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "engine"

# Lower layers never import higher ones. A new module must be placed here.
LAYERS = {
    0: ["engine.errors", "engine.state.rng", "engine.distributed", "engine.distributed.agent_store", "engine.distributed.process_group",
        "engine.distributed.mesh",
        "engine.config", "engine.config.raw", "engine.config.colossalai", "engine.config.offload", "engine.config.torch_features",
        "engine.config.loaders", "engine.config.deepspeed", "engine.config.schema",
        "engine.adapters", "engine.adapters.torch_internals", "engine.adapters.deepspeed_internals",
        "engine.adapters.pipelining",
        "engine.distributed.collectives", "engine.memory", "engine.state", "engine.batching", "engine.autotune",
        "engine.window.hooks", "engine.pipeline", "engine.losses", "engine.window", "engine.config.factories",
        "engine.window.loss_checks", "engine.distributed.error_report", "engine.precision", "engine.experts",
        "engine.experts.balance", "engine.experts.terms", "engine.experts.hf", "engine.experts.bias",
        "engine.monitor.throughput", "engine.config.deepspeed_monitor", "engine.context"],
    1: ["engine.batching.plan", "engine.batching.microbatch", "engine.batching.forward_sizes",
        "engine.batching.token_budget", "engine.batching.window_split", "engine.batching.data", "engine.config.optim",
        "engine.precision.loss_scaler", "engine.precision.compute_copy",
        "engine.precision.policy", "engine.strategies.model_transforms", "engine.distributed.rank_consistency",
        "engine.state.preemption", "engine.config.checks", "engine.config.setup", "engine.state.async_save", "engine.distributed.batch_fingerprint",
        "engine.state.checkpoint", "engine.batching.mesh_plan",
        "engine.pipeline.split", "engine.pipeline.hf_plan", "engine.pipeline.stages", "engine.context.sharding",
        "engine.context.ulysses"],
    2: ["engine.strategies", "engine.strategies.base", "engine.strategies.torch_checkpoint",
        "engine.strategies.deferral", "engine.strategies.ddp", "engine.strategies.replicas",
        "engine.strategies.zero1", "engine.strategies.fsdp",
        "engine.strategies.deepspeed", "engine.strategies.pipeline", "engine.strategies.gradients",
        "engine.strategies.parallelize", "engine.strategies.tensor_plan", "engine.strategies.same_batch",
        "engine.strategies.plan_check",
        "engine.strategies.stage_failures", "engine.experts.window", "engine.context.parallel",
        "engine.experts.parallel"],
    3: ["engine.engine", "engine.window.records", "engine.window.positions", "engine.window.non_finite"],
    4: ["engine.state.autosave", "engine.autotune.tuner", "engine.monitor", "engine.monitor.metrics",
        "engine.autotune.report", "engine.pipeline.windows"],
    5: ["engine.build", "engine.verify", "engine.cli", "engine", "engine.__main__",
        "engine.compat", "engine.compat.deepspeed", "engine.compat.colossalai",
        "engine.compat.deepspeed.accelerator", "engine.compat.deepspeed.checkpointing", "engine.compat.deepspeed.comm", "engine.compat.deepspeed.moe",
        "engine.compat.deepspeed.moe.utils", "engine.compat.deepspeed.utils", "engine.compat.deepspeed.utils.zero_to_fp32",
        "engine.compat.deepspeed.zero", "engine.compat.colossalai.amp", "engine.compat.colossalai.context",
        "engine.compat.colossalai.core", "engine.compat.colossalai.logging", "engine.compat.colossalai.nn",
        "engine.compat.colossalai.nn.lr_scheduler", "engine.compat.colossalai.utils"],
}
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}


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
    missing = sorted(set(module_names()) - set(LAYER_OF))
    assert not missing, f"place these modules in tests/test_layering.py LAYERS: {missing}"


def test_imports_point_down():
    upward = [(module, target) for module, targets in import_graph().items() for target in targets
              if LAYER_OF.get(target, 0) > LAYER_OF.get(module, 0)]
    assert not upward, f"imports from a lower layer to a higher one: {upward}"


def test_no_import_cycle():
    graph, state, cycles = import_graph(), {}, []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_every_module_imports_on_its_own():
    """Each module in an interpreter where no other engine module was imported first."""
    code = ("import importlib, sys\n"
            f"for name in {sorted(set(module_names()) - {'engine.__main__'})!r}:  # __main__ runs the CLI\n"
            "    for loaded in [m for m in sys.modules if m == 'engine' or m.startswith('engine.')]:\n"
            "        del sys.modules[loaded]\n"
            "    importlib.import_module(name)\n"
            "assert 'deepspeed' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
