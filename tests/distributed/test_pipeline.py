"""Pipeline parallelism against the float64 full-batch reference: pipeline 2 on 2 ranks with
every schedule, pipeline 2 × data 2 and pipeline 4 on 4 ranks; ZeRO 0, 2 and 3 (FSDP2 per
stage); mean and (sum, count) losses, clipping on the global norm over the stages, a short last
window, a balanced plan (micro-batches of different sizes in one schedule), windows of two
sequence lengths, a model whose blocks are an nn.ModuleList, an fp16 overflow on one stage only,
the monitor, checkpoints resumed on another data-parallel size and without a pipeline, and the
README's script on 1, 2 and 4 processes. The broken variant of DeepSpeed #7773 (micro-batch
gradients summed instead of averaged) misses the tolerance.

Every scenario runs on every rank and returns this rank's view of the result: the whole model
(``full_state_dict``, the same on every stage), counters and the reported loss."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import engine
import engine.config.checks
from engine.errors import ConfigError, EngineUsageError
from tests.support.broken import intact, summed_micro_batches
from tests.support.dist_utils import run_distributed, run_scenarios
from tests.support.scenarios import halving_schedule
from tests.support.pipeline_helpers import (VOCAB, data_share, mse_outputs, overflow_in_second_window, overflow_result,
                                            reference_mse, reference_run, token_batches, token_sum)
from tests.support.reference import TinyLM, max_param_diff, mlp, regression_batches, sgd, state

TOL = 1e-10
MISSED = 1e-4
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero_bubble"]
WIDTH = 8


def config(global_batch, micro, schedule="1f1b", **extra):
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
            "pipeline": {"stages": 2, "schedule": schedule}, **extra}


class Blocks(torch.nn.Module):
    """Not an nn.Sequential: an input layer, an nn.ModuleList of blocks run in a loop, a head."""

    def __init__(self, seed=0, width=16):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                          for _ in range(3))
        self.head = torch.nn.Linear(width, 3)
        self.double()

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Residual(Blocks):
    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class WithStep(Blocks):
    """A chain of modules, and a root-level buffer no stage would hold (a step counter)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("step", torch.zeros(()))


def token_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, VOCAB)).double()


def reference_token_mean(model, batch):
    loss, count = token_sum(model(batch[0]), batch[1])
    return loss / count


def train(rank, world, *, schedule="1f1b", loss="mean", clip=0.0, short=False, split="strict", zero=0,
          shorter_sequences=False, stages=2, breaks=intact, **extra):
    """Three windows (the last a short one when ``short``; the second of shorter sequences when
    ``shorter_sequences``: another shape, another schedule) against the reference."""
    data_ranks = world // stages
    # strict: A = 4 micro-batches of 1; a short window: A = 2 of 2, then 2 and 1 (padded to 2)
    global_batch, micro = (4 * data_ranks, 2 if short else 1) if split == "strict" else (5 * data_ranks + 1, 2)
    if loss in ("mean", "blocks"):
        model = mlp() if loss == "mean" else Blocks()
        batches, loss_fn, reference_loss = regression_batches(3, global_batch), mse_outputs, reference_mse
    else:
        model, batches, loss_fn, reference_loss = token_model(), token_batches(3, global_batch), token_sum, \
            reference_token_mean
    if shorter_sequences:
        batches[1] = tuple(t[:, :4] for t in batches[1])
    if short:  # the end of an epoch: fewer samples than planned, as many micro-steps
        batches[-1] = tuple(t[:global_batch - 1] for t in batches[-1])
    expected, reference_losses = reference_run(model, batches, reference_loss, clip)
    settings = config(global_batch, micro, schedule, gradient_clipping=clip, batch_split=split,
                      zero_optimization={"stage": zero}, **extra)
    settings["pipeline"]["stages"] = stages
    eng = breaks(engine.initialize(copy.deepcopy(model), settings, optimizer=sgd))
    losses = [eng.train_batch(data_share(batch, eng), loss_fn) for batch in batches]
    result = {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
              "keys": list(eng.full_state_dict()) == list(model.state_dict()),
              "loss_diff": max(abs(a - b) for a, b in zip(losses, reference_losses)),
              "counters": (eng.global_steps, eng.micro_steps, eng.global_samples),
              "expected_counters": (3, 3 * eng.plan.gradient_accumulation_steps, sum(b[0].shape[0] for b in batches)),
              "eval": eng.eval_batch(data_share(batches[0], eng), loss_fn),
              "reference_eval": float(reference_loss(expected, batches[0]))}
    eng.close()
    return result


