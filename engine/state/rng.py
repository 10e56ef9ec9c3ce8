"""Random generators: seeding every one of them, and saving / restoring their states
(torch CPU and the current CUDA device, Python's ``random``, NumPy when installed)."""

from __future__ import annotations

import random

import torch


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def seed_everything(seed: int) -> None:
    """The same seed for torch, Python's ``random`` and NumPy (when installed)."""
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": None, "cuda": None}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    numpy = _numpy()
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (kind, keys.tolist(), int(pos), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    random.setstate(state["python"])
    numpy = _numpy()
    if state["numpy"] is not None and numpy is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))
