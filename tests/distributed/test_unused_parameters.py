"""A parameter the forward never uses (a Hugging Face encoder's pooler, a head trained in
another phase) trains at every ZeRO stage on one rank and on two, in the manual loop and
in ``train_batch``: equal to the full-batch reference, where such a parameter has no
gradient and the optimizer leaves it alone."""

import copy
import functools

import pytest
import torch

import engine
from engine.batching.microbatch import split_batch
from tests.support.dist_utils import run_scenarios
from tests.support.reference import DTYPE, adamw, max_param_diff, mse, reference_train, regression_batches, state

TOLERANCE = 1e-12  # float64


class EncoderWithPooler(torch.nn.Module):
    """An encoder whose pooler the loss never reaches (as in BertModel + a token-level head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.pooler = torch.nn.Linear(3, 3)
        self.to(DTYPE)

    def forward(self, x):
        return self.encoder(x)


def config(stage: int) -> dict:
    return {"train_batch_size": 8, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
            "seed": 0}


def train(rank, world, stage, loop):
    model, batches = EncoderWithPooler(), regression_batches(3, 8)
    eng = engine.initialize(copy.deepcopy(model), config(stage), optimizer=adamw)
    for batch in batches:
        local = tuple(t[4 * rank:4 * rank + 4] for t in batch) if world == 2 else batch
        if loop == "train_batch":
            eng.train_batch(local, mse)
            continue
        for micro_batch in split_batch(local, eng.plan.micro_batch_sizes):
            eng.backward(mse(eng, micro_batch))
            eng.step()
    expected = reference_train(model, batches, mse, adamw)
    result = eng.full_state_dict()
    eng.close()
    return {"diff": max_param_diff(result, state(expected)), "steps": eng.global_steps,
            "pooler_moved": not torch.equal(result["pooler.weight"], model.pooler.weight.detach())}


def check(results):
    for name, per_rank in results.items():
        for result in per_rank:
            assert result["steps"] == 3 and result["diff"] < TOLERANCE, (name, result)
            assert not result["pooler_moved"], name  # no gradient: AdamW's decay does not touch it


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unused_parameter_in_one_process(stage):
    check({f"stage {stage} {loop}": [train(0, 1, stage, loop)] for loop in ("manual", "train_batch")})


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_unused_parameter_on_two_ranks_at_every_stage():
    scenarios = {f"stage {stage} {loop}": functools.partial(train, stage=stage, loop=loop)
                 for stage in (0, 1, 2, 3) for loop in ("manual", "train_batch")}
    check(run_scenarios(scenarios, world_size=2, timeout=220))


def train_bf16(rank, world, stage):
    """The precision policy's replicas (bf16 parameters at ZeRO 0/1 reduce the fp32 masters'
    gradients themselves, in buckets of reduce_bucket_size elements)."""
    model, batches = EncoderWithPooler().float(), regression_batches(3, 8)
    settings = {**config(stage), "bf16": {"enabled": True},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 64}}
    eng = engine.initialize(copy.deepcopy(model), settings, optimizer=adamw)
    for batch in batches:
        eng.train_batch(tuple(t[4 * rank:4 * rank + 4].float() for t in batch), mse)
    expected = reference_train(model.double(), batches, mse, adamw)
    result = eng.full_state_dict()
    eng.close()
    return {"diff": max_param_diff(result, state(expected)), "steps": eng.global_steps,
            "pooler_moved": not torch.equal(result["pooler.weight"], model.pooler.weight.detach().float())}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_unused_parameter_under_the_bf16_policy_on_two_ranks():
    results = run_scenarios({f"bf16 stage {stage}": functools.partial(train_bf16, stage=stage) for stage in (0, 1)},
                            world_size=2, timeout=100)
    for name, per_rank in results.items():
        for result in per_rank:
            assert result["steps"] == 3 and result["diff"] < 1e-2, (name, result)  # bf16 compute
            assert not result["pooler_moved"], name