def assert_exact(results):
    for result in results:
        assert result["diff"] < TOL, result
        assert result["keys"]
        assert result["loss_diff"] < TOL, result
        assert result["counters"] == result["expected_counters"]
        assert abs(result["eval"] - result["reference_eval"]) < TOL, result


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_stages_every_schedule_is_exact():
    scenarios = {f"{schedule} {loss}": functools.partial(train, schedule=schedule, loss=loss)
                 for schedule in SCHEDULES for loss in ("mean", "tokens")}
    scenarios["1f1b clipped"] = functools.partial(train, clip=0.05)
    scenarios["gpipe short window"] = functools.partial(train, schedule="gpipe", short=True)
    scenarios["1f1b short window, tokens"] = functools.partial(train, loss="tokens", short=True)
    scenarios["1f1b balanced"] = functools.partial(train, split="balanced")
    scenarios["interleaved, blocks in an nn.ModuleList"] = functools.partial(train, schedule="interleaved",
                                                                            loss="blocks")
    scenarios["interleaved tokens, windows of two lengths"] = functools.partial(
        train, schedule="interleaved", loss="tokens", shorter_sequences=True)
    scenarios["1f1b, blocks checkpointed"] = functools.partial(
        train, loss="blocks", activation_checkpointing={"enabled": True, "blocks": "auto"})
    scenarios["summed (DeepSpeed #7773)"] = functools.partial(train, breaks=summed_micro_batches)
    results = run_scenarios(scenarios, world_size=2, timeout=280)
    broken = results.pop("summed (DeepSpeed #7773)")
    for name, per_rank in results.items():
        assert_exact(per_rank), name
    assert all(result["diff"] > MISSED for result in broken)


def fp16_overflow_on_first_stage(rank, world):
    """fp16 autocast with the loss scaler; the second window's gradient overflows on stage 1
    only (injected): the window is discarded on every stage, the others train as the reference."""
    model, batches = mlp(dtype=torch.float32), regression_batches(3, 4, dtype=torch.float32)
    doubled = [tuple(t.double() for t in batch) for batch in batches]
    expected, _ = reference_run(copy.deepcopy(model).double(), [doubled[0], doubled[2]], reference_mse, 0.0)
    eng = engine.initialize(copy.deepcopy(model), config(4, 1, fp16={"enabled": True, "initial_scale_power": 8}),
                            optimizer=sgd)
    overflow_in_second_window(eng, eng.strategy.schedules.holds_first_stage)
    for batch in batches:
        eng.train_batch(data_share(batch, eng), mse_outputs)
    return overflow_result(eng, expected)


