"""A non-finite gradient never reaches the weights: in fp32 and bf16 (fp16: the loss scaler) the
window is discarded and counted in ``skipped_steps``, the scheduler does not step; with
``faults.non_finite_gradient: raise`` every rank raises instead. Never checkpointed."""

import copy
import functools
import logging
import math
import os
from pathlib import Path

import pytest
import torch

import engine
from engine.state.checkpoint import ENGINE_STATE
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, mlp, mse, reference_train, regression_batches, sgd, state
from tests.support.scenarios import needs_deepspeed, share

F32 = torch.float32
HALVING = {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}


def poisoned(at: set[int], value=math.nan):
    """A mean loss that becomes ``value`` on the calls counted in ``at`` (0-based)."""
    calls = {"n": 0}

    def loss_fn(model, batch):
        loss = mse(model, batch)
        if calls["n"] in at:
            loss = loss * value
        calls["n"] += 1
        return loss

    return loss_fn


def reference_without_window(model, batches, skipped: int):
    """The full-batch reference trained on every window but ``skipped``, scheduler included."""
    kept = [b for i, b in enumerate(batches) if i != skipped]
    doubled = [tuple(t.double() for t in b) for b in kept]
    return reference_train(copy.deepcopy(model).double(), doubled, mse, sgd,
                           scheduler_factory=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))


@pytest.mark.parametrize("precision,value", [("fp32", math.nan), ("fp32", math.inf), ("bf16", math.nan)])
def test_a_non_finite_window_is_discarded_and_the_run_goes_on(precision, value, caplog):
    model, batches = mlp(dtype=F32), regression_batches(3, 8, dtype=F32)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "scheduler": HALVING}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    eng = engine.initialize(copy.deepcopy(model), config, optimizer=sgd)
    loss_fn = poisoned({5}, value)  # the second micro-step of the second window
    eng.train_batch(batches[0], loss_fn)
    after_first, lr = state(eng.module), eng.optimizer.param_groups[0]["lr"]
    with caplog.at_level(logging.WARNING, logger="engine"):
        eng.train_batch(batches[1], loss_fn)
    assert max_param_diff(state(eng.module), after_first) == 0  # nothing applied
    assert eng.optimizer.param_groups[0]["lr"] == lr and eng.lr_scheduler.last_epoch == 1
    assert (eng.global_steps, eng.skipped_steps) == (2, 1)
    assert "non-finite gradient" in caplog.text and "global step 2" in caplog.text
    assert all(p.grad is None for p in eng.module.parameters())  # the window's gradient is gone
    eng.train_batch(batches[2], loss_fn)
    assert all(torch.isfinite(p).all() for p in eng.module.parameters())
    expected = reference_without_window(model, batches, skipped=1)
    # bf16: 1.3e-4 measured
    assert max_param_diff(state(eng.module), state(expected)) < (1e-5 if precision == "fp32" else 1e-3)


def test_manual_loop_discards_too_and_raise_mode_raises_with_nothing_changed():
    model, batches = mlp(dtype=F32), regression_batches(2, 8, dtype=F32)
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
    eng = engine.initialize(copy.deepcopy(model), config, optimizer=sgd)
    x, y = batches[0]
    eng.backward(mse(eng, (x[:4], y[:4])))
    eng.step()
    eng.backward(mse(eng, (x[4:], y[4:])) * math.inf)
    assert eng.step() is True and eng.skipped_steps == 1
    assert max_param_diff(state(eng.module), state(model)) == 0

    eng = engine.initialize(copy.deepcopy(model), {**config, "faults": {"non_finite_gradient": "raise"}},
                            optimizer=sgd)
    eng.train_batch(batches[0], mse)
    before = state(eng.module)
    with pytest.raises(engine.NonFiniteGradientError, match="global step 2 holds an inf or nan"):
        eng.train_batch(batches[1], poisoned({0}))
    assert max_param_diff(state(eng.module), before) == 0 and eng.global_steps == 1
    eng.train_batch(batches[1], mse)  # the engine is usable after the error
    assert eng.global_steps == 2


