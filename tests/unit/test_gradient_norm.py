"""The squared-norm shares of ``engine.strategies.gradients``: summed over the ranks holding a
module they give the squared norm of its gradient, however the replicated gradients are split
between the ranks that all-reduced them."""

import math

import pytest
import torch

from engine.strategies.gradients import squares_share


def params_with_gradients(sizes, nan_at=None):
    params = []
    for index, size in enumerate(sizes):
        p = torch.nn.Parameter(torch.zeros(size, dtype=torch.float64))
        p.grad = torch.arange(1, size + 1, dtype=torch.float64) * (index + 1)
        params.append(p)
    if nan_at is not None:
        params[nan_at[0]].grad[nan_at[1]] = float("nan")
    return params


@pytest.mark.parametrize("sizes, holders, parts", [
    ([5, 3, 8], 1, 1),  # one rank holds everything
    ([5, 3, 8], 2, 2),  # two data ranks split the whole gradient
    ([5, 3, 8], 4, 2),  # data 2 × tensor 2: the replicated gradient split over data, each tensor rank alike
    ([2, 1], 8, 8),  # fewer elements than ranks: some parts are empty
    ([7], 6, 3),
])
def test_shares_over_the_holders_add_up_to_the_squared_norm(sizes, holders, parts):
    params = params_with_gradients(sizes)
    expected = sum(float(p.grad.square().sum()) for p in params)
    copies = holders // parts  # ranks at the same index of the reduction group (tensor ranks)
    total = sum(float(squares_share(params, holders, torch.device("cpu"), split=(index, parts))) * copies
                for index in range(parts))
    assert total == pytest.approx(expected, rel=1e-14)


def test_a_non_finite_gradient_anywhere_makes_the_total_non_finite():
    params = params_with_gradients([5, 3, 8], nan_at=(2, 7))
    shares = [float(squares_share(params, 2, torch.device("cpu"), split=(index, 2))) for index in range(2)]
    assert math.isnan(sum(shares)) and sum(math.isnan(share) for share in shares) == 1
