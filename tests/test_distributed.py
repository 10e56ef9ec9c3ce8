"""Two gloo ranks, every ZeRO stage on the torch backend, against the single-process
full-batch reference (float64). Each stage runs all its scenarios in one set of ranks."""

import copy
import functools

import pytest
import torch

import engine
from bench.comm_count import CommCounter
from engine.microbatch import split_batch
from tests.dist_utils import run_distributed, run_scenarios
from tests.reference import (
    TinyLM, adamw, max_param_diff, mlp, mse, rank_slice, reference_train, regression_batches, sgd, state,
    token_batches, token_loss_mean, token_loss_sum,
)

TOL = 1e-10
STAGES = [0, 1, 2, 3]


def make_engine(model, stage, global_batch, micro, split="strict", optimizer=adamw, **extra):
    config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
              "batch_split": split, "zero_optimization": {"stage": stage}, **extra}
    return engine.initialize(model, config, optimizer=optimizer)




def flat_params(eng) -> torch.Tensor:
    return torch.cat([v.flatten().double() for v in eng.full_state_dict().values()])


# -- scenarios: each runs on every rank and returns what the test asserts on ---------------
def manual_loop(rank, world, stage, split):
    """Manual loop; records whether parameters moved after every micro-step."""
    global_batch, micro = (8, 2) if split == "strict" else (11, 2)
    model, batches = mlp(), regression_batches(3, global_batch)
    expected = reference_train(model, batches, mse, sgd)
    eng = make_engine(copy.deepcopy(model), stage, global_batch, micro, split, sgd)
    moved, before = [], flat_params(eng)
    for batch in batches:
        for micro_batch in split_batch(rank_slice(batch, eng.plan), eng.plan.micro_batch_sizes):
            eng.backward(mse(eng, micro_batch))
            stepped = eng.step()
            after = flat_params(eng)
            moved.append((stepped, not torch.equal(after, before)))
            before = after
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "moved": moved,
            "params": flat_params(eng), "steps": eng.global_steps, "samples": eng.global_samples}


def train_batch(rank, world, stage, split, clip=0.0):
    global_batch, micro = (8, 2) if split == "strict" else (11, 2)
    model, batches = mlp(), regression_batches(3, global_batch)
    expected = reference_train(model, batches, mse, adamw, clip=clip)
    eng = make_engine(copy.deepcopy(model), stage, global_batch, micro, split, gradient_clipping=clip)
    losses = [eng.train_batch(rank_slice(batch, eng.plan), mse) for batch in batches]
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "params": flat_params(eng),
            "loss0": losses[0], "expected_loss0": mse(model, batches[0]).item()}


def token_weighted(rank, world, stage):
    model, batches = TinyLM(), token_batches(2, 8)
    expected = reference_train(model, batches, token_loss_mean, adamw)
    eng = make_engine(copy.deepcopy(model), stage, 8, 2)
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), token_loss_sum)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "params": flat_params(eng)}


def short_windows(rank, world, stage):
    """A manual-loop window closed early with flush, then a short last batch in train_batch."""
    model, batches = mlp(), regression_batches(3, 16)
    flushed = (batches[1][0][:8], batches[1][1][:8])  # each rank runs 2 of its 4 micro-steps
    short = (batches[2][0][:12], batches[2][1][:12])  # 6 of the planned 8 per rank
    expected = reference_train(model, [batches[0], flushed, short], mse, sgd)
    eng = make_engine(copy.deepcopy(model), stage, 16, 2, optimizer=sgd)
    for micro_batch in split_batch(rank_slice(batches[0], eng.plan), eng.plan.micro_batch_sizes):
        eng.backward(mse(eng, micro_batch))
        eng.step()
    local = tuple(t[4 * rank:4 * rank + 4] for t in flushed)
    for micro_batch in split_batch(local, (2, 2)):
        eng.backward(mse(eng, micro_batch))
        eng.step()
    eng.step(flush=True)
    eng.train_batch(tuple(t[6 * rank:6 * rank + 6] for t in short), mse)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "samples": eng.global_samples}


def gradient_collectives(rank, world, stage, reduce_every_micro_step=False):
    """Collectives per micro-step of a manual-loop window (accumulation 4)."""
    model, (batch,) = mlp(), regression_batches(1, 16)
    eng = make_engine(copy.deepcopy(model), stage, 16, 2, optimizer=sgd,
                      zero_optimization={"stage": stage, "defer_reduction": not reduce_every_micro_step})
    per_micro_step = []
    with CommCounter() as comm:
        if hasattr(eng.strategy.forward_module, "register_comm_hook"):
            comm.watch_ddp(eng.strategy.forward_module)
        for micro_batch in split_batch(rank_slice(batch, eng.plan), eng.plan.micro_batch_sizes):
            comm.reset()
            eng.backward(mse(eng, micro_batch))
            eng.step()
            per_micro_step.append(dict(comm.calls))
    return per_micro_step


def reduce_every_micro_step(rank, world, stage):
    model, batches = mlp(), regression_batches(2, 16)
    expected = reference_train(model, batches, mse, adamw)
    eng = make_engine(copy.deepcopy(model), stage, 16, 2,
                      zero_optimization={"stage": stage, "defer_reduction": False})
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), mse)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "params": flat_params(eng),
            "collectives": gradient_collectives(rank, world, stage, reduce_every_micro_step=True)}


