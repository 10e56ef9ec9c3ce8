"""A Hugging Face Llama cut into pipeline stages by its own pipeline plan, against the float64
full-batch reference (the plain model on the whole global batch in one process).

The user's code is the same with and without a pipeline: ``train_batch((input_ids, labels),
loss_fn)`` with a loss on the model's outputs (``outputs.logits``). Pipeline 2 on 2 ranks (a
window of A = 4 micro-batches; mean and (sum, count) losses; 1F1B and interleaved) and
pipeline 2 × data 2 on 4 ranks (ZeRO 0 and 3); the whole model (``full_state_dict``) loads
back into a plain Llama. The broken variant of DeepSpeed #7773 (micro-batch gradients summed
instead of averaged) misses the tolerance."""

from __future__ import annotations

import copy
import functools
import importlib.util

import pytest
import torch

import engine
from engine.errors import ConfigError, EngineUsageError
from tests.support.broken import intact, summed_micro_batches
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, sgd, state
from tests.support.hf_models import (TOL, VOCAB, gpt2, llama, llama_config, reference_run, token_batches, token_mean,
                                     token_sum)
from tests.support.pipeline_helpers import data_share

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")

MISSED = 1e-4  # a wrong gradient misses by far more than TOL (summed micro-batches: above 1e-2)


def train(rank, world, *, schedule="1f1b", loss="tokens", zero=0, clip=0.0, tensor=1, breaks=intact, **extra):
    """Three windows of A = 4 micro-batches of 1 sample on each data-parallel rank."""
    data_ranks = world // (2 * tensor)
    model, batches = llama(), token_batches(3, 4 * data_ranks, dense=loss == "mean")
    expected = reference_run(model, batches, clip)
    settings = {"train_batch_size": 4 * data_ranks, "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": zero}, "gradient_clipping": clip,
                "pipeline": {"stages": 2, "schedule": schedule, "split": "auto"}, "tensor_parallel": {"size": tensor},
                **extra}
    eng = breaks(engine.initialize(copy.deepcopy(model), settings, optimizer=sgd))
    loss_fn = token_sum if loss == "tokens" else token_mean
    for batch in batches:
        eng.train_batch(data_share(batch, eng), loss_fn)
    whole = eng.full_state_dict()
    plain = llama(seed=1)  # another initialisation: the loaded state must replace all of it
    loaded = plain.load_state_dict(whole, strict=True)
    tokens, labels = batches[0]
    result = {"diff": max_param_diff(whole, state(expected)),
              "loaded": not loaded.missing_keys and not loaded.unexpected_keys
              and max_param_diff(state(plain), whole) == 0,
              "accumulation": eng.plan.gradient_accumulation_steps,
              "held": sorted(eng.module.state_dict()),
              "tensor_split": sorted(name for name, p in eng.module.named_parameters()
                                     if type(p.data).__name__ == "DTensor" and zero == 0),
              "eval": abs(eng.eval_batch(data_share(batches[0], eng), token_sum)
                          - float(token_sum.on_outputs(expected(tokens), labels)[0].detach()
                                  / (labels != -100).sum()))}
    eng.close()
    return result


def without_a_plan(rank, world):
    """A Hugging Face model without a pipeline plan: refused by initialize, on every rank."""
    try:
        engine.initialize(gpt2(), {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
                                   "pipeline": {"stages": 2}}, optimizer=sgd)
    except ConfigError as error:
        return str(error)
    return "no error"


def attention_mask_given(rank, world):
    """(input_ids, attention_mask) as inputs: refused on every rank before the schedule runs."""
    eng = engine.initialize(llama(), {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
                                      "pipeline": {"stages": 2}}, optimizer=sgd)
    tokens, labels = token_batches(1, 4)[0]
    try:
        eng.train_batch(((tokens, torch.ones_like(tokens)), labels), token_sum)
    except EngineUsageError as error:
        return str(error)
    finally:
        eng.close()
    return "no error"