def misuse(rank, world):
    """The manual loop names train_batch; a batch that is not (inputs, labels) says what is; a
    loss_fn that fails on the last stage raises on every rank, not only there; an
    accumulation the schedule cannot run is refused naming the nearest; a loss_fn(model, batch)
    is refused on every rank alike, naming @engine.loss_on_outputs; an evaluation of fewer
    micro-batches than 1F1B runs is padded with zero-weight ones."""
    model = mlp()
    eng = engine.initialize(copy.deepcopy(model), config(4, 1), optimizer=sgd)
    found = {}
    x, y = regression_batches(1, 4)[0]
    found["eval"] = abs(eng.eval_batch((x[:1], y[:1]), mse_outputs) - float(reference_mse(model, (x[:1], y[:1]))))
    try:
        engine.initialize(mlp(), config(5, 1, "interleaved"), optimizer=sgd)
    except ConfigError as error:
        found["accumulation"] = str(error)
    # a loss that is not a scalar: refused on the last stage, and every rank learns of it at once
    unreduced = lambda outputs, labels: (outputs - labels) ** 2  # noqa: E731
    for name, call in {"forward": lambda: eng(x), "backward": lambda: eng.backward(x.sum()),
                       "batch": lambda: eng.train_batch(x, mse_outputs),
                       "bad loss": lambda: eng.train_batch((x, y), unreduced),
                       "bad evaluation loss": lambda: eng.eval_batch((x, y), unreduced),
                       "loss on the model": lambda: eng.train_batch((x, y), reference_mse),
                       "micro-batches": lambda: eng.train_batch(engine.MicroBatches([(x[:2], y[:2]), (x[2:], y[2:])]),
                                                                mse_outputs)}.items():
        try:
            call()
        except EngineUsageError as error:
            found[name] = str(error)
    eng.close()
    return found


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fp16_overflow_on_one_stage_discards_the_window_everywhere_and_misuse_is_explained():
    results = run_scenarios({"fp16": fp16_overflow_on_first_stage, "misuse": misuse}, world_size=2, timeout=110)
    for result in results["fp16"]:
        assert result["skipped"] == 1 and result["steps"] == 3
        assert result["diff"] < 2e-4, result
    assert results["fp16"][0]["scale"] == results["fp16"][1]["scale"]
    found_on_rank_0 = results["misuse"][0]
    for found in results["misuse"]:
        assert "train_batch((inputs, labels), loss_fn)" in found["forward"]
        assert "train_batch((inputs, labels), loss_fn)" in found["backward"]
        assert "a pair (inputs, labels)" in found["batch"]
        assert "the loss must be a scalar" in found["bad loss"] or "failed on another rank" in found["bad loss"]
        assert "the loss must be a scalar" in found["bad evaluation loss"] or (
            "failed on another rank, which raises its error itself; this evaluation is abandoned" in found["bad evaluation loss"])
        assert found["eval"] < TOL
        assert "train_batch(engine.MicroBatches(...)) under a pipeline" in found["micro-batches"]
        assert found["loss on the model"] == found_on_rank_0["loss on the model"]
        assert ("under a pipeline the last stage calls loss_fn(outputs, labels), with the model's outputs (the model is "
                "spread over the stages: none can call it); yours takes (model, batch). Give a mapping batch with "
                "'input_ids' and 'labels'" in found["loss on the model"])
        assert "to train with and without a pipeline, write it on the outputs and decorate it with " \
               "@engine.loss_on_outputs" in found["loss on the model"]
        assert ("gradient_accumulation_steps: 5 micro-batches per window cannot run as a pipeline.schedule interleaved "
                "over 2 pipeline ranks (a multiple of its rounds, ⌊micro-batches / pipeline ranks⌋); nearest: 4 or 6"
                in found["accumulation"])
    assert sum("failed on another rank" in found["bad loss"] for found in results["misuse"]) == 1
    assert sum("failed on another rank" in found["bad evaluation loss"] for found in results["misuse"]) == 1


