"""Nothing silent on a mesh (issue 33): what a pipeline, a tensor plan or a precision setting
cannot do as asked is refused at ``initialize``, naming the module, the parameters or the schedule
and the fix, on every rank; what it can do, it does exactly.

- a pipeline rank whose stages hold no parameters (an activation alone) saves and resumes its
  (empty) share of the checkpoints, equal to the full-batch reference;
- an interleaved schedule on too few modules: the advice counts the schedule's stages per rank;
- bf16 where it runs as autocast (a pipeline, a tensor mesh, ``torch_autocast``) on a float64
  model, which autocast leaves in float64 while one process computes it in bf16;
- a tensor plan that changes what a module computes (heads counted by ``num_heads`` without a
  ``head_dim``, a fused qkv split colwise), found by running the split model against the whole
  one on a probe input;
- a vocabulary that does not divide by the tensor size trains exactly (uneven shards), and its
  checkpoint holds the whole vocabulary.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

import engine
from engine.errors import ConfigError
from engine.pipeline.split import cut, sequence_of
from tests.support.dist_utils import run_scenarios
from examples.gpt import GPT, GPTConfig
from tests.support.reference import (max_param_diff, mlp, mse, rank_slice, reference_train, regression_batches, sgd, state,
                             token_batches)
from tests.support.tp_models import PLAN, Attention, TinyTransformer


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
        assert found["bf16 float64"].startswith("bf16.enabled: under world 2 = pipeline 2 × "), found["bf16 float64"]
        assert "tensor 1, bf16 is autocast, which computes in bf16 only what is float32" in found["bf16 float64"]
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
    try:  # fp32 labels, as the copy's outputs (torch 2.11's mse_loss backward refuses fp32 against float64)
        eng.train_batch(regression_batches(1, 4, dtype=torch.float32)[0], mse)
        assert eng.global_steps == 1
    finally:
        eng.close()


# -- tensor plans: checked against the whole model; uneven vocabularies -------------------------
def tensor_config(plan, **extra):
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "tensor_parallel": {"size": 2, "plan": plan}, **extra}


class NumHeadsAttention(Attention):
    """Heads by count, without a head_dim attribute: ``view(b, s, num_heads, -1)``."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, self.num_heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        attended = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.o(attended.transpose(1, 2).reshape(b, s, -1))


def heads_by_count(heads=3, width=12):
    model = TinyTransformer(width=width, heads=heads)
    for layer in model.layers:
        layer.attn.__class__ = NumHeadsAttention
        layer.attn.num_heads = heads
        del layer.attn.head_dim
    return model


def token_loss(model, batch):
    logits = model(batch["tokens"])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


def tensor_refusals(rank, world):
    gpt = GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=4, n_embd=16))
    gpt.head.weight = torch.nn.Parameter(gpt.head.weight.detach().clone())  # untied, so the plan may split it
    return {"heads by count": refused(heads_by_count(), tensor_config(PLAN)),
            "fused qkv": refused(gpt, tensor_config({"blocks.*.attn.qkv": "colwise", "blocks.*.attn.out": "rowwise"})),
            "heads by head_dim": refused(TinyTransformer(), tensor_config(PLAN))}


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_tensor_plan_that_changes_what_a_module_computes_is_refused_naming_it():
    """3 heads counted by num_heads (no head_dim) on tensor 2: each rank would compute 3 heads of
    the wrong width; the GPT's fused qkv split colwise fails inside the model. Both are refused
    at initialize naming the attention module; heads found by head_dim split whole, and run."""
    for found in run_scenarios({"refusals": tensor_refusals}, world_size=2, timeout=140)["refusals"]:
        assert "tensor_parallel.plan: layers.0.attn (layers.0.attn.q, layers.0.attn.k, layers.0.attn.v, " \
               "layers.0.attn.o split): its output on a probe input changes by" in found["heads by count"], found
        assert ("tensor_parallel.plan: blocks.0.attn (blocks.0.attn.qkv, blocks.0.attn.out split): its forward "
                "fails once split: RuntimeError: shape" in found["fused qkv"]), found["fused qkv"]
        assert found["heads by head_dim"] == ""


