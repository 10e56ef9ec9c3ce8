"""accelerate's collective helpers over the default process group: ``gather`` (tensors, nested in
lists, tuples and dicts, concatenated along dim 0 in rank order), ``gather_object``, ``reduce`` and
``split_between_processes``' slicing. One process: the input itself."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.errors import EngineUsageError


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({key: map_tensors(value, fn) for key, value in data.items()})
    if isinstance(data, (list, tuple)):
        mapped = [map_tensors(value, fn) for value in data]
        return type(data)(*mapped) if hasattr(data, "_fields") else type(data)(mapped)
    raise EngineUsageError(f"gather / reduce take tensors (nested in lists, tuples or dicts); got "
                           f"{type(data).__name__}: use gather_object for other objects")


def _gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.contiguous()
    if tensor.dim() == 0:
        tensor = tensor[None]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


def gather(data: Any) -> Any:
    """Every process's tensors, concatenated along dim 0 (0-dim tensors become one row each)."""
    if not _distributed():
        return data
    return map_tensors(data, _gather_tensor)


def gather_object(obj: Any) -> list:
    """Every process's ``obj`` (a list: concatenated; anything else: one entry per process)."""
    if not _distributed():
        return list(obj) if isinstance(obj, (list, tuple)) else [obj]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    if isinstance(obj, (list, tuple)):
        return [item for part in everyone for item in part]
    return everyone


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    if reduction not in ("sum", "mean", "none"):
        raise EngineUsageError(f"reduce(reduction={reduction!r}): choose sum, mean or none")

    def one(tensor: torch.Tensor) -> torch.Tensor:
        result = tensor.clone()
        if _distributed() and reduction != "none":
            dist.all_reduce(result)
            if reduction == "mean":
                result /= dist.get_world_size()
        return result * scale if scale != 1.0 else result

    return map_tensors(data, one)


def process_slice(length: int, rank: int, world_size: int) -> slice:
    """This process's part of ``length`` items: equal parts, the first ``length % world_size`` one longer."""
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def split_for_process(inputs: Any, rank: int, world_size: int, apply_padding: bool) -> Any:
    """This process's part of a list, tuple, tensor or dict of them (accelerate's split_between_processes)."""
    if isinstance(inputs, dict):
        lengths = {len(value) for value in inputs.values()}
        if len(lengths) > 1:
            raise EngineUsageError("split_between_processes: every value of the dict must have the same length")
        return {key: split_for_process(value, rank, world_size, apply_padding) for key, value in inputs.items()}
    part = inputs[process_slice(len(inputs), rank, world_size)]
    longest = -(-len(inputs) // world_size)
    if apply_padding and len(part) < longest and len(inputs):
        padding = [inputs[-1]] * (longest - len(part))
        if isinstance(inputs, torch.Tensor):
            return torch.cat([part, torch.stack(padding)])
        return type(inputs)(list(part) + padding)
    return part