def a_loss_failing_on_one_replica(rank, world):
    """Pipeline 2 × data 2, three windows; the second's loss_fn raises on one replica's last stage
    only: every rank abandons that window (the failing rank with its own error), the others train
    as the reference on the first and third batches."""
    model, batches = mlp(), regression_batches(3, 8)
    expected, _ = reference_run(model, [batches[0], batches[2]], reference_mse, 0.0)
    eng = engine.initialize(copy.deepcopy(model), config(8, 1), optimizer=sgd)

    def failing(outputs, labels):
        if eng.plan.rank == 1:
            raise ValueError("this replica's labels are unreadable")
        return mse_outputs(outputs, labels)

    raised = None
    for index, batch in enumerate(batches):
        try:
            eng.train_batch(data_share(batch, eng), failing if index == 1 else mse_outputs)
        except (ValueError, EngineUsageError) as error:
            raised = f"{type(error).__name__}: {error}"
    result = {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "raised": raised,
              "counters": (eng.global_steps, eng.global_samples), "computes loss": eng.strategy.holds_last_stage,
              "data rank": eng.plan.rank}
    eng.close()
    return result


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_pipeline_two_by_data_two_is_exact():
    """4 ranks: stages 1-2 on ranks {0, 1} and {2, 3}, their data-parallel replicas {0, 2} and {1, 3};
    ZeRO 0, and 2 / 3 (each stage sharded by FSDP2 over its replicas); and a pipeline of 4."""
    scenarios = {"1f1b mean": functools.partial(train),
                 "interleaved tokens": functools.partial(train, schedule="interleaved", loss="tokens"),
                 "gpipe clipped, short window": functools.partial(train, schedule="gpipe", clip=0.05, short=True),
                 "zero_bubble balanced": functools.partial(train, schedule="zero_bubble", split="balanced"),
                 "1f1b ZeRO-3, clipped short window": functools.partial(train, zero=3, clip=0.05, short=True),
                 "interleaved ZeRO-3 tokens": functools.partial(train, schedule="interleaved", loss="tokens", zero=3),
                 "gpipe ZeRO-2": functools.partial(train, schedule="gpipe", zero=2),
                 "zero_bubble ZeRO-2": functools.partial(train, schedule="zero_bubble", zero=2),
                 "pipeline 4, 1f1b tokens, clipped": functools.partial(train, loss="tokens", clip=0.05, stages=4),
                 "summed (DeepSpeed #7773)": functools.partial(train, breaks=summed_micro_batches),
                 "a loss failing on one replica": a_loss_failing_on_one_replica}
    results = run_scenarios(scenarios, world_size=4, timeout=280)
    broken = results.pop("summed (DeepSpeed #7773)")
    for found in results.pop("a loss failing on one replica"):
        assert found["diff"] < TOL and found["counters"] == (2, 16), found
        if found["computes loss"] and found["data rank"] == 1:
            assert found["raised"] == "ValueError: this replica's labels are unreadable", found
        else:
            assert "failed on another rank" in found["raised"], found
    for name, per_rank in results.items():
        assert_exact(per_rank), name
    assert all(result["diff"] > MISSED for result in broken)


# -- config, planner and split: no processes -----------------------------------------------------
def test_deepspeed_pipeline_keys_map_and_the_unused_ones_are_named():
    with pytest.warns(UserWarning, match="pipeline.activation_checkpoint_interval"):
        config = engine.load_config({"train_batch_size": 8, "pipeline": {
            "stages": 2, "partition": "uniform", "activation_checkpoint_interval": 1}})
    assert (config.pipeline.stages, config.pipeline.split, config.pipeline.schedule) == (2, "uniform", "1f1b")
    assert engine.load_config({"pipeline": {"stages": "auto", "partition": "parameters"}}).pipeline.stages == 1
    with pytest.raises(ConfigError, match=r"partition 'type:transformer' \(DeepSpeed's partition method\)"):
        engine.load_config({"pipeline": {"stages": 2, "partition": "type:transformer"}})
    with pytest.raises(ConfigError, match="pipeline.schedule: input should be 'gpipe', '1f1b', 'interleaved' or"):
        engine.load_config({"pipeline": {"stages": 2, "schedule": "dualpipe"}})


