"""Functions for tests/integration/test_verify.py, at module level so the processes verify starts load them."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tests.support.reference import mlp, mse, regression_batches

GLOBAL_BATCH = 8


def plain_mlp() -> torch.nn.Module:
    return mlp(seed=0, dtype=torch.float32)  # verify casts it to its --dtype


def mlp_with_dropout_and_batchnorm() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                               torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))


def unseeded_mlp() -> torch.nn.Module:
    return torch.nn.Linear(8, 3)


def regression(step: int):
    return regression_batches(step + 1, GLOBAL_BATCH, dtype=torch.float32)[step]


def mean_loss(model, batch):
    return mse(model, batch)


def summed_as_mean(model, batch):
    """A broken loss: the sum over the micro-batch's samples returned as if it were their mean."""
    x, y = batch
    return F.mse_loss(model(x), y, reduction="sum")


def fails_on_a_rank(model, batch):
    """A loss that raises in the started process whose rank VERIFY_TEST_FAIL_RANK names."""
    if os.environ.get("RANK") == os.environ.get("VERIFY_TEST_FAIL_RANK"):
        raise RuntimeError(f"failing on purpose on rank {os.environ['RANK']}")
    return mse(model, batch)
