"""Batch planning: valid and invalid plans in both split modes, auto plans, properties."""
import logging
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.batching.plan import BatchConfigError, BatchPlan, resolve_batch_plan

# (resolve kwargs, expected G, M, A, per-device sizes, micro-batch sizes per distinct rank kind)
VALID_PLANS = [
    # strict: any two of G, M, A determine the third
    (dict(world_size=2, train_batch_size=32, train_micro_batch_size_per_gpu=4),
     32, 4, 4, (16, 16), {0: (4, 4, 4, 4)}),
    (dict(world_size=2, train_batch_size=32, gradient_accumulation_steps=4),
     32, 4, 4, (16, 16), {0: (4, 4, 4, 4)}),
    (dict(world_size=2, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4),
     32, 4, 4, (16, 16), {1: (4, 4, 4, 4)}),
    (dict(world_size=2, train_batch_size=32, train_micro_batch_size_per_gpu=4,
          gradient_accumulation_steps=4), 32, 4, 4, (16, 16), {0: (4, 4, 4, 4)}),
    (dict(world_size=4, train_batch_size=32), 32, 8, 1, (8,) * 4, {3: (8,)}),
    (dict(world_size=3, train_micro_batch_size_per_gpu=5), 15, 5, 1, (5,) * 3, {0: (5,)}),
    (dict(world_size=1, train_batch_size=7), 7, 7, 1, (7,), {0: (7,)}),
    # balanced: uneven ranks and / or uneven micro-batches
    (dict(world_size=4, train_batch_size=30, train_micro_batch_size_per_gpu=4,
          batch_split="balanced"), 30, 4, 2, (8, 8, 7, 7), {0: (4, 4), 3: (4, 3)}),
    (dict(world_size=4, train_batch_size=34, train_micro_batch_size_per_gpu=3,
          batch_split="balanced"), 34, 3, 3, (9, 9, 8, 8), {1: (3, 3, 3), 2: (3, 3, 2)}),
    (dict(world_size=4, train_batch_size=30, batch_split="balanced"),
     30, 8, 1, (8, 8, 7, 7), {0: (8,), 2: (7,)}),
    (dict(world_size=4, train_batch_size=30, gradient_accumulation_steps=2,
          batch_split="balanced"), 30, 4, 2, (8, 8, 7, 7), {0: (4, 4), 3: (4, 3)}),
    (dict(world_size=4, train_batch_size=30, train_micro_batch_size_per_gpu=4,
          gradient_accumulation_steps=3, batch_split="balanced"),
     30, 4, 3, (8, 8, 7, 7), {0: (3, 3, 2), 3: (3, 2, 2)}),
    (dict(world_size=2, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2,
          batch_split="balanced"), 12, 3, 2, (6, 6), {0: (3, 3)}),
    (dict(world_size=2, train_batch_size=32, train_micro_batch_size_per_gpu=16,
          batch_split="balanced"), 32, 16, 1, (16, 16), {0: (16,)}),
]


@pytest.mark.parametrize("kwargs, g, m, a, per_device, micro", VALID_PLANS)
def test_valid_plans(kwargs, g, m, a, per_device, micro):
    plan = resolve_batch_plan(**kwargs)
    assert (plan.train_batch_size, plan.train_micro_batch_size_per_gpu,
            plan.gradient_accumulation_steps) == (g, m, a)
    assert plan.world_size == kwargs["world_size"]
    assert plan.batch_split == kwargs.get("batch_split", "strict")
    assert plan.rank == 0 and plan.micro_batch_mode == "fixed"
    assert plan.per_device_batch_sizes == per_device
    assert plan.per_device_batch_size == per_device[0]
    for rank, sizes in micro.items():
        assert plan.micro_batch_sizes_for_rank(rank) == sizes
        assert plan.for_rank(rank).micro_batch_sizes == sizes
        assert plan.for_rank(rank).per_device_batch_size == per_device[rank]
    uneven = len(set(per_device)) > 1 or any(len(set(s)) > 1 for s in micro.values())
    assert bool(plan.notes) == uneven


