"""DeepSpeed's bucket and prefetch sizes on the torch backend: ``reduce_bucket_size`` is DDP's
gradient bucket, ``allgather_bucket_size`` ZeRO-1's parameter broadcast bucket,
``stage3_prefetch_bucket_size`` FSDP2's explicit prefetch. Each changes how many collectives
run (counted) and never the result."""

import copy
import functools
import warnings

import pytest
import torch

import engine
from bench.comm_count import CommCounter
from engine.config.schema import load_config
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, mlp, mse, regression_batches

ELEMENTS = 200  # a bucket of 800 bytes: one per layer or so in the 8-16-16-3 MLP


def overlap_case(rank, world, stage, sizes):
    """Two windows with and without ``sizes``: (largest parameter difference, collectives counted per run)."""
    model = mlp(dtype=torch.float32)
    batches = [tuple(t[4 * rank:4 * rank + 4] for t in b) for b in regression_batches(2, 8, dtype=torch.float32)]
    runs, calls = {}, {}
    for name, extra in {"default": {}, "sized": sizes}.items():
        config = {"train_batch_size": 8, "gradient_accumulation_steps": 2,
                  "zero_optimization": {"stage": stage, "shard_unit_size": 1, **extra}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng = engine.initialize(copy.deepcopy(model), config, optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
        with CommCounter() as comm:
            if stage == 0:
                comm.watch_ddp(eng.strategy.forward_module)
            for batch in batches:
                eng.train_batch(batch, mse)
        runs[name], calls[name] = eng.full_state_dict(), dict(comm.calls)
        eng.close()
    return max_param_diff(runs["sized"], runs["default"]), calls


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_bucket_and_prefetch_sizes_change_the_collectives_not_the_result():
    scenarios = {
        "ddp bucket": functools.partial(overlap_case, stage=0, sizes={"reduce_bucket_size": ELEMENTS}),
        "zero-1 broadcast bucket": functools.partial(overlap_case, stage=1, sizes={"allgather_bucket_size": ELEMENTS}),
        "zero-3 prefetch": functools.partial(overlap_case, stage=3, sizes={"stage3_prefetch_bucket_size": 1}),
        "zero-2 prefetch all": functools.partial(overlap_case, stage=2, sizes={"prefetch_bucket_size": 10**6}),
    }
    results = run_scenarios(scenarios, world_size=2, timeout=100)
    for name, per_rank in results.items():
        for diff, calls in per_rank:
            assert diff == 0, (name, diff)
            default, sized = calls["default"], calls["sized"]
            if name == "ddp bucket":  # DDP's buckets: one all-reduce per full bucket instead of one in all
                assert sized["all_reduce"] > default["all_reduce"], calls
            elif name == "zero-1 broadcast bucket":
                assert sized["broadcast"] > default["broadcast"], calls
            else:  # prefetching reorders the all-gathers; it adds none
                assert sized == default, calls


def test_sizes_the_torch_backend_reads_are_not_called_unused_and_bad_ones_are_refused():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config({"zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                                                    "overlap_comm": True}})
    notes = [str(w.message) for w in caught]
    assert len(notes) == 1 and "overlap_comm" in notes[0] and "bucket" not in notes[0], notes
    with pytest.raises(engine.ConfigError, match="zero_optimization.reduce_bucket_size: expected a number of elements"):
        engine.initialize(mlp(), {**config.to_dict(), "zero_optimization": {"reduce_bucket_size": -1}},
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
