"""The 3-D mesh (pipeline × data × tensor) against the float64 full-batch reference: tensor 2 ×
pipeline 2 on 4 ranks (every schedule; ZeRO 0, 2 and 3; mean and (sum, count) losses; clipping on the global norm
over every stage and tensor shard; a short last window), and pipeline 2 × data 2 × context 1 × tensor 2 on
8 ranks. The model is Llama-shaped (tests/support/tp_models.py), cut after its first block; each stage's
layers are split by the tensor plan. Broken variants miss the tolerance: the replicated norms'
gradients left unreduced over the tensor group, and micro-batch gradients summed (DeepSpeed
#7773). A checkpoint of the 3-D mesh resumes on pipeline × data alone; the README's pipeline
script prints on tensor 2 × pipeline 2 what it prints in one process."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import engine
from engine.errors import ConfigError, EngineUsageError
from engine.pipeline.split import cut, sequence_of
from engine.strategies.tensor_plan import resolve_plan
from engine.strategies.tensor_plan import stage_boundary_problems
from tests.support.broken import intact, summed_micro_batches, unreduced_replicated_gradients
from tests.support.dist_utils import run_distributed, run_scenarios
from tests.support.reference import max_param_diff, mlp, sgd, state, token_batches
from tests.support.pipeline_helpers import data_share, overflow_in_second_window, overflow_result, reference_run, token_sum
from tests.support.tp_models import PLAN, TinyTransformer

TOL = 1e-10
MISSED = 1e-4
VOCAB = 12


def batches(steps, global_batch, dense):
    """(tokens, labels) batches; ``dense``: every label valid (a micro-batch's mean over tokens
    is then its mean over samples, for mean losses)."""
    found = []
    for batch in token_batches(steps, global_batch, vocab=VOCAB):
        labels = batch["labels"]
        if dense:
            labels = torch.where(labels == -100, (batch["tokens"] + 1) % VOCAB, labels)
        found.append((batch["tokens"], labels))
    return found


def token_mean(outputs, labels):
    loss, count = token_sum(outputs, labels)
    return loss / count


def reference_token_mean(model, batch):
    return token_mean(model(batch[0]), batch[1])


def train(rank, world, *, zero=0, loss="mean", clip=0.0, short=False, schedule="1f1b", split=("layers.1",),
          breaks=intact, tensor_plan=None):
    """Three windows of A = 4 micro-batches per data rank (the last one short when ``short``)."""
    data = world // 4
    global_batch = 4 * data
    model = TinyTransformer()
    windows = batches(3, global_batch, dense=loss == "mean")
    if short:  # the end of an epoch: fewer samples than planned, as many micro-steps
        windows[-1] = tuple(t[:global_batch - 1] for t in windows[-1])
    expected, reference_losses = reference_run(model, windows, reference_token_mean, clip)
    reference_norm = _first_norm(model, windows[0])
    cfg = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": 1 + short,
           "pipeline": {"stages": 2, "schedule": schedule, "split": list(split) if isinstance(split, tuple) else split},
           "tensor_parallel": {"size": 2, "plan": PLAN}, "zero_optimization": {"stage": zero},
           "gradient_clipping": clip}
    plan = unreduced_replicated_gradients(PLAN) if tensor_plan == "broken" else None
    eng = breaks(engine.initialize(copy.deepcopy(model), cfg, optimizer=sgd, tensor_plan=plan))
    loss_fn = token_mean if loss == "mean" else token_sum
    losses, norms = [], []
    for window in windows:
        losses.append(eng.train_batch(data_share(window, eng), loss_fn))
        norms.append(float(eng.last_window.step.grad_norm) if eng.last_window.step.grad_norm is not None else None)
    try:
        full = eng.full_state_dict()
    except EngineUsageError as error:  # broken: the drifted replicas are found by the engine itself
        eng.close()
        return {"diff": float("inf"), "refused": str(error)}
    split = sorted(name for name, p in eng.module.named_parameters() if type(p).__name__ == "DTensor"
                   or type(getattr(p, "data", None)).__name__ == "DTensor")
    result = {"diff": max_param_diff(full, state(expected)), "keys": list(full) == list(model.state_dict()),
              "loss_diff": max(abs(a - b) for a, b in zip(losses, reference_losses)),
              "norm": norms[0], "reference_norm": reference_norm,
              "samples": eng.global_samples, "expected_samples": sum(w[0].shape[0] for w in windows),
              "eval": eng.eval_batch(data_share(windows[0], eng), loss_fn),
              "reference_eval": float(reference_token_mean(expected, windows[0])),
              "strategy": (eng.strategy.name, eng.strategy.mesh.data_sharded), "plan": (eng.plan.world_size, eng.plan.rank),
              "split": split}
    eng.close()
    return result


def _first_norm(model, batch):
    """The reference's gradient norm on the first window, before clipping."""
    model = copy.deepcopy(model)
    reference_token_mean(model, batch).backward()
    return float(torch.sqrt(sum(p.grad.square().sum() for p in model.parameters())))


