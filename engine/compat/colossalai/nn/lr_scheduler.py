"""``colossalai.nn.lr_scheduler``: Colossal-AI's schedules by their names and arguments
(``total_steps`` rather than torch's ``T_max``), stepped once per call as in Colossal-AI; under
``colossalai.initialize(..., lr_scheduler=...)`` or a script that steps every iteration, the
facade's ``OncePerWindow`` moves them once per accumulation window."""
from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["CosineAnnealingLR", "LinearWarmupLR"]


class CosineAnnealingLR(torch.optim.lr_scheduler.CosineAnnealingLR):
    """torch's ``CosineAnnealingLR`` over ``total_steps`` (its ``T_max``) down to ``eta_min``."""

    def __init__(self, optimizer, total_steps: int, eta_min: float = 0.0, last_epoch: int = -1, **kwargs):
        super().__init__(optimizer, T_max=total_steps, eta_min=eta_min, last_epoch=last_epoch)


class LinearWarmupLR(LRScheduler):
    """Up from lr / (warmup_steps + 1) to the optimizer's lr over ``warmup_steps`` steps, then
    linearly down to 0 at ``total_steps``."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, last_epoch: int = -1, **kwargs):
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        step = self.last_epoch
        if step < self.warmup_steps:
            return [base * (step + 1) / (self.warmup_steps + 1) for base in self.base_lrs]
        return [base * (self.total_steps - step) / (self.total_steps - self.warmup_steps) for base in self.base_lrs]
