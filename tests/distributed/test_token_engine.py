"""micro_batch_tokens through the engine: config and plan, train_batch / eval_batch split by
tokens equal to the full-batch update (float64), ranks that agree on their micro-steps,
the monitor's token report, and auto / explore moving the token budget."""

from __future__ import annotations

import copy
import functools
import logging
import time

import pytest
import torch

import engine
from engine.cli import main as cli_main
from engine.batching.token_budget import TokenBudgetError, group_by_tokens, token_cost
from tests.support.dist_utils import run_scenarios
from tests.support.oom_models import TokenTripwire
from tests.support.reference import max_param_diff, rank_slice, reference_train, sgd, state
from tests.support.lm_models import STEPS, TinyCausalLM, lm_batches, loss_sum_and_count, padded_batch, token_mean

TOL = 1e-10


def mean_per_micro_batch(model, batch):
    """The common mistake: each micro-batch's own token mean, then weighted by its rows."""
    return token_mean(model, batch)


def tiny_lm():
    torch.manual_seed(0)
    return TinyCausalLM().double()


def token_engine(model, tokens=20, global_batch=8, lengths=None, **extra):
    config = {"train_batch_size": global_batch, "micro_batch_tokens": tokens, **extra}
    return engine.initialize(model, config, optimizer=sgd, loss_fn=loss_sum_and_count, lengths=lengths)


# -- plan and config ---------------------------------------------------------------------------
def test_the_plan_fixes_the_global_batch_and_caps_rows():
    plan = engine.resolve_batch_plan(2, 16, micro_batch_tokens=4096)
    assert (plan.micro_batch_tokens, plan.train_micro_batch_size_per_gpu, plan.gradient_accumulation_steps) == (4096, 8, 1)
    assert plan.per_device_batch_size == 8 and plan.micro_batch_mode == "fixed"
    capped = engine.resolve_batch_plan(2, 16, 4, micro_batch_tokens=4096)
    assert capped.train_micro_batch_size_per_gpu == 4  # a cap, not a divisor: no G = M·A·W check
    auto = engine.resolve_batch_plan(2, 16, "auto", auto_max=3, micro_batch_tokens=4096)
    assert (auto.micro_batch_mode, auto.train_micro_batch_size_per_gpu) == ("auto", 3)
    assert auto.with_micro_batch_tokens(1024).micro_batch_tokens == 1024
    assert engine.resolve_batch_plan(2, 7, batch_split="balanced", micro_batch_tokens=64).per_device_batch_sizes == (4, 3)
    text = capped.describe()
    assert "token budget:         4096 padded tokens (rows x longest row) per micro-batch" in text
    assert "rows per micro-batch: at most 4" in text and "accumulation steps" not in text


@pytest.mark.parametrize("args, message", [
    (dict(micro_batch_tokens=64), r"micro_batch_tokens: needs train_batch_size"),
    (dict(train_batch_size=8, gradient_accumulation_steps=2, micro_batch_tokens=64),
     r"gradient_accumulation_steps: micro_batch_tokens chooses each window's micro-steps"),
    (dict(train_batch_size=8, auto_max=2, micro_batch_tokens=64), r"auto_max: with micro_batch_tokens"),
    (dict(train_batch_size=7, micro_batch_tokens=64), r"train_batch_size 7 is not divisible by world size 2.*balanced"),
    (dict(train_batch_size=8, micro_batch_tokens=0), r"micro_batch_tokens must be a positive integer, got 0"),
])
def test_plan_errors_name_the_fix(args, message):
    with pytest.raises(engine.BatchConfigError, match=message):
        engine.resolve_batch_plan(2, **args)


