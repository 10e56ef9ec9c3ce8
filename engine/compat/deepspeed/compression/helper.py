"""``from deepspeed.compression.helper import recursive_getattr, recursive_setattr``: reach a
submodule of a model by its dotted name (``"model.layers.0.mlp"``), as ``named_modules`` names it."""
from __future__ import annotations

import functools

import torch

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: torch.nn.Module, module_name: str):
    """The submodule (or attribute) of ``model`` at the dotted ``module_name``."""
    return functools.reduce(getattr, module_name.split("."), model)


def recursive_setattr(model: torch.nn.Module, module_name: str, module) -> None:
    """Replace the submodule of ``model`` at the dotted ``module_name`` by ``module``."""
    parent_name, _, name = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, name, module)
