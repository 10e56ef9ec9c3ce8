"""Aux-loss-free load balancing (DeepSeek-V3): each router's expert bias moved at the boundary by
the load of the whole window.

A router holding an ``e_score_correction_bias`` buffer (Hugging Face's DeepSeek-V3, GLM-4-MoE, ...)
adds it to its scores to choose experts, and transformers never updates it. DeepSeek-V3 moves it
after each step by γ towards even load: ``bias_i += γ · sign(mean load − load_i)``. The load here is
the window's: the top-k assignments of every training forward of every micro-batch, summed over the
data ranks in one all-reduce at the window's end (rows whose ``attention_mask`` is 0 are not
counted when the micro-batch is a mapping holding one of the router's rows); the bias moves with
the optimizer step — not after a discarded window — so that it changes only at boundaries, as the
parameters do. A counting forward (``count_forward``) and the recomputation of activation
checkpointing are not counted.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

from engine.experts.balance import WindowLoad

log = logging.getLogger("engine")

BIAS = "e_score_correction_bias"


def _chosen_experts(output):
    """The (rows, top_k) integer tensor of expert indices among a router's outputs."""
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    for value in outputs:
        if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point() \
                and not value.is_complex() and value.dtype != torch.bool:
            return value
    return None


class BiasRouters:
    """The model's aux-loss-free routers and their load over the window in progress."""

    def __init__(self, model: torch.nn.Module, speed: float):
        self.speed = speed
        self.routers = [(name, module) for name, module in model.named_modules()
                        if isinstance(getattr(module, BIAS, None), torch.Tensor)]
        if self.routers and not speed:
            log.info("the model's %d router(s) hold an %s that nothing updates (moe.bias_update_speed: 0); "
                     "set moe.bias_update_speed (DeepSeek-V3 used 0.001) for aux-loss-free balancing",
                     len(self.routers), BIAS)
        self._loads: list[torch.Tensor | None] = [None] * len(self.routers)
        self._counting = False
        self._mask = None
        self._pending: list[torch.Tensor] | None = None
        if self.updating:
            for index, (_, module) in enumerate(self.routers):
                module.register_forward_hook(self._hook(index))

    @property
    def updating(self) -> bool:
        return bool(self.routers) and self.speed > 0

    def _hook(self, index: int):
        def count(module, inputs, output):
            if not self._counting:
                return
            chosen = _chosen_experts(output)
            bias = getattr(module, BIAS)
            if chosen is None:
                raise RuntimeError(f"moe.bias_update_speed: router {self.routers[index][0]} returned no "
                                   "(rows, top_k) tensor of chosen experts: its load cannot be counted")
            weight = torch.ones(chosen.shape[0], dtype=torch.float64, device=chosen.device)
            mask = self._mask
            if mask is not None and mask.numel() == chosen.shape[0]:
                weight = mask.reshape(-1).to(device=chosen.device, dtype=torch.float64)
            load = torch.zeros(bias.numel(), dtype=torch.float64, device=chosen.device).index_add_(
                0, chosen.reshape(-1), weight.repeat_interleave(chosen.shape[1]))
            self._loads[index] = load if self._loads[index] is None else self._loads[index] + load
        return count

    def start_window(self) -> None:
        self._loads = [None] * len(self.routers)
        self._pending = None

    def counting(self, forward: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``forward(micro_batch)`` whose routers' choices count for the window's load."""
        if not self.updating:
            return forward

        def counted(micro_batch):
            mask = micro_batch.get("attention_mask") if isinstance(micro_batch, dict) else None
            self._counting, self._mask = True, mask
            try:
                return forward(micro_batch)
            finally:
                self._counting, self._mask = False, None
        return counted

    @contextlib.contextmanager
    def paused(self):
        """Forwards inside the block are not counted (the counting forward of ``count_forward``)."""
        counting, self._counting = self._counting, False
        try:
            yield
        finally:
            self._counting = counting

    def window_load(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> WindowLoad | None:
        """The window's load over every data rank (one all-reduce), kept for the boundary's update."""
        if not self.updating:
            return None
        missing = [name for (name, _), load in zip(self.routers, self._loads) if load is None]
        if missing:
            raise RuntimeError(f"moe.bias_update_speed: router(s) {', '.join(missing)} chose no expert in this "
                               "window's forwards; every router with an e_score_correction_bias must run")
        total = all_reduce_sum(torch.cat(self._loads))
        self._pending = list(total.split([load.numel() for load in self._loads]))
        return WindowLoad([load.reshape(1, -1) for load in self._pending])

    @torch.no_grad()
    def update(self, applied: bool) -> None:
        """At the boundary: move every bias towards even load (only when the step was applied)."""
        pending, self._pending = self._pending, None
        if not applied or pending is None:
            return
        for (_, module), load in zip(self.routers, pending):
            bias = getattr(module, BIAS)
            step = torch.sign(load.mean() - load) * self.speed
            bias.add_(step.to(device=bias.device, dtype=bias.dtype))
