"""``from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam``: DeepSpeed's Adam kernels as
torch's Adam, which does the same arithmetic.

Both are ``torch.optim.Adam`` with DeepSpeed's arguments and defaults: AdamW (decoupled weight
decay: ``p -= lr * wd * p``) unless ``adam_w_mode`` / ``adamw_mode`` is False (then the L2 term
``wd * p`` joins the gradient), weight decay 0.0, lr 1e-3, betas (0.9, 0.999), eps 1e-8, the
moments bias-corrected. torch's fused kernel steps every parameter at once (CPU and CUDA), as
DeepSpeed's multi-tensor kernel does. Under ZeRO-1..3 the engine re-points the optimizer at its
shards; with ``offload_optimizer`` those shards live on the host, where ``DeepSpeedCPUAdam``
steps them in DeepSpeed too.
"""
from __future__ import annotations

import torch

from engine.errors import EngineUsageError

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


def _check(name: str, bias_correction: bool, amsgrad: bool) -> None:
    if amsgrad:
        raise EngineUsageError(f"{name}(amsgrad=True): DeepSpeed's {name} has no AMSGrad variant either; "
                               "use torch.optim.AdamW(params, amsgrad=True)")
    if not bias_correction:
        raise EngineUsageError(f"{name}(bias_correction=False): torch's Adam always corrects the moments' bias; "
                               "leave bias_correction=True")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)``."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
        _check(type(self).__name__, bias_correction, amsgrad)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, fused=True)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True)``: the
    optimizer state is in the parameters' precision (fp32 master weights under bf16 / fp16)."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        _check(type(self).__name__, bias_correction, amsgrad)
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode, fused=True)
