"""Nothing silent on a mesh (issue 33): what a pipeline or a precision setting cannot do as asked
is refused at ``initialize``, naming the parameters or the schedule and the fix, on every rank;
what it can do, it does exactly.

- a pipeline rank whose stages hold no parameters (an activation alone) saves and resumes its
  (empty) share of the checkpoints, equal to the full-batch reference;
- an interleaved schedule on too few modules: the advice counts the schedule's stages per rank;
- bf16 where it runs as autocast (a pipeline, a tensor mesh, ``torch_autocast``) on a float64
  model, which autocast leaves in float64 while one process computes it in bf16.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import engine
from engine.errors import ConfigError
from engine.pipeline.split import cut, sequence_of
from tests.dist_utils import run_scenarios
from tests.reference import max_param_diff, mlp, mse, regression_batches, reference_train, sgd, state


def pipeline_config(schedule="1f1b", **extra):
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "pipeline": {"stages": 2, "schedule": schedule}, **extra}


def refused(model, config) -> str:
    """The ConfigError ``initialize`` raises for ``model`` under ``config`` ('' if none)."""
    try:
        eng = engine.initialize(model, config, optimizer=sgd)
    except ConfigError as error:
        return str(error)
    eng.close()
    return ""


def three_modules():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def parameterless_last_stage():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3), torch.nn.Tanh()).double()


def pipeline_refusals(rank, world):
    found = {"interleaved": refused(three_modules(), pipeline_config("interleaved")),
             "bf16 float64": refused(mlp(), pipeline_config(bf16={"enabled": True}))}
    # the same bf16 setting on a float32 model runs (as autocast), and trains
    model = mlp(dtype=torch.float32)
    eng = engine.initialize(copy.deepcopy(model), pipeline_config(bf16={"enabled": True}), optimizer=sgd)
    batch = tuple(t.float() for t in regression_batches(1, 8)[0])  # one data rank: the whole batch
    eng.train_batch(batch, engine.loss_on_outputs(torch.nn.functional.mse_loss))
    found["float32 trained"] = eng.global_steps
    eng.close()
    return found


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_pipeline_refuses_what_it_cannot_run_as_asked_on_every_rank():
    results = run_scenarios({"refusals": pipeline_refusals}, world_size=2, timeout=140)["refusals"]
    for found in results:  # every rank raises the same error, before any collective could hang
        assert "pipeline.stages: the model has 3 part(s) (0, 1, 2) for 2 pipeline rank(s) × 2 stages each" \
            in found["interleaved"], found["interleaved"]
        assert "use pipeline.schedule 1f1b or gpipe (one stage per rank: up to 3 ranks)" in found["interleaved"]
        assert "use at most 3 stage" not in found["interleaved"]
        assert ("bf16.enabled: under world 2 = pipeline 2 × data 1 × tensor 1, bf16 is autocast"
                in found["bf16 float64"]), found["bf16 float64"]
        assert "parameters are float64 (0.weight, 0.bias, 2.weight, ...)" in found["bf16 float64"]
        assert found["float32 trained"] == 1
    assert results[0] == results[1]


def parameterless_rank_checkpoints(rank, world, directory, broken=False):
    """Rank 1 holds a Tanh alone; checkpoints every step; a second engine resumes from step 2
    and trains to step 4: equal to 4 full-batch reference steps. ``broken``: the resumed run
    starts its batches over (a position lost), which misses the tolerance."""
    batches = regression_batches(4, 8)
    expected = reference_train(parameterless_last_stage(), batches, mse, sgd)
    settings = pipeline_config(pipeline={"stages": 2, "split": ["2"]},
                               checkpoint={"dir": directory, "every_steps": 1, "keep_last": 2})
    loss = engine.loss_on_outputs(torch.nn.functional.mse_loss)
    for until in (2, 4):
        eng = engine.initialize(parameterless_last_stage(), settings, optimizer=sgd)
        resumed = eng.global_steps
        while eng.global_steps < until:
            eng.train_batch(batches[eng.global_steps - (resumed if broken else 0)], loss)
        eng.close()
    return {"resumed": resumed, "diff": max_param_diff(eng.full_state_dict(), state(expected))}


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_pipeline_rank_without_parameters_checkpoints_and_resumes_exactly(tmp_path):
    results = run_scenarios({
        "resumed": functools.partial(parameterless_rank_checkpoints, directory=str(tmp_path / "a")),
        "broken": functools.partial(parameterless_rank_checkpoints, directory=str(tmp_path / "b"), broken=True)},
        world_size=2, timeout=140)
    for result in results["resumed"]:
        assert result["resumed"] == 2 and result["diff"] < 1e-12, result
    assert all(result["diff"] > 1e-4 for result in results["broken"])


def test_the_interleaved_advice_counts_two_stages_per_rank():
    with pytest.raises(ConfigError) as raised:
        cut(sequence_of(three_modules()), 4, "auto", per_rank=2)
    assert "pipeline.stages: 1 with this schedule" in str(raised.value)


def test_bf16_autocast_on_a_float64_model_is_refused_on_one_process_too():
    """torch_autocast on one process would leave a float64 model in float64 as well; the bf16
    compute copy (the default) casts it, and trains."""
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}}
    problem = refused(mlp(), {**config, "torch_autocast": {"enabled": True}})
    assert "bf16.enabled: with torch_autocast, bf16 is autocast" in problem
    assert "model.float()" in problem
    eng = engine.initialize(mlp(), config, optimizer=sgd)
    try:
        eng.train_batch(regression_batches(1, 4)[0], mse)
        assert eng.global_steps == 1
    finally:
        eng.close()
