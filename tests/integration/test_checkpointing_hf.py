"""Activation checkpointing on Hugging Face models as their users build them: from the config,
``use_cache`` on (its default). The checkpointed blocks train without the generation cache
(the backward's recomputation would otherwise write its keys and values a second time), and
the run equals the float64 full-batch reference at ZeRO 0 and 3 on two ranks; the broken
variant (the cache left to the blocks) is the crash users met."""

import copy
import functools
import importlib.util

import pytest
import torch

import engine
from engine.strategies import model_transforms
from engine.errors import ConfigError
from engine.strategies.model_transforms import apply_activation_checkpointing, repeated_blocks
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, sgd, state
from tests.support.hf_models import TOL, VOCAB, gpt2, llama, reference_run, token_batches, token_sum
from tests.support.pipeline_helpers import data_share

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")

CHECKPOINTED = {"activation_checkpointing": {"enabled": True}}


def cache_left_to_the_blocks():
    """The broken variant: the checkpointed forward passes the cache through (run last: it
    stays in the rank's process)."""
    model_transforms._without_cache = lambda kwargs: kwargs


def checkpointed_llama(rank, world, *, zero, broken=False):
    """Two windows of 2 micro-batches per rank, decoder layers checkpointed: the largest
    difference from the reference (or the error of the broken variant)."""
    if broken:
        cache_left_to_the_blocks()
    model, batches = llama(layers=2), token_batches(2, 4 * world)
    assert model.config.use_cache  # as LlamaForCausalLM(LlamaConfig(...)) builds it
    expected = reference_run(model, batches)
    eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 2,
                                                   "zero_optimization": {"stage": zero}, **CHECKPOINTED},
                            optimizer=sgd)
    try:
        for batch in batches:
            eng.train_batch(data_share(batch, eng), token_sum)
    except RuntimeError as error:
        return str(error)
    finally:
        whole = eng.full_state_dict()
        eng.close()
    return max_param_diff(whole, state(expected))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_checkpointed_llama_with_its_cache_on_equals_the_full_batch_reference_at_zero_0_and_3():
    scenarios = {"zero 0": functools.partial(checkpointed_llama, zero=0),
                 "zero 3": functools.partial(checkpointed_llama, zero=3),
                 "cache left to the blocks": functools.partial(checkpointed_llama, zero=0, broken=True)}
    results = run_scenarios(scenarios, world_size=2, timeout=220)
    broken = results.pop("cache left to the blocks")
    assert all("must match the size of tensor b" in message for message in broken), broken
    for case, diffs in results.items():
        assert max(diffs) < TOL, (case, diffs)  # measured 3.5e-9 (RMSNorm in float32)


def test_a_checkpointed_gpt2_with_its_cache_on_trains_as_without_checkpointing():
    model = gpt2().double()
    assert model.config.use_cache
    tokens, labels = token_batches(1, 4)[0]
    runs = {}
    for name, features in {"without": {}, "with": CHECKPOINTED}.items():
        eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 4, "gradient_accumulation_steps": 2,
                                                       **features}, optimizer=sgd)
        torch.manual_seed(7)  # GPT-2's dropout: the same draws in both runs
        eng.train_batch((tokens, labels), token_sum)
        runs[name] = state(eng.module)
    assert max_param_diff(runs["with"], runs["without"]) < 1e-12


def test_without_gradients_the_checkpointed_blocks_still_fill_the_cache():
    model = llama(layers=2)
    apply_activation_checkpointing(repeated_blocks(model))
    tokens = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        assert model(tokens).past_key_values.get_seq_length() == 5  # generation keeps working
    assert model(tokens).past_key_values.get_seq_length() == 0  # training: the blocks got no cache


def test_a_filled_cache_given_to_a_checkpointed_block_is_refused():
    model = llama(layers=2)
    tokens = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        cache = model(tokens).past_key_values
    apply_activation_checkpointing(repeated_blocks(model))
    with pytest.raises(ConfigError, match="was given a past_key_values cache that already holds 5 token\\(s\\); the "
                                          "backward recomputes the block"):
        model(tokens, past_key_values=cache)
