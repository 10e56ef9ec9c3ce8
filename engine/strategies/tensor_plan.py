"""Tensor parallelism: which layers are split over the mesh's ``tensor`` dimension, and how
(``engine.strategies.parallelize`` applies it first of the model-parallel steps).

A plan maps module names to styles of ``torch.distributed.tensor.parallel`` (PyTorch's own
DTensor engine; nothing is sharded by hand here):

* ``colwise``: a Linear's output features (or an Embedding's width) split over the ranks;
  its input is replicated and its output stays split, for the next ``rowwise`` layer;
* ``rowwise``: a Linear's input features (or an Embedding's vocabulary) split; the partial
  outputs are summed over the tensor group, so the output is whole on every rank;
* ``colwise_rep`` (Hugging Face: ``colwise_gather_output``): colwise with the output gathered
  whole, e.g. an LM head before a loss that needs every logit;
* ``embedding_rowwise`` (Hugging Face's name): ``rowwise`` on an Embedding.

A name pattern matches module names component by component; ``*`` stands for one component
(``layers.*.mlp.up`` matches ``layers.0.mlp.up``), as in Hugging Face's plans.

``auto``: the model's own plan when it has one (a Hugging Face model's ``tp_plan`` /
``_tp_plan``, or its config's ``base_model_tp_plan`` under the base model's prefix), less the
entries of styles not listed above (a mixture of experts' ``moe_tp_experts``, ``packed_colwise``:
those layers stay whole on every tensor rank, and ``expert_parallel`` splits experts); else the
Megatron pairing of an MLP written as a ``Sequential``: a Linear split colwise, followed, with
nothing but element-wise activations between them, by a Linear split rowwise. Layers outside
the plan (norms, biases of rowwise layers, ...) are replicated on every rank of the group.

Every planned layer is checked before anything is split: the split dimension holds at least
one row per rank (it need not divide: a vocabulary of 97 rows splits 49 + 48, DTensor's uneven
shards, exact and saved in the whole shape); for a layer of an attention module with
``head_dim``, whole heads land on each rank; no planned layer holds a parameter tied to another
module's (splitting would untie it). A layer that cannot be split is named in the error. After
the split of a whole model, it is run against the unsplit one on a probe input
(``engine.strategies.plan_check``): a plan that changes what a module computes is refused,
naming it.
"""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from engine.errors import ConfigError
from engine.strategies.plan_check import split_checked

log = logging.getLogger("engine")

STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "embedding_rowwise")
_ELEMENTWISE = (torch.nn.ReLU, torch.nn.GELU, torch.nn.Tanh, torch.nn.SiLU, torch.nn.Sigmoid, torch.nn.Dropout,
                torch.nn.Identity, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.Mish)
_SPLIT_DIMENSION = {  # (style family, layer type) -> (attribute split, what it is called)
    ("colwise", torch.nn.Linear): ("out_features", "output features"),
    ("colwise", torch.nn.Embedding): ("embedding_dim", "embedding width"),
    ("rowwise", torch.nn.Linear): ("in_features", "input features"),
    ("rowwise", torch.nn.Embedding): ("num_embeddings", "vocabulary rows"),
}


def model_plan(module: torch.nn.Module) -> dict[str, str] | None:
    """The model's own tensor-parallel plan, names relative to ``module`` (None: it has none)."""
    for attribute in ("tp_plan", "_tp_plan"):
        plan = getattr(module, attribute, None)
        if isinstance(plan, dict) and plan:
            return dict(plan)
    config_plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
    if isinstance(config_plan, dict) and config_plan:
        prefix = getattr(module, "base_model_prefix", "")
        if prefix and isinstance(getattr(module, prefix, None), torch.nn.Module):
            return {f"{prefix}.{pattern}": style for pattern, style in config_plan.items()}
        return dict(config_plan)
    return None