def padded_vocabulary(model, rows):
    """``model`` with its vocabulary padded to ``rows`` by rows of zeros (embedding and head)."""
    padded = TinyTransformer(vocab=rows)
    padded.load_state_dict({name: torch.cat([value, value.new_zeros(rows - value.shape[0], *value.shape[1:])])
                            if name.startswith(("embed", "head")) else value
                            for name, value in model.state_dict().items()})
    return padded


def uneven_vocabulary(rank, world, directory, broken=False):
    """A vocabulary of 13 rows on tensor 2 (7 + 6) against the full-batch reference; ``broken``:
    padded to 14 rows of zeros instead, whose padding row takes a share of every softmax."""
    model, batches = TinyTransformer(vocab=13), token_batches(3, 8, vocab=13, dense=True)
    expected = reference_train(model, batches, token_loss, sgd)
    trained = padded_vocabulary(model, 14) if broken else copy.deepcopy(model)
    eng = engine.initialize(trained, tensor_config(PLAN), optimizer=sgd)
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), token_loss)
    full = {name: value[:13] if name.startswith(("embed", "head")) else value
            for name, value in eng.full_state_dict().items()}
    if not broken:
        eng.save_checkpoint(directory)
    eng.close()
    return {"diff": max_param_diff(full, state(expected)), "full": full}


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_vocabulary_that_does_not_divide_by_the_tensor_size_trains_exactly(tmp_path):
    results = run_scenarios({
        "uneven": functools.partial(uneven_vocabulary, directory=str(tmp_path / "uneven")),
        "padded (broken)": functools.partial(uneven_vocabulary, directory="", broken=True)},
        world_size=2, timeout=140)
    for result in results["uneven"]:
        assert result["diff"] < 1e-12, result["diff"]
    assert all(result["diff"] > 1e-4 for result in results["padded (broken)"])
    # the checkpoint holds the whole 13-row vocabulary: one process loads it unchanged
    eng = engine.initialize(TinyTransformer(vocab=13), {"train_batch_size": 8}, optimizer=sgd)
    try:
        eng.load_checkpoint(tmp_path / "uneven")
        loaded = eng.full_state_dict()
    finally:
        eng.close()
    assert loaded["head.weight"].shape == (13, 8) and loaded["embed.weight"].shape == (13, 8)
    assert max_param_diff(loaded, results["uneven"][0]["full"]) == 0.0


# -- every rank of a replica sees the same batch, at every window --------------------------------
def by_global_rank(batch, rank, world):
    """A script's mistake: this rank's share of the global batch by its global rank."""
    share = batch[0].shape[0] // world if isinstance(batch, tuple) else batch["tokens"].shape[0] // world
    pick = slice(rank * share, (rank + 1) * share)
    return tuple(t[pick] for t in batch) if isinstance(batch, tuple) else {k: v[pick] for k, v in batch.items()}


def pipeline_given_different_batches(rank, world):
    """Pipeline 2 on 2 ranks: one data index, so both stages must get the whole batch; sliced by
    global rank, stage 0 gets one half's inputs and stage 1 the other half's labels."""
    eng = engine.initialize(mlp(), pipeline_config(), optimizer=sgd)
    batch = regression_batches(1, 8)[0]
    try:
        eng.train_batch(by_global_rank(batch, rank, world), engine.loss_on_outputs(torch.nn.functional.mse_loss))
        found = "trained"
    except engine.EngineUsageError as error:
        found = str(error)
    result = {"found": found, "steps": eng.global_steps, "samples": eng.global_samples}
    eng.train_batch(batch, engine.loss_on_outputs(torch.nn.functional.mse_loss))  # usable after the refusal
    result["then"] = (eng.global_steps, eng.global_samples)
    eng.close()
    return result


