"""Tensor parallelism (DTensor, composed with FSDP2 on one mesh) against the float64
full-batch reference: tensor 2 on 2 ranks, tensor 2 × data 2 on 4 ranks, at ZeRO 0 and 3.

The model is Llama-shaped (tests/support/tp_models.py): attention split by heads, an MLP split
column → row, an embedding split by vocabulary, an LM head gathered, replicated norms. Each
set of ranks runs every scenario once; a broken plan (the column-split layers' input
gradients not all-reduced, so the replicated norms get partial gradients) must miss the
tolerance: its replicas drift apart, which full_state_dict() refuses.
"""

import copy
import functools
import importlib.util
import logging

import pytest
import torch

import engine
from engine.batching.microbatch import split_batch
from engine.config.schema import load_config
from engine.errors import ConfigError, EngineUsageError
from engine.strategies.tensor_plan import mlp_pairs, model_plan, resolve_plan
from tests.support.broken import unreduced_replicated_gradients
from tests.support.dist_utils import run_scenarios
from tests.support.reference import (
    max_param_diff, mlp, mse, rank_slice, reference_train, regression_batches, sgd, state, token_batches,
    token_loss_mean, token_loss_sum,
)
from tests.support.oom_models import tripwire_mlp
from tests.support.lm_models import loss_sum_and_count, padded_batch, token_mean
from tests.support.tp_models import PLAN, TinyTransformer, TinyTransformerLM

TOL = 1e-10
MISSED = 1e-4


def config(stage, tensor, global_batch=8, micro=2, **extra):
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
            "zero_optimization": {"stage": stage}, "tensor_parallel": {"size": tensor, "plan": PLAN}, **extra}


def lm_batches(steps, global_batch):
    """Token batches whose samples hold different numbers of valid labels: for (sum, count) losses."""
    return token_batches(steps, global_batch, vocab=12)


def dense_lm_batches(steps, global_batch):
    """Every label valid: a micro-batch's mean over tokens is its mean over samples."""
    batches = lm_batches(steps, global_batch)
    for batch in batches:
        batch["labels"] = torch.where(batch["labels"] == -100, (batch["tokens"] + 1) % 12, batch["labels"])
    return batches


# -- scenarios: each runs on every rank ---------------------------------------------------------
def clipped_mean(rank, world, stage, broken=False):
    """Mean losses, strict plan, clipping on the global norm every window."""
    tensor_plan = unreduced_replicated_gradients(PLAN) if broken else None
    model, batches = TinyTransformer(), dense_lm_batches(3, 8)
    ref = copy.deepcopy(model)
    optimizer = sgd(ref.parameters())
    expected_norms = []
    for batch in batches:
        optimizer.zero_grad()
        token_loss_mean(ref, batch).backward()
        expected_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        optimizer.step()
    eng = engine.initialize(copy.deepcopy(model), config(stage, 2, gradient_clipping=0.5), optimizer=sgd,
                            tensor_plan=tensor_plan)
    norms = []
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), token_loss_mean)
        norms.append(float(eng.last_window.step.grad_norm))
    try:
        full = eng.full_state_dict()
    except EngineUsageError as error:  # broken: the drifted replicas are found by the engine itself
        return {"diff": float("inf"), "refused": str(error)}
    return {"diff": max_param_diff(full, state(ref)), "norms": norms, "expected_norms": expected_norms,
            "keys": list(full), "model_keys": list(model.state_dict()), "strategy": eng.strategy.name,
            "plan_world": eng.plan.world_size, "plan_rank": eng.plan.rank}


def balanced_tokens(rank, world, stage):
    """(sum, count) losses on a balanced plan: 7 sequences over the data ranks, unequal micro-batches."""
    model, batches = TinyTransformer(), lm_batches(3, 7)
    expected = reference_train(model, batches, token_loss_mean, sgd)
    eng = engine.initialize(copy.deepcopy(model), config(stage, 2, global_batch=7, batch_split="balanced"),
                            optimizer=sgd)
    losses = [eng.train_batch(rank_slice(batch, eng.plan), token_loss_sum) for batch in batches]
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "loss0": losses[0],
            "expected_loss0": token_loss_mean(model, batches[0]).item(), "samples": eng.global_samples}