@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_automatic_checkpoints_never_hold_non_finite_weights(tmp_path, mode):
    model, batches = mlp(dtype=F32), regression_batches(3, 8, dtype=F32)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "faults": {"non_finite_gradient": mode},
              "checkpoint": {"dir": str(tmp_path), "every_steps": 1}}
    eng = engine.initialize(copy.deepcopy(model), config, optimizer=sgd)
    loss_fn = poisoned({2})  # the first micro-step of the second window
    try:
        eng.train_batch(batches[0], loss_fn)
        if mode == "raise":
            with pytest.raises(engine.NonFiniteGradientError):
                eng.train_batch(batches[1], loss_fn)
        else:
            eng.train_batch(batches[1], loss_fn)
    finally:
        eng.close()  # gives the stop signals back, waits for a save in flight
    if mode == "raise":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
        return
    saved = torch.load(tmp_path / "step_00000002" / ENGINE_STATE, weights_only=True)
    assert saved["parts"]["engine"]["counters"]["skipped_steps"] == 1
    fresh = engine.initialize(copy.deepcopy(model), config, optimizer=sgd)  # resumes step_00000002
    fresh.close()
    assert fresh.global_steps == 2
    assert all(torch.isfinite(p).all() for p in fresh.module.parameters())
    assert max_param_diff(state(fresh.module), state(eng.module)) == 0


def non_finite_on_one_rank(rank, world, backend, stage, precision, mode):
    """Rank 1's loss turns nan in window 2 of 3: every rank discards it (or raises)."""
    model, batches = mlp(dtype=F32), regression_batches(3, 8, dtype=F32)
    zero = {"stage": stage}
    if backend == "deepspeed" and stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {"backend": backend, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": zero, "scheduler": HALVING, "faults": {"non_finite_gradient": mode}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    eng = engine.initialize(copy.deepcopy(model), config, optimizer=sgd)
    loss_fn = poisoned({3} if rank == 1 else set())
    eng.train_batch(share(batches[0], rank, world), loss_fn)
    before = eng.full_state_dict()
    raised = None
    try:
        eng.train_batch(share(batches[1], rank, world), loss_fn)
    except engine.NonFiniteGradientError as error:
        raised = str(error)
    unchanged = max_param_diff(eng.full_state_dict(), before) == 0
    lr = eng.optimizer.param_groups[0]["lr"]
    eng.train_batch(share(batches[2], rank, world), loss_fn)
    expected = reference_without_window(model, batches, skipped=1)
    result = {"unchanged": unchanged, "raised": raised, "skipped": eng.skipped_steps, "lr": lr,
              "diff": max_param_diff(eng.full_state_dict(), state(expected))}
    eng.close()
    return result


def assert_discarded_everywhere(results, tolerance):
    for name, per_rank in results.items():
        mode = name[-1]
        for result in per_rank:
            assert result["unchanged"], (name, result)
            assert result["lr"] == 0.05, (name, result)  # one scheduler step, not two
            if mode == "raise":
                assert result["raised"] and "global step 2" in result["raised"], (name, result)
                assert result["skipped"] == 0, (name, result)
            else:
                assert result["raised"] is None and result["skipped"] == 1, (name, result)
            assert result["diff"] < tolerance[name[1]], (name, result)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_non_finite_gradient_on_one_rank_is_discarded_on_every_torch_stage():
    scenarios = {(stage, precision, mode): functools.partial(non_finite_on_one_rank, backend="torch", stage=stage,
                                                             precision=precision, mode=mode)
                 for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16") for mode in ("skip", "raise")
                 if precision == "fp32" or mode == "skip"}
    assert_discarded_everywhere(run_scenarios(scenarios, world_size=2, timeout=200),
                                {"fp32": 1e-5, "bf16": 1e-3})


@needs_deepspeed
@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_non_finite_gradient_on_one_rank_is_discarded_on_the_deepspeed_backend():
    scenarios = {(stage, "fp32", mode): functools.partial(non_finite_on_one_rank, backend="deepspeed", stage=stage,
                                                          precision="fp32", mode=mode)
                 for stage in (0, 1, 2, 3) for mode in ("skip", "raise") if stage in (0, 3) or mode == "skip"}
    default = str(Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions")
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", default)}
    assert_discarded_everywhere(run_scenarios(scenarios, world_size=2, timeout=260, env=env), {"fp32": 1e-5})