def different_batches(rank, world):
    """Ranks of one tensor group given different inputs: refused on every rank before training."""
    model = TinyTransformer()
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 2},
           "tensor_parallel": {"size": 2, "plan": PLAN}}
    eng = engine.initialize(copy.deepcopy(model), cfg, optimizer=sgd)
    tokens, labels = batches(1, 8, dense=True)[0]
    mine = (tokens[4 * (rank % 2):4 * (rank % 2) + 4], labels[4 * (rank % 2):4 * (rank % 2) + 4])  # wrong: by rank
    before = eng.full_state_dict()
    try:
        eng.train_batch(mine, token_mean)
    except EngineUsageError as error:
        return {"error": str(error), "unchanged": max_param_diff(eng.full_state_dict(), before) == 0}
    return {"error": None}


def resumed_without_tensor_parallelism(rank, world, directory):
    """Two windows on tensor 2 × pipeline 2 at ZeRO 3 (AdamW), a checkpoint; a new engine on
    pipeline 2 × data 2 at ZeRO 0 loads it and trains the third: the reference's three steps."""
    model, windows = TinyTransformer(), batches(3, 4, dense=True)
    expected = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(expected.parameters())
    for window in windows:
        optimizer.zero_grad()
        reference_token_mean(expected, window).backward()
        optimizer.step()
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 2, "split": ["layers.1"]},
           "tensor_parallel": {"size": 2, "plan": PLAN}, "zero_optimization": {"stage": 3}}
    eng = engine.initialize(copy.deepcopy(model), cfg, optimizer=torch.optim.AdamW)
    for window in windows[:2]:
        eng.train_batch(data_share(window, eng), token_mean)
    eng.save_checkpoint(directory)
    eng.close()
    del cfg["tensor_parallel"]
    cfg["zero_optimization"]["stage"] = 0
    resumed = engine.initialize(TinyTransformer(seed=5), cfg, optimizer=torch.optim.AdamW)
    resumed.load_checkpoint(directory)
    resumed.train_batch(data_share(windows[2], resumed), token_mean)
    result = {"diff": max_param_diff(resumed.full_state_dict(), state(expected)), "steps": resumed.global_steps,
              "data": resumed.plan.world_size}
    resumed.close()
    return result


def cut_after_a_split_output(rank, world):
    """A stage ending on a colwise layer whose rowwise partner is in the next stage: refused on every rank."""
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 2, "split": ["2"]},
           "tensor_parallel": {"size": 2}}
    try:
        engine.initialize(mlp(), cfg, optimizer=sgd)
    except ConfigError as error:
        return str(error)
    return None


def fp16_overflow_on_one_stage(rank, world):
    """fp16 autocast with the loss scaler on a float32 model; the second window's gradient
    overflows on the first stage's first tensor rank only (injected): discarded on every rank."""
    model, windows = TinyTransformer(dtype=torch.float32), batches(3, 4, dense=True)
    expected, _ = reference_run(copy.deepcopy(model).double(), [windows[0], windows[2]], reference_token_mean, 0.0)
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 2, "split": ["layers.1"]},
           "tensor_parallel": {"size": 2, "plan": PLAN}, "fp16": {"enabled": True, "initial_scale_power": 8}}
    eng = engine.initialize(copy.deepcopy(model), cfg, optimizer=sgd)
    overflow_in_second_window(eng, rank == 0)
    for window in windows:
        eng.train_batch(data_share(window, eng), token_mean)
    return overflow_result(eng, expected)


def readme_script_alone(rank, world):
    from examples.pipeline import main

    return main(["--set", "pipeline.stages=1"])


def readme_script(rank, world):
    """examples/pipeline.py as README shows it, with tensor_parallel.size=2: pipeline 2 × tensor 2."""
    from examples.pipeline import main

    return main(["--set", "tensor_parallel.size=2"])


