"""What a training window makes the ranks wait for besides its own training collectives, counted:
the position checks (one all-gather each on the control group, counted where the engine makes
them) and the reductions (all-reduces, and the all-gathers that sum a few numbers,
``collectives.small_sum``). Each is a point where every rank waits for the slowest, so the engine
makes only the checks no other one covers (tests/distributed/test_rank_agreement.py shows they
still stop every disagreement), and the non-finite gradient check adds no collective of its own
where ``train_batch`` sums the window's statistics anyway: its squared norm travels in that
reduction."""

import functools

import pytest
import torch

import engine
from bench.comm_count import CommCounter
from engine.window import positions
from tests.support.dist_utils import run_scenarios
from tests.support.pipeline_helpers import mse_outputs
from tests.support.reference import mlp, mse, regression_batches, sgd
from tests.support.scenarios import share

F32 = torch.float32
WINDOWS = 5  # DDP agrees on rebuilt buckets in the third window's first forward: the last two are steady


def waits_per_window(rank, world, stage, defer=False, buffer=False, half=None, mesh=None, broadcasts=False):
    """[(position checks, reductions on the training group)] of each train_batch window (2 micro-steps);
    ``broadcasts``: broadcasts count among the reductions (not at ZeRO-1, which broadcasts its updated
    parameters: training traffic).
    ``mesh``: a "pipeline" or "tensor" section over both ranks (one data rank: the whole batch)."""
    model = mlp(dtype=F32)
    if buffer:  # DDP broadcasts buffers in a window's first forward
        model.register_buffer("seen", torch.zeros(1))
    eng = engine.initialize(model, {"train_batch_size": 8 if mesh is None else 4, "train_micro_batch_size_per_gpu": 2,
                                    "zero_optimization": {"stage": stage, "defer_reduction": defer},
                                    **({half: {"enabled": True}} if half else {}), **(mesh or {})}, optimizer=sgd)
    loss_fn = mse_outputs if mesh and "pipeline" in mesh else mse
    data_ranks = eng.plan.world_size
    checks = {"n": 0}
    original = positions.post_positions

    def counted(*args, **kwargs):
        checks["n"] += 1
        return original(*args, **kwargs)

    per_window = []
    positions.post_positions = counted
    try:
        with CommCounter() as comm:
            for batch in regression_batches(WINDOWS, 4 * data_ranks, dtype=F32):
                checks["n"] = 0
                comm.reset()
                eng.train_batch(share(batch, eng.plan.rank, data_ranks), loss_fn)
                per_window.append((checks["n"], comm.calls["all_reduce"] + comm.calls["small all_gather"]
                                    + (comm.calls["broadcast"] if broadcasts else 0)))
    finally:
        positions.post_positions = original
    eng.close()
    return per_window


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_window_waits_only_where_no_other_check_covers():
    # name -> (position checks, reductions) in a steady window of 2 micro-steps per rank
    expected = {
        # The check before the closing backward comes before DDP's first collective.
        "stage 0": (1, 1), "stage 1": (1, 1),
        "stage 0, a buffer": (2, 1),  # broadcast in the window's first forward: checked before it too
        "stage 2": (2, 1),  # reduce-scatters from the first backward on
        "stage 2, deferred": (1, 1),
        "stage 3": (3, 1),  # before each of the 2 forwards (gathers) and the closing backward
        "stage 3, deferred": (2, 1),
    }
    scenarios = {
        "stage 0": functools.partial(waits_per_window, stage=0),
        "stage 1": functools.partial(waits_per_window, stage=1),
        "stage 0, a buffer": functools.partial(waits_per_window, stage=0, buffer=True),
        "stage 2": functools.partial(waits_per_window, stage=2),
        "stage 2, deferred": functools.partial(waits_per_window, stage=2, defer=True),
        "stage 3": functools.partial(waits_per_window, stage=3),
        "stage 3, deferred": functools.partial(waits_per_window, stage=3, defer=True),
    }
    for name, per_rank in run_scenarios(scenarios, world_size=2, timeout=130).items():
        for per_window in per_rank:
            # The first windows check at their start too while DDP still communicates in a forward.
            assert per_window[-2:] == [expected[name]] * 2, (name, per_window)
            assert all(checks >= expected[name][0] for checks, _ in per_window), (name, per_window)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_the_half_precision_compute_copy_checks_once_per_window():
    """bf16 / fp16 parameters from fp32 masters at ZeRO-0/1: no collective before the window's
    end (the masters' gradients are all-reduced after the closing backward), so the check before
    that backward is the only one; bf16's norm rides in the statistics' all-reduce (fp16's loss
    scaler reads its own), which adds none."""
    scenarios = {f"stage {stage}, {half}": functools.partial(waits_per_window, stage=stage, half=half)
                 for stage in (0, 1) for half in ("bf16", "fp16")}
    results = run_scenarios(scenarios, world_size=2, timeout=130)
    for name, per_rank in results.items():
        for per_window in per_rank:
            assert [checks for checks, _ in per_window] == [1] * WINDOWS, (name, per_window)
    # bf16's norm adds no all-reduce: the statistics, which parameters got gradients, one bucket
    for stage in (0, 1):
        assert results[f"stage {stage}, bf16"] == [[(1, 3)] * WINDOWS] * 2, results


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_mesh_window_sums_its_statistics_norm_and_batch_check_in_one_reduction():
    """With ranks that must see the same batch (pipeline stages, tensor ranks), the window's
    statistics all-reduce spans the world and carries the batch fingerprint and the squared
    gradient norm, which then needs no reduction of its own; the other pipeline stages learn the
    last stage's losses (and whether its loss_fn failed) there too, with no broadcast."""
    scenarios = {
        "pipeline 2": functools.partial(waits_per_window, stage=0, broadcasts=True,
                                        mesh={"pipeline": {"stages": 2, "schedule": "gpipe"}}),
        "tensor 2": functools.partial(waits_per_window, stage=0, broadcasts=True,
                                      mesh={"tensor_parallel": {"size": 2, "plan": {"0": "colwise", "2": "rowwise"}}}),
        "tensor 2, stage 3": functools.partial(
            waits_per_window, stage=3, broadcasts=True,
            mesh={"tensor_parallel": {"size": 2, "plan": {"0": "colwise", "2": "rowwise"}}}),
    }
    expected = {"pipeline 2": (1, 1),  # the check before the schedule's first send; one reduction, no broadcast
                "tensor 2": (1, 1),  # before the first forward's exchange (one data rank: no gradient reduction)
                "tensor 2, stage 3": (1, 1)}  # nor a gather over one data rank before each forward
    for name, per_rank in run_scenarios(scenarios, world_size=2, timeout=130).items():
        for per_window in per_rank:
            # (a tensor group also compares each forward's inputs in its first two windows)
            assert per_window[-2:] == [expected[name]] * 2, (name, per_window)
