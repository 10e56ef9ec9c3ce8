"""Automatic micro-batch size with injected out-of-memory: the run survives, ranks agree,
the global batch never drifts and the parameters equal the full-batch reference."""

import copy
import functools
import logging

import pytest
import torch

import engine
from engine.autotune import OutOfMemoryAtMicroBatchOne
from tests.dist_utils import run_scenarios
from tests.oom_models import SlowPerCall, tripwire_mlp
from tests.reference import adamw, max_param_diff, mse, reference_train, regression_batches, state

TOL = 1e-10


def auto_engine(model, global_batch=16, split="strict", **extra):
    config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": "auto",
              "batch_split": split, **extra}
    return engine.initialize(model, config, optimizer=adamw)


def train(eng, batches):
    plan = eng.plan
    sizes = plan.per_device_batch_sizes
    start = sum(sizes[:plan.rank])
    for x, y in batches:
        eng.train_batch((x[start:start + sizes[plan.rank]], y[start:start + sizes[plan.rank]]), mse)


def reference(batches):
    return reference_train(tripwire_mlp(), batches, mse, adamw)


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
        probe.run_window(regression_batches(1, 16)[0], metered)
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


def test_explore_picks_the_fastest_size_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(SlowPerCall(overhead=0.02, per_square=0.00125), torch.nn.Linear(8, 3)).double()
    batches = regression_batches(2, 16, d_out=3)
    expected = reference_train(model, batches, mse, adamw)
    eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "explore"},
                            optimizer=adamw)
    train(eng, batches)
    rows = eng.micro_batch_tuner.explored
    assert [r.micro_batch_size for r in rows] == [1, 2, 4, 8, 16]
    best = next(r for r in rows if r.recommended)
    assert best.micro_batch_size == 4, [(r.micro_batch_size, r.samples_per_second) for r in rows]
    assert eng.plan.train_micro_batch_size_per_gpu == 4
    assert rows[0].relative_speed == 1.0 and best.relative_speed > 1.5
    assert max_param_diff(state(eng.module), state(expected)) < TOL


def test_explore_stops_at_the_first_size_that_does_not_fit():
    eng = engine.initialize(tripwire_mlp(max_micro=4), {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "explore"},
                            optimizer=adamw)
    train(eng, regression_batches(1, 16))
    rows = eng.micro_batch_tuner.explored
    assert [(r.micro_batch_size, r.fits) for r in rows] == [(1, True), (2, True), (4, True), (8, False)]
    assert eng.plan.train_micro_batch_size_per_gpu in (1, 2, 4)


# -- two ranks --------------------------------------------------------------------------------
def oom_scenario(rank, world, stage, split="strict", **tripwire):
    batches = regression_batches(4, 16 if split == "strict" else 14)
    expected = reference(batches)
    eng = auto_engine(tripwire_mlp(**tripwire), global_batch=batches[0][0].shape[0], split=split,
                      zero_optimization={"stage": stage})
    train(eng, batches)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
            "micro": eng.plan.micro_batch_sizes_for_rank(0), "global_batch": eng.plan.train_batch_size,
            "samples": eng.global_samples, "changes": eng.micro_batch_tuner.changes}


class _Broken(torch.nn.Module):
    def forward(self, x):
        if torch.distributed.get_rank() == 1:
            raise ValueError("a bug on rank 1")
        return x


def other_error_on_one_rank(rank, world, stage):
    """A failure that is not out-of-memory stops every rank instead of leaving one waiting."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), _Broken(), torch.nn.Linear(16, 3)).double()
    eng = auto_engine(model, zero_optimization={"stage": stage})
    try:
        train(eng, regression_batches(1, 16))
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


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_out_of_memory_never_deadlocks(stage):
    scenarios = {name: functools.partial(oom_scenario, stage=stage, **kwargs) for name, kwargs in SCENARIOS.items()}
    scenarios["another error on rank 1"] = functools.partial(other_error_on_one_rank, stage=stage)
    results = run_scenarios(scenarios, world_size=2, timeout=180)
    assert results.pop("another error on rank 1") == ["PeerError", "ValueError"]
    for name, (first, second) in results.items():
        assert first["diff"] < TOL and second["diff"] < TOL, (name, first["diff"], second["diff"])
        assert first["micro"] == second["micro"] and first["changes"] == second["changes"], name
        assert first["global_batch"] == second["global_batch"] and first["samples"] == 4 * first["global_batch"], name
        assert first["changes"], name
    assert results["every rank, forward"][0]["micro"] == (2, 2, 2, 2)
    assert results["rank 1 only, backward"][0]["changes"][0]["ranks"] == [1]


def test_explore_command_prints_a_table_and_saves_json_and_png(tmp_path):
    import json
    import subprocess
    import sys

    config = tmp_path / "explore.yaml"
    config.write_text("train_batch_size: 16\noptimizer: {type: SGD, params: {lr: 0.1}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "engine", "explore", str(config), "--model", "tests.oom_models:explore_model",
         "--batch", "tests.oom_models:explore_batch", "--loss", "tests.reference:mse", "--out", str(tmp_path / "out"),
         "--repeats", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:1] == ["4"] and "recommended" in line for line in lines), result.stdout
    assert "samples/s" in result.stdout and "peak memory" in result.stdout
    saved = json.loads((tmp_path / "out" / "explore.json").read_text())
    assert [c["micro_batch_size"] for c in saved["candidates"]] == [1, 2, 4, 8, 16]
    assert (tmp_path / "out" / "explore.png").stat().st_size > 1000


def test_explore_command_with_a_bad_factory_exits_2(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "explore.yaml"
    config.write_text("train_batch_size: 16\n")
    result = subprocess.run([sys.executable, "-m", "engine", "explore", str(config), "--model", "tests.oom_models:nope",
                             "--batch", "tests.oom_models:explore_batch"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "has no callable named nope" in result.stderr and "Traceback" not in result.stderr


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
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "explore"}
    eng = engine.initialize(tripwire_mlp(max_micro=4), config, optimizer=adamw)
    train(eng, regression_batches(1, 16))
    eng.save_checkpoint(tmp_path / "ckpt")
    resumed = engine.initialize(tripwire_mlp(max_micro=4), config, optimizer=adamw)
    resumed.load_checkpoint(tmp_path / "ckpt")
    train(resumed, regression_batches(1, 16))
    assert resumed.micro_batch_tuner.explored == []
    assert resumed.plan.train_micro_batch_size_per_gpu == eng.plan.train_micro_batch_size_per_gpu