@pytest.mark.parametrize("extra, problem", [
    ({"train_micro_batch_size_per_gpu": "explore"}, "'explore' is not available under a pipeline of 2 stages"),
    ({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": None, "micro_batch_tokens": 64},
     "'auto' under a pipeline of 2 stages is not available with micro_batch_tokens"),
    ({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2, "schedule": "zero_bubble"}},
     "pipeline.schedule: zero_bubble does not train exactly with ZeRO stage 3"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
     "data_types.grad_accum_dtype: bf16 is not available under tensor_parallel.size 1 × pipeline.stages 2"),
])
def test_what_a_pipeline_cannot_run_yet_is_refused_before_anything_starts(extra, problem):
    config = engine.load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                 "pipeline": {"stages": 2}, **extra})
    assert any(problem in line for line in engine.config.checks.check_without_model(config))


def test_the_deepspeed_facade_names_train_batch_for_a_pipeline():
    """Its loop is one engine(x) / backward / step per micro-batch: refused before anything starts."""
    from engine.compat import deepspeed

    with pytest.raises(ConfigError, match=r"pipeline.stages: 2: .*eng.train_batch\(\(inputs, labels\), loss_fn\)"):
        deepspeed.initialize(model=mlp(), config={"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                                  "pipeline": {"stages": 2},
                                                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def test_the_planner_counts_data_parallel_ranks_and_its_errors_name_the_mesh(capsys):
    from engine.batching.mesh_plan import plan_for_mesh
    from engine.config.setup import mesh_layout

    config = engine.load_config({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2,
                                 "pipeline": {"stages": 2}})
    plan = plan_for_mesh(config, mesh_layout(config, 4), rank=3)
    assert (plan.world_size, plan.rank, plan.gradient_accumulation_steps) == (2, 1, 3)
    with pytest.raises(engine.BatchConfigError) as raised:
        plan_for_mesh(config, mesh_layout(config, 8))
    assert str(raised.value).startswith(
        "world 8 = pipeline 2 × data 4 × context 1 × tensor 1: the batch is planned for W_dp = 8 / (pipeline 2 × context 1 × tensor 1) = 4 "
        "data-parallel rank(s), so G = M·A·4: train_batch_size 12 is not divisible by micro 2 × world 4")
    with pytest.raises(ConfigError, match="world of 3 rank"):
        mesh_layout(config, 3)


def test_a_sequential_model_is_cut_by_parameters_uniformly_or_at_named_modules():
    from engine.pipeline.split import StageModule, cut, sequence_of

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]),
                                torch.nn.Linear(8, 2))
    parts = sequence_of(model)
    assert [name for name, _ in parts] == ["0", "1.0", "1.1", "1.2", "1.3", "2"]
    names = lambda stages: [[name for name, _ in stage] for stage in stages]  # noqa: E731
    # parameters 40, 72 x 4, 18: the cut whose largest stage is smallest
    assert names(cut(parts, 2, "auto")) == [["0", "1.0", "1.1"], ["1.2", "1.3", "2"]]
    assert names(cut(parts, 3, "uniform")) == [["0", "1.0"], ["1.1", "1.2"], ["1.3", "2"]]
    assert names(cut(parts, 2, ["1.3"])) == [["0", "1.0", "1.1", "1.2"], ["1.3", "2"]]
    stages = [StageModule(stage) for stage in cut(parts, 2, "auto")]
    assert [k for stage in stages for k in stage.state_dict()] == list(model.state_dict())
    x = torch.randn(3, 4)
    assert torch.equal(stages[1](stages[0](x)), model(x))
    blocks = Blocks()  # not an nn.Sequential: its forward's chain, traced
    assert [name for name, _ in sequence_of(blocks)] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]


def tied_sequential():
    first, last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    last.weight = first.weight
    return torch.nn.Sequential(first, torch.nn.Tanh(), last)