INVALID_PLANS = [
    (dict(world_size=2, train_batch_size=30, train_micro_batch_size_per_gpu=4,
          gradient_accumulation_steps=4),
     ["train_batch_size 30 != micro 4 × accumulation 4 × world 2 = 32",
      "nearest valid train_batch_size: 24 or 32", "batch_split: balanced"]),
    (dict(world_size=2, train_batch_size=32, train_micro_batch_size_per_gpu=4,
          gradient_accumulation_steps=2),
     ["!= micro 4 × accumulation 2 × world 2 = 16", "gradient_accumulation_steps 4",
      "train_micro_batch_size_per_gpu 8"]),
    (dict(world_size=4, train_batch_size=30),
     ["not divisible by world size 4", "7.5 per device", "nearest valid train_batch_size: 28 or 32"]),
    (dict(world_size=2, train_batch_size=30, train_micro_batch_size_per_gpu=4),
     ["micro 4 × world 2 = 8", "nearest valid train_batch_size: 24 or 32",
      "train_micro_batch_size_per_gpu 3 or 5"]),
    (dict(world_size=2, train_batch_size=32, gradient_accumulation_steps=3),
     ["accumulation 3 × world 2 = 6", "nearest valid train_batch_size: 30 or 36",
      "gradient_accumulation_steps 2 or 4"]),
    (dict(world_size=4, train_batch_size=3), ["smaller than world size 4", ">= 4"]),
    (dict(world_size=4, train_batch_size=3, batch_split="balanced"), ["smaller than world size"]),
    (dict(world_size=4, train_batch_size=3, batch_split="balanced", micro_batch_tokens=64),
     ["train_batch_size 3 is smaller than world size 4", ">= 4"]),  # a token plan too: no rank left empty
    (dict(world_size=2, gradient_accumulation_steps=4),
     ["set train_batch_size or", "gradient_accumulation_steps alone does not fix the batch"]),
    (dict(world_size=2), ["set train_batch_size or"]),
    (dict(world_size=2, train_batch_size=0), ["train_batch_size must be a positive integer, got 0"]),
    (dict(world_size=2, train_batch_size=True), ["got True (bool)"]),
    (dict(world_size=2, train_micro_batch_size_per_gpu=2.0), ["got 2.0 (float)"]),
    (dict(world_size=2, train_micro_batch_size_per_gpu="big"), ["'auto' or 'explore'"]),
    (dict(world_size=2, train_batch_size=8, gradient_accumulation_steps=-1),
     ["gradient_accumulation_steps must be a positive integer"]),
    (dict(world_size=0, train_batch_size=8), ["world_size must be an integer >= 1"]),
    (dict(world_size=True, train_batch_size=8), ["world_size must be an integer >= 1"]),
    (dict(world_size=2, train_batch_size=8, rank=2), ["rank must be an integer in 0..1"]),
    (dict(world_size=2, train_batch_size=8, batch_split="even"), ["batch_split must be"]),
    (dict(world_size=4, train_batch_size=5, train_micro_batch_size_per_gpu=1,
          batch_split="balanced"),
     ["empty micro-batch", "rank 3", "train_micro_batch_size_per_gpu >= 2", "4 or 8"]),
    (dict(world_size=4, train_batch_size=5, gradient_accumulation_steps=2,
          batch_split="balanced"),
     ["empty micro-batch", "gradient_accumulation_steps <= 1", "train_batch_size >= 8"]),
    (dict(world_size=4, train_batch_size=30, train_micro_batch_size_per_gpu=2,
          gradient_accumulation_steps=2, batch_split="balanced"),
     ["micro-batches of 4 > micro 2", "gradient_accumulation_steps >= 4"]),
    (dict(world_size=2, train_micro_batch_size_per_gpu="auto"), ["needs train_batch_size"]),
    (dict(world_size=2, train_batch_size=8, train_micro_batch_size_per_gpu="explore",
          gradient_accumulation_steps=2), ["remove gradient_accumulation_steps"]),
    (dict(world_size=2, train_batch_size=8, train_micro_batch_size_per_gpu="auto", auto_max=0),
     ["auto_max must be a positive integer"]),
    (dict(world_size=3, train_batch_size=8, train_micro_batch_size_per_gpu="auto"),
     ["not divisible by world size 3", "6 or 9"]),
]