def short_windows(rank, world, stage, defer=False):
    """A manual-loop window closed early by flush, then a short last batch in train_batch
    (``defer``: zero_optimization.defer_reduction, one reduction per window)."""
    model, batches = TinyTransformer(), lm_batches(3, 8)
    flushed = {k: v[:4] for k, v in batches[1].items()}
    short = {k: v[:6] for k, v in batches[2].items()}
    expected = reference_train(model, [batches[0], flushed, short], token_loss_mean, sgd)
    cfg = config(stage, 2, global_batch=8, micro=2)
    cfg["zero_optimization"]["defer_reduction"] = defer
    eng = engine.initialize(copy.deepcopy(model), cfg, optimizer=sgd)
    data = eng.plan.world_size
    for micro_batch in split_batch(rank_slice(batches[0], eng.plan), eng.plan.micro_batch_sizes):
        eng.backward(token_loss_sum(eng, micro_batch))
        eng.step()
    n = 4 // data
    local = {k: v[n * eng.plan.rank:n * (eng.plan.rank + 1)] for k, v in flushed.items()}
    for micro_batch in split_batch(local, (2,) * (n // 2)):
        eng.backward(token_loss_sum(eng, micro_batch))
        eng.step()
    eng.step(flush=True)
    n = 6 // data
    eng.train_batch({k: v[n * eng.plan.rank:n * (eng.plan.rank + 1)] for k, v in short.items()}, token_loss_sum)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "samples": eng.global_samples}


def fp16_overflow(rank, world, stage):
    """fp16 on an fp32 MLP split by the automatic plan: a window holding an inf is discarded
    whole on every rank (no step, no scheduler step); the others match the reference."""
    model = mlp(dtype=torch.float32)
    batches = regression_batches(3, 8, dtype=torch.float32)
    batches[1][0][3, 0] = float("inf")
    doubled = [tuple(t.double() for t in batches[i]) for i in (0, 2)]
    expected = reference_train(copy.deepcopy(model).double(), doubled, mse, sgd)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "tensor_parallel": {"size": 2}, "fp16": {"enabled": True}}
    eng = engine.initialize(copy.deepcopy(model), cfg, optimizer=sgd)
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), mse)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "skipped": eng.skipped_steps,
            "steps": eng.global_steps}


def different_batches(rank, world, stage):
    """Each rank slices the data by its global rank (a script unaware of the tensor group)."""
    model, batch = TinyTransformer(), lm_batches(1, 16)[0]
    eng = engine.initialize(copy.deepcopy(model), config(stage, 2, global_batch=8, micro=2), optimizer=sgd)
    n = eng.plan.per_device_batch_size
    mine = {k: v[n * rank:n * (rank + 1)] for k, v in batch.items()}  # wrong: rank, not eng.plan.rank
    before = eng.full_state_dict()
    try:
        eng.train_batch(mine, token_loss_sum)
    except EngineUsageError as error:
        unchanged = max_param_diff(eng.full_state_dict(), before) == 0
        return {"error": str(error), "unchanged": unchanged}
    return {"error": None}


def batches_helper(rank, world, stage):
    """eng.batches() hands the ranks of one tensor group the same batch: exact."""
    model, batches = TinyTransformer(), lm_batches(2, 8)
    dataset = [{k: v[i] for k, v in batch.items()} for batch in batches for i in range(8)]
    expected = reference_train(model, batches, token_loss_mean, sgd)
    eng = engine.initialize(copy.deepcopy(model), config(stage, 2), optimizer=sgd)
    for batch in eng.batches(dataset, shuffle=False):
        eng.train_batch(batch, token_loss_sum)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "steps": eng.global_steps}


