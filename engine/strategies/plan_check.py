"""A tensor plan is checked against what the model computes, not against attribute names.

Before the planned layers are split, the whole model runs once on a small probe input and the
output of every module holding a planned layer is recorded; after the split, the split model
runs on the same input and each output is compared. A plan that changes what the model
computes — heads cut in the middle by an attention module that has no ``head_dim`` attribute
(``view(b, s, num_heads, -1)``), a fused projection split the wrong way — is refused at
``initialize``, naming the innermost module whose output changed (or whose forward failed)
and its planned layers. Uneven splits (a vocabulary of 97 rows on 2 ranks: 49 and 48) are
allowed by the plan's own checks exactly because this one sees whether they compute the same.

The probe input: token ids below the vocabulary (as ``input_ids`` for a Hugging Face model)
for a model whose first layer is an ``Embedding``; rows of its input width for one whose first
layer is a ``Linear``. A model whose input cannot be guessed (or whose forward fails on the guess) is not
checked, and the log says so. The probe runs in eval mode, without gradients and with the
random generators forked, so it changes neither the model nor the run's random numbers.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from engine.errors import ConfigError

log = logging.getLogger("engine")

PROBE_ROWS, PROBE_LENGTH = 2, 5
# Split layers sum in another order: a difference above this share of the output's largest
# value is a different computation, not rounding.
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_HALF_TOLERANCE = 2e-2


def split_checked(module: torch.nn.Module, plan: dict, split: Callable[[], None]) -> None:
    """Run ``split()`` (which splits ``module``'s ``plan`` layers in place) and check that the
    split model computes what the whole one did on a probe input; raises ConfigError naming the
    module otherwise. Collective when ``split`` and the split forward are (every rank of the
    tensor group calls it)."""
    probe = probe_input(module)
    if probe is None:
        log.info("tensor_parallel.plan: not checked against the whole model: no probe input can be made for "
                 "%s (neither a Hugging Face model nor one whose first layer is an Embedding or a Linear)",
                 type(module).__name__)
        split()
        return
    watched = _watched_modules(module, plan)
    try:
        whole = _outputs(module, probe, watched)
    except Exception as error:  # noqa: BLE001 - the guess does not suit this model's forward
        log.info("tensor_parallel.plan: not checked against the whole model: %s's forward does not take the probe "
                 "input (%s: %s)", type(module).__name__, type(error).__name__, error)
        split()
        return
    split()
    try:
        after = _outputs(module, probe, watched)
    except _FailedIn as failed:
        raise ConfigError([_refusal(failed.name, plan, f"its forward fails once split: "
                                                       f"{type(failed.error).__name__}: {failed.error}")]) from None
    for name in whole:  # in the order they finished: children before parents, earlier layers first
        difference = _difference(whole[name], after.get(name))
        if difference is not None:
            raise ConfigError([_refusal(name, plan, f"its output on a probe input changes by {difference:.3g} once "
                                                    "split (a plan must keep what the model computes)")])


def probe_input(module: torch.nn.Module) -> dict | None:
    """Keyword arguments of a small input the model takes ("" for the one positional argument),
    or None when none can be guessed."""
    generator = torch.Generator().manual_seed(0)
    embeddings = getattr(module, "get_input_embeddings", None)
    if callable(embeddings) and getattr(module, "main_input_name", None) == "input_ids":  # Hugging Face
        table = embeddings()
        if isinstance(table, torch.nn.Embedding):
            ids = torch.randint(0, table.num_embeddings, (PROBE_ROWS, PROBE_LENGTH), generator=generator)
            return {"input_ids": ids.to(table.weight.device)}
    first = next((m for m in module.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.Linear))), None)
    if isinstance(first, torch.nn.Embedding):
        ids = torch.randint(0, first.num_embeddings, (PROBE_ROWS, PROBE_LENGTH), generator=generator)
        return {"": ids.to(first.weight.device)}
    if isinstance(first, torch.nn.Linear):
        rows = torch.randn(PROBE_ROWS, first.in_features, generator=generator, dtype=first.weight.dtype)
        return {"": rows.to(first.weight.device)}
    return None


class _FailedIn(Exception):
    def __init__(self, name: str, error: BaseException):
        super().__init__(name)
        self.name, self.error = name, error


def _watched_modules(module: torch.nn.Module, plan: dict) -> list[str]:
    """The modules whose outputs are compared: every module holding a planned layer, and their
    ancestors up to the model itself (named ""). Not the planned layers: their outputs are split."""
    names = set()
    for layer in plan:
        parts = layer.split(".")
        names.update(".".join(parts[:end]) for end in range(len(parts)))
    return sorted(names)


def _outputs(module: torch.nn.Module, probe: dict, watched: list[str]) -> dict[str, Any]:
    """The watched modules' outputs on ``probe``, in the order they finished (eval mode, no
    gradients, random generators forked); a forward that fails raises _FailedIn naming the
    innermost watched module it was in."""
    modules = dict(module.named_modules())
    outputs: dict[str, Any] = {}
    running: list[str] = []
    handles = []

    def entered(name):
        return lambda _module, _args: running.append(name)

    def finished(name):
        def record(_module, _args, output):  # returns None: the output is left as it is
            outputs[name] = _detached(output)
            running.pop()
        return record

    for name in watched:
        handles.append(modules[name].register_forward_pre_hook(entered(name)))
        handles.append(modules[name].register_forward_hook(finished(name)))
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            try:
                module(probe[""]) if "" in probe else module(**probe)
            except Exception as error:
                raise _FailedIn(running[-1] if running else "", error) from error
    finally:
        module.train(was_training)
        for handle in handles:
            handle.remove()
    return outputs


def _detached(output):
    if isinstance(output, DTensor):
        return output.full_tensor().detach().clone()
    if isinstance(output, torch.Tensor):
        return output.detach().clone()
    if isinstance(output, dict):
        return {key: _detached(value) for key, value in output.items()}
    if isinstance(output, (list, tuple)):
        return [_detached(value) for value in output]
    return None  # not compared (a cache object, a flag)


def _difference(whole, split) -> float | None:
    """The largest difference between two recorded outputs when it exceeds rounding, else None."""
    if isinstance(whole, torch.Tensor) and isinstance(split, torch.Tensor):
        if not whole.is_floating_point():
            return None if torch.equal(whole, split) else float("inf")
        if whole.shape != split.shape:  # a module returning a split layer's output as it is: not comparable
            return None
        difference = (whole.double() - split.double()).abs().max().item() if whole.numel() else 0.0
        scale = whole.double().abs().max().item() if whole.numel() else 0.0
        tolerance = _TOLERANCE.get(whole.dtype, _HALF_TOLERANCE) * max(scale, 1.0)
        return difference if not difference <= tolerance else None  # nan differs too
    if isinstance(whole, dict) and isinstance(split, dict):
        found = [_difference(whole[key], split.get(key)) for key in whole]
    elif isinstance(whole, list) and isinstance(split, list) and len(whole) == len(split):
        found = [_difference(a, b) for a, b in zip(whole, split)]
    else:
        return None if whole is None or split is not None else float("inf")
    found = [value for value in found if value is not None]
    return max(found) if found else None


def _refusal(name: str, plan: dict, what: str) -> str:
    where = name or "the model"
    layers = [layer for layer in plan if not name or layer.startswith(name + ".")]
    return (f"tensor_parallel.plan: {where} ({', '.join(layers[:6])}{', ...' if len(layers) > 6 else ''} split): "
            f"{what}. Split each layer so that every rank computes whole pieces of what {where} computes (whole "
            "attention heads: give the attention module a head_dim attribute, or leave its projections out of the "
            "plan; a fused projection such as qkv split colwise cuts q, k and v apart: split q, k and v separately), "
            f"or leave {where}'s layers out of the plan")