def check(results):
    for name, per_rank in results.items():
        for result in per_rank:
            assert result["diff"] < TOL, (name, result["diff"])
            assert result["loaded"], name
            assert result["accumulation"] == 4, name
            assert result["eval"] < TOL, (name, result["eval"])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_llama_split_in_two_by_its_own_plan_equals_the_full_batch_reference():
    scenarios = {"1f1b tokens": functools.partial(train),
                 "1f1b mean, clipped": functools.partial(train, loss="mean", clip=0.05),
                 "interleaved tokens": functools.partial(train, schedule="interleaved"),
                 "zero_bubble tokens": functools.partial(train, schedule="zero_bubble"),
                 "gpipe tokens, decoder layers checkpointed": functools.partial(
                     train, schedule="gpipe", activation_checkpointing={"enabled": True, "blocks": "auto"}),
                 "attention mask": attention_mask_given,
                 "summed (DeepSpeed #7773)": functools.partial(train, breaks=summed_micro_batches),
                 "GPT-2": without_a_plan}
    results = run_scenarios(scenarios, world_size=2, timeout=220)
    broken = results.pop("summed (DeepSpeed #7773)")
    assert all("GPT2LMHeadModel is a Hugging Face model without a pipeline plan" in text
               for text in results.pop("GPT-2"))
    assert all("LlamaForCausalLM (cut by its pipeline plan) takes its input_ids alone: give batches (input_ids, "
               "labels), input_ids a (batch, sequence) tensor of token ids; got a tuple of 2" in text
               for text in results.pop("attention mask"))
    check(results)
    assert all(result["diff"] > MISSED for result in broken), [result["diff"] for result in broken]
    first, last = (result["held"] for result in results["1f1b tokens"])
    # stage 1: the embeddings and the first two layers; stage 2: the last two, the norm, the head
    assert "model.embed_tokens.weight" in first and "model.layers.1.mlp.up_proj.weight" in first
    assert not any(key.startswith(("model.layers.2", "model.norm", "lm_head")) for key in first)
    assert {"model.layers.2.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"} <= set(last)
    assert not any(key.startswith(("model.embed_tokens", "model.layers.1")) for key in last)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_llama_pipeline_two_by_data_two_and_by_tensor_two_equals_the_full_batch_reference():
    """And pipeline 2 × tensor 2: each stage's layers split by the model's own tensor plan."""
    results = run_scenarios({"1f1b tokens": functools.partial(train),
                             "1f1b ZeRO-3 tokens, clipped": functools.partial(train, zero=3, clip=0.05),
                             "pipeline 2 × tensor 2": functools.partial(train, tensor=2)},
                            world_size=4, timeout=280)
    check(results)
    for result in results["pipeline 2 × tensor 2"]:
        assert "model.layers.0.self_attn.q_proj.weight" in result["tensor_split"] \
            or "model.layers.2.self_attn.q_proj.weight" in result["tensor_split"]
        assert not any("norm" in name for name in result["tensor_split"])


# -- how the plan cuts the model, and what it refuses: no processes -------------------------------
def names(split):
    return [[name for name, _ in piece] for piece in split.pieces]


def test_the_plan_puts_embeddings_first_and_norm_and_head_last():
    from engine.pipeline.stages import split_model

    model = llama(layers=4)
    assert names(split_model(model, 2, "auto")) == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1"],
        ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]]
    assert names(split_model(model, 3, "uniform")) == [
        ["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.layers.2"],
        ["model.layers.3", "model.norm", "lm_head"]]
    assert names(split_model(model, 2, ["model.layers.3"]))[1] == ["model.layers.3", "model.norm", "lm_head"]
    # by parameters: layers of 2336, embeddings of 4096, norm and head 4112: the largest stage
    # is smallest (8768) with 2, 3 and 1 layers
    from transformers import LlamaForCausalLM

    wide = LlamaForCausalLM(llama_config(layers=6, vocab=256))
    assert [[name.split(".")[-1] for name in piece] for piece in names(split_model(wide, 3, "auto"))] == [
        ["embed_tokens", "0", "1"], ["2", "3", "4"], ["5", "norm", "lm_head"]]


