"""How a model is cut into pipeline stages, keeping the model's own parameter names.

A model is split as a sequence of parts run one after the other: an ``nn.Sequential``'s
children in order, a child that is itself an ``nn.Sequential`` (a stack of blocks) opened
into its own children; or, for another model, the modules its forward calls one after the
other, each on the previous one's output (an embedding, an ``nn.ModuleList``'s blocks in a
loop, a head), read from a ``torch.fx`` trace. The parts are cut into consecutive stages:

* ``auto``: balanced by parameter count (DeepSpeed's ``partition_method: parameters``):
  the cut whose largest stage holds the fewest parameters;
* ``uniform``: the same number of parts per stage (give or take one);
* a list of part names: where stages 2, 3, ... start (``["4", "blocks.6"]``).

A stage is a :class:`StageModule`: it holds its parts under their original names (so its
``state_dict`` keys are the model's own) and runs them in order. (A Hugging Face model with a
pipeline plan is cut by that plan instead: ``engine.pipeline.hf_plan``.)
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.fx
from torch import nn

from engine.errors import ConfigError


def sequence_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) parts ``model`` runs in order; a ConfigError naming the fix for a
    model whose forward is not such a chain."""
    if isinstance(model, nn.Sequential):
        parts = []
        for name, child in model.named_children():
            if isinstance(child, nn.Sequential):
                parts += [(f"{name}.{inner}", block) for inner, block in child.named_children()]
            else:
                parts.append((name, child))
        return parts
    return _traced_chain(model)


class _WholeModules(torch.fx.Tracer):
    """Records each module the forward calls as one step (a block with a residual inside stays whole)."""

    def is_leaf_module(self, module, qualified_name):
        return True