def mlp_pairs(module: torch.nn.Module) -> dict[str, str]:
    """Megatron's MLP split for every ``Sequential`` holding Linear → activations → Linear."""
    plan = {}
    for name, container in module.named_modules():
        if not isinstance(container, torch.nn.Sequential):
            continue
        open_column = None  # the name of a colwise Linear waiting for its rowwise partner
        for child_name, child in container.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear):
                if open_column is None:
                    open_column = full
                else:
                    plan[open_column], plan[full] = "colwise", "rowwise"
                    open_column = None
            elif not isinstance(child, _ELEMENTWISE):
                open_column = None
    return plan


def resolve_plan(module: torch.nn.Module, plan, size: int) -> dict[str, ParallelStyle]:
    """``{module name: ParallelStyle}`` for ``plan`` ("auto" or {pattern: style}) on ``size``
    ranks, every layer checked; raises ConfigError naming what cannot be split."""
    source = None
    if plan == "auto":
        own = model_plan(module)
        patterns, strict = (own, False) if own is not None else (mlp_pairs(module), True)
        source = "the model's own tensor-parallel plan" if own is not None else "its Sequential MLPs (Linear, activation, Linear)"
        if not patterns:
            raise ConfigError([
                f"tensor_parallel.plan: auto found no plan for {type(module).__name__}: it has no tensor-parallel "
                "plan of its own (a Hugging Face tp_plan / base_model_tp_plan) and no Sequential MLP "
                "(Linear, activation, Linear) to split; give tensor_parallel.plan: {module pattern: colwise | "
                "rowwise | colwise_rep}, or engine.initialize(..., tensor_plan={...})"])
    elif isinstance(plan, dict):
        patterns, strict = plan, True
    else:
        raise ConfigError([f"tensor_parallel.plan: expected 'auto' or {{module pattern: style}}, got {plan!r}"])
    modules = dict(module.named_modules())
    resolved, problems, patterns_style = {}, [], {}
    if not strict:  # a model's own plan: what no style here splits (its experts) stays whole on every rank
        kept = {pattern: style for pattern, style in patterns.items() if isinstance(style, ParallelStyle)
                or _family(style) is not None}
        if len(kept) < len(patterns):
            log.info("tensor_parallel.plan auto: left whole on every tensor rank (styles Microstep does not split "
                     "with): %s; a mixture of experts' experts are split by expert_parallel.size instead",
                     ", ".join(f"{pattern} {style}" for pattern, style in patterns.items() if pattern not in kept))
        patterns = kept
    for pattern, style in patterns.items():
        names = [name for name in modules if name and _matches(pattern, name)]
        if not names:
            if strict:
                problems.append(f"tensor_parallel.plan: {pattern!r} matches no module of {type(module).__name__}")
            continue
        for name in names:
            problem = _split_problem(name, modules[name], style, size, modules)
            if problem:
                problems.append(f"tensor_parallel.plan: {problem}")
            else:
                resolved[name] = _style(style, modules[name])
                patterns_style[name] = style if isinstance(style, str) else type(style).__name__
    problems += _tied_problems(module, resolved)
    if problems:
        raise ConfigError(problems)
    if source is not None:  # auto: say what it chose, the user wrote no names
        split = [f"{name} {patterns_style[name]}" for name in resolved]
        log.info("tensor_parallel.plan auto: from %s, %d layer(s) split over %d ranks: %s", source, len(split), size,
                 ", ".join(split))
    return resolved


def apply_tensor_parallel(module: torch.nn.Module, tensor_mesh, plan: dict[str, ParallelStyle]) -> None:
    """Split ``module``'s planned layers over ``tensor_mesh`` in place (their parameters become
    DTensors; rank 0 of the group provides the values)."""
    parallelize_module(module, tensor_mesh, plan)


def apply_checked_tensor_parallel(module: torch.nn.Module, tensor_mesh, plan: dict[str, ParallelStyle]) -> None:
    """:func:`apply_tensor_parallel` on a whole model, refused (ConfigError naming the module)
    when the split model computes otherwise than the whole one on a probe input
    (``engine.strategies.plan_check``)."""
    split_checked(module, plan, lambda: apply_tensor_parallel(module, tensor_mesh, plan))


