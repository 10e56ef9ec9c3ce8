"""fp16's dynamic loss scaler, and the in-place multiply of gradients it and the boundary use.

The scaler multiplies every micro-step's loss by the current scale; unscaling, the
overflow check and the scale update happen once per window, at the boundary, so an
overflow anywhere in the window discards the whole window.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from engine.adapters.torch_internals import foreach_mul_, non_finite_check_and_unscale_


class LossScaler:
    """DeepSpeed-style dynamic loss scaling (or a static scale when ``static_scale`` > 0).

    The first ``hysteresis - 1`` overflows after a growth are tolerated; every later one
    halves the scale. After ``window`` clean steps in a row it doubles (and the tolerance is
    restored).
    """

    def __init__(self, initial_scale_power: int = 16, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, static_scale: float = 0.0):
        self.dynamic = not static_scale
        self.scale = float(2 ** initial_scale_power) if self.dynamic else float(static_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self._hysteresis_left = hysteresis
        self._clean_steps = 0

    def unscale_(self, grads: list[torch.Tensor], multiplier: float | torch.Tensor = 1.0) -> torch.Tensor:
        """Multiply ``grads`` in place by ``multiplier / scale``; a 0-dim float tensor that is
        non-zero when some gradient is inf or nan (checked in the same pass)."""
        found_inf = torch.zeros((), dtype=torch.float32, device=_device_of(grads))
        for (device, _dtype), group in _by_device_and_dtype(grads).items():
            inv = torch.as_tensor(multiplier, dtype=torch.float32, device=device) / self.scale
            found = torch.zeros(1, dtype=torch.float32, device=device)
            non_finite_check_and_unscale_(group, found, inv.reshape(1))
            found_inf = found_inf + found.to(found_inf.device).squeeze()
        return found_inf

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._hysteresis_left <= 1:  # stays at 1 until the scale grows again
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._hysteresis_left -= 1
        else:
            self._clean_steps += 1
            if self._clean_steps % self.window == 0:
                self.scale *= 2
                self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._clean_steps = int(state["clean_steps"])


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict:
    groups: dict = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return groups


def scale_(grads: list[torch.Tensor], multiplier: float | torch.Tensor) -> None:
    """Multiply ``grads`` in place (one fused pass per device and dtype)."""
    for (device, dtype), group in _by_device_and_dtype(grads).items():
        factor = multiplier if isinstance(multiplier, float) else multiplier.to(device=device, dtype=dtype)
        foreach_mul_(group, factor)