def resumed_on_another_mesh(rank, world, stage, directory, tensor_after, stage_after):
    """Two windows on tensor 2, a checkpoint, then a new engine on another tensor size (and
    so another data size) loads it and trains the third window: the reference's three steps."""
    model, batches = TinyTransformer(), lm_batches(3, 8)
    expected = reference_train(model, batches, token_loss_mean, torch.optim.AdamW)
    eng = engine.initialize(copy.deepcopy(model), config(stage, 2), optimizer=torch.optim.AdamW)
    for batch in batches[:2]:
        eng.train_batch(rank_slice(batch, eng.plan), token_loss_sum)
    eng.save_checkpoint(directory)
    eng.close()
    cfg = config(stage_after, tensor_after)
    if tensor_after == 1:
        del cfg["tensor_parallel"]
    resumed = engine.initialize(TinyTransformer(seed=5), cfg, optimizer=torch.optim.AdamW)
    resumed.load_checkpoint(directory)
    resumed.train_batch(rank_slice(batches[2], resumed.plan), token_loss_sum)
    return {"diff": max_param_diff(resumed.full_state_dict(), state(expected)), "steps": resumed.global_steps,
            "data": resumed.plan.world_size}


def deepspeed_facade(rank, world, stage):
    """DeepSpeed's facade reports the data-parallel view, as DeepSpeed does under AutoTP."""
    from engine.compat import deepspeed as ds

    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "tensor_parallel": {"autotp_size": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    eng, *_ = ds.initialize(model=mlp(), config=cfg)
    return {"world_size": eng.world_size, "train_batch_size": eng.train_batch_size(),
            "accumulation": eng.gradient_accumulation_steps()}


def colossal_facade(rank, world):
    """Colossal-AI's gpc answers per parallel mode under parallel = dict(tensor=dict(size=2, mode='1d'))."""
    from engine.compat import colossalai

    colossalai.launch_from_torch(config={"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, verbose=False)
    return {mode: colossalai.gpc.get_world_size(mode) for mode in ("data", "tensor", "global", "pipeline")}


def automatic_micro_size(rank, world, stage, where):
    """train_micro_batch_size_per_gpu: auto; the second tensor group (its two ranks alike) runs
    out of memory above 2 rows: every rank shrinks together and the result stays exact."""
    batches = regression_batches(3, 16)
    expected = reference_train(tripwire_mlp(), batches, mse, sgd)
    model = tripwire_mlp(max_micro=2, ranks=(world - 2, world - 1), where=where)
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": stage},
           "tensor_parallel": {"size": 2}}
    eng = engine.initialize(model, cfg, optimizer=sgd)
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), mse)
    changes = eng.micro_batch_tuner.changes
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "micro": eng.plan.micro_batch_sizes,
            "failed_ranks": changes[0]["ranks"] if changes else None}


def token_budget_and_monitor(rank, world, stage, directory):
    """micro_batch_tokens (micro-batches formed by padded tokens) with the monitor on: exact,
    and the monitor's loss, samples and tokens count every data rank once."""
    lengths = [[6, 2, 1, 5, 3, 6, 2, 4], [1, 6, 2, 2, 5, 3, 6, 1]]
    batches = [padded_batch(row, 6, seed=i) for i, row in enumerate(lengths)]
    model = TinyTransformerLM()
    expected = reference_train(model, batches, token_mean, sgd)
    cfg = {"train_batch_size": 8, "micro_batch_tokens": 12, "zero_optimization": {"stage": stage},
           "tensor_parallel": {"size": 2, "plan": PLAN},
           "monitor": {"enabled": True, "progress": False, "jsonl": f"{directory}/metrics.jsonl"}}
    eng = engine.initialize(copy.deepcopy(model), cfg, optimizer=sgd)
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), loss_sum_and_count)
    history = eng.monitor.history
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
            "losses": [r["loss"] for r in history], "samples": [r["samples"] for r in history],
            "tokens": [r.get("real_tokens") for r in history],
            "expected_losses": [token_mean(model, batches[0]).item()]}


