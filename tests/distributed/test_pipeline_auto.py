"""The automatic micro size under a pipeline: an out-of-memory injected on one stage (one
rank) in its forward, its backward or the last stage's loss_fn, inside the schedule, makes
every rank of the pipeline × data mesh discard the window, halve the micro size (A doubles,
the global batch stays) and re-run the same batch through a schedule built for the new number
of micro-batches. No rank waits for another (the failed stage stands in for the rest of the
schedule; every collective runs under a 60 s timeout), and the final parameters equal the
float64 full-batch reference. Broken variants: keeping the failed attempt's gradients misses
the tolerance; ranks deciding alone (only the failing one shrinks) stop with an error."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import engine
from engine.errors import ConfigError, PeerError
from tests.support.broken import intact, keeps_failed_windows, votes_alone
from tests.support.dist_utils import run_scenarios
from tests.support.oom_models import Tripwire
from tests.support.reference import max_param_diff, regression_batches, sgd, state
from tests.support.pipeline_helpers import data_share, mse_outputs, reference_mse, reference_run

TOL = 1e-10
MISSED = 1e-4
# where stages 2.. start: the Tripwires (parts 2 and 5) on rank 0's and rank 1's side, each
# schedule (interleaved: four stages, rank 0 holding the first and third)
SPLITS = {"interleaved": ["2", "3", "5"]}


def tripped_mlp(stage: int, **tripwire) -> torch.nn.Sequential:
    """tests.support.reference.mlp's layers cut in two at part "3", a Tripwire on ``stage``'s side."""
    torch.manual_seed(0)
    wires = [Tripwire(), Tripwire()]
    wires[stage] = Tripwire(**tripwire)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), wires[0],
                               torch.nn.Linear(16, 16), torch.nn.Tanh(), wires[1],
                               torch.nn.Linear(16, 3)).double()


def auto_pipeline(rank, world, *, stage, where="forward", schedule="1f1b", trip_ranks=None, after_calls=0,
                  breaks=intact, evaluate=False, agreement_timeout=60, timeout=60, loss_fn=mse_outputs):
    """Per-device batch 8: auto starts at 8 (A = 1, which 1F1B over 2 ranks cannot run: 4),
    out of memory above 2 on ``trip_ranks``: 4 -> 2, A = 4; three windows. ``evaluate``: an
    evaluation before training (micro-batches of 8, then 4, run out of memory: 2) and after."""
    data_ranks = world // 2
    global_batch = 8 * data_ranks
    model = tripped_mlp(stage, max_micro=2, ranks=trip_ranks, where=where, after_calls=after_calls)
    batches = regression_batches(3, global_batch)
    expected, reference_losses = reference_run(tripped_mlp(stage), batches, reference_mse, 0.0)  # no trip
    settings = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": "auto",
                "pipeline": {"stages": 2, "schedule": schedule, "split": SPLITS.get(schedule, ["3"])},
                "distributed": {"agreement_timeout_seconds": agreement_timeout, "timeout_seconds": timeout}}
    eng = breaks(engine.initialize(copy.deepcopy(model), settings, optimizer=sgd))
    result = {}
    if evaluate:
        result["eval_first"] = eng.eval_batch(data_share(batches[0], eng), mse_outputs)
        result["reference_eval_first"] = float(reference_mse(tripped_mlp(stage), batches[0]).detach())
        result["eval_size"] = eng.micro_batch_tuner.eval_micro_batch_size
    losses = [eng.train_batch(data_share(batch, eng), loss_fn) for batch in batches]
    result |= {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
              "loss_diff": max(abs(a - b) for a, b in zip(losses, reference_losses)),
              "plan": (eng.plan.train_micro_batch_size_per_gpu, eng.plan.gradient_accumulation_steps,
                       eng.plan.train_batch_size),
              "changes": [(c["old"], c["new"], c["ranks"]) for c in eng.micro_batch_tuner.changes],
              "counters": (eng.global_steps, eng.micro_steps, eng.global_samples),
              "stage": eng.strategy.position}
    if evaluate:
        result["eval"] = eng.eval_batch(data_share(batches[0], eng), mse_outputs)
        result["reference_eval"] = float(reference_mse(expected, batches[0]).detach())
    eng.close()
    return result


def loss_out_of_memory(outputs, labels):
    """The mean squared error, out of memory for more than 2 rows (e.g. a large vocabulary)."""
    if outputs.shape[0] > 2:
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {outputs.shape[0]} MiB (loss)")
    return mse_outputs(outputs, labels)


def alone(rank, world):
    """The broken variant above cannot train on: the ranks that did not shrink closed a window
    whose last stage counted nothing; every rank stops with an error (the others after the
    agreement timeout: run last)."""
    try:
        auto_pipeline(rank, world, stage=1, trip_ranks=[1], breaks=votes_alone, agreement_timeout=3)
    except Exception as error:  # noqa: BLE001 - whichever error, none trains on
        return type(error).__name__
    return "trained"


def failing_loss(rank, world):
    """Another error than an out-of-memory on one stage (loss_fn on the last): that rank raises
    it, the others a PeerError naming it, at once."""
    settings = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
                "pipeline": {"stages": 2, "schedule": "1f1b", "split": ["3"]}}
    eng = engine.initialize(tripped_mlp(0), settings, optimizer=sgd)

    def broken_loss(outputs, labels):
        raise ValueError("a broken loss")

    try:
        eng.train_batch(regression_batches(1, 8)[0], broken_loss)
    except (ValueError, PeerError) as error:
        return type(error).__name__, str(error)
    finally:
        eng.close()


def too_small(rank, world):
    """1F1B over 2 ranks runs at least 2 micro-batches: a per-device batch of 1 has no size."""
    settings = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": "auto", "pipeline": {"stages": 2}}
    try:
        engine.initialize(tripped_mlp(0), settings, optimizer=sgd)
    except ConfigError as error:
        return str(error)


def assert_exact(per_rank, changes):
    for result in per_rank:
        assert result["diff"] < TOL and result["loss_diff"] < TOL, result
        assert result["plan"][:2] == (2, 4) and result["changes"] == changes, result
        assert result["counters"] == (3, 12, 3 * result["plan"][2]), result
        if "eval" in result:
            assert abs(result["eval"] - result["reference_eval"]) < TOL, result
            assert abs(result["eval_first"] - result["reference_eval_first"]) < TOL, result
            assert result["eval_size"] == 2, result


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_out_of_memory_on_one_stage_shrinks_every_rank_and_changes_nothing_else():
    scenarios = {
        "stage 2 (rank 1), forward": functools.partial(auto_pipeline, stage=1, trip_ranks=[1], evaluate=True),
        "stage 1 (rank 0), forward": functools.partial(auto_pipeline, stage=0, trip_ranks=[0]),
        # after the schedule's metadata inference (torch 2.13): inside the schedule's first backward
        "stage 2, backward": functools.partial(auto_pipeline, stage=1, trip_ranks=[1], where="backward",
                                               after_calls=1),
        "stage 1, backward, gpipe": functools.partial(auto_pipeline, stage=0, trip_ranks=[0], where="backward",
                                                      schedule="gpipe"),
        "interleaved, rank 1's first stage": functools.partial(auto_pipeline, stage=0, trip_ranks=[1],
                                                               schedule="interleaved"),
        "the last stage's loss_fn": functools.partial(auto_pipeline, stage=1, loss_fn=loss_out_of_memory),
        # fits in window 1 at 4, runs out of memory in window 2 in the same schedule
        "after a step": functools.partial(auto_pipeline, stage=1, trip_ranks=[1], after_calls=3),
        "failed attempts kept": functools.partial(auto_pipeline, stage=1, trip_ranks=[1], where="backward",
                                                  after_calls=1, breaks=keeps_failed_windows),
        "another error": failing_loss,
        "a per-device batch too small for 1F1B": too_small,
        "each rank alone": alone,
    }
    results = run_scenarios(scenarios, world_size=2, timeout=280)
    fit, shrunk = (8, 4, []), lambda ranks: (4, 2, ranks)
    assert_exact(results["stage 2 (rank 1), forward"], [fit, shrunk([1])])
    assert_exact(results["stage 1 (rank 0), forward"], [fit, shrunk([0])])
    assert_exact(results["stage 2, backward"], [fit, shrunk([1])])
    assert_exact(results["the last stage's loss_fn"], [fit, shrunk([1])])
    # gpipe runs A = 1: 8 runs out of memory too
    assert_exact(results["stage 1, backward, gpipe"], [(8, 4, [0]), shrunk([0])])
    assert_exact(results["interleaved, rank 1's first stage"], [(8, 4, [1]), shrunk([1])])
    assert [r["changes"] for r in results["after a step"]] == [[fit, shrunk([1])]] * 2
    assert all(r["diff"] < TOL for r in results["after a step"])
    # broken variants: the failed attempt's partial gradients (stage 2's last layer) kept ...
    assert all(r["diff"] > MISSED and r["plan"][:2] == (2, 4) for r in results["failed attempts kept"])
    # ... the ranks shrinking alone: no rank trains on
    assert "trained" not in results["each rank alone"]
    (kind0, _), (kind1, message) = results["another error"]
    assert (kind0, kind1) == ("PeerError", "ValueError") and "a broken loss" in message
    assert all("no micro-batch size of at most 1 gives a number of micro-batches the pipeline schedule runs" in m
               for m in results["a per-device batch too small for 1F1B"])


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_pipeline_times_data_an_out_of_memory_on_one_rank_shrinks_all_four():
    scenarios = {"rank 3 (stage 2, replica 2), forward": functools.partial(auto_pipeline, stage=1, trip_ranks=[3],
                                                                                      evaluate=True),
                 "rank 0 (stage 1, replica 1), backward": functools.partial(
                     auto_pipeline, stage=0, trip_ranks=[0], where="backward", after_calls=1)}
    results = run_scenarios(scenarios, world_size=4, timeout=180)
    assert_exact(results["rank 3 (stage 2, replica 2), forward"], [(8, 4, []), (4, 2, [3])])
    assert_exact(results["rank 0 (stage 1, replica 1), backward"], [(8, 4, []), (4, 2, [0])])
    assert [r["stage"] for r in results["rank 3 (stage 2, replica 2), forward"]] == [0, 0, 1, 1]


@pytest.mark.parametrize("extra, problem", [
    ({"train_micro_batch_size_per_gpu": "explore"}, "'explore' is not available under a pipeline"),
    ({"zero_optimization": {"stage": 3}}, "runs on stages FSDP2 does not shard"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, "1 without offload"),
    ({"pipeline": {"stages": 2, "schedule": "zero_bubble"}}, "zero_bubble"),
    ({"auto_memory_limit": 0.5}, "auto_memory_limit: not available"),
])
def test_what_auto_cannot_do_under_a_pipeline_is_refused(extra, problem):
    """Before anything starts, each with the reason and what to do instead."""
    settings = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "pipeline": {"stages": 2}, **extra}
    with pytest.raises(ConfigError, match=problem):
        engine.initialize(tripped_mlp(0), settings, optimizer=sgd)


