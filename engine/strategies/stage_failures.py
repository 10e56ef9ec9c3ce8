"""A pipeline stage that fails inside a schedule without leaving its peers waiting (the
automatic micro size under a pipeline, ``engine.autotune.tuner``).

torch's schedules pass activations and their gradients point to point: a rank whose forward
or backward raises leaves the schedule, and the stages it would have sent to or received
from wait in their send or receive until the process-group timeout. With the failure guard
on, a rank instead keeps the first error of a window attempt (:class:`StageFailures`) and
runs the rest of the schedule with stand-ins: every later forward of its stages returns zeros
of the outputs' shapes without running the layers, every backward returns zero input
gradients. So every send and receive of the schedule still happens, on every rank; after the
schedule the rank raises the error it kept, and the tuner's vote turns it into one decision
everywhere (an out-of-memory: the window is discarded on every stage and re-run smaller).
The stand-ins never reach a parameter: the window they ran in is discarded.

The stand-ins' shapes are those of the stage's last outputs for inputs of the same trailing
shapes (rows scaled to the micro-batch), or, before any forward of the stage succeeded, of
its outputs for the micro-batch's first row, computed without gradients. A stage whose
outputs do not keep the micro-batch's rows along dimension 0, or that cannot run one row,
cannot stand in: its error is raised at once, as without the guard.
"""

from __future__ import annotations

import traceback
from typing import Callable

import torch


class StageFailures:
    """The first error of this rank's stages in the current window attempt, and the stand-ins
    that replace their forwards and backwards from then on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.error: BaseException | None = None
        self._outputs: dict[tuple, tuple] = {}  # inputs' trailing shapes and dtypes -> outputs' (see _remember)

    def clear(self) -> None:
        """A window attempt starts: nothing failed yet."""
        self.error = None

    def keep(self, error: BaseException) -> None:
        """Keep ``error`` (the first one) until the schedule is through. Its traceback is kept
        as text only: the frames would hold the failed micro-batch's activations."""
        if self.error is None:
            error = _unwrapped(error)
            error.add_note("".join(traceback.format_tb(error.__traceback__)).rstrip())
            self.error = error.with_traceback(None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def raise_kept(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error

    # -- forward ----------------------------------------------------------------------------
    def forward(self, run: Callable, module: torch.nn.Module, inputs: tuple):
        """``run(*inputs)``, or its stand-in once this attempt failed (then or earlier)."""
        if self.error is None:
            try:
                outputs = run(*inputs)
            except Exception as error:  # noqa: BLE001 - every error is kept and raised after the schedule
                self.keep(error)
            else:
                self._remember(inputs, outputs)
                return outputs
        return self._stand_in(run, module, inputs)

    def _remember(self, inputs: tuple, outputs) -> None:
        rows = _rows(inputs)
        tensors = _tensors(outputs)
        if rows is None or any(t.dim() == 0 or t.shape[0] != rows for t in tensors):
            return
        self._outputs[_signature(inputs)] = (isinstance(outputs, torch.Tensor),
                                             tuple((tuple(t.shape[1:]), t.dtype) for t in tensors))

    def _stand_in(self, run: Callable, module: torch.nn.Module, inputs: tuple):
        """Zeros of the outputs' shapes; those that carry gradients are tied to the inputs that
        do, so that the backward gives them zero gradients of their own shapes."""
        rows = _rows(inputs)
        known = self._outputs.get(_signature(inputs)) or self._one_row(run, inputs)
        if rows is None or known is None:
            raise self.error  # cannot stand in (see the module's doc): as without the guard
        single, metas = known
        # as the layers' outputs: floating ones carry gradients when the stage learns
        learns = torch.is_grad_enabled() and (
            any(p.requires_grad for p in module.parameters())
            or any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs))
        tie = None
        for value in inputs:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                tie = value.sum() * 0 if tie is None else tie + value.sum() * 0
        outputs = []
        for shape, dtype in metas:
            zeros = torch.zeros((rows, *shape), dtype=dtype, device=self.device)
            if learns and zeros.is_floating_point():
                zeros = zeros + tie.to(dtype) if tie is not None else zeros.requires_grad_()
            outputs.append(zeros)
        return outputs[0] if single else tuple(outputs)

    def _one_row(self, run: Callable, inputs: tuple):
        """The outputs' shapes and dtypes for the inputs' first row, computed without gradients
        (None when that fails too, or the outputs do not keep the row along dimension 0)."""
        try:
            with torch.no_grad():
                outputs = run(*(value[:1] if isinstance(value, torch.Tensor) else value for value in inputs))
        except Exception:  # noqa: BLE001 - the stage cannot stand in; its first error is raised
            return None
        tensors = _tensors(outputs)
        if any(t.dim() == 0 or t.shape[0] != 1 for t in tensors):
            return None
        return isinstance(outputs, torch.Tensor), tuple((tuple(t.shape[1:]), t.dtype) for t in tensors)

    # -- backward ---------------------------------------------------------------------------
    def backward(self, run: Callable[[], tuple], inputs) -> tuple:
        """``run()`` (torch's backward of one micro-batch: (input gradients, more)), or, once
        this attempt failed (then or earlier), zero gradients for the inputs that take one."""
        if self.error is None:
            try:
                return run()
            except Exception as error:  # noqa: BLE001 - every error is kept and raised after the schedule
                self.keep(error)
        for value in inputs:
            if isinstance(value, torch.Tensor):
                value.grad = None  # what the failed backward left there
        return tuple(torch.zeros_like(value) if isinstance(value, torch.Tensor) and value.requires_grad else None
                     for value in inputs), None


def _unwrapped(error: BaseException) -> BaseException:
    """The error itself, not torch's RuntimeError around a stage's failed backward (whose
    message says nothing of the cause: an out-of-memory must stay recognisable)."""
    cause = error.__cause__
    if type(error) is RuntimeError and cause is not None and "Failed to run stage backward" in str(error):
        return cause
    return error


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if isinstance(t, torch.Tensor)] if isinstance(value, (tuple, list)) else []


def _rows(inputs: tuple) -> int | None:
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0]
    return tensors[0].shape[0] if tensors else None


def _signature(inputs: tuple) -> tuple:
    return tuple((tuple(t.shape[1:]), t.dtype) for t in inputs if isinstance(t, torch.Tensor))