def scenarios(world, directory):
    found = {}
    for stage in (1, 2):
        found[("clipped mean", stage)] = functools.partial(clipped_mean, stage=stage)
        found[("balanced tokens", stage)] = functools.partial(balanced_tokens, stage=stage)
    for stage in (0, 3):
        found[("clipped mean", stage)] = functools.partial(clipped_mean, stage=stage)
        found[("balanced tokens", stage)] = functools.partial(balanced_tokens, stage=stage)
        found[("short windows", stage)] = functools.partial(short_windows, stage=stage)
        found[("fp16 overflow", stage)] = functools.partial(fp16_overflow, stage=stage)
        found[("broken", stage)] = functools.partial(clipped_mean, stage=stage, broken=True)
    found["short windows, deferred"] = functools.partial(short_windows, stage=3, defer=True)
    found["different batches"] = functools.partial(different_batches, stage=3 if world == 4 else 0)
    found["batches()"] = functools.partial(batches_helper, stage=0)
    found["facade"] = functools.partial(deepspeed_facade, stage=0)
    found["colossal facade"] = colossal_facade
    for stage, where in ((0, "forward"), (3, "backward")):
        found[("auto", stage)] = functools.partial(automatic_micro_size, stage=stage, where=where)
    found["tokens + monitor"] = functools.partial(token_budget_and_monitor, stage=3, directory=directory)
    if world == 4:  # tensor 2 × data 2 → tensor 4 × data 1 and tensor 1 × data 4
        found["resume tensor 4"] = functools.partial(resumed_on_another_mesh, stage=3, directory=f"{directory}/a",
                                                     tensor_after=4, stage_after=1)
        found["resume data 4"] = functools.partial(resumed_on_another_mesh, stage=0, directory=f"{directory}/b",
                                                   tensor_after=1, stage_after=3)
    else:  # tensor 2 → tensor 1 × data 2
        found["resume data 2"] = functools.partial(resumed_on_another_mesh, stage=3, directory=f"{directory}/a",
                                                   tensor_after=1, stage_after=0)
    return found


def check(results, world):
    data = world // 2
    for stage in (0, 1, 2, 3):
        for rank, result in enumerate(results[("clipped mean", stage)]):
            assert result["diff"] < TOL, (stage, rank, result["diff"])
            assert result["norms"] == pytest.approx(result["expected_norms"], rel=1e-10)
            assert all(norm > 0.5 for norm in result["expected_norms"])  # clipping acted
            assert result["keys"] == result["model_keys"]  # the model's own names, whole
            assert (result["plan_world"], result["plan_rank"]) == (data, rank // 2)
            assert result["strategy"] == ("replicas", "replicas", "fsdp", "fsdp")[stage]
        for result in results[("balanced tokens", stage)]:
            assert result["diff"] < TOL and result["samples"] == 21
            assert result["loss0"] == pytest.approx(result["expected_loss0"], rel=1e-12)
    for stage in (0, 3):
        for result in results[("short windows", stage)]:
            assert result["diff"] < TOL and result["samples"] == 8 + 4 + 6
        for result in results[("fp16 overflow", stage)]:
            assert result["skipped"] == 1 and result["steps"] == 3
            assert result["diff"] < 2e-4, result["diff"]
        for result in results[("broken", stage)]:  # replicas drift apart: full_state_dict() refuses them
            assert result["diff"] > MISSED, (stage, result["diff"])
            assert "replicated parameters differ between the ranks of a tensor group" in result["refused"]
    for result in results["short windows, deferred"]:
        assert result["diff"] < TOL and result["samples"] == 8 + 4 + 6
    for result in results["different batches"]:
        assert result["error"] is not None and "different inputs" in result["error"], result
        assert "ranks 0..1 (data index 0)" in result["error"] and "eng.plan.rank" in result["error"]
        assert result["unchanged"]
    for result in results["batches()"]:
        assert result["diff"] < TOL and result["steps"] == 2
    for result in results["facade"]:
        assert result == {"world_size": data, "train_batch_size": 8, "accumulation": 4 // data}
    for result in results["colossal facade"]:
        assert result == {"data": data, "tensor": 2, "global": world, "pipeline": 1}
    for stage in (0, 3):
        for result in results[("auto", stage)]:
            assert result["diff"] < TOL and result["failed_ranks"] == [world - 2, world - 1], result
            assert result["micro"] == (2,) * (8 // data), result
    for result in results["tokens + monitor"]:
        assert result["diff"] < TOL, result["diff"]
    recorded = results["tokens + monitor"][0]  # rank 0 records
    assert recorded["samples"] == [8, 8]
    assert recorded["losses"][0] == pytest.approx(recorded["expected_losses"][0], rel=1e-12)
    assert recorded["tokens"] == [sum([6, 2, 1, 5, 3, 6, 2, 4]), sum([1, 6, 2, 2, 5, 3, 6, 1])]
    for name in [key for key in results if isinstance(key, str) and key.startswith("resume")]:
        for result in results[name]:
            assert result["diff"] < TOL and result["steps"] == 3, (name, result)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tensor_2_on_two_ranks_equals_the_full_batch_reference(tmp_path):
    check(run_scenarios(scenarios(2, str(tmp_path)), world_size=2, timeout=360), 2)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_tensor_2_by_data_2_on_four_ranks_equals_the_full_batch_reference(tmp_path):
    check(run_scenarios(scenarios(4, str(tmp_path)), world_size=4, timeout=560), 4)


# -- a Hugging Face Llama with its own plan -------------------------------------------------------
def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).double()


def hf_loss_sum(model, batch):
    logits = model(batch["tokens"]).logits
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                             reduction="sum")
    return loss, (labels != -100).sum()


def hf_loss_mean(model, batch):
    loss, count = hf_loss_sum(model, batch)
    return loss / count


def hugging_face(rank, world):
    model, batches = hf_llama(), token_batches(2, 4, vocab=16)
    expected = reference_train(model, batches, hf_loss_mean, sgd)
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"size": 2}}
    eng = engine.initialize(copy.deepcopy(model), cfg, optimizer=sgd)
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), hf_loss_sum)
    split = sorted(name for name, p in eng.module.named_parameters() if type(p.data).__name__ == "DTensor")
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "split": split}


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hugging_face_llama_with_its_own_plan_equals_the_full_batch_reference():
    results = run_scenarios({"llama": hugging_face}, world_size=2, timeout=200)["llama"]
    for result in results:
        # Llama's RMSNorm normalises in float32: the row-split layers sum their pieces in another
        # order than one process does, and that last-bit difference survives the float32 rounding
        # (measured 3.5e-9 after two steps; a wrong gradient misses by 1e-3 and more, as above).
        assert result["diff"] < 1e-7, result["diff"]
        assert "model.layers.0.self_attn.q_proj.weight" in result["split"]
        assert "model.embed_tokens.weight" in result["split"] and "lm_head.weight" in result["split"]
        assert "model.norm.weight" not in result["split"]


