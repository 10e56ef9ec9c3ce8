"""A config giving only ``gradient_accumulation_steps`` (Colossal-AI's usual): the batch
sizes are the data loader's, every micro-batch is weighted by its real size, and the
result equals the float64 full-batch reference on 2 ranks with unequal micro-batches and
unequal ranks, at ZeRO stages 0, 2 and 3 and on the DeepSpeed backend (float32, ZeRO-2). A
1/A weighting misses the same tolerance."""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

import engine
from engine.batching.plan import plan_from_config
from engine.errors import CheckpointError
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, mlp, mse, reference_train, sgd, state

TOL = 1e-10
FP32_TOL = 1e-6  # the DeepSpeed backend's float32 run against the float64 reference
ACCUMULATION = 3
CONFIG = {"gradient_accumulation_steps": ACCUMULATION,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
# Micro-batch sizes per window, per rank: unequal within a window and between the ranks.
MANUAL_SIZES = [{0: [3, 1, 2], 1: [2, 4, 1]},
                {0: [2, 2, 2], 1: [1, 1, 5]}]
WHOLE_BATCHES = [{0: 7, 1: 5}]  # train_batch: each rank's batch, split into A near-equal parts
SHORT_WINDOW = {0: [2, 3], 1: [4, 1]}  # two micro-steps of three, closed by flush()


def samples(window: int, rank: int, size: int, part: int, dtype=torch.float64):
    """A deterministic micro-batch that every process can rebuild."""
    g = torch.Generator().manual_seed(1000 * window + 100 * rank + part)
    return (torch.randn(size, 8, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(size, 3, generator=g, dtype=torch.float64).to(dtype))


def concat(parts):
    return tuple(torch.cat(column) for column in zip(*parts))


def windows(dtype=torch.float64):
    """Every window as {rank: [micro-batches]}: manual windows, whole batches, the short one."""
    out = []
    for w, sizes in enumerate(MANUAL_SIZES):
        out.append({r: [samples(w, r, n, k, dtype) for k, n in enumerate(ns)] for r, ns in sizes.items()})
    for w, sizes in enumerate(WHOLE_BATCHES, start=len(out)):
        out.append({r: [samples(w, r, n, 0, dtype)] for r, n in sizes.items()})
    w = len(out)
    out.append({r: [samples(w, r, n, k, dtype) for k, n in enumerate(ns)] for r, ns in SHORT_WINDOW.items()})
    return out


def global_batches():
    return [concat([part for r in sorted(window) for part in window[r]]) for window in windows()]


def reference():
    return state(reference_train(mlp(), global_batches(), mse, sgd))


def one_over_a_reference():
    """The common mistake: every micro-batch's mean loss weighted 1/A (and every rank 1/W)."""
    model = mlp()
    optimizer = sgd(model.parameters())
    for window in windows():
        optimizer.zero_grad()
        loss = sum(mse(model, part) for parts in window.values() for part in parts)
        (loss / (ACCUMULATION * len(window))).backward()
        optimizer.step()
    return state(model)


def data_defined_run(rank, world_size, stage, backend="torch"):
    fp32 = backend == "deepspeed"  # DeepSpeed trains float32 at most
    eng = engine.initialize(mlp(dtype=torch.float32 if fp32 else torch.float64),
                            {**CONFIG, "zero_optimization": {"stage": stage}, "backend": backend})
    plan = eng.plan
    everything = windows(torch.float32 if fp32 else torch.float64)
    updated_at = []
    for window in everything[:len(MANUAL_SIZES)]:  # the manual loop, Colossal-AI style
        for x, y in window[rank]:
            before = eng.full_state_dict()
            eng.zero_grad()
            loss = mse(eng, (x, y))
            eng.backward(loss)
            eng.step()
            updated_at.append(max_param_diff(before, eng.full_state_dict()) > 0)
    for window in everything[len(MANUAL_SIZES):-1]:  # whole batches
        eng.train_batch(window[rank][0], mse)
    for part in everything[-1][rank]:  # a short window at the end of the data
        eng.backward(mse(eng, part))
        eng.step()
    eng.flush()
    result = {"state": eng.full_state_dict(), "updated_at": updated_at,
              "global_samples": eng.global_samples, "global_steps": eng.global_steps,
              "data_defined": plan.is_data_defined, "train_batch_size": plan.train_batch_size}
    eng.close()
    return result


HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
RUNS = [f"stage{stage}" for stage in (0, 2, 3)] + (["deepspeed stage2"] if HAS_DEEPSPEED else [])


@pytest.fixture(scope="module")
def runs():
    scenarios = {f"stage{stage}": functools.partial(data_defined_run, stage=stage) for stage in (0, 2, 3)}
    if HAS_DEEPSPEED:
        scenarios["deepspeed stage2"] = functools.partial(data_defined_run, stage=2, backend="deepspeed")
    return run_scenarios(scenarios, world_size=2, timeout=240)


@pytest.mark.parametrize("name", RUNS)
def test_accumulation_alone_equals_the_full_batch_reference(runs, name):
    expected = reference()
    total = sum(len(batch[0]) for batch in global_batches())
    for result in runs[name]:
        assert result["data_defined"] and result["train_batch_size"] is None
        assert max_param_diff(result["state"], expected) < (FP32_TOL if "deepspeed" in name else TOL)
        # parameters move only at the last micro-step of each window
        assert result["updated_at"] == [False, False, True] * len(MANUAL_SIZES)
        assert result["global_samples"] == total
        assert result["global_steps"] == len(global_batches())


def test_one_over_a_weighting_misses_the_tolerance():
    assert max_param_diff(one_over_a_reference(), reference()) > 1000 * FP32_TOL  # the DeepSpeed run's too


def test_the_plan_says_the_data_defines_the_batch():
    config = engine.load_config(CONFIG)
    plan = plan_from_config(config, world_size=2, rank=1)
    assert plan.is_data_defined and not plan.is_provisional
    assert (plan.train_batch_size, plan.train_micro_batch_size_per_gpu, plan.gradient_accumulation_steps) == \
        (None, None, ACCUMULATION)
    text = plan.describe()
    assert "global batch:" in text and "defined by the data" in text and "accumulation steps: 3" in text
    with pytest.raises(engine.BatchConfigError, match="only gradient_accumulation_steps"):
        plan.per_device_batch_size


def test_a_config_with_a_batch_size_keeps_its_plan():
    plan = plan_from_config(engine.load_config({"train_batch_size": 8, "gradient_accumulation_steps": 2}), 2)
    assert not plan.is_data_defined and plan.micro_batch_sizes == (2, 2)
    # the resolver's contract is unchanged: accumulation alone does not fix a batch there
    with pytest.raises(engine.BatchConfigError, match="gradient_accumulation_steps alone"):
        engine.resolve_batch_plan(2, gradient_accumulation_steps=2)


def test_cli_plan_prints_a_data_defined_plan(capsys):
    from engine.cli import main

    path = Path(__file__).resolve().parents[2] / "configs" / "colossalai_legacy.py"  # gradient_accumulation = 4
    assert main(["plan", str(path), "--world-size", "2"]) == 0
    assert "defined by the data" in capsys.readouterr().out


class Scaled(torch.nn.Module):
    """A model taking a batch and a tensor without a batch dimension of the same size."""

    def __init__(self):
        super().__init__()
        self.inner = mlp()

    def forward(self, x, scale):
        return self.inner(x) * scale


def test_sizes_come_from_the_forward_and_must_be_readable():
    eng = engine.initialize(Scaled(), CONFIG)
    x, y = samples(0, 0, 4, 0)
    with pytest.raises(engine.EngineUsageError, match="call eng\\(x\\), not eng.module\\(x\\)"):
        eng.backward(torch.nn.functional.mse_loss(eng.module(x, torch.ones(1, dtype=x.dtype)), y))
    with pytest.raises(engine.EngineUsageError, match=r"do not share a first \(batch\) dimension \(args\[0\]: 4, "
                       r"args\[1\]: 1\).*position_ids \[batch, T\].*or set train_micro_batch_size_per_gpu"):
        eng.backward(torch.nn.functional.mse_loss(eng(x, torch.ones(1, dtype=x.dtype)), y))
    eng.close()


def failing_loss(model, x):
    model(x)
    raise ValueError("a loss that fails after its forward")


def test_a_micro_step_holds_what_the_forward_its_loss_came_from_held(caplog):
    """Forwards with gradients enabled that reach no backward (an evaluation pass without
    no_grad, a forward whose loss raised, one after the loss's own) do not size the micro-step:
    a window of 1 + 3 samples equals the full-batch reference with any of them around."""
    x, y = samples(0, 0, 4, 0)
    big, _ = samples(1, 0, 16, 0)
    expected = state(reference_train(mlp(), [(x, y)], mse, sgd))
    eng = engine.initialize(mlp(), {**CONFIG, "gradient_accumulation_steps": 2})
    eng(big)  # an evaluation pass that forgot torch.no_grad()
    eng.backward(mse(eng, (x[:1], y[:1])))
    eng.step()
    with pytest.raises(ValueError):  # a forward whose loss fails, then the micro-step again
        failing_loss(eng, big)
    loss = mse(eng, (x[1:], y[1:]))
    eng(x[:2])  # a forward after the loss's own
    eng.backward(loss)
    assert eng.step()
    assert max_param_diff(eng.full_state_dict(), expected) < TOL
    assert eng.global_samples == 4 and not caplog.records  # every loss traced to its forward: nothing to warn
    eng.close()


def test_resuming_across_a_data_defined_plan_names_the_keys_to_change(tmp_path):
    x, y = samples(0, 0, 3, 0)
    engines = {"data": engine.initialize(mlp(), CONFIG),
               "planned": engine.initialize(mlp(), {**CONFIG, "train_batch_size": 3})}
    for name, eng in engines.items():
        for k in range(ACCUMULATION):
            eng.backward(mse(eng, (x[k:k + 1], y[k:k + 1])))
            eng.step()
        eng.save_checkpoint(tmp_path / name)
    with pytest.raises(CheckpointError, match=r"trained with a data-defined batch \(the config gave only "
                       r"gradient_accumulation_steps\); this engine has 3\..*give only "
                       r"gradient_accumulation_steps, as when it was saved: remove train_batch_size and "
                       r"train_micro_batch_size_per_gpu"):
        engines["planned"].load_checkpoint(tmp_path / "data")
    with pytest.raises(CheckpointError, match=r"trained with train_batch_size 3 \(the global batch\); this engine has "
                       r"a data-defined batch .*set train_batch_size: 3"):
        engines["data"].load_checkpoint(tmp_path / "planned")
    for eng in engines.values():
        eng.close()


def test_a_plan_with_sizes_can_count_the_inputs_too():
    """initialize(manual_sizes="inputs"), what the facades use: a planned window fed 1 + 3
    samples is weighted by them (exact), not as the plan's 2 + 2; an unknown choice is refused."""
    x, y = samples(0, 0, 4, 0)
    expected = state(reference_train(mlp(), [(x, y)], mse, sgd))
    config = {**CONFIG, "train_batch_size": 4, "gradient_accumulation_steps": 2}
    for manual_sizes, exact in (("inputs", True), ("plan", False)):
        eng = engine.initialize(mlp(), config, manual_sizes=manual_sizes)
        for part in (slice(0, 1), slice(1, 4)):
            eng.backward(mse(eng, (x[part], y[part])))
            eng.step()
        assert (max_param_diff(eng.full_state_dict(), expected) < TOL) == exact, manual_sizes
        eng.close()
    with pytest.raises(ValueError, match="manual_sizes must be one of 'plan', 'inputs'; got 'data'"):
        engine.initialize(mlp(), config, manual_sizes="data")


def test_the_gradient_norm_at_every_boundary_on_request():
    x, y = samples(0, 0, 4, 0)
    model = mlp()
    mse(model, (x, y)).backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    norms = {}
    for every_step in (False, True):
        eng = engine.initialize(mlp(), CONFIG, grad_norm_every_step=every_step)  # no clipping, no monitor
        eng.train_batch((x, y), mse)
        norms[every_step] = eng.last_window.step.grad_norm
        eng.close()
    assert norms[False] is None and float(norms[True]) == pytest.approx(expected, rel=1e-12)