@pytest.mark.parametrize("model, stages, split, problem", [
    (mlp(), 2, ["9"], "pipeline.split: 9 is not a part of the model; the parts, in order, are: 0, 1, 2, 3, 4"),
    (mlp(), 3, ["2"], "pipeline.split: 1 module name(s) for 3 stage(s)"),
    (mlp(), 3, ["4", "2"], "must name modules after the first, in the model's order"),
    (mlp(), 6, "auto", "the model has 5 part(s) (0, 1, 2, 3, 4) for 6 pipeline stage(s)"),
    (TinyLM(), 2, "auto", "TinyLM's forward is not a chain of its modules: its step tanh (call_function tanh)"),
    (Residual(), 2, "auto", "Residual's forward is not a chain of its modules: its step add (call_function add)"),
    (tied_sequential(), 2, "auto", "pipeline.split: the parameter 2.weight is shared by stages 1 and 2 (tied weights)"),
    (WithStep(), 2, "auto", "WithStep has parameters or buffers its chain of modules does not hold (step)"),
])
def test_a_model_that_cannot_be_cut_as_asked_says_how_to_fix_it(model, stages, split, problem):
    from engine.pipeline.split import cut, sequence_of

    with pytest.raises(ConfigError) as raised:
        cut(sequence_of(model), stages, split)
    assert problem in str(raised.value)


def train_with_checkpoints(rank, world, directory, windows, zero, stages=2):
    """Automatic checkpoints every 2 steps in ``directory``; resumes from the newest there and
    trains up to ``windows`` windows of the same global batch on this run's data size."""
    model, batches = mlp(), regression_batches(4, 8)
    expected, _ = reference_run(model, batches[:windows], reference_mse, 0.05)
    settings = config(8, 2, "interleaved", gradient_clipping=0.05, checkpoint={"dir": directory, "every_steps": 2},
                      zero_optimization={"stage": zero})
    settings["pipeline"]["stages"] = stages
    eng = engine.initialize(copy.deepcopy(model), settings, optimizer=sgd)
    resumed = eng.global_steps
    while eng.global_steps < windows:  # the same loss with and without a pipeline
        eng.train_batch(data_share(batches[eng.global_steps], eng), engine.loss_on_outputs(mse_outputs))
    result = {"resumed": resumed, "diff": max_param_diff(eng.full_state_dict(), state(expected)),
              "accumulation": eng.plan.gradient_accumulation_steps}
    eng.close()
    return result


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("zero", [0, 3])
def test_checkpoints_per_stage_resume_on_another_data_parallel_size(tmp_path, zero):
    directory = str(tmp_path / "checkpoints")
    first = run_scenarios({"4 ranks": functools.partial(train_with_checkpoints, directory=directory, windows=2, zero=zero)},
                          world_size=4, timeout=90)["4 ranks"]
    assert [result["resumed"] for result in first] == [0] * 4
    assert [result["accumulation"] for result in first] == [2] * 4  # G 8 = M 2 · A 2 · W_dp 2
    second = run_scenarios({"2 ranks": functools.partial(train_with_checkpoints, directory=directory, windows=3, zero=zero)},
                           world_size=2, timeout=90)["2 ranks"]
    for result in second:
        assert result["resumed"] == 2 and result["accumulation"] == 4  # W_dp 1: A 4
        assert result["diff"] < TOL, result
    # and without a pipeline: one process reads every stage's entries of the step-2 checkpoint
    alone = run_scenarios({"1 rank": functools.partial(train_with_checkpoints, directory=directory, windows=4,
                                                       zero=0, stages=1)}, world_size=1, timeout=90)["1 rank"]
    assert alone[0]["resumed"] == 2 and alone[0]["diff"] < TOL, alone


def run_example(rank, world, *argv):
    from examples.pipeline import main

    return main(list(argv))


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_the_readme_script_runs_unchanged_on_one_two_and_four_processes():
    """examples/pipeline.py as README shows it: no pipeline, pipeline 2, pipeline 2 × data 2 give
    the same losses, learning rates and model on every rank (float64)."""
    alone = run_distributed(run_example, world_size=1, args=("--set", "pipeline.stages=1"))[0]
    two, four = (run_distributed(run_example, world_size=world, timeout=150) for world in (2, 4))
    assert len(alone) == 9 and alone[-1].startswith("8 micro-batches per step on 1 data-parallel rank(s)"), alone
    assert two == [alone, alone]
    for lines in four:
        assert lines[:-1] == alone[:-1] and lines[-1].startswith("4 micro-batches per step on 2 data-parallel rank(s)")
        assert lines[-1].split("checksum")[1] == alone[-1].split("checksum")[1]


