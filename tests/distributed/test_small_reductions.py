"""A few numbers summed or maxed over the ranks (``collectives.small_sum`` / ``small_max``): one
all-gather and a reduction in rank order, or, past ``GATHERED_LIMIT`` gathered elements, an
all-reduce. Both give the all-reduce's values, the same on every rank."""

import pytest
import torch
import torch.distributed as dist

from engine.distributed import collectives
from engine.distributed.collectives import small_max, small_sum
from tests.support.dist_utils import run_distributed


def reductions(rank, world):
    results = {}
    for size in (3, collectives.GATHERED_LIMIT // world + 1):  # gathered; past the limit: all-reduce
        values = torch.arange(size, dtype=torch.float64) * (rank + 1) - rank
        expected_sum, expected_max = values.clone(), values.clone()
        dist.all_reduce(expected_sum)
        dist.all_reduce(expected_max, op=dist.ReduceOp.MAX)
        summed, maxed = small_sum(values.clone()), small_max(values.clone())
        results[size] = {"sum": torch.equal(summed, expected_sum), "max": torch.equal(maxed, expected_max),
                         "shape": tuple(summed.shape), "first": float(summed[1])}
    scalar = small_sum(torch.tensor(float(rank + 1), dtype=torch.float64))
    results["scalar"] = (tuple(scalar.shape), float(scalar))
    return results


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_small_reductions_equal_the_all_reduce_on_every_rank_either_way():
    per_rank = run_distributed(reductions, world_size=2, timeout=50)
    assert per_rank[0] == per_rank[1]
    for size, result in per_rank[0].items():
        if size == "scalar":
            assert result == ((), 3.0)
            continue
        assert result["sum"] and result["max"] and result["shape"] == (size,), (size, result)
        assert result["first"] == 2.0, (size, result)  # element 1: rank 0 holds 1, rank 1 holds 2 - 1