def test_validate_reports_token_budget_conflicts(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("gradient_accumulation_steps: 4\nmicro_batch_tokens: 4096\n")
    assert cli_main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: gradient_accumulation_steps: micro_batch_tokens chooses" in err
    assert f"{path}:2: micro_batch_tokens: needs train_batch_size" in err
    path.write_text("train_batch_size: 8\nsequence_keys: [input_ids]\n")
    assert cli_main(["validate", str(path)]) == 2
    assert "sequence_keys: names the tensors micro_batch_tokens trims, but micro_batch_tokens is not set" in \
        capsys.readouterr().err
    assert cli_main(["validate", str(path), "--set", "micro_batch_tokens=512"]) == 0
    assert "micro_batch_tokens 512" in capsys.readouterr().out


def test_initialize_refuses_a_lengths_function_it_would_not_use():
    with pytest.raises(engine.ConfigError, match=r"initialize\(lengths=...\) was given.*set micro_batch_tokens"):
        engine.initialize(tiny_lm(), {"train_batch_size": 8}, optimizer=sgd, lengths=lambda b: b)
    with pytest.raises(TypeError, match="lengths must be a function"):
        engine.initialize(tiny_lm(), {"train_batch_size": 8, "micro_batch_tokens": 8}, optimizer=sgd, lengths=3)


# -- one process: exact, and what it reports --------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"train_micro_batch_size_per_gpu": 2}], ids=["budget", "budget and row cap"])
def test_train_batch_by_tokens_equals_the_full_batch(extra):
    model, batches = tiny_lm(), lm_batches()
    expected = reference_train(model, batches, token_mean, sgd)
    eng = token_engine(copy.deepcopy(model), **extra)
    for batch in batches:
        eng.train_batch(batch)
        layout_lengths = batch["attention_mask"].sum(1).tolist()
        groups = group_by_tokens(layout_lengths, 20, max_rows=extra.get("train_micro_batch_size_per_gpu"))
        cost = token_cost(groups)
        assert eng.last_window.micro_steps == len(groups) == len(eng.window_split.groups)
        assert (eng.last_window.real_tokens, eng.last_window.padded_tokens) == (cost.real_tokens, cost.padded_tokens)
        assert cost.padded_tokens < batch["input_ids"].numel()  # trimmed: fewer positions than the padded batch
    assert max_param_diff(state(eng.module), state(expected)) < TOL

    broken = token_engine(copy.deepcopy(model), **extra)  # mean per micro-batch, weighted by rows
    for batch in batches:
        broken.train_batch(batch, mean_per_micro_batch)
    assert max_param_diff(state(broken.module), state(expected)) > 1e3 * TOL


def test_eval_batch_by_tokens_is_the_full_batch_mean():
    model, batch = tiny_lm(), lm_batches()[0]
    eng = token_engine(copy.deepcopy(model))
    with torch.no_grad():
        expected = float(token_mean(model, batch))
    assert eng.eval_batch(batch) == pytest.approx(expected, rel=1e-12)
    assert eng.global_steps == 0 and max_param_diff(state(eng.module), state(model)) == 0


def test_lengths_function_and_sequence_keys_for_a_batch_without_a_mask():
    seen = []

    def loss(model, batch):
        seen.append((batch["input_ids"].shape, batch["weight"].shape))
        loss_sum, count = loss_sum_and_count(model, {**batch, "attention_mask": None})
        return loss_sum * batch["weight"].mean(), count  # weight: ones

    model, batches = tiny_lm(), lm_batches()
    plain = [{"input_ids": b["input_ids"], "labels": b["labels"], "weight": torch.ones(8, 16)} for b in batches]
    expected = reference_train(model, batches, token_mean, sgd)
    eng = token_engine(copy.deepcopy(model), sequence_keys=["input_ids", "labels"],
                       lengths=lambda batch: (batch["labels"] != -100).sum(1))
    for batch in plain:
        eng.train_batch(batch, loss)
    assert max_param_diff(state(eng.module), state(expected)) < TOL
    # Sequences trimmed to each micro-batch's longest row; weight, as wide by chance, only row-selected.
    assert all(ids[1] < 16 and weight == (ids[0], 16) for ids, weight in seen[1:]), seen


def test_manual_loop_is_refused_with_the_alternative():
    eng = token_engine(tiny_lm())
    batch = lm_batches()[0]
    with pytest.raises(engine.EngineUsageError, match=r"micro_batch_tokens: 20 forms micro-batches by tokens.*"
                                                      r"Use eng.train_batch\(batch, loss_fn\)"):
        eng.backward(loss_sum_and_count(eng, batch))


def test_a_row_over_the_budget_runs_alone_with_one_warning(caplog):
    eng = token_engine(tiny_lm(), tokens=12)
    with caplog.at_level(logging.WARNING, logger="engine"):
        for batch in lm_batches():
            eng.train_batch(batch)
    warnings = [r.getMessage() for r in caplog.records if "exceed micro_batch_tokens 12" in r.getMessage()]
    assert len(warnings) == 1 and "(14 tokens)" in warnings[0], warnings
    assert any(g.over_budget for g in eng.window_split.groups)  # the second step has long rows too: no new warning


def test_monitor_records_micro_steps_and_padded_vs_real_tokens():
    eng = token_engine(tiny_lm(), monitor={"enabled": True, "progress": False})
    for batch in lm_batches():
        eng.train_batch(batch)
    record = eng.monitor.history[-1]
    assert record["micro_batch_tokens"] == 20 and record["micro_steps"] == eng.last_window.micro_steps
    assert (record["real_tokens"], record["padded_tokens"]) == (sum(STEPS[1]), eng.last_window.padded_tokens)
    assert record["micro_batch_size"] is None and record["accumulation_steps"] is None
    assert "% padding" in eng.monitor.format_progress(record)


def lm_with_tripwire(**tripwire):
    model = tiny_lm()
    model.tokens = torch.nn.Sequential(model.tokens, TokenTripwire(**tripwire))  # trips on [rows, length, width]
    return model


def reference_without_tripwire(model, batches):
    model = copy.deepcopy(model)
    model.tokens[1].max_micro = float("inf")  # the reference is the whole batch in one piece
    return reference_train(model, batches, token_mean, sgd)


def test_auto_shrinks_the_budget_and_a_checkpoint_keeps_it(tmp_path):
    model, batches = lm_with_tripwire(max_micro=18), lm_batches()
    expected = reference_without_tripwire(model, batches)
    eng = token_engine(copy.deepcopy(model), tokens=64, train_micro_batch_size_per_gpu="auto")
    for batch in batches:
        eng.train_batch(batch)
    changes = eng.micro_batch_tuner.changes
    assert [(c["old"], c["new"]) for c in changes] == [(64, 21)], changes
    assert eng.plan.micro_batch_tokens == 21 and eng.plan.train_batch_size == 8
    assert max(g.padded_tokens for g in eng.window_split.groups if len(g.rows) > 1) <= 18
    assert max_param_diff(state(eng.module), state(expected)) < TOL
    eng.save_checkpoint(tmp_path / "ckpt")
    resumed = token_engine(copy.deepcopy(model), tokens=64, train_micro_batch_size_per_gpu="auto")
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.plan.micro_batch_tokens == 21 and resumed.micro_batch_tuner.changes == changes


def test_explore_measures_token_budgets_and_leaves_the_model_alone():
    model, batches = lm_with_tripwire(max_micro=32), lm_batches()
    expected = reference_without_tripwire(model, batches)
    eng = token_engine(copy.deepcopy(model), tokens=64, train_micro_batch_size_per_gpu="explore")
    eng.micro_batch_tuner.warmup, eng.micro_batch_tuner.repeats = 0, 1
    for batch in batches:
        eng.train_batch(batch)
    rows = eng.micro_batch_tuner.explored
    assert [(r.micro_batch_tokens, r.fits) for r in rows] == [(16, True), (32, True), (64, False)]
    assert eng.plan.micro_batch_tokens == next(r.micro_batch_tokens for r in rows if r.recommended)
    assert rows[0].accumulation_steps > rows[1].accumulation_steps  # micro-steps the budget needed
    assert max_param_diff(state(eng.module), state(expected)) < TOL


def test_eval_under_auto_shrinks_its_own_budget():
    eng = token_engine(lm_with_tripwire(max_micro=18), tokens=64, train_micro_batch_size_per_gpu="auto")
    batch = lm_batches()[0]
    with torch.no_grad():
        expected = float(token_mean(tiny_lm(), batch))
    assert eng.eval_batch(batch) == pytest.approx(expected, rel=1e-12)
    assert eng.micro_batch_tuner.eval_micro_batch_tokens == 21 and eng.plan.micro_batch_tokens == 64


# -- two ranks -------------------------------------------------------------------------------------
LLAMA_STEPS = [[14, 12, 13, 2, 3, 2, 4],  # rank 0 needs 4 micro-steps, rank 1 (3 rows) 1: a zero-weight step
               [2, 3, 2, 1, 15, 9, 8]]  # rank 1 needs 3, rank 0 splits its 4 short rows into 3
LLAMA_BUDGET = 16


def tiny_llama():
    """A 2-layer Llama from a config (no download), float64 throughout. Two of its parts
    compute in float32 even in a float64 model: eager attention's softmax (so: sdpa) and
    RMSNorm (its forward casts to float32). Float32 rounding in a backward depends on the
    loss's scale, which the engine sets (W/G, then G/count at the boundary) differently from
    the reference (1/count): ~1e-9 apart. The same RMSNorm in float64 keeps the comparison
    about the weighting, not rounding."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Float64RMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    config = transformers.LlamaConfig(vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    for module in model.modules():
        if type(module) is LlamaRMSNorm:
            module.__class__ = Float64RMSNorm
    return model


def llama_scenario(rank, world, stage):
    """Two steps of a balanced global batch of 7 rows (4 + 3) against the full batch."""
    model, batches = tiny_llama(), lm_batches(LLAMA_STEPS)
    expected = reference_train(model, batches, token_mean, sgd)
    results = {}
    for name, loss_fn in (("exact", loss_sum_and_count), ("mean per micro-batch", mean_per_micro_batch)):
        eng = token_engine(copy.deepcopy(model), tokens=LLAMA_BUDGET, global_batch=7, batch_split="balanced",
                           zero_optimization={"stage": stage, "shard_unit_size": 1000},
                           monitor={"enabled": True, "progress": False})
        windows = []
        for batch in batches:
            eng.train_batch(rank_slice(batch, eng.plan), loss_fn)
            windows.append((eng.last_window.micro_steps, sum(g.zero_weight for g in eng.window_split.groups)))
        results[name] = {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "windows": windows,
                         "records": eng.monitor.history}
        eng.close()
    return results


def oom_scenario(rank, world, stage):
    """Out of memory on rank 1 only: every rank shrinks the same budget, the update stays exact."""
    model, batches = lm_with_tripwire(max_micro=16, ranks=(1,)), lm_batches()
    expected = reference_without_tripwire(model, batches)
    eng = token_engine(copy.deepcopy(model), tokens=64, train_micro_batch_size_per_gpu="auto",
                       zero_optimization={"stage": stage})
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan))
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "changes": eng.micro_batch_tuner.changes,
            "tokens": eng.plan.micro_batch_tokens, "samples": eng.global_samples}


def left_padded_on_rank_1(rank, world):
    """A batch one rank cannot split stops every rank (no rank waits in a collective)."""
    eng = token_engine(tiny_lm(), global_batch=4)
    batch = padded_batch([3, 2], width=4, side="right" if rank == 0 else "left")
    try:
        eng.train_batch(batch)
    except (TokenBudgetError, engine.EngineUsageError) as error:
        outcome = f"{type(error).__name__}: {error}"
    eng.train_batch(padded_batch([3, 2], width=4))  # the engine is still usable
    return outcome, eng.global_steps


def lengths_fail_on_rank_1(rank, world):
    """A lengths(batch) that raises (not a BatchError) on one rank: that rank raises its error, the
    other learns at the agreement which rank failed, nobody waits out the agreement timeout."""
    def lengths(batch):
        if rank == 1:
            raise ValueError("lengths() failed on rank 1")
        return batch["attention_mask"].sum(1)

    eng = token_engine(tiny_lm(), global_batch=4, lengths=lengths, distributed={"agreement_timeout_seconds": 20})
    started = time.perf_counter()
    try:
        eng.train_batch(padded_batch([3, 2], width=4))
    except (ValueError, engine.EngineUsageError) as error:
        outcome = f"{type(error).__name__}: {error}"
    return outcome, time.perf_counter() - started


@pytest.fixture(scope="module")
def two_ranks():
    scenarios = {f"llama stage {stage}": functools.partial(llama_scenario, stage=stage) for stage in (0, 3)}
    scenarios |= {f"oom stage {stage}": functools.partial(oom_scenario, stage=stage) for stage in (0, 3)}
    scenarios["left padded on rank 1"] = left_padded_on_rank_1
    scenarios["lengths fail on rank 1"] = lengths_fail_on_rank_1
    return run_scenarios(scenarios, world_size=2, timeout=240)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 3])
def test_hugging_face_llama_on_two_ranks_equals_the_full_batch(two_ranks, stage):
    results = two_ranks[f"llama stage {stage}"]
    for rank, result in enumerate(results):
        assert result["exact"]["diff"] < TOL, (rank, result["exact"]["diff"])
        assert result["mean per micro-batch"]["diff"] > 1e3 * TOL, result["mean per micro-batch"]["diff"]
    # Every rank ran the same micro-steps: rank 1 filled step 1 with a zero-weight repeat,
    # rank 0 split its short rows further in step 2.
    assert [r["exact"]["windows"] for r in results] == [[(4, 0), (3, 0)], [(4, 1), (3, 0)]]
    records = results[0]["exact"]["records"]
    for record, lengths in zip(records, LLAMA_STEPS):
        padded = sum(token_cost(group_by_tokens(part, LLAMA_BUDGET, record["micro_steps"])).padded_tokens
                     for part in (lengths[:4], lengths[4:]))
        assert (record["real_tokens"], record["padded_tokens"]) == (sum(lengths), padded)
        assert record["samples"] == 7
    assert results[1]["exact"]["records"] == []  # rank 0 alone records


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 3])
def test_out_of_memory_on_one_rank_shrinks_the_budget_on_every_rank(two_ranks, stage):
    first, second = two_ranks[f"oom stage {stage}"]
    assert first["diff"] < TOL and second["diff"] < TOL, (first["diff"], second["diff"])
    assert first["changes"] == second["changes"] and first["changes"][0]["ranks"] == [1]
    assert [c["global_step"] for c in first["changes"]] == [1, 2]
    assert [(c["old"], c["new"]) for c in first["changes"]] == [(64, 28), (28, 9)], first["changes"]
    assert first["tokens"] == second["tokens"] == 9 and first["samples"] == 16


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_batch_one_rank_cannot_split_stops_every_rank(two_ranks):
    (first, steps0), (second, steps1) = two_ranks["left padded on rank 1"]
    assert first == ("EngineUsageError: rank 1 could not split its batch by tokens (its error is in its log); "
                     "every rank stops at the same micro-step")
    assert second.startswith("TokenBudgetError: batch['attention_mask']: row 0 is left-padded")
    assert steps0 == steps1 == 1


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_lengths_function_failing_on_one_rank_stops_every_rank_at_once(two_ranks):
    (first, waited0), (second, waited1) = two_ranks["lengths fail on rank 1"]
    assert first.startswith("EngineUsageError: rank 1 could not split its batch by tokens")
    assert second == "ValueError: lengths() failed on rank 1"
    assert max(waited0, waited1) < 10  # not the agreement timeout (20 s)


def deepspeed_scenario(rank, world, stage):
    model, batches = tiny_lm().float(), lm_batches(LLAMA_STEPS)  # DeepSpeed trains float32 at most
    expected = reference_train(model, batches, token_mean, sgd)
    eng = token_engine(copy.deepcopy(model), tokens=LLAMA_BUDGET, global_batch=7, batch_split="balanced",
                       backend="deepspeed", zero_optimization={"stage": stage})
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan))
    return max_param_diff(eng.full_state_dict(), state(expected)), eng.last_window.micro_steps


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(300)
def test_deepspeed_backend_splits_by_tokens_too():
    pytest.importorskip("deepspeed")
    results = run_scenarios({stage: functools.partial(deepspeed_scenario, stage=stage) for stage in (0, 1, 2, 3)},
                            world_size=2, timeout=240)
    for stage, per_rank in results.items():
        for diff, micro_steps in per_rank:
            assert diff < 1e-6 and micro_steps == 3, (stage, diff, micro_steps)  # fp32 against float64


# Factories for `python -m engine explore` (module:function references).
def explore_lm():
    return lm_with_tripwire(max_micro=32)


def explore_lm_batch(size):
    return padded_batch(STEPS[0][:size], width=16)


def test_explore_command_measures_token_budgets(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("train_batch_size: 8\nmicro_batch_tokens: 64\n")
    assert cli_main(["explore", str(config), "--model", "tests.distributed.test_token_engine:explore_lm",
                     "--batch", "tests.distributed.test_token_engine:explore_lm_batch",
                     "--loss", "tests.support.lm_models:loss_sum_and_count",
                     "--out", str(tmp_path), "--warmup", "0", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "token budgets for global batch 8 on 1 rank(s) (8 per device):"
    assert lines[1].split()[:2] == ["tokens", "micro-steps"]
    assert [line.split()[0] for line in lines[2:5]] == ["16", "32", "64"] and "out of memory" in lines[4]
    assert "<- recommended" in "\n".join(lines[2:4])
