"""torch.distributed.pipelining's stage, with its backward of one micro-batch handed to a
guard (``engine.strategies.stage_failures``). Imported only where a pipeline runs.

Two methods are overridden, neither documented as stable (docs/compatibility.md):

* ``backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)``: every schedule's
  backward of one micro-batch on a stage (torch 2.11 to 2.13; extra arguments passed on);
* ``_compute_input_grads(outputs, inputs, grad_outputs)``: the backward that torch 2.13's
  metadata inference runs at a schedule's first step (absent before: then never called).
"""

from __future__ import annotations

from typing import Protocol

from torch.distributed.pipelining import PipelineStage


class BackwardGuard(Protocol):
    def backward(self, run, inputs) -> tuple: ...


class GuardedPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose backwards run through ``guard.backward(run, inputs)``."""

    def __init__(self, *args, guard: BackwardGuard, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard = guard

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, *args, **kwargs):
        base = super().backward_maybe_with_nosync
        return self.guard.backward(lambda: base(backward_type, bwd_kwargs, *args, **kwargs),
                                   bwd_kwargs["input_values"])

    def _compute_input_grads(self, outputs, inputs, *args, **kwargs):
        base = super()._compute_input_grads
        grads, _ = self.guard.backward(lambda: (base(outputs, inputs, *args, **kwargs), None), inputs)
        return grads