def assert_exact(results, strategy):
    for result in results:
        assert result["diff"] < TOL, result
        assert result["keys"], result
        assert result["loss_diff"] < TOL, result
        assert result["samples"] == result["expected_samples"], result
        assert abs(result["eval"] - result["reference_eval"]) < TOL, result
        assert result["strategy"] == strategy, result
        assert result["split"], result  # this rank's stage holds split layers


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tensor_2_by_pipeline_2_on_four_ranks_is_exact(tmp_path):
    scenarios = {
        "ZeRO 0 mean, clipped": functools.partial(train, clip=0.05),
        "ZeRO 0 tokens, short window": functools.partial(train, loss="tokens", short=True),
        "ZeRO 3 tokens, clipped short window": functools.partial(train, zero=3, loss="tokens", clip=0.05, short=True),
        "ZeRO 3 mean": functools.partial(train, zero=3),
        "interleaved, ZeRO 2 tokens, clipped": functools.partial(train, schedule="interleaved", zero=2, loss="tokens",
                                                                 clip=0.05, split="auto"),
        "zero_bubble, ZeRO 0 mean": functools.partial(train, schedule="zero_bubble", split="auto"),
        "gpipe, ZeRO 3 mean, short window": functools.partial(train, schedule="gpipe", zero=3, short=True),
        "broken: norms unreduced over the tensor group": functools.partial(train, tensor_plan="broken"),
        "broken: summed (DeepSpeed #7773)": functools.partial(train, zero=3, breaks=summed_micro_batches),
        "different batches": different_batches,
        "README script": readme_script,
        "fp16 overflow on one rank": fp16_overflow_on_one_stage,
        "a cut after a split output": cut_after_a_split_output,
        "resumed without tensor parallelism": functools.partial(resumed_without_tensor_parallelism,
                                                                directory=str(tmp_path / "checkpoint")),
    }
    results = run_scenarios(scenarios, world_size=4, timeout=280)
    alone = run_distributed(readme_script_alone, world_size=1)[0]
    assert len(alone) == 9 and alone[-1].startswith("8 micro-batches per step on 1 data-parallel rank(s)"), alone
    for lines in results["README script"]:  # the same losses, learning rates and model
        assert lines == alone, (lines, alone)
    for name in ("ZeRO 0 mean, clipped", "ZeRO 0 tokens, short window", "zero_bubble, ZeRO 0 mean"):
        assert_exact(results[name], ("pipeline", False))
    for name in ("ZeRO 3 tokens, clipped short window", "ZeRO 3 mean", "interleaved, ZeRO 2 tokens, clipped",
                 "gpipe, ZeRO 3 mean, short window"):
        assert_exact(results[name], ("pipeline", True))  # each stage sharded
    for name in ("ZeRO 0 mean, clipped", "ZeRO 3 tokens, clipped short window", "interleaved, ZeRO 2 tokens, clipped"):
        for result in results[name]:  # the whole model's norm over every stage and shard, on every rank
            assert result["norm"] == pytest.approx(result["reference_norm"], rel=1e-10), result
            assert result["reference_norm"] > 0.05  # clipping acted
    for name in ("broken: norms unreduced over the tensor group", "broken: summed (DeepSpeed #7773)"):
        assert all(result["diff"] > MISSED for result in results[name]), name
    for result in results["resumed without tensor parallelism"]:
        assert result["diff"] < TOL and result["steps"] == 3 and result["data"] == 2, result
    for result in results["fp16 overflow on one rank"]:
        assert result["skipped"] == 1 and result["steps"] == 3, result
        assert result["diff"] < 2e-4, result
        assert result["scale"] == results["fp16 overflow on one rank"][0]["scale"]
    for error in results["a cut after a split output"]:
        assert error is not None and "pipeline.split: stage 1 ends after 0, whose output stays split" in error, error
    for result in results["different batches"]:
        assert result["error"] is not None and "different inputs" in result["error"], result
        assert result["unchanged"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_pipeline_2_by_data_2_by_tensor_2_on_eight_ranks_is_exact():
    results = run_scenarios({"ZeRO 3 tokens, clipped short window": functools.partial(
        train, zero=3, loss="tokens", clip=0.05, short=True)}, world_size=8, timeout=280)
    per_rank = results["ZeRO 3 tokens, clipped short window"]
    assert_exact(per_rank, ("pipeline", True))
    assert [result["plan"] for result in per_rank] == [(2, 0), (2, 0), (2, 1), (2, 1)] * 2
    for result in per_rank:
        assert result["norm"] == pytest.approx(result["reference_norm"], rel=1e-10), result


# -- no processes ---------------------------------------------------------------------------------
def test_a_stage_ending_on_a_split_output_is_refused_naming_the_layer():
    model = mlp()  # Linear, Tanh, Linear, Tanh, Linear: the auto plan splits 0 colwise, 2 rowwise
    plan = resolve_plan(model, "auto", 2)
    problems = stage_boundary_problems(cut(sequence_of(model), 2, ["2"]), plan)
    assert len(problems) == 1 and problems[0].startswith(
        "pipeline.split: stage 1 ends after 0, whose output stays split over the tensor group (ColwiseParallel)")
    assert stage_boundary_problems(cut(sequence_of(model), 2, ["3"]), plan) == []
    transformer = TinyTransformer()
    assert stage_boundary_problems(cut(sequence_of(transformer), 2, ["layers.1"]),
                                   resolve_plan(transformer, PLAN, 2)) == []


def test_tensor_and_pipeline_compose_in_the_config():
    from engine.config.checks import check_without_model
    from engine.config.setup import mesh_layout

    config = engine.load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                                 "pipeline": {"stages": 2}, "tensor_parallel": {"size": 2}})
    assert check_without_model(config) == []
    assert mesh_layout(config, 8).describe() == "world 8 = pipeline 2 × data 2 × context 1 × tensor 2"
    with pytest.raises(ConfigError, match="does not divide into pipeline 2 × context 1 × tensor 2"):
        mesh_layout(config, 6)
