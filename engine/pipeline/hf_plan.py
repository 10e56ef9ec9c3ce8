"""A Hugging Face model cut into pipeline stages by its own pipeline plan.

Transformers' decoder models declare which of their modules a pipeline may cut between: the
config's ``base_model_pp_plan`` (Llama: ``embed_tokens``, ``layers``, ``norm``, under the base
model's prefix ``model.``) and the head's own ``_pp_plan`` (``lm_head``). Where a model has one,
its parts are those modules in that order, the ``layers`` list opened into its decoder layers
(``model.embed_tokens``, ``model.layers.0``, ..., ``model.norm``, ``lm_head``), and:

* ``auto``: the decoder layers cut so that the largest stage holds the fewest parameters, the
  modules before the layers (embeddings) counted with the first stage, those after (final norm,
  head) with the last; every stage holds at least one layer;
* ``uniform``: as many decoder layers per stage (give or take one), embeddings on the first,
  norm and head on the last;
* a list of part names: where stages 2, 3, ... start (``["model.layers.2"]``).

A stage runs the model's own forward (as transformers' and torchtitan's pipelines do): a copy
of the model's module tree whose modules of other stages are skipped (they hand their first
input on), sharing this stage's modules with the model. So whatever a decoder layer needs
beyond the hidden states (position ids, rotary embeddings, the causal mask) is computed on
every stage by the model's code, from the hidden states' shape. The first stage is called with
the ``input_ids``; the others with the previous stage's hidden states as ``inputs_embeds``;
all but the last hand on the base model's ``last_hidden_state``, the last returns the model's
``logits`` (a base model without a head: its ``last_hidden_state``), which ``loss_fn`` sees in
the model's own output type (``outputs.logits``), as without a pipeline. Attention runs causal
over the whole sequence: no padding mask is passed (pad on the right, labels -100).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Callable

import torch
from torch import nn

from engine.errors import ConfigError, EngineUsageError
from engine.pipeline.split import balanced_starts, cut, owned_outputs, too_few_parts


def is_hugging_face_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (read by its surface: a config and a base model prefix)."""
    return hasattr(model, "config") and isinstance(getattr(model, "base_model_prefix", None), str)


def _base_name(model: nn.Module) -> str:
    """Where the base model sits in ``model`` (``model`` for Llama's causal LM); "" when ``model`` is it."""
    prefix = model.base_model_prefix
    return prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""


def plan_of(model: nn.Module) -> list[str] | None:
    """The module names of the model's pipeline plan (relative to ``model``) in the order its
    forward runs them: the base model's, then the head's; None when it declares none."""
    base_plan = getattr(model.config, "base_model_pp_plan", None) or {}
    base = _base_name(model)
    if not base:
        return list(base_plan) or None
    names = [f"{base}.{name}" for name in base_plan]
    head = getattr(type(model), "_pp_plan", None) or {}
    names += [name for name in head if name not in names]
    return names or None


class PlanSplit:
    """The stages of a Hugging Face model cut by its pipeline plan."""

    hands_positions = True  # each stage runs the model's forward: it can be given the part's positions

    def __init__(self, model: nn.Module, plan: list[str], stages: int, split, per_rank: int = 1):
        self.model = model
        self.base_name = _base_name(model)
        # a head (lm_head) around the base model: the last stage returns the model's logits
        self.has_head = bool(self.base_name) and any(not name.startswith(f"{self.base_name}.") for name in plan)
        head, layers, tail = _plan_parts(model, plan)
        self.parts = [*head, *layers, *tail]
        if isinstance(split, str) and len(layers) < stages:
            raise ConfigError([too_few_parts(
                f"{type(model).__name__} has {len(layers)} decoder layer(s), and its pipeline plan gives every stage "
                "at least one,", len(layers), stages, per_rank, "name the parts where stages start in pipeline.split")])
        if split == "auto":
            sizes = [_parameter_count(layer) for _, layer in layers]
            sizes[0] += sum(_parameter_count(part) for _, part in head)
            sizes[-1] += sum(_parameter_count(part) for _, part in tail)
            starts = balanced_starts(sizes, stages)
        elif split == "uniform":
            starts = [round(i * len(layers) / stages) for i in range(stages)]
        else:
            self.pieces = cut(self.parts, stages, list(split), per_rank)
            return
        bounds = [start + len(head) for start in starts[1:]]
        self.pieces = cut(self.parts, stages, [self.parts[bound][0] for bound in bounds], per_rank)

    def check_inputs(self, inputs: tuple) -> None:
        """The first stage takes the ``input_ids`` alone: an EngineUsageError naming the batch's
        form for anything else (raised on every rank, before the schedule runs)."""
        ids = inputs[0] if len(inputs) == 1 else None
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
            return
        got = f"a tuple of {len(inputs)}" if len(inputs) != 1 else \
            (f"a {ids.dim()}-d {ids.dtype} tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__)
        raise EngineUsageError(
            f"under a pipeline, {type(self.model).__name__} (cut by its pipeline plan) takes its input_ids alone: "
            f"give batches (input_ids, labels), input_ids a (batch, sequence) tensor of token ids; got {got}. "
            "Attention is causal over the whole sequence (no attention mask is passed): pad on the right and "
            "mark padded positions -100 in the labels")

    def stage(self, index: int, forward_context: Callable[[], contextlib.AbstractContextManager]
              = contextlib.nullcontext, own_outputs: bool = False) -> nn.Module:
        """Stage ``index`` as a module running the model's forward on its own parts."""
        held = {name for name, _ in self.pieces[index]}
        skipped = [name for name, _ in self.parts if name not in held]
        return PlanStage(_skipping(self.model, skipped), base_name=self.base_name,
                         first=index == 0, last=index == len(self.pieces) - 1,
                         head=self.has_head, forward_context=forward_context, own_outputs=own_outputs)


def _plan_parts(model: nn.Module, plan: list[str]):
    """(parts before the decoder layers, the decoder layers, parts after): (name, module) each."""
    name = type(model).__name__
    modules = dict(model.named_modules())
    missing = [part for part in plan if part not in modules]
    if missing:
        raise ConfigError([f"pipeline.split: {name}'s pipeline plan names {', '.join(missing)}, which it does not "
                           "have; run it with pipeline.stages: 1, or give its Hugging Face config a "
                           "base_model_pp_plan naming its modules"])
    lists = [part for part in plan if isinstance(modules[part], nn.ModuleList)]
    if len(lists) != 1:
        raise ConfigError([f"pipeline.split: {name}'s pipeline plan ({', '.join(plan)}) must hold one list of "
                           f"decoder layers (an nn.ModuleList), found {len(lists)}; run it with pipeline.stages: 1"])
    at = plan.index(lists[0])
    layers = [(f"{lists[0]}.{index}", layer) for index, layer in modules[lists[0]].named_children()]
    head = [(part, modules[part]) for part in plan[:at]]
    tail = [(part, modules[part]) for part in plan[at + 1:]]
    base = model.get_submodule(_base_name(model))
    if "inputs_embeds" not in inspect.signature(base.forward).parameters:
        raise ConfigError([f"pipeline.split: {name}'s base model takes no inputs_embeds, through which a stage "
                           "hands its hidden states to the next; run it with pipeline.stages: 1"])
    covered = {id(p) for _, part in (*head, *layers, *tail) for p in part.parameters()}
    outside = [param for param, p in model.named_parameters() if id(p) not in covered]
    if outside:
        raise ConfigError([f"pipeline.split: {name} has parameters outside its pipeline plan's modules "
                           f"({', '.join(outside[:4])}): no stage would hold them; run it with pipeline.stages: 1"])
    return head, layers, tail


class _Skipped(nn.Module):
    """A module another stage holds: hands its first input on (transformers' pipeline does the same)."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def _shallow_copy(module: nn.Module) -> nn.Module:
    """The same module object's state in a new object, its registries (children, parameters,
    hooks) copied, so that changing the copy's children leaves the model as it is."""
    clone = copy.copy(module)
    clone.__dict__ = {key: value.copy() if isinstance(value, dict) else value for key, value in module.__dict__.items()}
    return clone


