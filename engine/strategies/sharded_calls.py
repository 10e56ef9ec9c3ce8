"""ZeRO-3's first window: a module called while its parameters are still sharded is named.

FSDP2 gathers a unit's parameters in the unit's own forward. A model whose forward calls a module
inside a unit directly (``block.mlp(x)`` instead of ``block(x)``) runs that module on its
sharded parameters, and torch fails deep inside an operator ("got mixed torch.Tensor and
DTensor"). Until the first window closes, every module that holds parameters gets a forward
pre-hook that raises, on every rank alike, an error naming the module, the unit that gathers it
and the fix; the hooks are removed after that window (no cost afterwards: a model's call graph
does not change between windows). Under a tensor split the parameters are DTensors anyway, and
compiled blocks would trace the hooks and recompile after their removal: the check is not
installed there.
"""

from __future__ import annotations

import torch
from torch import nn

from torch.distributed.tensor import DTensor
from engine.errors import EngineUsageError


class ShardedCallCheck:
    """The pre-hooks on ``module``'s parameter-holding modules (``units``: the sharded units' names)."""

    def __init__(self, module: nn.Module, units: list[str]):
        self._handles = []
        for name, child in module.named_modules():
            if any(isinstance(p, nn.Parameter) for p in child._parameters.values()):
                unit = max((u for u in units if name == u or name.startswith(u + ".") or u == ""), key=len,
                           default="")
                self._handles.append(child.register_forward_pre_hook(_refuse_sharded(name, unit)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _refuse_sharded(name: str, unit: str):
    def check(module: nn.Module, args) -> None:
        if any(isinstance(p, DTensor) for p in module._parameters.values() if isinstance(p, torch.Tensor)):
            where = f"'{unit}'" if unit else "the model's root"
            raise EngineUsageError(
                f"ZeRO 3: '{name or type(module).__name__}' was called with its parameters still sharded: they are "
                f"gathered in the forward of their unit {where}, and this call went around it (e.g. "
                f"block.mlp(x) instead of block(x)). Call the unit itself, or move that call into the unit's "
                "forward; or use ZeRO stage 2, which keeps whole parameters during the window")
    return check
