"""Low-precision parameters without sharding (one process, ZeRO-0 and ZeRO-1): what FSDP2's
``MixedPrecisionPolicy`` does at ZeRO-2/3, for a model held whole.

The user's model keeps its fp32 parameters: the masters the optimizer updates, checkpoints
save and ``eng.module`` shows. A copy of the model whose parameters are cast to the half
precision (buffers and hooks shared with the original, not copied) runs every forward and backward; it
is refreshed from the masters after each optimizer step, so each parameter is cast once per
step rather than once per op as under autocast. Floating-point inputs are cast to the half
precision on the way in and outputs back to fp32 on the way out (the loss is computed in fp32).

Gradients: each backward's half-precision gradient is added into the master's fp32 gradient
as soon as autograd has it (``accumulate="fp32"``, the default) and dropped, so the window
accumulates in fp32 and no half-precision gradient outlives its backward. With
``data_types.grad_accum_dtype`` in the half precision they accumulate on the copy in that
precision and are moved to the masters (in fp32) at the window's end. Either way the
reduction over ranks is the masters' fp32 gradients.
"""

from __future__ import annotations

import copy
import functools

import torch


def cast_floating(value, dtype: torch.dtype, only: torch.dtype | None = None):
    """``value`` with every floating-point tensor in it (nested in tuples, lists, namedtuples, dicts)
    cast to ``dtype`` (with ``only``: every tensor of dtype ``only``); the containers are new ones of
    the same type (a dict subclass such as a Hugging Face ``ModelOutput`` shallow-copied, so it keeps
    its type and attributes): the caller's own batch is never changed."""
    if isinstance(value, torch.Tensor):
        cast = value.is_floating_point() if only is None else value.dtype == only
        return value.to(dtype) if cast else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(cast_floating(v, dtype, only) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(v, dtype, only) for v in value)
    if isinstance(value, dict):
        cast = copy.copy(value)
        for key in list(value):
            cast[key] = cast_floating(value[key], dtype, only)
        return cast
    return value



def _add_into_master(master: torch.nn.Parameter, half: torch.nn.Parameter) -> None:
    """Post-accumulate-grad hook of a half-precision parameter: its gradient joins the master's."""
    if master.grad is None:
        master.grad = half.grad.to(master.dtype)
    else:
        master.grad.add_(half.grad)
    half.grad = None


class ComputeCopy:
    """A half-precision copy of ``module`` that computes, with ``module``'s parameters as fp32 masters."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, accumulate_dtype: torch.dtype):
        self.masters = list(module.parameters())  # unique: tied parameters appear once
        self.halves = [torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad) for p in self.masters]
        # deepcopy with a memo: each master is replaced by its half copy (ties preserved), each
        # buffer is the original object itself (shared, so eng.module's buffers stay current).
        # Hook registries are shared too: a hook registered on eng.module, before or after,
        # fires in training.
        memo = {id(b): b for b in module.buffers()}
        memo.update({id(m): h for m, h in zip(self.masters, self.halves)})
        memo.update({id(v): v for m in module.modules() for k, v in vars(m).items() if "hook" in k and isinstance(v, dict)})
        self.model = copy.deepcopy(module, memo)
        self.module = _HalfPrecisionForward(self.model, dtype)
        self.accumulates_in_fp32 = accumulate_dtype == torch.float32
        if self.accumulates_in_fp32:
            for master, half in zip(self.masters, self.halves):
                if half.requires_grad:
                    half.register_post_accumulate_grad_hook(functools.partial(_add_into_master, master))

    def move_gradients_to_masters(self) -> None:
        """At the window's end, with half-precision accumulation: the masters' gradients become
        the copy's (in fp32); the copy's are dropped. Nothing to do with fp32 accumulation."""
        if self.accumulates_in_fp32:
            return
        for master, half in zip(self.masters, self.halves):
            if half.grad is not None:
                master.grad = half.grad.to(master.dtype)
                half.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy's parameters from the masters (after an optimizer step or a load)."""
        for master, half in zip(self.masters, self.halves):
            half.copy_(master)

    def zero_grad(self) -> None:
        for half in self.halves:
            half.grad = None

    def held_tensors(self) -> list[torch.Tensor | None]:
        return self.halves + [half.grad for half in self.halves]


class _HalfPrecisionForward(torch.nn.Module):
    """The copy's forward: floating-point inputs cast to the half precision, outputs to fp32."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        output = self.model(*cast_floating(args, self.dtype), **cast_floating(kwargs, self.dtype))
        return cast_floating(output, torch.float32)
