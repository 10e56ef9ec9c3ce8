"""torch.distributed.pipelining's runtime for a schedule given as data, and its stage, with the
warm-up of torch 2.11's multi-stage schedules kept off this rank's own pair and its backward of one
micro-batch handed to a guard (``engine.strategies.stage_failures``). Imported only where a pipeline runs.

``ActionSchedule`` runs the engine's own schedules (``engine.schedule``: GPipe, 1F1B, interleaved,
zero-bubble V; one list of stage actions per pipeline rank) on torch's ``_PipelineScheduleRuntime``,
which adds each action's sends and receives and runs the list; the class and its
``_prepare_schedule_with_comms(order)`` are private (torch 2.11 to 2.15 build their interleaved and
zero-bubble schedules the same way: ``pipeline_order`` set, then that call, whose result
``pipeline_order_with_comms`` an evaluation's schedule keeps the forwards of).

Nine methods are overridden, none documented as stable (docs/compatibility.md):

* ``_get_init_p2p_neighbors_ops()``: the messages torch 2.11's multi-stage schedules send each
  neighbouring stage before their first step, to open the connections (2.13 replaced it, for a
  ``PipelineStage``, by a vote and no longer calls it);
* ``backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)``: every schedule's
  backward of one micro-batch on a stage (torch 2.11 to 2.13; extra arguments passed on);
* ``_compute_input_grads(outputs, inputs, grad_outputs)``: the backward that torch 2.13's
  metadata inference runs at a schedule's first step (absent before: then never called);
* ``get_fwd_recv_ops`` / ``get_fwd_send_ops`` / ``get_bwd_recv_ops`` / ``get_bwd_send_ops``
  (a micro-batch index): the point-to-point messages of one micro-batch, which every schedule
  asks its stage for (2.11 to 2.15), here preceded by ``before_first_message`` (and, for the
  first gradient receive, by ``before_first_gradient_wait``);
* ``_forward_metadata_inference`` (torch 2.13) / ``_shape_inference`` (before): the forward a stage
  runs once per schedule to learn its shapes, marked on the stage's module (``learning_shapes``)
  so that what counts the micro-batches' forwards (``engine.experts.stages``) leaves it out.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Protocol

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from engine.schedule import BACKWARD, FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT, StageAction, splits_backward

_KIND = torch_schedules._ComputationType
_TORCH_KIND = {FORWARD: _KIND.FORWARD, BACKWARD: _KIND.FULL_BACKWARD, INPUT_GRADIENT: _KIND.BACKWARD_INPUT,
               WEIGHT_GRADIENT: _KIND.BACKWARD_WEIGHT}
# what an evaluation keeps of a lowered order: its forwards, their messages, FSDP's unshard and reshard
_FORWARD_KINDS = {_KIND.FORWARD, _KIND.SEND_F, _KIND.RECV_F, _KIND.UNSHARD, _KIND.RESHARD}


def torch_order(order: dict[int, list[StageAction]]) -> dict[int, list]:
    """The engine's order in torch's terms: ``_Action(stage, kind, micro-batch)`` per rank."""
    return {rank: [torch_schedules._Action(action.stage, _TORCH_KIND[action.kind], action.k) for action in actions]
            for rank, actions in order.items()}


def forward_actions(lowered: dict[int, list]) -> dict[int, list]:
    """Of an order torch lowered (its sends and receives added): the forwards, their messages and FSDP's
    unshard / reshard, in order; the backwards, their messages and the gradient reduction dropped."""
    return {rank: [action for action in actions if action.computation_type in _FORWARD_KINDS]
            for rank, actions in lowered.items()}


class ActionSchedule(torch_schedules._PipelineScheduleRuntime):
    """A pipeline schedule whose order is ``order`` (every pipeline rank's stage actions, the same on
    every rank): this rank runs its own list, with the sends and receives that order implies. Losses are
    summed as ``loss_fn`` returns them (no 1/micro-batches: the engine weighs each)."""

    def __init__(self, stages: list[PipelineStage], micro_batches: int, loss_fn,
                 order: dict[int, list[StageAction]]):
        if splits_backward(order) and hasattr(torch_schedules, "_check_torch_compile_compatibility"):
            # a split backward cannot run through a compiled block: torch's own refusal
            torch_schedules._check_torch_compile_compatibility(stages, "zero-bubble")
        super().__init__(stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
        self.pipeline_order = torch_order(order)
        self._prepare_schedule_with_comms(self.pipeline_order)

    @classmethod
    def forwards(cls, stages: list[PipelineStage], micro_batches: int, loss_fn,
                 order: dict[int, list[StageAction]]) -> "ActionSchedule":
        """An evaluation's schedule (or a counting pass's): ``order``'s forwards alone, with their sends and
        receives (torch's check of an order wants every backward, so the whole order is checked and
        lowered, then :func:`forward_actions` kept; run it with ``eval()``)."""
        schedule = cls(stages, micro_batches, loss_fn, order)
        schedule.pipeline_order = forward_actions(schedule.pipeline_order)
        schedule.pipeline_order_with_comms = forward_actions(schedule.pipeline_order_with_comms)
        return schedule


class BackwardGuard(Protocol):
    def backward(self, run, inputs) -> tuple: ...


class NeighbourStage(PipelineStage):
    """A ``PipelineStage`` that sends no warm-up message to a neighbouring stage on its own rank.

    The zero-bubble V schedule places two adjacent stages on one rank (the last rank holds stages
    n - 1 and n); torch 2.11's warm-up sends each neighbour a message, to itself there, and gloo
    has no connection from a rank to itself ("Pair is not connected"). The schedule passes
    activations and gradients between stages of one rank locally, so no connection is needed."""

    # Set for one run of a schedule, each called once: before this stage's first message of it (the
    # engine confirms the window's position check there: before any exchange, off the critical
    # path), and before its first receive of a gradient from the next stage (where it would wait
    # for that stage's first backward anyway).
    before_first_message: Callable[[], None] | None = None
    before_first_gradient_wait: Callable[[], None] | None = None

    def _get_init_p2p_neighbors_ops(self):
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def get_fwd_recv_ops(self, *args, **kwargs):
        self._call_once("before_first_message")
        return super().get_fwd_recv_ops(*args, **kwargs)

    def get_fwd_send_ops(self, *args, **kwargs):
        self._call_once("before_first_message")
        return super().get_fwd_send_ops(*args, **kwargs)

    def get_bwd_recv_ops(self, *args, **kwargs):
        self._call_once("before_first_message")
        if not self.is_last:
            self._call_once("before_first_gradient_wait")
        return super().get_bwd_recv_ops(*args, **kwargs)

    def get_bwd_send_ops(self, *args, **kwargs):
        self._call_once("before_first_message")
        return super().get_bwd_send_ops(*args, **kwargs)

    def _forward_metadata_inference(self, *args, **kwargs):
        with _learning_shapes(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _shape_inference(self, *args, **kwargs):
        with _learning_shapes(self.submod):
            return super()._shape_inference(*args, **kwargs)

    def _call_once(self, hook: str) -> None:
        call = getattr(self, hook)
        if call is not None:
            setattr(self, hook, None)
            call()


@contextlib.contextmanager
def _learning_shapes(module) -> Iterator[None]:
    """Inside the block ``module.learning_shapes`` is True: its forwards learn the schedule's shapes."""
    module.learning_shapes = True
    try:
        yield
    finally:
        module.learning_shapes = False


class GuardedPipelineStage(NeighbourStage):
    """A ``NeighbourStage`` whose backwards run through ``guard.backward(run, inputs)``."""

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
