"""Automatic micro-batch size with injected out-of-memory: the run survives, ranks agree,
the global batch never drifts and the parameters equal the full-batch reference."""

import copy
import functools
import logging

import pytest
import torch

import engine
from engine.autotune.tuner import OutOfMemoryAtMicroBatchOne
from engine.autotune.tuner import MicroBatchTuner
from tests.support import oom_models
from tests.support.broken import keeps_failed_windows
from tests.support.dist_utils import run_scenarios
from tests.support.oom_models import CostPerCall, VirtualClock, tripwire_mlp
from tests.support.reference import max_param_diff, mse, rank_slice, reference_train, regression_batches, sgd, state

TOL = 1e-10


def auto_engine(model, global_batch=16, split="strict", **extra):
    """SGD with momentum: the weighting shows in the parameters (AdamW hides a constant factor)."""
    config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": "auto",
              "batch_split": split, **extra}
    return engine.initialize(model, config, optimizer=sgd)


def train(eng, batches):
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), mse)


def reference(batches):
    return reference_train(tripwire_mlp(), batches, mse, sgd)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_shrinks_the_micro_batch_and_changes_nothing_else(where, caplog):
    batches = regression_batches(3, 16)
    eng = auto_engine(tripwire_mlp(max_micro=3, where=where))
    assert eng.plan.train_micro_batch_size_per_gpu == 16
    with caplog.at_level(logging.WARNING, logger="engine"):
        train(eng, batches)
    assert (eng.plan.train_micro_batch_size_per_gpu, eng.plan.gradient_accumulation_steps) == (2, 8)
    assert eng.plan.train_batch_size == 16 and eng.global_samples == 48 and eng.global_steps == 3
    assert max_param_diff(state(eng.module), state(reference(batches))) < TOL
    assert [(c["old"], c["new"]) for c in eng.micro_batch_tuner.changes] == [(16, 8), (8, 4), (4, 2)]
    assert "micro-batch size 16 -> 8 (out of memory" in caplog.text and "global batch 16 unchanged" in caplog.text


def test_a_window_that_kept_its_failed_attempts_would_miss_the_tolerance():
    """The broken variant of the test above: the failed attempts' gradients (from the part of
    the backward that ran before the out-of-memory) are not discarded."""
    batches = regression_batches(3, 16)
    eng = keeps_failed_windows(auto_engine(tripwire_mlp(max_micro=3, where="backward")))
    train(eng, batches)
    assert eng.plan.train_micro_batch_size_per_gpu == 2  # the same shrinking ...
    assert max_param_diff(state(eng.module), state(reference(batches))) > 1e-3  # ... and a wrong model


def test_out_of_memory_after_several_steps():
    batches = regression_batches(4, 16)
    eng = auto_engine(tripwire_mlp(max_micro=8, after_calls=2))  # fits twice, then the data "grows"
    train(eng, batches)
    assert [c["global_step"] for c in eng.micro_batch_tuner.changes] == [3]
    assert eng.plan.train_micro_batch_size_per_gpu == 8
    assert max_param_diff(state(eng.module), state(reference(batches))) < TOL


def test_balanced_plans_halve():
    batches = regression_batches(2, 14)
    eng = auto_engine(tripwire_mlp(max_micro=5), global_batch=14, split="balanced")
    train(eng, batches)
    assert [(c["old"], c["new"]) for c in eng.micro_batch_tuner.changes] == [(14, 7), (7, 3)]
    assert eng.plan.micro_batch_sizes == (3, 3, 3, 3, 2)
    assert max_param_diff(state(eng.module), state(reference(batches))) < TOL


def test_micro_batch_one_still_failing_is_a_clear_error():
    eng = auto_engine(tripwire_mlp(max_micro=0))
    with pytest.raises(OutOfMemoryAtMicroBatchOne, match="even with micro-batch size 1.*zero_optimization.stage"):
        train(eng, regression_batches(1, 16))
    assert eng.global_steps == 0 and eng.micro_steps == 0


def test_auto_max_caps_the_start():
    eng = auto_engine(tripwire_mlp(), auto_max=6)
    assert eng.plan.train_micro_batch_size_per_gpu == 4