def _tied_problems(module: torch.nn.Module, resolved: dict) -> list[str]:
    """A parameter shared by several modules (tied embeddings) cannot be split by one of them:
    splitting gives the planned module a new parameter and silently unties the others."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    problems = []
    for shared in (group for group in names.values() if len(group) > 1):
        owners = [name.rpartition(".")[0] for name in shared]
        if any(owner in resolved for owner in owners):
            problems.append(f"tensor_parallel.plan: {' and '.join(shared)} are one tied parameter; splitting "
                            f"{' or '.join(o for o in owners if o in resolved)} would untie it. Leave "
                            f"{' and '.join(owners)} out of the plan, or untie the weights")
    return problems


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def _family(style) -> str | None:
    if style in ("colwise", "colwise_rep", "colwise_gather_output"):
        return "colwise"
    if style in ("rowwise", "embedding_rowwise"):
        return "rowwise"
    return None


def _split_problem(name: str, layer: torch.nn.Module, style, size: int, modules: dict) -> str | None:
    if isinstance(style, ParallelStyle):  # given as an object to initialize(): the caller's responsibility
        return None
    family = _family(style)
    if family is None:
        return (f"{name}: unknown style {style!r}; expected one of {', '.join(STYLES)} (or a "
                "torch.distributed.tensor.parallel.ParallelStyle passed to engine.initialize(tensor_plan=...))")
    kind = next((t for (f, t) in _SPLIT_DIMENSION if f == family and isinstance(layer, t)), None)
    if kind is None:
        return (f"{name}: style {style} splits Linear and Embedding layers; {name} is a {type(layer).__name__} "
                "(leave it out of the plan: it is then replicated)")
    attribute, words = _SPLIT_DIMENSION[(family, kind)]
    count = getattr(layer, attribute)
    if count < size:
        return (f"{name}: its {count} {words} cannot be split over tensor size {size} ({style}): every rank needs "
                f"at least one; choose a tensor size of at most {count}, or leave {name} out of the plan")
    parent = modules.get(name.rpartition(".")[0])
    head_dim = getattr(parent, "head_dim", None)
    if family == "colwise" and kind is torch.nn.Linear and isinstance(head_dim, int) and count % head_dim == 0:
        heads = count // head_dim
        if heads % size:
            return (f"{name}: its {heads} heads ({count} output features / head_dim {head_dim}) do not divide into "
                    f"tensor size {size}: every rank must hold whole heads; choose a tensor size dividing {heads}")
    return None


def _style(style, layer: torch.nn.Module) -> ParallelStyle:
    if isinstance(style, ParallelStyle):
        return style
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if style == "colwise":
        return ColwiseParallel()
    if isinstance(layer, torch.nn.Embedding):  # token ids come whole to every rank
        return RowwiseParallel(input_layouts=Replicate())
    return RowwiseParallel()


def leaves_output_split(style: ParallelStyle) -> bool:
    """Whether a layer split by ``style`` hands on a piece of its output (not the whole)."""
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return not style.output_layouts[0].is_replicate()
    return False


def stage_boundary_problems(pieces: list[list[tuple[str, torch.nn.Module]]], plan: dict) -> list[str]:
    """Under a pipeline each rank sends its stage's outputs to the rank of the same tensor index in
    the next stage, so what passes between stages must be the whole activation: a stage (but the
    last) whose last planned layer leaves its output split is a problem, named."""
    problems = []
    for index, piece in enumerate(pieces[:-1]):
        last = None
        for part_name, part in piece:
            for name, _ in part.named_modules():
                full = f"{part_name}.{name}" if name else part_name
                if full in plan:
                    last = full
        if last is not None and leaves_output_split(plan[last]):
            problems.append(
                f"pipeline.split: stage {index + 1} ends after {last}, whose output stays split over the tensor "
                f"group ({type(plan[last]).__name__}): the next stage needs the whole activation on every tensor "
                f"rank. Cut where activations are whole (after a rowwise layer: move the split point past "
                f"{last}'s rowwise partner), or give {last} a style with a whole output (colwise_rep)")
    return problems