def tensor_given_different_batches_late(rank, world):
    """Tensor 2 on 2 ranks: three windows of the same batch, then one sliced by global rank."""
    eng = engine.initialize(TinyTransformer(), tensor_config(PLAN), optimizer=sgd)
    batches = token_batches(4, 8, dense=True, vocab=12)
    found = "trained"
    try:
        for step, batch in enumerate(batches):
            eng.train_batch(batch if step < 3 else by_global_rank(batch, rank, world), token_loss)
    except engine.EngineUsageError as error:
        found = str(error)
    result = {"found": found, "steps": eng.global_steps}
    eng.close()
    return result


def manual_loop_given_different_batches_late(rank, world):
    """Tensor 2 on 2 ranks, the manual loop (eng(x), backward, step): the same micro-batches for two
    windows and the first micro-batch of the third, then rank 1's sixth one differs (issue 45: the
    input check of the first steps alone let it train)."""
    config = tensor_config(PLAN)
    config["tensor_parallel"]["check_batches"] = 1  # the first step's input check: the sixth micro-batch is past it
    eng = engine.initialize(TinyTransformer(), config, optimizer=sgd)
    batches = token_batches(3, 8, dense=True, vocab=12)
    found, micro = "trained", eng.plan.micro_batch_sizes[0]
    try:
        for step, batch in enumerate(batches):
            for k in range(eng.plan.gradient_accumulation_steps):
                piece = {key: value[k * micro:(k + 1) * micro] for key, value in batch.items()}
                if step == 2 and k == 1 and rank == 1:
                    piece = {key: value.flip(0) for key, value in piece.items()}
                eng.backward(token_loss(eng, piece))
                eng.step()
    except engine.EngineUsageError as error:
        found = str(error)
    result = {"found": found, "steps": eng.global_steps}
    eng.close()
    return result


def replicas_drifted(rank, world, directory):
    """Tensor 2: rank 1's copy of a replicated parameter (a rowwise layer's bias) changed by hand;
    full_state_dict() and a checkpoint refuse to keep one rank's copy."""
    eng = engine.initialize(TinyTransformer(), tensor_config(PLAN), optimizer=sgd)
    eng.train_batch(token_batches(1, 8, dense=True, vocab=12)[0], token_loss)
    if rank == 1:
        with torch.no_grad():
            eng.module.layers[0].attn.o.bias.add_(1e-2)
    found = {}
    try:
        eng.full_state_dict()
    except engine.EngineUsageError as error:
        found["full_state_dict"] = str(error)
    try:
        eng.save_checkpoint(directory)
    except engine.CheckpointError as error:
        found["save"] = str(error)
    eng.close()
    return found


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_every_rank_of_a_replica_is_checked_to_see_the_same_batch_at_every_window(tmp_path):
    results = run_scenarios({
        "pipeline": pipeline_given_different_batches,
        "tensor, fourth window": tensor_given_different_batches_late,
        "manual loop, third window": manual_loop_given_different_batches_late,
        "replicas": functools.partial(replicas_drifted, directory=str(tmp_path / "drifted"))},
        world_size=2, timeout=190)
    for result in results["pipeline"]:
        assert "the ranks of one data index (pipeline: 2 ranks, one model replica) were given different batches" \
            in result["found"], result
        assert "eng.plan.rank" in result["found"] and "The window was not applied" in result["found"]
        assert (result["steps"], result["samples"]) == (0, 0)  # not counted as a short window either
        assert result["then"] == (1, 8)
    for result in results["tensor, fourth window"]:  # the first steps' input check alone missed it
        assert "(tensor: 2 ranks, one model replica) were given different batches" in result["found"], result
        assert result["steps"] == 3
    for result in results["manual loop, third window"]:  # every micro-batch, compared at the close
        assert "(tensor: 2 ranks, one model replica) were given different batches" in result["found"], result
        assert result["steps"] == 2
    for found in results["replicas"]:
        assert "full_state_dict(): replicated parameters differ between the ranks of a tensor group " \
               "(layers.0.attn.o.bias)" in found["full_state_dict"], found
        assert "saving a checkpoint: replicated parameters differ" in found["save"] and "nothing was published" \
            in found["save"], found
    assert not (tmp_path / "drifted").exists()