@pytest.mark.parametrize("kwargs, fragments", INVALID_PLANS)
def test_invalid_plans(kwargs, fragments):
    with pytest.raises(BatchConfigError) as caught:
        resolve_batch_plan(**kwargs)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_batch_config_error_is_a_value_error():
    assert issubclass(BatchConfigError, ValueError)


@pytest.mark.parametrize("kwargs, mode, m, a", [
    (dict(world_size=2, train_batch_size=32), "auto", 16, 1),
    (dict(world_size=2, train_batch_size=32, auto_max=5), "auto", 4, 4),
    (dict(world_size=2, train_batch_size=24, auto_max=5), "explore", 4, 3),
    (dict(world_size=2, train_batch_size=24, auto_max=100), "auto", 12, 1),
    (dict(world_size=4, train_batch_size=30, batch_split="balanced"), "auto", 8, 1),
    (dict(world_size=4, train_batch_size=30, batch_split="balanced", auto_max=3), "explore", 3, 3),
])
def test_auto_plans_start_at_the_capped_per_device_batch(kwargs, mode, m, a):
    plan = resolve_batch_plan(train_micro_batch_size_per_gpu=mode, **kwargs)
    assert plan.micro_batch_mode == mode
    assert (plan.train_micro_batch_size_per_gpu, plan.gradient_accumulation_steps) == (m, a)
    assert sum(plan.per_device_batch_sizes) == kwargs["train_batch_size"]
    smaller = plan.with_micro_batch_size(plan.candidate_micro_sizes()[0])
    assert smaller.micro_batch_mode == mode
    assert smaller.train_batch_size == plan.train_batch_size
    assert "provisional" in plan.describe()


def test_candidates_and_next_smaller_strict():
    plan = resolve_batch_plan(2, 24, 4)  # P = 12
    assert plan.candidate_micro_sizes() == (1, 2, 3, 4, 6, 12)
    assert plan.next_smaller_micro_size() == 3
    assert resolve_batch_plan(2, 24, 1).next_smaller_micro_size() is None
    replanned = plan.with_micro_batch_size(6)
    assert (replanned.train_micro_batch_size_per_gpu, replanned.gradient_accumulation_steps) == (6, 2)
    with pytest.raises(BatchConfigError, match="does not divide the per-device batch 12"):
        plan.with_micro_batch_size(5)
    with pytest.raises(BatchConfigError, match="positive integer"):
        plan.with_micro_batch_size(0)


def test_candidates_and_next_smaller_balanced():
    plan = resolve_batch_plan(4, 30, 8, batch_split="balanced")  # P = 8, 8, 7, 7
    # 1 would need 8 micro-steps, leaving the 7-sample ranks an empty one.
    assert plan.candidate_micro_sizes() == (2, 3, 4, 5, 6, 7, 8)
    assert plan.next_smaller_micro_size() == 4
    assert resolve_batch_plan(4, 30, 2, batch_split="balanced").next_smaller_micro_size() is None
    assert resolve_batch_plan(2, 4, 1, batch_split="balanced").next_smaller_micro_size() is None
    replanned = plan.with_micro_batch_size(3)
    assert replanned.micro_batch_sizes_for_rank(3) == (3, 2, 2)
    with pytest.raises(BatchConfigError, match="empty micro-batch"):
        plan.with_micro_batch_size(1)


def test_window_samples():
    plan = resolve_batch_plan(4, 30, 4, batch_split="balanced")
    assert [plan.window_samples(k) for k in range(3)] == [0, 16, 30]
    with pytest.raises(ValueError):
        plan.window_samples(3)


def test_describe_shows_each_kind_of_rank():
    text = resolve_batch_plan(4, 34, 3, batch_split="balanced").describe()
    assert "ranks 0-1:" in text and "9 samples, micro-batches 3,3,3" in text
    assert "ranks 2-3:" in text and "8 samples, micro-batches 3,3,2" in text
    for label in ("world size", "global batch", "micro-batch cap", "accumulation steps",
                  "batch split", "note:"):
        assert label in text
    assert "rank 0:" in resolve_batch_plan(1, 4).describe()