def _traced_chain(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a model's forward calls one after the other, each on the previous one's
    output (e.g. an embedding, the blocks of an nn.ModuleList in a loop, a head), read from a
    ``torch.fx`` trace of the forward."""
    name = type(model).__name__
    fix = (f"build it as nn.Sequential(embedding, *blocks, head), or make its forward call its modules one after "
           f"the other, each on the previous one's output (other steps inside modules), or run it with "
           f"pipeline.stages: 1")
    try:
        graph = _WholeModules().trace(model)
    except Exception as error:  # noqa: BLE001 - any tracing failure means: not a chain we can read
        raise ConfigError([f"pipeline.split: {name}'s forward cannot be traced to find its modules' order "
                           f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); {fix}"]) from None
    parts, previous = [], None
    for node in graph.nodes:
        if node.op == "placeholder" and previous is None:
            previous = node
        elif node.op == "call_module" and previous is not None and node.args == (previous,) and not node.kwargs:
            parts.append((node.target, model.get_submodule(node.target)))
            previous = node
        elif node.op == "output" and node.args == (previous,) and parts:
            break
        else:
            step = getattr(node.target, "__name__", node.target)
            raise ConfigError([f"pipeline.split: {name}'s forward is not a chain of its modules: its step "
                               f"{node.name} ({node.op} {step}) is not one of its modules called on the previous "
                               f"one's output alone; {fix}"])
    # A buffer outside the chain would be lost from every stage (and from full_state_dict).
    covered = {id(t) for _, module in parts for t in (*module.parameters(), *module.buffers())}
    outside = [tensor_name for tensor_name, t in (*model.named_parameters(), *model.named_buffers())
               if id(t) not in covered]
    if outside:
        raise ConfigError([f"pipeline.split: {name} has parameters or buffers its chain of modules does not hold "
                           f"({', '.join(outside[:4])}); {fix}"])
    return parts


def too_few_parts(have: str, count: int, stages: int, per_rank: int, fix: str) -> str:
    """The error for a model of ``count`` parts (``have`` says what they are) cut into ``stages``
    stages, ``per_rank`` of them on each pipeline rank; ``fix``: the model-side remedy."""
    if per_rank == 1:
        return (f"pipeline.stages: {have} for {stages} pipeline stage(s); every stage needs at least one: use at "
                f"most {count} stage(s), or {fix}")
    ranks = stages // per_rank
    fewer = (f"pipeline.stages: {count // per_rank} with this schedule" if count >= per_rank
             else "no pipeline with this schedule")
    return (f"pipeline.stages: {have} for {ranks} pipeline rank(s) × {per_rank} stages each (the schedule holds "
            f"{per_rank} stages per rank: {ranks} × {per_rank} = {stages} stages); every stage needs at least one: "
            f"use pipeline.schedule 1f1b or gpipe (one stage per rank: up to {count} ranks), {fewer}, or {fix}")


def cut(parts: list[tuple[str, nn.Module]], stages: int, split, per_rank: int = 1) -> list[list[tuple[str, nn.Module]]]:
    """The parts of each of ``stages`` consecutive stages, as ``split`` asks (``per_rank``:
    stages each pipeline rank holds, for the error's advice)."""
    names = [name for name, _ in parts]
    if len(parts) < stages:
        raise ConfigError([too_few_parts(f"the model has {len(parts)} part(s) ({', '.join(names)})", len(parts),
                                         stages, per_rank, "split the model into more modules")])
    if split == "auto":
        starts = balanced_starts([_parameter_count(module) for _, module in parts], stages)
    elif split == "uniform":
        starts = [round(i * len(parts) / stages) for i in range(stages)]
    else:
        starts = [0] + _starts_of_names(split, names, stages)
    bounds = starts + [len(parts)]
    pieces = [parts[bounds[i]:bounds[i + 1]] for i in range(stages)]
    _check_nothing_shared(pieces)
    return pieces


def _check_nothing_shared(pieces: list[list[tuple[str, nn.Module]]]) -> None:
    """A parameter used by two stages (tied weights) would be trained apart on two ranks."""
    owner: dict[int, int] = {}
    for index, piece in enumerate(pieces):
        for name, module in piece:
            for param_name, param in module.named_parameters():
                first = owner.setdefault(id(param), index)
                if first != index:
                    raise ConfigError([
                        f"pipeline.split: the parameter {name}.{param_name} is shared by stages {first + 1} and "
                        f"{index + 1} (tied weights); choose split points that keep the modules sharing it in one "
                        "stage, or untie it"])


def _starts_of_names(split: list[str], names: list[str], stages: int) -> list[int]:
    if len(split) != stages - 1:
        raise ConfigError([
            f"pipeline.split: {len(split)} module name(s) for {stages} stage(s); give the {stages - 1} name(s) of "
            f"the modules where stages 2..{stages} start, in order, among: {', '.join(names)}"])
    unknown = [name for name in split if name not in names]
    if unknown:
        raise ConfigError([
            f"pipeline.split: {', '.join(unknown)} is not a part of the model; the parts, in order, are: "
            f"{', '.join(names)}"])
    starts = [names.index(name) for name in split]
    if starts != sorted(starts) or starts[0] == 0:
        raise ConfigError([
            f"pipeline.split: {split} must name modules after the first, in the model's order "
            f"({', '.join(names)}), each starting a non-empty stage"])
    return starts


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balanced_starts(sizes: list[int], stages: int) -> list[int]:
    """Start indices of the contiguous cut into ``stages`` non-empty pieces whose largest
    piece is smallest (ties: the earliest cut), by dynamic programming."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: (largest piece, starts) cutting the first i parts into k pieces
    best: list[dict[int, tuple[int, list[int]]]] = [{0: (0, [])}]
    for k in range(1, stages + 1):
        row = {}
        for i in range(k, n - (stages - k) + 1):
            row[i] = min(((max(best[k - 1][j][0], prefix[i] - prefix[j]), best[k - 1][j][1] + [j])
                          for j in range(k - 1, i) if j in best[k - 1]), key=lambda option: option[0])
        best.append(row)
    return best[stages][n][1]


class StageModule(nn.Module):
    """Some consecutive parts of a model, under their original names, run in order (the
    first part gets the stage's inputs; a tuple output is passed on as several inputs)."""

    def __init__(self, parts: list[tuple[str, nn.Module]],
                 forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 own_outputs: bool = False):
        super().__init__()
        for name, module in parts:
            *path, leaf = name.split(".")
            holder: nn.Module = self
            for step in path:
                if step not in holder._modules:
                    holder.add_module(step, nn.Module())
                holder = holder._modules[step]
            holder.add_module(leaf, module)
        self.part_names = [name for name, _ in parts]
        self._forward_context = forward_context  # e.g. autocast for half precision
        # Zero-bubble schedules detach a stage's outputs in place, which a view does not allow
        # (e.g. a Linear's output on 3-d inputs): such outputs are copied.
        self._own_outputs = own_outputs
        # With the automatic micro size's failure guard: the stage's forward runs through it
        # (engine.strategies.stage_failures), which stands in for it after a failure.
        self.failures = None

    def forward(self, *inputs):
        if self.failures is not None:
            return self.failures.forward(self.run_parts, self, inputs)
        return self.run_parts(*inputs)

    def run_parts(self, *inputs):
        """The parts in order on ``inputs``."""
        value = inputs[0] if len(inputs) == 1 else inputs
        with self._forward_context():
            for name in self.part_names:
                value = self.get_submodule(name)(value)
        if self._own_outputs:
            value = owned_outputs(value)
        return value

    def model_outputs(self, value):
        """What ``loss_fn`` sees of the last stage's output: the output itself."""
        return value


class SequenceSplit:
    """A model cut as a sequence of parts (``sequence_of``, ``cut``): each stage a :class:`StageModule`."""

    # a stage is called with the previous stage's output alone: nothing carries a sequence part's positions
    hands_positions = False

    def __init__(self, model: nn.Module, stages: int, split, per_rank: int = 1):
        self.pieces = cut(sequence_of(model), stages, split, per_rank)

    def stage(self, index: int, forward_context: Callable[[], contextlib.AbstractContextManager]
              = contextlib.nullcontext, own_outputs: bool = False) -> StageModule:
        return StageModule(self.pieces[index], forward_context, own_outputs)

    def check_inputs(self, inputs: tuple) -> None:
        """Any tensors: the first part takes whatever the model takes."""


def owned_outputs(value):
    """``value`` with a view among its tensors copied (zero-bubble schedules detach outputs in place)."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value._is_view() else value
    if isinstance(value, tuple):
        return tuple(owned_outputs(item) for item in value)
    return value
