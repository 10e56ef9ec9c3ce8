"""``from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer``.

DeepSpeed moves the parameters of its MoE experts (marked ``allreduce = False``) into
parameter groups of their own, so that ZeRO reduces them over the expert-parallel group.
Microstep has no expert parallelism and no MoE layer: the groups come back as DeepSpeed returns
groups without experts (a list), and an expert parameter is refused rather than reduced over
the wrong ranks.
"""
from __future__ import annotations

from typing import Any

import torch

from engine.errors import EngineUsageError

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter: ``param.allreduce`` is False."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971
                                                         ) -> list[dict[str, Any]]:
    """``param_groups`` (a group dict, or a list / tuple of them) as a list of groups."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"unknown param group type {type(param_groups).__name__}: expected a dict of a "
                         "parameter group, or a list or tuple of them")
    for group in param_groups:
        group["params"] = list(group["params"])  # a generator would be used up by the first reader
        experts = [param for param in group["params"] if is_moe_param(param)]
        if experts:
            raise EngineUsageError(
                f"parameter group {group.get('name', '?')!r} holds {len(experts)} mixture-of-experts parameter(s) "
                "(allreduce=False): Microstep has no expert parallelism; train the model without MoE layers or "
                "with DeepSpeed itself")
    return param_groups
