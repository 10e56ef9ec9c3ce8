"""Nothing silent on a mesh (issue 33): what a pipeline or a precision setting cannot do as asked
is refused at ``initialize``, naming the stage or the parameters and the fix, on every rank.

- a pipeline rank whose stages hold no parameters (its every checkpoint save would fail);
- an interleaved schedule on too few modules: the advice counts the schedule's stages per rank;
- bf16 where it runs as autocast (a pipeline, a tensor mesh, ``torch_autocast``) on a float64
  model, which autocast leaves in float64 while one process computes it in bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

import engine
from engine.errors import ConfigError
from engine.pipeline.split import cut, sequence_of
from tests.dist_utils import run_scenarios
from tests.reference import mlp, mse, regression_batches, sgd


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
             "no parameters": refused(parameterless_last_stage(), pipeline_config(pipeline={"stages": 2,
                                                                                            "split": ["2"]})),
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
        assert ("pipeline: pipeline rank 1 would hold no parameters (stage 2 of 2: 2)" in found["no parameters"]
                ), found["no parameters"]
        assert "pipeline.split" in found["no parameters"]
        assert ("bf16.enabled: under world 2 = pipeline 2 × data 1 × tensor 1, bf16 is autocast"
                in found["bf16 float64"]), found["bf16 float64"]
        assert "parameters are float64 (0.weight, 0.bias, 2.weight, ...)" in found["bf16 float64"]
        assert found["float32 trained"] == 1
    assert results[0] == results[1]


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