def _skipping(model: nn.Module, skipped: list[str]) -> nn.Module:
    """A copy of ``model``'s module tree with the modules ``skipped`` replaced by ``_Skipped``;
    every other module is the model's own (shared)."""
    root = _shallow_copy(model)
    copies = {"": root}
    for name in skipped:
        *path, leaf = name.split(".")
        holder, where = root, ""
        for step in path:
            where = f"{where}.{step}" if where else step
            if where not in copies:
                copies[where] = _shallow_copy(holder._modules[step])
                holder._modules[step] = copies[where]
            holder = copies[where]
        holder._modules[leaf] = _Skipped()
    return root


class PlanStage(nn.Module):
    """One stage of a Hugging Face model: its forward on this stage's modules (see the module doc)."""

    def __init__(self, model: nn.Module, *, base_name: str, first: bool, last: bool, head: bool,
                 forward_context: Callable[[], contextlib.AbstractContextManager], own_outputs: bool):
        super().__init__()
        self.model = model
        self._base_name = base_name
        self._input = "input_ids" if first else "inputs_embeds"
        self._runs_head = last and head
        self._output_type = None  # the model's output class, seen on the last stage's forward
        self._forward_context = forward_context
        self._own_outputs = own_outputs
        # With the automatic micro size's failure guard: the forward runs through it
        # (engine.strategies.stage_failures), which stands in for it after a failure.
        self.failures = None
        # The micro-batch's position_ids, handed in order by the pipeline (packed rows, a context part:
        # engine.strategies.stage_schedules.StageSchedules.positions); None: the model numbers them.
        self.part_positions = _own_positions

    def forward(self, hidden):
        if self.failures is not None:
            return self.failures.forward(self.run_model, self, (hidden,))
        return self.run_model(hidden)

    def run_model(self, hidden):
        """``hidden``: the input_ids on the first stage (PlanSplit.check_inputs), else the hidden states."""
        arguments = {self._input: hidden, "use_cache": False}
        positions = self.part_positions(hidden)
        if positions is not None:
            arguments["position_ids"] = positions
        with self._forward_context():
            if self._runs_head:
                output = self.model(**arguments)
                value = output.logits
            else:
                output = self.base_model()(**arguments)
                value = output.last_hidden_state
        self._output_type = type(output)
        return owned_outputs(value) if self._own_outputs else value

    def base_model(self) -> nn.Module:
        """This stage's copy of the base model (its output holds the stage's router logits, when the
        model records them)."""
        return self.model.get_submodule(self._base_name) if self._base_name else self.model

    def model_outputs(self, value: torch.Tensor):
        """What the model itself returns, around the last stage's output (``outputs.logits``)."""
        if self._output_type is None:
            return value
        return self._output_type(**{"logits" if self._runs_head else "last_hidden_state": value})


def _own_positions(part: torch.Tensor) -> None:
    """Whole sequences: the model numbers the positions itself."""
    return None


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
