"""A model and a batch maker for ``python -m engine explore`` (docs/autotune.md):

    python -m engine explore configs/mlp.yaml --model examples/explore_mlp.py:model \\
        --batch examples/explore_mlp.py:batch --loss examples/explore_mlp.py:loss
"""

import torch
import torch.nn.functional as F


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))


def batch(size: int):
    """One per-device batch of ``size`` samples: (inputs, targets)."""
    generator = torch.Generator().manual_seed(size)
    return torch.randn(size, 64, generator=generator), torch.randn(size, 8, generator=generator)


def loss(model, micro_batch):
    inputs, targets = micro_batch
    return F.mse_loss(model(inputs), targets)