def test_memory_limit_treated_like_out_of_memory():
    """A CPU memory cap: the measured peak of a micro-step decides, deterministically."""
    probe = auto_engine(tripwire_mlp())
    train(probe, regression_batches(1, 16))  # optimizer state now counts too
    peaks = {}
    for micro in (8, 4):
        probe.replan(probe.plan.with_micro_batch_size(micro))
        tuner = probe.micro_batch_tuner
        metered = tuner._metered(mse, track_peak=True)
        probe.executor.run_window(regression_batches(1, 16)[0], metered, probe.plan)
        probe.discard_window()
        peaks[micro] = tuner.window_peak
    assert peaks[8] > peaks[4]
    batches = regression_batches(2, 16)
    eng = auto_engine(tripwire_mlp(), auto_memory_limit=float((peaks[8] + peaks[4]) // 2))
    train(eng, batches)
    assert eng.plan.train_micro_batch_size_per_gpu == 4
    assert eng.micro_batch_tuner.changes[-1]["reason"] == "memory limit exceeded"
    assert max_param_diff(state(eng.module), state(reference(batches))) < TOL


def test_eval_batch_adapts_too():
    model = tripwire_mlp(max_micro=5)
    eng = auto_engine(model)
    (batch,) = regression_batches(1, 16)
    expected = mse(tripwire_mlp(), batch).item()
    assert eng.eval_batch(batch, mse) == pytest.approx(expected, rel=1e-12)
    assert eng.micro_batch_tuner.eval_micro_batch_size == 4
    assert eng.plan.train_micro_batch_size_per_gpu == 16  # training has not failed yet


def test_manual_loop_needs_a_fixed_micro_size():
    eng = auto_engine(tripwire_mlp())
    x, y = regression_batches(1, 16)[0]
    with pytest.raises(engine.EngineUsageError, match="manual loop"):
        eng.backward(mse(eng, (x, y)))


def explore_engine(model, **extra):
    """``explore`` timed by the model's virtual clock instead of the wall clock."""
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "explore", **extra}
    eng = engine.initialize(model, config, optimizer=sgd)
    eng.micro_batch_tuner.clock = eng.module[0].clock
    return eng


def costed(overhead, per_square, model):
    """``model`` behind a CostPerCall with a clock of its own."""
    return torch.nn.Sequential(CostPerCall(VirtualClock(), overhead, per_square), model)


def test_explore_picks_the_fastest_size_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = costed(0.02, 0.00125, torch.nn.Linear(8, 3).double())  # fastest at √(0.02/0.00125) = 4
    batches = regression_batches(2, 16, d_out=3)
    expected = reference_train(model, batches, mse, sgd)
    eng = explore_engine(copy.deepcopy(model))
    train(eng, batches)
    rows = eng.micro_batch_tuner.explored
    assert [r.micro_batch_size for r in rows] == [1, 2, 4, 8, 16]
    # a window of 16 samples in 16/m forwards of 0.02 + 0.00125·m² virtual seconds
    window_seconds = [16 / m * (0.02 + 0.00125 * m * m) for m in (1, 2, 4, 8, 16)]
    assert [r.samples_per_second for r in rows] == pytest.approx([16 / t for t in window_seconds], rel=1e-9)
    best = next(r for r in rows if r.recommended)
    assert best.micro_batch_size == 4 and sum(r.recommended for r in rows) == 1
    assert eng.plan.train_micro_batch_size_per_gpu == 4
    assert rows[0].relative_speed == 1.0 and best.relative_speed == pytest.approx(0.34 / 0.16, rel=1e-9)
    assert max_param_diff(state(eng.module), state(expected)) < TOL  # measuring trained nothing


def test_explore_stops_at_the_first_size_that_does_not_fit():
    eng = explore_engine(costed(0.02, 0.005, tripwire_mlp(max_micro=4)))  # fastest at 2
    train(eng, regression_batches(1, 16))
    rows = eng.micro_batch_tuner.explored
    assert [(r.micro_batch_size, r.fits) for r in rows] == [(1, True), (2, True), (4, True), (8, False)]
    assert eng.plan.train_micro_batch_size_per_gpu == 2


def test_explore_command_prints_a_table_and_saves_json_and_png(tmp_path, capsys, monkeypatch):
    """`python -m engine explore` (through engine.cli.main, timed by the model's virtual clock;
    the bad-factory test below runs it as a process)."""
    import json

    from engine.cli import main

    monkeypatch.setattr(MicroBatchTuner, "clock", staticmethod(oom_models.EXPLORE_CLOCK))
    config = tmp_path / "explore.yaml"
    config.write_text("train_batch_size: 16\noptimizer: {type: SGD, params: {lr: 0.1}}\n")
    status = main(["explore", str(config), "--model", "tests.support.oom_models:explore_model",
                   "--batch", "tests.support.oom_models:explore_batch", "--loss", "tests.support.reference:mse",
                   "--out", str(tmp_path / "out"), "--repeats", "2"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    lines = captured.out.splitlines()
    assert [line.split()[0] for line in lines if "recommended" in line] == ["4"], captured.out
    assert "samples/s" in captured.out and "peak memory" in captured.out
    saved = json.loads((tmp_path / "out" / "explore.json").read_text())
    assert [c["micro_batch_size"] for c in saved["candidates"]] == [1, 2, 4, 8, 16]
    assert [c["recommended"] for c in saved["candidates"]] == [False, False, True, False, False]
    assert (tmp_path / "out" / "explore.png").stat().st_size > 1000


def test_explore_command_with_a_bad_factory_exits_2(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "explore.yaml"
    config.write_text("train_batch_size: 16\n")
    result = subprocess.run([sys.executable, "-m", "engine", "explore", str(config), "--model", "tests.support.oom_models:nope",
                             "--batch", "tests.support.oom_models:explore_batch"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "has no callable named nope" in result.stderr and "Traceback" not in result.stderr


def test_explore_without_loss_on_a_plain_model_says_to_pass_one(tmp_path):
    """A model that computes no loss of its own, called with (inputs, labels): a clear error
    naming --loss, not the TypeError of its forward."""
    import subprocess
    import sys

    config = tmp_path / "explore.yaml"
    config.write_text("train_batch_size: 16\noptimizer: {type: SGD, params: {lr: 0.1}}\n")
    result = subprocess.run([sys.executable, "-m", "engine", "explore", str(config), "--model",
                             "tests.support.oom_models:explore_model", "--batch", "tests.support.oom_models:explore_batch",
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "pass --loss module:function" in result.stderr and "takes 2 positional arguments" in result.stderr


# -- several ranks ----------------------------------------------------------------------------
def zero(stage, defer=False):
    return {"stage": stage, "defer_reduction": defer} if stage >= 2 else {"stage": stage}


def oom_scenario(rank, world, stage, defer=False, split="strict", zero_extra=None, **tripwire):
    """``zero_extra``: more zero_optimization keys (hybrid sharding's shard_size, offload)."""
    global_batch = 16 if split == "strict" else 14
    batches = regression_batches(4, global_batch)
    expected = reference(batches)
    eng = auto_engine(tripwire_mlp(**tripwire), global_batch=global_batch, split=split,
                      zero_optimization={**zero(stage, defer), **(zero_extra or {})})
    train(eng, batches)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
            "micro": eng.plan.micro_batch_sizes_for_rank(0), "global_batch": eng.plan.train_batch_size,
            "samples": eng.global_samples, "changes": eng.micro_batch_tuner.changes}


def eval_oom_on_one_rank(rank, world, stage, defer=False):
    """eval_batch under auto, out of memory on rank 1 only: every rank shrinks the evaluation's
    micro size together, the loss is the whole batch's, and training afterwards is exact."""
    batches = regression_batches(3, 16)
    eng = auto_engine(tripwire_mlp(max_micro=3, ranks=(1,)), zero_optimization=zero(stage, defer))
    plan = eng.plan
    start = sum(plan.per_device_batch_sizes[:rank])
    local = tuple(t[start:start + plan.per_device_batch_size] for t in batches[0])
    loss = eng.eval_batch(local, mse)
    evaluated = {"loss": loss, "eval_micro": eng.micro_batch_tuner.eval_micro_batch_size,
                 "train_micro": eng.plan.train_micro_batch_size_per_gpu, "steps": eng.global_steps}
    train(eng, batches)
    return {**evaluated, "expected": mse(tripwire_mlp(), batches[0]).item(),
            "diff": max_param_diff(eng.full_state_dict(), state(reference(batches)))}


class _Broken(torch.nn.Module):
    def forward(self, x):
        if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            raise ValueError("a bug on the last rank")
        return x


def other_error_on_one_rank(rank, world, stage, defer=False, split="strict"):
    """A failure that is not out-of-memory stops every rank instead of leaving one waiting."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), _Broken(), torch.nn.Linear(16, 3)).double()
    global_batch = 16 if split == "strict" else 14
    eng = auto_engine(model, global_batch=global_batch, split=split, zero_optimization=zero(stage, defer))
    try:
        train(eng, regression_batches(1, global_batch))
    except Exception as error:  # noqa: BLE001
        return type(error).__name__
    return "no error"


SCENARIOS = {
    "every rank, forward": dict(max_micro=3),
    "rank 1 only, forward": dict(max_micro=3, ranks=(1,)),
    "rank 1 only, backward": dict(max_micro=3, ranks=(1,), where="backward"),
    "rank 0 only, backward, after two steps": dict(max_micro=4, ranks=(0,), where="backward", after_calls=2),
    "rank 1 only, balanced": dict(max_micro=3, ranks=(1,), split="balanced"),
}


def assert_same_exact_shrinking(results: dict, world: int) -> None:
    for name, per_rank in results.items():
        first = per_rank[0]
        for result in per_rank:
            assert result["diff"] < TOL, (name, result["diff"])
            assert result["micro"] == first["micro"] and result["changes"] == first["changes"], name
            assert result["global_batch"] == first["global_batch"], name
        assert first["samples"] == 4 * first["global_batch"] and first["changes"], name


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_out_of_memory_never_deadlocks(stage):
    """Every scenario at ZeRO-2/3 runs with both zero_optimization.defer_reduction settings."""
    defers = (False, True) if stage >= 2 else (False,)
    scenarios = {}
    for defer in defers:
        for name, kwargs in SCENARIOS.items():
            scenarios[(name, defer)] = functools.partial(oom_scenario, stage=stage, defer=defer, **kwargs)
        scenarios[("another error on rank 1", defer)] = functools.partial(other_error_on_one_rank, stage=stage,
                                                                         defer=defer)
        scenarios[("eval, rank 1 only", defer)] = functools.partial(eval_oom_on_one_rank, stage=stage, defer=defer)
    if stage == 3:
        scenarios["offload"] = functools.partial(oom_scenario, stage=3, zero_extra={"offload_optimizer": {"device": "cpu"}},
                                                 **SCENARIOS["rank 1 only, backward"])
    results = run_scenarios(scenarios, world_size=2, timeout=180)
    for defer in defers:
        assert results.pop(("another error on rank 1", defer)) == ["PeerError", "ValueError"]
        for result in results.pop(("eval, rank 1 only", defer)):
            assert result["loss"] == pytest.approx(result["expected"], rel=1e-12), (defer, result)
            assert (result["eval_micro"], result["train_micro"], result["steps"]) == (2, 8, 0), (defer, result)
            assert result["diff"] < TOL, (defer, result["diff"])
        assert results[("every rank, forward", defer)][0]["micro"] == (2, 2, 2, 2)
        assert results[("rank 1 only, backward", defer)][0]["changes"][0]["ranks"] == [1]
    assert_same_exact_shrinking(results, 2)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [3, 4])
def test_one_rank_out_of_memory_on_three_and_four_ranks(world):
    """Four ranks (strict plan, 4 samples each) and three (balanced: 5, 5, 4), every stage: the
    last rank alone runs out of memory in its backward."""
    last = world - 1
    kwargs = dict(max_micro=2, ranks=(last,), where="backward") if world == 4 else \
        dict(max_micro=3, ranks=(last,), where="backward", split="balanced")
    scenarios = {stage: functools.partial(oom_scenario, stage=stage, **kwargs) for stage in (0, 1, 2, 3)}
    if world == 4:  # hybrid: shards within pairs of ranks, replicas across them
        scenarios["hybrid"] = functools.partial(oom_scenario, stage=3, zero_extra={"shard_size": 2}, **kwargs)
    scenarios["another error"] = functools.partial(other_error_on_one_rank, stage=3, split=kwargs.get("split", "strict"))
    results = run_scenarios(scenarios, world_size=world, timeout=200)
    assert results.pop("another error") == ["PeerError"] * last + ["ValueError"]
    assert_same_exact_shrinking(results, world)
    for per_rank in results.values():
        assert per_rank[0]["changes"][0]["ranks"] == [last]
        assert per_rank[0]["micro"] == ((2, 2) if world == 4 else (2, 2, 1))


def test_checkpoint_keeps_the_chosen_micro_size_and_its_history(tmp_path):
    batches = regression_batches(3, 16)
    eng = auto_engine(tripwire_mlp(max_micro=5))
    train(eng, batches[:2])
    eng.save_checkpoint(tmp_path / "ckpt")
    resumed = auto_engine(tripwire_mlp(max_micro=5))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.plan == eng.plan and resumed.plan.train_micro_batch_size_per_gpu == 4
    assert resumed.micro_batch_tuner.changes == eng.micro_batch_tuner.changes
    train(resumed, batches[2:])
    assert not resumed.micro_batch_tuner.changes[2:]  # no new failure: it did not restart from 16
    assert max_param_diff(state(resumed.module), state(reference(batches))) < TOL


def test_resumed_explore_run_does_not_explore_again(tmp_path):
    eng = explore_engine(costed(0.02, 0.005, tripwire_mlp(max_micro=4)))
    train(eng, regression_batches(1, 16))
    assert eng.plan.train_micro_batch_size_per_gpu == 2
    eng.save_checkpoint(tmp_path / "ckpt")
    resumed = explore_engine(costed(0.02, 0.005, tripwire_mlp(max_micro=4)))
    resumed.load_checkpoint(tmp_path / "ckpt")
    train(resumed, regression_batches(1, 16))
    assert resumed.micro_batch_tuner.explored == []
    assert resumed.plan.train_micro_batch_size_per_gpu == 2