def monitored(rank, world):
    """The monitor's records under a pipeline: the loss, the global gradient norm over every stage
    (the reference's, before clipping), the learning rate and a peak memory, on every stage."""
    model, batches = mlp(), regression_batches(2, 4)
    reference = copy.deepcopy(model)
    reference_mse(reference, batches[0]).backward()
    norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in reference.parameters())))
    eng = engine.initialize(copy.deepcopy(model), config(4, 1, gradient_clipping=0.05,
                                                         monitor={"enabled": True, "progress": False}),
                            optimizer=sgd, lr_scheduler=halving_schedule)
    losses, norms = [], []
    for batch in batches:
        losses.append(eng.train_batch(data_share(batch, eng), mse_outputs))
        norms.append(float(eng.last_window.step.grad_norm))
    records = [(r["loss"], r["grad_norm"], r["lr"], r["peak_memory_mb"]) for r in eng.monitor.history]
    eng.close()
    return {"norm": norm, "records": records, "losses": losses, "norms": norms}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_monitor_reports_the_same_on_every_stage():
    results = run_scenarios({"monitor": monitored}, world_size=2, timeout=110)["monitor"]
    for result in results:  # the norm every stage clipped with: the whole model's
        assert abs(result["norms"][0] - result["norm"]) < TOL and result["norms"] == results[0]["norms"]
    (loss, grad_norm, lr, peak), (_, _, second_lr, _) = results[0]["records"]  # rank 0 records
    assert loss == results[0]["losses"][0] and grad_norm == results[0]["norms"][0]
    assert (lr, second_lr) == (0.1, 0.05)
    assert peak > 0


def test_plan_and_validate_show_the_mesh(capsys):
    from engine.cli import main

    assert main(["plan", "configs/pipeline.yaml", "--world-size", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("mesh: world 4 = pipeline 2 × data 2 × context 1 × tensor 1: the batch is planned for W_dp = 4 / "
                      "(pipeline 2 × context 1 × tensor 1) = 2 data-parallel rank(s), so G = M·A·2")
    assert "accumulation steps: 4" in out
    assert main(["validate", "configs/pipeline.yaml"]) == 0
    assert "zero stage 0, pipeline 2 stages (1f1b, split auto), backend torch" in capsys.readouterr().out
    assert main(["plan", "configs/pipeline.yaml", "--world-size", "3"]) == 2
    assert "the world of 3 rank(s) does not divide into pipeline 2 × context 1 × tensor 1" in capsys.readouterr().err


def evaluated_then_trained(rank, world):
    """An evaluation, then training on batches of the same shapes and micro-batches."""
    model, batches = mlp(), regression_batches(2, 8)
    expected, _ = reference_run(model, batches, reference_mse, 0.0)
    eng = engine.initialize(copy.deepcopy(model), config(8, 2), optimizer=sgd)
    evaluated = eng.eval_batch(data_share(batches[0], eng), mse_outputs)
    for batch in batches:
        eng.train_batch(data_share(batch, eng), mse_outputs)
    result = {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
              "eval_diff": abs(evaluated - float(reference_mse(model, batches[0]))),
              "schedules": eng.strategy.schedules.built}
    eng.close()
    return result


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_evaluation_before_training_on_the_same_shapes_changes_nothing():
    """Found on torch 2.11 (docs/compatibility.md): a training schedule first run by eval() kept receive
    buffers that take no gradient. An evaluation runs a schedule of its own, the forwards alone."""
    results = run_scenarios({"evaluated, then trained": evaluated_then_trained}, world_size=2, timeout=110)
    for result in results["evaluated, then trained"]:
        assert result["diff"] < TOL and result["eval_diff"] < TOL, result
        assert result["schedules"] == 2, result