def test_balanced_changes_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        plan = resolve_batch_plan(4, 30, 4, batch_split="balanced")
    assert len(plan.notes) == 2
    assert "ranks 0-1 get 8 samples, ranks 2-3 get 7" in plan.notes[0]
    assert [r.getMessage() for r in caplog.records] == [f"batch_split balanced: {n}"
                                                        for n in plan.notes]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine"):
        resolve_batch_plan(2, 32, 4, batch_split="balanced")
    assert not caplog.records


def test_plans_are_hashable_and_picklable():
    plan = resolve_batch_plan(4, 30, 4, batch_split="balanced", rank=2)
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert hash(plan.for_rank(2)) == hash(plan)
    assert {plan, plan.for_rank(1)} == {plan, plan.for_rank(1)}
    assert isinstance(plan, BatchPlan)
    with pytest.raises(BatchConfigError):
        plan.for_rank(4)


# -- properties ------------------------------------------------------------------------
def _check_invariants(plan: BatchPlan) -> None:
    g, m, a, w = (plan.train_batch_size, plan.train_micro_batch_size_per_gpu,
                  plan.gradient_accumulation_steps, plan.world_size)
    per_rank = [plan.micro_batch_sizes_for_rank(r) for r in range(w)]
    assert sum(sum(sizes) for sizes in per_rank) == g
    assert all(len(sizes) == a for sizes in per_rank)
    assert all(1 <= size <= m for sizes in per_rank for size in sizes)
    assert max(plan.per_device_batch_sizes) - min(plan.per_device_batch_sizes) <= 1
    if plan.batch_split == "strict":
        assert g == m * a * w and all(size == m for sizes in per_rank for size in sizes)
    window = [plan.window_samples(k) for k in range(a + 1)]
    assert window[0] == 0 and window[-1] == g
    assert all(before < after for before, after in zip(window, window[1:]))


@settings(max_examples=300, deadline=None)
@given(w=st.integers(1, 16), m=st.integers(1, 12), a=st.integers(1, 12),
       given_keys=st.sampled_from(["GM", "GA", "MA", "GMA", "M"]))
def test_strict_plans_hold_the_equation(w, m, a, given_keys):
    g = m * a * w
    kwargs = dict(train_batch_size=g if "G" in given_keys else None,
                  train_micro_batch_size_per_gpu=m if "M" in given_keys else None,
                  gradient_accumulation_steps=a if "A" in given_keys else None)
    plan = resolve_batch_plan(w, **kwargs)
    _check_invariants(plan)
    if given_keys != "M":
        assert (plan.train_batch_size, plan.train_micro_batch_size_per_gpu,
                plan.gradient_accumulation_steps) == (g, m, a)
    for micro in plan.candidate_micro_sizes():
        replanned = plan.with_micro_batch_size(micro)
        assert replanned.train_batch_size == plan.train_batch_size
        _check_invariants(replanned)


@settings(max_examples=300, deadline=None)
@given(w=st.integers(1, 16), extra=st.integers(0, 200), m=st.integers(1, 40),
       rank=st.integers(0, 15))
def test_balanced_plans_cover_the_global_batch(w, extra, m, rank):
    g, rank = w + extra, rank % w
    largest, smallest = math.ceil(g / w), g // w
    needs_empty_micro_batch = math.ceil(largest / m) > smallest
    try:
        plan = resolve_batch_plan(w, g, m, batch_split="balanced", rank=rank)
    except BatchConfigError as error:
        assert needs_empty_micro_batch and "empty micro-batch" in str(error)
        return
    assert not needs_empty_micro_batch
    assert plan.rank == rank
    _check_invariants(plan)
    candidates = plan.candidate_micro_sizes()
    for micro in {candidates[0], candidates[len(candidates) // 2], candidates[-1]}:
        replanned = plan.with_micro_batch_size(micro)
        assert (replanned.train_batch_size, replanned.world_size, replanned.rank) == (g, w, rank)
        _check_invariants(replanned)
    smaller = plan.next_smaller_micro_size()
    if smaller is not None:
        assert smaller < max(plan.micro_batch_sizes_for_rank(0))
