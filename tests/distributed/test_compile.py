"""``compile: {enabled, mode, dynamic, backend}``: each block compiled before the strategy wraps
or shards it; training equals eager to rounding with accumulation at every stage, and variable
shapes cost a bounded number of compilations (counted). Compilation is slow on CPU: these tests
are few and small (inductor in one process, aot_eager — the same capture, no code generation — on
two ranks)."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import engine
from bench.model_transforms import lm, lm_loss, tokens
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, state
from tests.support.scenarios import compiled_case, every_stage_and_precision


def train(model, lengths, **features):
    eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 8, "gradient_accumulation_steps": 2, **features},
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    for length in lengths:
        eng.train_batch(tokens(8, length, seed=length), lm_loss)
    return state(eng.module)


@pytest.mark.timeout(600)
def test_compiled_blocks_equal_eager_and_variable_lengths_compile_twice():
    """Four identical blocks share one graph; the first new length makes the sequence dimension
    dynamic (torch's automatic dynamic shapes), after which no length recompiles."""
    torch._dynamo.reset()
    counters.clear()
    model, lengths = lm(layers=4, width=32), (16, 24, 32, 20)
    compiled = train(model, lengths, compile={"enabled": True})
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert max_param_diff(compiled, train(model, lengths)) < 1e-5  # measured 3e-8


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_compiled_checkpointed_blocks_equal_eager_at_every_stage():
    scenarios = every_stage_and_precision(compiled_case)
    for case, per_rank in run_scenarios(scenarios, world_size=2, timeout=380).items():
        for diff, captured in per_rank:
            assert captured > 0 and diff < 1e-6, (case, per_rank)  # measured 0: aot_eager runs the same kernels
