"""The size of a manual-loop micro-batch, read from the forwards of its micro-step.

When sizes come from the inputs (a data-defined plan, the DeepSpeed / Colossal-AI facades),
a micro-batch holds what the tensors given to ``eng(...)`` hold along dim 0. A micro-step
may run several forwards with gradients enabled: an evaluation pass without
``torch.no_grad()``, a forward whose loss raised, a second call of the model. Its size is
that of the latest forward whose output the loss was computed from.

Which forward that is: autograd numbers the nodes it creates in one thread in increasing
order, and a node's inputs were created before it. Each forward records the numbers of its
outputs' nodes (integers: holding the nodes would keep a discarded forward's activations
alive). Walking the loss's graph from the highest number down, the first recorded output
met belongs to the latest forward the loss reaches, and only the nodes created after it —
the loss computation — are visited. When the forwards of a micro-step agree on the size,
nothing is walked.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.adapters.torch_internals import autograd_sequence_nr
from engine.batching.microbatch import tensor_leaves


@dataclass(frozen=True)
class Forward:
    """One forward of a micro-step, as far as its size is concerned."""

    samples: int | None  # the first dimension every input tensor shares; None: none, or they differ
    inputs: str  # when samples is None: the inputs' first dimensions, for an error message
    outputs: frozenset[int]  # autograd numbers of the output tensors' nodes


def record_forward(args, kwargs, output: Any) -> Forward:
    """What ``eng(*args, **kwargs)`` returning ``output`` tells about the micro-batch's size."""
    leaves = [*tensor_leaves(args, "args"), *tensor_leaves(kwargs, "kwargs")]
    dims = [(path, t.shape[0]) for path, t in leaves if t.dim() > 0]
    sizes = {n for _, n in dims}
    samples = sizes.pop() if len(sizes) == 1 else None
    inputs = "" if samples is not None else \
        ", ".join(f"{path}: {n}" for path, n in dims) or "no tensor with a batch dimension"
    nodes = frozenset(autograd_sequence_nr(t.grad_fn) for _, t in tensor_leaves(output) if t.grad_fn is not None)
    return Forward(samples, inputs, nodes)


def forward_of_loss(loss: torch.Tensor, forwards: Sequence[Forward]) -> Forward | None:
    """The forward whose samples ``loss`` stands for: the only size the micro-step's
    forwards give, else the latest forward the loss's graph reaches (None: it reaches none
    of them, e.g. a loss computed in another thread)."""
    if not forwards:
        return None
    if len({f.samples for f in forwards}) == 1:
        return forwards[-1]
    owner = {number: forward for forward in forwards for number in forward.outputs}
    if not owner or loss.grad_fn is None:
        return None
    floor, order = min(owner), itertools.count()
    frontier = [(-autograd_sequence_nr(loss.grad_fn), next(order), loss.grad_fn)]
    seen = {id(loss.grad_fn): loss.grad_fn}  # held: ids stay unique during the walk
    while frontier:
        negative, _, node = heapq.heappop(frontier)
        if -negative in owner:
            return owner[-negative]
        if -negative < floor:  # every node left was created before the first recorded output
            return None
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen[id(child)] = child
                heapq.heappush(frontier, (-autograd_sequence_nr(child), next(order), child))
    return None
