"""``deepspeed.runtime.utils.set_random_seed``: seed Python's, NumPy's and torch's generators."""
from __future__ import annotations

import random

import numpy
import torch

__all__ = ["set_random_seed"]


def set_random_seed(seed: int) -> None:
    """The same ``seed`` for ``random``, NumPy and torch (every device), as DeepSpeed's."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