# -- plans, without processes ------------------------------------------------------------------
def test_auto_plan_pairs_the_linears_of_a_sequential_mlp():
    assert mlp_pairs(mlp()) == {"0": "colwise", "2": "rowwise"}
    assert mlp_pairs(TinyTransformer()) == {f"layers.{i}.mlp.{j}": style for i in range(2)
                                            for j, style in ((0, "colwise"), (2, "rowwise"))}


def test_an_auto_plan_says_which_layers_it_split(caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        resolve_plan(TinyTransformer(), "auto", 2)
    assert ("tensor_parallel.plan auto: from its Sequential MLPs (Linear, activation, Linear), 4 layer(s) split over 2 "
            "ranks: layers.0.mlp.0 colwise, layers.0.mlp.2 rowwise, layers.1.mlp.0 colwise, layers.1.mlp.2 rowwise"
            in caplog.text)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine"):
        resolve_plan(TinyTransformer(), {"head": "colwise_rep"}, 2)  # names the user wrote: nothing to say
    assert "tensor_parallel.plan auto" not in caplog.text


def test_a_model_plan_is_read_under_its_base_model_prefix():
    class Config:
        base_model_tp_plan = {"layers.*.attn.q": "colwise"}

    class Wrapper(torch.nn.Module):
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.model, self.config = TinyTransformer(), Config()

    assert model_plan(Wrapper()) == {"model.layers.*.attn.q": "colwise"}
    assert model_plan(TinyTransformer()) is None


def test_a_layer_that_cannot_be_split_is_named():
    with pytest.raises(ConfigError) as raised:
        resolve_plan(TinyTransformer(width=12, heads=3), PLAN, 2)
    text = str(raised.value)
    assert ("layers.0.attn.q: its 3 heads (12 output features / head_dim 4) do not divide into tensor size 2"
            in text)
    with pytest.raises(ConfigError, match=r"head: its 3 output features cannot be split over tensor size 5 "
                                          r"\(colwise_rep\): every rank needs at least one"):
        resolve_plan(TinyTransformer(vocab=3, width=10, heads=5), {"head": "colwise_rep"}, 5)
    assert list(resolve_plan(TinyTransformer(vocab=13), {"head": "colwise_rep"}, 2)) == ["head"]  # 7 + 6 rows
    with pytest.raises(ConfigError, match=r"layers.0.norm1: style colwise splits Linear and Embedding layers; "
                                          r"layers.0.norm1 is a LayerNorm"):
        resolve_plan(TinyTransformer(), {"layers.*.norm1": "colwise"}, 2)
    with pytest.raises(ConfigError, match=r"'layers.\*.ffn' matches no module of TinyTransformer"):
        resolve_plan(TinyTransformer(), {"layers.*.ffn": "colwise"}, 2)
    with pytest.raises(ConfigError, match=r"unknown style 'columnwise'"):
        resolve_plan(TinyTransformer(), {"head": "columnwise"}, 2)
    tied = TinyTransformer()
    tied.head.weight = tied.embed.weight
    with pytest.raises(ConfigError, match=r"embed.weight and head.weight are one tied parameter; splitting "
                                          r"embed or head would untie it"):
        resolve_plan(tied, PLAN, 2)
    with pytest.raises(ConfigError, match=r"auto found no plan for Attention"):
        resolve_plan(TinyTransformer().layers[0].attn, "auto", 2)


# -- config --------------------------------------------------------------------------------------
def test_deepspeed_autotp_size_is_read_as_the_tensor_size():
    loaded = load_config({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 2}})
    assert loaded.tensor_parallel.size == 2 and loaded.tensor_parallel.plan == "auto"
    with pytest.raises(ConfigError, match="autotp_size: 4 conflicts with tensor_parallel.size: 2"):
        load_config({"tensor_parallel": {"autotp_size": 4, "size": 2}})
    with pytest.warns(UserWarning, match=r"tensor_parallel.tp_overlap_comm are not used by the torch backend"):
        load_config({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": False}})


def test_tensor_parallel_refusals_name_the_fix():
    from engine.config.checks import check_without_model

    problems = check_without_model(load_config({"tensor_parallel": {"size": 2}, "backend": "deepspeed"}))
    assert any("tensor_parallel.size: 2: tensor parallelism runs on backend: torch" in p for p in problems)
    with pytest.raises(ConfigError, match=r"tensor_parallel.plan: expected 'auto' or a mapping"):
        load_config({"tensor_parallel": {"plan": "megatron"}})


def test_the_planner_counts_data_parallel_ranks_and_names_the_mesh():
    from engine.batching.mesh_plan import plan_for_mesh
    from engine.config.setup import mesh_layout

    loaded = load_config({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"size": 2}})
    named = (r"world 8 = pipeline 1 × data 4 × context 1 × tensor 2: the batch is planned for W_dp = 8 / \(pipeline 1 × "
             r"context 1 × tensor 2\) = 4 data-parallel rank\(s\).*train_batch_size 6 is not divisible by world size 4")
    with pytest.raises(engine.BatchConfigError, match=named):
        plan_for_mesh(loaded, mesh_layout(loaded, 8), 0)
    plan = plan_for_mesh(loaded, mesh_layout(loaded, 6), 4)  # global rank 4: data rank 2
    assert (plan.world_size, plan.rank, plan.gradient_accumulation_steps) == (3, 2, 2)


def test_plan_command_shows_the_mesh(tmp_path, capsys):
    from engine.cli import main

    path = tmp_path / "tp.yaml"
    path.write_text("train_batch_size: 8\ntrain_micro_batch_size_per_gpu: 2\ntensor_parallel: {size: 2}\n")
    assert main(["plan", str(path), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "mesh: world 4 = pipeline 1 × data 2 × context 1 × tensor 2" in out
    assert "world size:         2" in out and "accumulation steps: 2" in out
    assert main(["validate", str(path)]) == 0
    assert "zero stage 0, tensor parallel 2, backend torch" in capsys.readouterr().out


def test_a_plan_without_a_tensor_size_is_not_silently_ignored(caplog):
    with caplog.at_level("WARNING", logger="engine"):
        engine.initialize(mlp(), {"train_batch_size": 4}, optimizer=sgd, tensor_plan={"0": "colwise"})
    assert "tensor_parallel.size is 1: nothing is split" in caplog.text