def test_each_stage_runs_the_models_own_forward_on_its_layers():
    """Stage by stage (rotary embeddings and the causal mask computed on each), the model's logits;
    and the model given to the split keeps all its modules."""
    from engine.pipeline.stages import split_model

    model = llama(layers=4)
    split = split_model(model, 3, "auto")
    stages = [split.stage(index) for index in range(3)]
    tokens = torch.randint(0, VOCAB, (3, 6))
    value = tokens
    for stage in stages:
        value = stage(value)
    expected = model(tokens).logits
    assert torch.equal(value, expected)
    assert torch.equal(stages[-1].model_outputs(value).logits, expected)
    assert type(stages[-1].model_outputs(value)).__name__ == "CausalLMOutputWithPast"
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in model.model.layers)
    assert not any(key.startswith("model.model.layers.3") for key in stages[0].state_dict())
    # a base model without a head: its last stage hands back the hidden states
    from transformers import LlamaModel

    base = LlamaModel(llama_config(layers=2)).double()
    split = split_model(base, 2, "uniform")
    assert names(split) == [["embed_tokens", "layers.0"], ["layers.1", "norm"]]
    hidden = split.stage(1)(split.stage(0)(tokens))
    assert torch.equal(hidden, base(tokens).last_hidden_state)


def test_a_model_the_plan_cannot_cut_is_refused_naming_the_fix():
    from engine.pipeline.stages import split_model

    with pytest.raises(ConfigError, match="pipeline.stages: LlamaForCausalLM has 2 decoder layer\\(s\\).* for 4 "
                                          "pipeline stage\\(s\\).*use at most 2 stage"):
        split_model(llama(layers=2), 4, "auto")
    model = gpt2()
    assert not getattr(model.config, "base_model_pp_plan", None), "GPT-2 has a plan now: pick a model without one"
    with pytest.raises(ConfigError, match="GPT2LMHeadModel is a Hugging Face model without a pipeline plan"):
        split_model(model, 2, "auto")
    tied = llama()
    tied.lm_head.weight = tied.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="lm_head.weight is shared by stages 1 and 2 \\(tied weights\\)"):
        split_model(tied, 2, "auto")


def out_of_memory_in_a_decoder_layer(rank, world):
    """``auto`` on a per-device batch of 8 (1F1B over 2 ranks starts at 2 rows, A = 4): the last
    stage's decoder layer runs out of memory above 1 row, so every rank shrinks to 1, A = 8."""
    model, batches = llama(), token_batches(2, 8)
    expected = reference_run(model, batches)
    settings = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
                "pipeline": {"stages": 2, "schedule": "1f1b", "split": "auto"},
                "distributed": {"agreement_timeout_seconds": 60, "timeout_seconds": 60}}
    eng = engine.initialize(copy.deepcopy(model), settings, optimizer=sgd)

    def trip(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[0] > 1:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {hidden.shape[0]} MiB")

    for name, module in eng.module.named_modules():  # the layer only the last stage holds
        if name.endswith("layers.3") and rank == 1:
            module.register_forward_pre_hook(trip, with_kwargs=True)
    for batch in batches:
        eng.train_batch(batch, token_sum)
    result = {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
              "plan": (eng.plan.train_micro_batch_size_per_gpu, eng.plan.gradient_accumulation_steps)}
    eng.close()
    return result


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_an_out_of_memory_in_a_stage_cut_by_the_plan_shrinks_every_rank_under_auto():
    """The stage a Hugging Face plan builds runs its forward through the failure guard too: no
    rank is left waiting for the one that failed, and the result is the reference's."""
    (first, last) = run_scenarios({"auto": out_of_memory_in_a_decoder_layer}, world_size=2, timeout=200)["auto"]
    for result in (first, last):
        assert result["plan"] == (1, 8) and result["diff"] < TOL, result