def each_rank_builds_its_own_model(rank, world, stage):
    """Like DDP, every strategy starts from rank 0's parameters."""
    batches = regression_batches(2, 8)
    expected = reference_train(mlp(seed=0), batches, mse, sgd)
    eng = make_engine(mlp(seed=rank), stage, 8, 2, optimizer=sgd)
    start = max_param_diff(eng.full_state_dict(), state(mlp(seed=0)))
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), mse)
    return {"start": start, "diff": max_param_diff(eng.full_state_dict(), state(expected))}


def eval_then_checkpoint(rank, world, stage, directory):
    """Evaluation gathers sharded parameters without a backward; saving right after works."""
    model, batches = mlp(), regression_batches(2, 8)
    expected = reference_train(model, batches, mse, sgd)
    eng = make_engine(copy.deepcopy(model), stage, 8, 2, optimizer=sgd)
    eng.train_batch(rank_slice(batches[0], eng.plan), mse)
    eng.eval_batch(rank_slice(batches[1], eng.plan), mse)
    eng.save_checkpoint(f"{directory}/stage{stage}")
    eng.train_batch(rank_slice(batches[1], eng.plan), mse)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected))}


def uneven_flush(rank, world, stage):
    eng = make_engine(mlp(), stage, 16, 2, optimizer=sgd)
    (batch,) = regression_batches(1, 16)
    for micro_batch in split_batch(rank_slice(batch, eng.plan), (2, 2, 2, 2))[:2 - rank]:
        eng.backward(mse(eng, micro_batch))
        eng.step()
    with pytest.raises(engine.EngineUsageError) as error:
        eng.step(flush=True)
    return str(error.value)


def stage_scenarios(stage, directory):
    return {**_robustness_scenarios(stage, directory), **_exactness_scenarios(stage)}


def _robustness_scenarios(stage, directory):
    scenarios = {
        "each rank builds its own model": functools.partial(each_rank_builds_its_own_model, stage=stage),
        "eval then checkpoint": functools.partial(eval_then_checkpoint, stage=stage, directory=directory),
    }
    if stage < 2:  # at ZeRO-2/3 every micro-step communicates: uneven micro-steps cannot all reach the flush
        scenarios["uneven flush"] = functools.partial(uneven_flush, stage=stage)
    return scenarios


def _exactness_scenarios(stage):
    scenarios = {
        "manual strict": functools.partial(manual_loop, stage=stage, split="strict"),
        "manual balanced": functools.partial(manual_loop, stage=stage, split="balanced"),
        "train_batch strict clipped": functools.partial(train_batch, stage=stage, split="strict", clip=0.05),
        "train_batch balanced": functools.partial(train_batch, stage=stage, split="balanced"),
        "token weighted": functools.partial(token_weighted, stage=stage),
        "short windows": functools.partial(short_windows, stage=stage),
        "collectives": functools.partial(gradient_collectives, stage=stage),
    }
    if stage >= 2:
        scenarios["reduce every micro-step"] = functools.partial(reduce_every_micro_step, stage=stage)
    return scenarios


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", STAGES)
def test_stage_equals_full_batch_reference(stage, tmp_path):
    results = run_scenarios(stage_scenarios(stage, str(tmp_path)), world_size=2, timeout=240)
    for first in results["each rank builds its own model"]:
        assert first["start"] == 0 and first["diff"] < TOL
    assert all(r["diff"] < TOL for r in results["eval then checkpoint"])
    if stage < 2:
        assert all("between 1 and 2 micro-steps" in message for message in results["uneven flush"])
    for name in ("manual strict", "manual balanced", "train_batch strict clipped", "train_batch balanced",
                 "token weighted", "short windows"):
        for rank, result in enumerate(results[name]):
            assert result["diff"] < TOL, (name, rank, result["diff"])
        if "params" in results[name][0]:
            assert torch.equal(results[name][0]["params"], results[name][1]["params"]), name
    for name in ("manual strict", "manual balanced"):
        for result in results[name]:
            # parameters move exactly when a window closes, on every rank
            assert all(stepped == moved for stepped, moved in result["moved"]), result["moved"]
            assert [s for s, _ in result["moved"]].count(True) == result["steps"] == 3
    first = results["train_batch strict clipped"][0]
    assert first["loss0"] == pytest.approx(first["expected_loss0"], rel=1e-12)
    assert results["short windows"][0]["samples"] == 16 + 8 + 12

    for per_micro_step in results["collectives"]:
        inside, boundary = per_micro_step[:-1], per_micro_step[-1]
        gradient_kinds = ("all_reduce", "reduce_scatter", "all_to_all")  # all_to_all: gloo's reduce-scatter
        assert all(step.get(kind, 0) == 0 for step in inside for kind in gradient_kinds), per_micro_step
        assert sum(boundary.get(kind, 0) for kind in gradient_kinds) >= 1, per_micro_step
    if stage >= 2:
        for result in results["reduce every micro-step"]:
            assert result["diff"] < TOL
            assert all(step.get("reduce_scatter", 0) + step.get("all_to_all", 0) >= 1
                       for step in result["collectives"]), result["collectives"]


def _config_from_rank(rank, world):
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2 if rank == 0 else 4,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(engine.ConfigError) as error:
        engine.initialize(mlp(), config)
    return str(error.value)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_with_different_configs_fail_clearly_on_every_rank():
    messages = run_distributed(_config_from_rank, world_size=2, timeout=60)
    for message in messages:
        assert "ranks disagree" in message
        assert "gradient_accumulation_steps: rank 0 has 2, rank 1 has 4" in message
