"""The precision policy of the torch backend: one object answers every question a holder has
about precision, so no holder reads a dtype (Lightning Fabric's ``Precision`` plugin is the model).

At each point of a window the holder asks the policy:

* module conversion: ``compute_copy(module)`` for a model held whole (the half-precision copy of
  ``engine.precision.compute_copy``), ``fsdp_policies()`` for one FSDP2 shards (its
  ``MixedPrecisionPolicy``), ``compute_itemsize`` for what a gathered parameter weighs;
* the forward: ``forward_context()`` (autocast, or nothing) and ``outputs(value)``, what the loss
  sees of the model's outputs (fp32 under every half policy);
* the backward: ``scale_loss(loss, weight)`` (fp16's loss scale);
* the boundary: ``unscale_(grads, multiplier, max_over_ranks)`` (the multiplier, the loss scale's
  inverse and the overflow check in one pass; the scale updated) — the non-finite check without
  a scaler is the gradient norm's, the holder's.

Policies: :class:`FullPrecision`, :class:`Autocast` (fp32 parameters, ops cast), and
:class:`HalfParameters` (parameters computed in the half precision from fp32 masters); fp16's
loss scaler belongs to either half policy. A new precision (fp8 through torchao) is one more
policy: its module conversion and its forward context.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from engine.errors import ConfigError
from engine.precision.compute_copy import ComputeCopy, cast_floating
from engine.precision.loss_scaler import LossScaler, scale_


class FullPrecision:
    """The parameters' own dtype throughout (the base of every policy)."""

    scaler: LossScaler | None = None
    converts_parameters = False  # whether the gathered / computing parameters are copies in another dtype
    compute_itemsize: int | None = None  # bytes of a computing parameter's element (None: its own)

    def compute_copy(self, module: torch.nn.Module) -> ComputeCopy | None:
        """What a holder keeping ``module`` whole computes in (None: ``module`` itself)."""
        return None

    def fsdp_policies(self) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
        """FSDP2's (inner units', root's) mixed-precision policies."""
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()

    def forward_context(self):
        return contextlib.nullcontext()

    def outputs(self, value):
        """What the loss sees of the model's outputs ``value``: the outputs themselves."""
        return value

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor, weight: float) -> torch.Tensor:
        """The micro-batch loss to back-propagate: weighted, times the loss scale."""
        return loss * (weight * self.loss_scale)

    def unscale_(self, grads: list[torch.Tensor], multiplier: float | torch.Tensor,
                 max_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> tuple[bool, bool]:
        """At the boundary: multiply ``grads`` in place by ``multiplier`` (and the loss scale's
        inverse). Returns (discard the window, its gradient is non-finite beyond what a smaller
        loss scale can cure); with a scaler the overflow is decided over every rank and the
        scale updated."""
        scaler = self.scaler
        if scaler is None:
            if isinstance(multiplier, torch.Tensor) or multiplier != 1.0:
                scale_(grads, multiplier)
            return False, False
        # .to: offloaded gradients (and so the flag) are on the host; nccl reduces device tensors
        found = scaler.unscale_(grads, multiplier)
        overflow = bool(max_over_ranks(found).item())
        at_minimum = scaler.scale <= scaler.min_scale  # a smaller scale cannot cure this one
        scaler.update(overflow)
        return overflow, overflow and at_minimum


class Autocast(FullPrecision):
    """fp32 parameters; autocast casts each op's inputs to ``dtype`` (``torch_autocast``, and every
    half precision under a tensor or pipeline mesh)."""

    def __init__(self, dtype: torch.dtype, device_type: str, scaler: LossScaler | None):
        self.dtype, self.device_type, self.scaler = dtype, device_type, scaler

    def forward_context(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def outputs(self, value):
        """The outputs autocast left in ``dtype``, cast to fp32: the loss is computed in fp32, as under
        :class:`HalfParameters` (the model runs inside autocast, the loss outside it). Without this,
        torch 2.11's backward of a loss mixing a half-precision output with an fp32 target fails
        (``mse_loss``: "Found dtype Float but expected Half"; 2.13 promotes)."""
        return cast_floating(value, torch.float32, only=self.dtype)


class HalfParameters(FullPrecision):
    """Parameters gathered and computed in ``dtype`` from fp32 masters, gradients reduced in fp32
    and accumulated over a window in ``accumulate_dtype``."""

    converts_parameters = True

    def __init__(self, dtype: torch.dtype, accumulate_dtype: torch.dtype, scaler: LossScaler | None):
        self.dtype, self.accumulate_dtype, self.scaler = dtype, accumulate_dtype, scaler
        self.compute_itemsize = dtype.itemsize

    def compute_copy(self, module):
        return ComputeCopy(module, self.dtype, self.accumulate_dtype)

    def fsdp_policies(self):
        # Gradients reduced in fp32 (and so, when a window defers, accumulated in fp32: FSDP2
        # accumulates unreduced gradients in the reduce dtype) unless data_types.grad_accum_dtype asks
        # for the half precision. The root returns fp32 outputs: the loss is computed in fp32, as
        # autocast would.
        inner = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=self.accumulate_dtype)
        root = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=self.accumulate_dtype,
                                    output_dtype=torch.float32)
        return inner, root


def precision_policy(half, device_type: str) -> FullPrecision:
    """The policy of ``half`` (an ``engine.config.setup.HalfPrecision``) on ``device_type``."""
    scaler = None
    if half.loss_scaling is not None:
        fp16 = half.loss_scaling
        scaler = LossScaler(fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale,
                            fp16.loss_scale)
    if half.dtype is None:
        return FullPrecision()
    if half.autocast:
        return Autocast(half.dtype, device_type, scaler)
    return HalfParameters(half.dtype, half.grad_accum_dtype, scaler)


def check_autocast_computes(model: torch.nn.Module, half, why: str) -> None:
    """Autocast casts only float32 tensors: over parameters of another floating dtype (float64)
    it would compute nothing in ``half.dtype``, where one process's half-precision copy casts
    every parameter. Refused rather than trained silently at full precision. ``half``: an
    ``engine.config.setup.HalfPrecision``; ``why``: why autocast is used (the mesh, or torch_autocast)."""
    if half.dtype is None or not half.autocast:
        return
    other = [(name, p.dtype) for name, p in model.named_parameters()
             if p.is_floating_point() and p.dtype != torch.float32]
    if not other:
        return
    key = "bf16" if half.dtype == torch.bfloat16 else "fp16"
    dtypes = sorted({str(dtype).removeprefix("torch.") for _, dtype in other})
    names = ", ".join(name for name, _ in other[:3]) + (", ..." if len(other) > 3 else "")
    raise ConfigError([
        f"{key}.enabled: {why}, {key} is autocast, which computes in {key} only what is float32; the model's "
        f"parameters are {' and '.join(dtypes)} ({names}), which it would leave as they are: the run would "
        f"compute nothing in {key}, unlike one process (which casts every parameter to {key}). Convert the model "
        f"to float32 (model.float()) to train in {key}, or set {key}.enabled: false to train at its own precision"])
