"""engine.batching.data.DistributedBatches: which samples each rank gets, per step and epoch."""
from itertools import islice
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.batching.data import DistributedBatches


def plan(sizes, rank=0, accumulation_steps=1):
    """Stand-in for engine.BatchPlan with the attributes DistributedBatches reads."""
    return SimpleNamespace(world_size=len(sizes), rank=rank, train_batch_size=sum(sizes),
                           per_device_batch_sizes=tuple(sizes),
                           per_device_batch_size=sizes[rank],
                           gradient_accumulation_steps=accumulation_steps)


def all_ranks(n, sizes, **kwargs):
    return [DistributedBatches(list(range(n)), plan(sizes, r), **kwargs)
            for r in range(len(sizes))]


def epoch_batches(loader):
    """One epoch of this rank's batches as lists of dataset indices."""
    return [batch.tolist() for batch in loader]


STRICT, BALANCED = (3, 3), (4, 3, 3)  # G = 6 on 2 ranks; G = 10 on 3 ranks


@pytest.mark.parametrize("sizes", [STRICT, BALANCED, (5,)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_each_step_covers_exactly_its_global_batch(sizes, shuffle):
    loaders = all_ranks(47, sizes, shuffle=shuffle, seed=3)
    per_rank = [epoch_batches(loader) for loader in loaders]
    G = sum(sizes)
    assert len(loaders[0]) == 47 // G and all(len(b) == len(loaders[0]) for b in per_rank)
    seen = []
    for step in range(len(loaders[0])):
        for rank, size in enumerate(sizes):
            assert len(per_rank[rank][step]) == size
            assert per_rank[rank][step] == loaders[0].rank_indices(0, step, rank)
        combined = [i for rank in range(len(sizes)) for i in per_rank[rank][step]]
        assert combined == loaders[0].global_batch_indices(0, step)
        assert len(set(combined)) == G
        seen += combined
    assert len(set(seen)) == len(seen) == len(loaders[0]) * G
    if not shuffle:
        assert seen == list(range(len(seen)))


def test_epochs_reshuffle_deterministically_and_roll_over():
    a, b = (DistributedBatches(list(range(40)), plan(STRICT), seed=7) for _ in range(2))
    first, second = epoch_batches(a), epoch_batches(a)  # the second loop is epoch 1
    assert a.epoch == 2 and a.step == 0
    assert first != second
    assert sorted(sum(first, [])) != sum(first, [])  # shuffled
    assert first == epoch_batches(b)
    b.set_epoch(1)
    assert [x.tolist() for x in b] == second
    other_seed = DistributedBatches(list(range(40)), plan(STRICT), seed=8)
    assert epoch_batches(other_seed) != first


def test_set_epoch_keeps_position_within_the_same_epoch():
    loader = DistributedBatches(list(range(40)), plan(STRICT))
    next(iter(loader))
    loader.set_epoch(0)  # the DistributedSampler habit after a resume: still at step 1
    assert (loader.epoch, loader.step) == (0, 1)
    loader.set_epoch(3)
    assert (loader.epoch, loader.step) == (3, 0)
    with pytest.raises(ValueError):
        loader.set_epoch(-1)


@pytest.mark.parametrize("stop_after", [1, 4, 6, 9])  # 6 batches per epoch: 6 and 9 cross it
def test_resume_mid_epoch_equals_uninterrupted_run(stop_after):
    def stream(loader, count):
        out = []
        while len(out) < count:
            out += [x.tolist() for x in islice(loader, count - len(out))]
        return out

    for rank in range(len(BALANCED)):
        reference = stream(DistributedBatches(list(range(65)), plan(BALANCED, rank), seed=1), 14)
        interrupted = DistributedBatches(list(range(65)), plan(BALANCED, rank), seed=1)
        done = stream(interrupted, stop_after)
        state = interrupted.state_dict()
        assert state["step"] == stop_after % 6 and state["epoch"] == stop_after // 6
        resumed = DistributedBatches(list(range(65)), plan(BALANCED, rank), seed=0)
        resumed.load_state_dict(state)  # restores the seed too
        assert done + stream(resumed, 14 - stop_after) == reference


def test_resume_on_a_different_world_size_keeps_the_global_batches():
    before = DistributedBatches(list(range(50)), plan((5, 5)), seed=4)
    next(iter(before))
    state = before.state_dict()
    after = all_ranks(50, (4, 3, 3), seed=0)
    for loader in after:
        loader.load_state_dict(state)
    step_batches = [next(iter(loader)).tolist() for loader in after]
    assert sum(step_batches, []) == before.global_batch_indices(0, 1)


def test_load_state_dict_rejects_a_different_data_order():
    state = DistributedBatches(list(range(40)), plan(STRICT)).state_dict()
    with pytest.raises(ValueError, match="dataset_size: saved 40, now 41"):
        DistributedBatches(list(range(41)), plan(STRICT)).load_state_dict(state)
    with pytest.raises(ValueError, match="train_batch_size"):
        DistributedBatches(list(range(40)), plan((4, 4))).load_state_dict(state)
    with pytest.raises(ValueError, match="saved step 99"):
        DistributedBatches(list(range(40)), plan(STRICT)).load_state_dict({**state, "step": 99})


def test_drop_last_true_drops_the_incomplete_global_batch():
    loaders = all_ranks(23, STRICT, shuffle=False)
    assert len(loaders[0]) == 3
    assert [epoch_batches(l)[-1] for l in loaders] == [[12, 13, 14], [15, 16, 17]]


@pytest.mark.parametrize("sizes, n, last_shares", [
    (STRICT, 23, (3, 2)),          # 5 left over on 2 ranks
    (BALANCED, 27, (3, 2, 2)),     # 7 left over on 3 ranks: the first rank gets the extra
    ((2, 2), 5, (1, 0)),           # rejected below: rank 1 would get nothing
])
def test_drop_last_false_spreads_the_remainder(sizes, n, last_shares):
    if min(last_shares) == 0:
        with pytest.raises(ValueError, match="no micro-batch is empty"):
            all_ranks(n, sizes, drop_last=False, shuffle=False)
        return
    loaders = all_ranks(n, sizes, drop_last=False, shuffle=False)
    steps = -(-n // sum(sizes))
    assert len(loaders[0]) == steps
    last = [epoch_batches(l)[-1] for l in loaders]
    assert tuple(len(b) for b in last) == last_shares == loaders[0].rank_sizes(steps - 1)
    assert sum(last, []) == list(range((steps - 1) * sum(sizes), n))


def test_drop_last_false_needs_a_share_per_accumulation_step():
    # 23 = 3 * 6 + 5: the last 5 samples cannot fill 2 ranks x 3 micro-batches.
    with pytest.raises(ValueError, match="2 ranks x 3 accumulation steps need at least 6"):
        DistributedBatches(list(range(23)), plan(STRICT, accumulation_steps=3), drop_last=False)
    DistributedBatches(list(range(24)), plan(STRICT, accumulation_steps=3), drop_last=False)


@pytest.mark.parametrize("kwargs, n, message", [
    ({}, 5, "fewer than one global batch"),
    ({"drop_last": False}, 0, "empty"),
])
def test_bad_dataset_sizes(kwargs, n, message):
    with pytest.raises(ValueError, match=message):
        DistributedBatches(list(range(n)), plan(STRICT), **kwargs)


def test_inconsistent_plan_is_rejected():
    bad = plan(STRICT)
    bad.train_batch_size = 7
    with pytest.raises(ValueError, match="summing to train_batch_size 7"):
        DistributedBatches(list(range(40)), bad)
    with pytest.raises(IndexError):
        DistributedBatches(list(range(40)), plan(STRICT)).global_batch_indices(0, 6)


def test_collation_default_and_custom():
    samples = [{"x": torch.full((2,), float(i)), "y": i} for i in range(12)]
    batch = next(iter(DistributedBatches(samples, plan(STRICT, rank=1), shuffle=False)))
    assert batch["x"].shape == (3, 2) and batch["y"].tolist() == [3, 4, 5]
    custom = DistributedBatches(samples, plan(STRICT), shuffle=False,
                                collate_fn=lambda items: [s["y"] for s in items])
    assert next(iter(custom)) == [0, 1, 2]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       extra=st.integers(0, 30), seed=st.integers(0, 5), drop_last=st.booleans())
def test_property_ranks_partition_each_global_batch(sizes, extra, seed, drop_last):
    G, W = sum(sizes), len(sizes)
    n = G + extra
    if not drop_last and 0 < n % G < W:
        return  # rejected at construction, covered above
    loaders = all_ranks(n, sizes, seed=seed, drop_last=drop_last)
    per_rank = [epoch_batches(loader) for loader in loaders]
    everything = []
    for step in range(len(loaders[0])):
        combined = sum((per_rank[r][step] for r in range(W)), [])
        assert combined == loaders[0].global_batch_indices(0, step)
        everything += combined
    expected = n if not drop_last else (n // G) * G
    assert len(everything) == len(set(everything)) == expected
