"""Split a batch pytree into micro-batches and read its size.

A batch is a tensor, a tuple/list/namedtuple, or a mapping (dict, OrderedDict, a Hugging
Face ``BatchEncoding``...), nested freely. Tensors with a batch dimension are split along
dim 0 into views (no copies); scalars, 0-dim tensors and other leaves are passed to every
micro-batch unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from engine.errors import BatchError


def _children(container: Mapping | tuple | list, path: str) -> Iterator[tuple[Any, str, Any]]:
    """(key, path, value) of each item of a mapping or a tuple/list."""
    if isinstance(container, Mapping):
        for key, value in container.items():
            yield key, f"{path}[{key!r}]", value
    else:
        for i, value in enumerate(container):
            yield i, f"{path}[{i}]", value


def tensor_leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``batch`` with its path, e.g. ``batch['inputs'][0]``."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, (Mapping, tuple, list)):
        for _, child, value in _children(batch, path):
            yield from tensor_leaves(value, child)


def map_tensors(batch: Any, fn: Callable[[str, torch.Tensor], Any], path: str = "batch") -> Any:
    """``batch`` with every tensor replaced by ``fn(path, tensor)`` (paths as in
    ``tensor_leaves``); containers keep their types, other leaves stay as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(path, batch)
    if isinstance(batch, Mapping):
        return rebuild_mapping(batch, {key: map_tensors(value, fn, child)
                                        for key, child, value in _children(batch, path)})
    if isinstance(batch, (tuple, list)):
        return _rebuild(batch, [map_tensors(value, fn, child) for _, child, value in _children(batch, path)])
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (those already there are not copied)."""
    return map_tensors(batch, lambda _path, tensor: tensor.to(device, non_blocking=True))


def batch_size(batch: Any) -> int:
    """The size of dim 0 shared by every tensor in ``batch`` that has a dim 0."""
    sizes = {path: t.shape[0] for path, t in tensor_leaves(batch) if t.dim() > 0}
    if not sizes:
        raise BatchError(
            f"cannot find the batch size of a {type(batch).__name__}: it holds no tensor with a "
            "batch dimension; pass a tensor, a tuple/list or a mapping of tensors"
        )
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{path}: {n}" for path, n in sizes.items())
        raise BatchError(
            f"the tensors of one batch must share their first (batch) dimension; got {listing}"
        )
    return next(iter(sizes.values()))


def _rebuild(template: Any, items: list) -> Any:
    if isinstance(template, tuple) and hasattr(template, "_fields"):  # namedtuple
        return type(template)(*items)
    return type(template)(items)


def split_batch(batch: Any, sizes: tuple[int, ...] | list[int]) -> list[Any]:
    """``batch`` cut along dim 0 into consecutive micro-batches of the given ``sizes``."""
    sizes = list(sizes)
    if sum(sizes) != batch_size(batch):
        raise BatchError(f"cannot cut a batch of {batch_size(batch)} samples into micro-batches {sizes}")
    return _split(batch, sizes)


def _split(batch: Any, sizes: list[int]) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * len(sizes)
        return list(torch.split(batch, sizes))
    if isinstance(batch, Mapping):
        keys = list(batch.keys())
        columns = [_split(batch[k], sizes) for k in keys]
        return [rebuild_mapping(batch, dict(zip(keys, row))) for row in zip(*columns)]
    if isinstance(batch, (tuple, list)):
        if not batch:
            return [batch] * len(sizes)
        columns = [_split(value, sizes) for value in batch]
        return [_rebuild(batch, list(row)) for row in zip(*columns)]
    return [batch] * len(sizes)


def rebuild_mapping(template: Mapping, data: dict) -> Mapping:
    if type(template) is dict:
        return data
    try:  # OrderedDict, BatchEncoding(data=...), most UserDict subclasses
        return type(template)(data)
    except TypeError:
        return data
