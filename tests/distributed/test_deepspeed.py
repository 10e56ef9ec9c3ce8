"""``backend: deepspeed`` against the full-batch reference: the DeepSpeed side only (the
torch backend's multi-rank scenarios are in tests/distributed/test_distributed.py and run without
DeepSpeed installed).

Two gloo ranks on CPU. DeepSpeed cannot train in float64 (its reductions refuse it, its
ZeRO master copies are fp32), so models are fp32 and compared with a float64 reference
at ``TOL``; SGD with momentum (AdamW hides a wrongly scaled gradient), and each family's
broken variant (tests/support/broken.py) is shown to miss ``TOL``. Stages 2/3 run every scenario
with both ``defer_reduction`` settings. ZeRO-3 runs with ``stage3_param_persistence_threshold: 0``
so the small test models really are partitioned. Each stage runs all its scenarios in one
set of ranks (DeepSpeed's start-up is paid once per stage).
"""

import copy
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine
from engine.state.checkpoint import CheckpointError
from bench.comm_count import CommCounter
from engine.config.schema import load_config
from engine.batching.data import DistributedBatches
from engine.batching.microbatch import split_batch
from engine.config.deepspeed import CPU_FP16_SWITCH, deepspeed_backend_problems, deepspeed_config
from tests.support.broken import gradient_doubled, ignores_window_total, intact, weighted_one_over_a
from tests.support.dist_utils import run_distributed, run_scenarios
from tests.support.oom_models import tripwire_mlp
from tests.support.reference import (
    max_param_diff,
    mlp,
    mse,
    rank_slice,
    reference_train,
    regression_batches,
    sgd,
    state,
    TinyLM,
    token_batches,
    token_loss_mean,
    token_loss_sum,
    train_steps,
)
from tests.support.scenarios import (
    assert_precision_results, checkpointing_case, clipped_reference, compiled_case, halving_schedule, mse_in_fp32,
    needs_deepspeed, precision_case, precision_scenarios, train_batch_failing_at, train_recording,
)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
F32 = torch.float32
TOL = 1e-6  # fp32 training against the float64 reference
MISSED = 1e-4  # every broken variant misses the reference by more (measured: 2e-3 to 0.1)
STAGES = [0, 1, 2, 3]
ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
LINEAR = torch.nn.functional.linear  # ZeRO-3 replaces it process-wide unless told not to


# -- helpers -----------------------------------------------------------------------------------
def zero(stage, **extra):
    section = {"stage": stage, **extra}
    if stage == 3:
        section.setdefault("stage3_param_persistence_threshold", 0)  # partition even tiny params
    return section


def make_engine(model, stage, global_batch, micro, split="strict", optimizer=sgd, defer=False, zero_extra=None,
                lr_scheduler=None, **extra):
    zero_extra = {**({"defer_reduction": defer} if stage >= 2 else {}), **(zero_extra or {})}
    config = {"backend": "deepspeed", "train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
              "batch_split": split, "zero_optimization": zero(stage, **zero_extra), **extra}
    return engine.initialize(model, config, optimizer=optimizer, lr_scheduler=lr_scheduler)


def doubled(batches):
    return [tuple(t.double() for t in batch) if isinstance(batch, tuple) else batch for batch in batches]


def reference(model, batches, loss_fn=mse, optimizer=sgd, **kwargs):
    """The float64 full-batch run from the same (fp32) initial weights."""
    return state(reference_train(copy.deepcopy(model).double(), doubled(batches), loss_fn, optimizer, **kwargs))


def flat(state_dict) -> torch.Tensor:
    return torch.cat([v.flatten().double() for v in state_dict.values()])


def finish(eng, expected, **extra):
    """What every scenario returns: the full parameters and their distance to the reference."""
    full = eng.full_state_dict()
    result = {"params": flat(full), "diff": max_param_diff(full, expected), "counters":
              (eng.micro_steps, eng.global_steps, eng.global_samples), **extra}
    eng.close()
    return result


# -- scenarios (run on every rank; each returns what the test asserts on) -----------------------
def plan_case(rank, world, stage, micro, global_batch=8, split="strict", defer=False, breaks=intact):
    """Two windows through the manual loop, one through train_batch."""
    model, batches = mlp(dtype=F32), regression_batches(3, global_batch, dtype=F32)
    expected = reference(model, batches)
    before_last = reference_train(copy.deepcopy(model).double(), doubled(batches[:2]), mse, sgd)
    eng = breaks(make_engine(copy.deepcopy(model), stage, global_batch, micro, split, defer=defer))
    shapes = sorted({tuple(p.shape) for p in eng.module.parameters()})
    moved, boundaries, previous = [], [], flat(eng.full_state_dict())
    for batch in batches[:2]:
        for micro_batch in split_batch(rank_slice(batch, eng.plan), eng.plan.micro_batch_sizes):
            eng.backward(mse(eng, micro_batch))
            boundaries.append(eng.is_gradient_accumulation_boundary())
            stepped = eng.step()
            now = flat(eng.full_state_dict())
            moved.append((stepped, not torch.equal(now, previous)))
            previous = now
    loss = eng.train_batch(rank_slice(batches[2], eng.plan), mse)
    return finish(eng, expected, moved=moved, boundaries=boundaries, shapes=shapes, loss=loss,
                  linear_untouched=torch.nn.functional.linear is LINEAR,
                  expected_loss=mse(before_last, doubled(batches[2:])[0]).item(),
                  accumulation=eng.plan.gradient_accumulation_steps)


def token_case(rank, world, stage, defer=False, breaks=intact):
    """(sum, count) losses: every token weighs the same over both ranks; eval_batch too."""
    model, batches = TinyLM(dtype=F32), token_batches(3, 8)
    expected_model = reference_train(copy.deepcopy(model).double(), batches, token_loss_mean, sgd)
    eng = breaks(make_engine(copy.deepcopy(model), stage, 8, 2, defer=defer))
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), token_loss_sum)
    evaluated = eng.eval_batch(rank_slice(batches[0], eng.plan), token_loss_sum)
    return finish(eng, state(expected_model), eval=evaluated,
                  expected_eval=token_loss_mean(expected_model, batches[0]).item())


def short_windows(rank, world, stage, defer=False, breaks=intact):
    """A manual-loop window closed early with step(flush=True), then a short train_batch."""
    model, batches = mlp(dtype=F32), regression_batches(3, 16, dtype=F32)
    flushed = tuple(t[:8] for t in batches[1])  # each rank runs 2 of its 4 micro-steps
    short = tuple(t[:12] for t in batches[2])  # 6 of the planned 8 per rank
    expected = reference(model, [batches[0], flushed, short])
    eng = breaks(make_engine(copy.deepcopy(model), stage, 16, 2, defer=defer))
    for micro_batch in split_batch(rank_slice(batches[0], eng.plan), eng.plan.micro_batch_sizes):
        eng.backward(mse(eng, micro_batch))
        eng.step()
    for micro_batch in split_batch(tuple(t[4 * rank:4 * rank + 4] for t in flushed), (2, 2)):
        eng.backward(mse(eng, micro_batch))
        assert not eng.step()
    assert eng.step(flush=True)
    eng.train_batch(tuple(t[6 * rank:6 * rank + 6] for t in short), mse)
    return finish(eng, expected)


def failed_batch(rank, world, stage, defer=False):
    """A batch whose loss function raises mid-window leaves nothing behind: the next window
    trains as if it had never run (gradients already reduced or accumulated are dropped)."""
    model, batches = mlp(dtype=F32), regression_batches(3, 16, dtype=F32)
    expected = reference(model, [batches[0], batches[2]])
    eng = make_engine(copy.deepcopy(model), stage, 16, 2, defer=defer)
    eng.train_batch(rank_slice(batches[0], eng.plan), mse)
    train_batch_failing_at(eng, rank_slice(batches[1], eng.plan))
    eng.train_batch(rank_slice(batches[2], eng.plan), mse)
    return finish(eng, expected)


def clipped_with_scheduler(rank, world, stage, defer=False):
    """Clipping sees the whole window's gradient; the scheduler steps once per applied step;
    the reported gradient norm is the full-batch one."""
    model, batches = mlp(dtype=F32), regression_batches(3, 8, dtype=F32)
    ref = copy.deepcopy(model).double()
    expected_norms = clipped_reference(ref, doubled(batches), 0.05)
    eng = make_engine(copy.deepcopy(model), stage, 8, 2, defer=defer, gradient_clipping=0.05,
                      lr_scheduler=halving_schedule)
    recorded = train_recording(eng, [rank_slice(batch, eng.plan) for batch in batches])
    return finish(eng, state(ref), expected_norms=expected_norms, **recorded)


def collectives(rank, world, stage, defer=False):
    """Collectives counted at DeepSpeed's comm layer after a first window: each micro-step of
    a manual-loop window of 4 (without and with clipping), and a whole train_batch window."""
    def counted(clip):
        model, (batch,) = mlp(dtype=F32), regression_batches(1, 16, dtype=F32)
        eng = make_engine(copy.deepcopy(model), stage, 16, 2, defer=defer, gradient_clipping=clip)
        local = rank_slice(batch, eng.plan)
        eng.train_batch(local, mse)
        per_micro_step = []
        with CommCounter() as comm:
            unwatch = comm.watch_deepspeed()
            try:
                for micro_batch in split_batch(local, eng.plan.micro_batch_sizes):
                    comm.reset()
                    eng.backward(mse(eng, micro_batch))
                    eng.step()
                    per_micro_step.append(dict(comm.calls))
                comm.reset()
                eng.train_batch(local, mse)
                window = dict(comm.calls)
            finally:
                unwatch()
        eng.close()
        return per_micro_step, window

    manual, train_batch = counted(0.0)
    manual_clipped, _ = counted(1.0)
    return {"manual": manual, "train_batch": train_batch, "manual clipped": manual_clipped}


def expected_collectives(stage, defer, clipped=False):
    """What one manual-loop window of 4 micro-steps sends, micro-step by micro-step (2 ranks,
    a model small enough for one bucket of each kind). Measured with DeepSpeed 0.19.8."""
    quiet = [{}] * 3
    if stage == 0:  # the gradient all-reduce in the closing backward; DeepSpeed's clipping all-reduces its norm
        return quiet + [{"all_reduce": 1 + int(clipped)}]
    boundary = {"all_reduce": 2, "all_gather": 1}  # the reduction, the norm / overflow check; the new partitions
    if stage == 1 or (stage == 2 and defer):  # gradients held full-size, one reduction pass at the boundary
        return quiet + [boundary]
    if stage == 2:  # gradients reduced into partitions after every micro-step
        return [{"all_reduce": 1}] * 3 + [boundary]
    # stage 3: parameters gathered for every forward; gradients reduce-scattered after every
    # micro-step, or once at the end when deferred; the norm / overflow check at the boundary
    step = {"all_gather": 1} if defer else {"all_gather": 1, "reduce_scatter": 1}
    return [step] * 3 + [{"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}]


def window_total(per_micro_step, statistics_reductions):
    """The micro-steps' collectives summed, plus the window statistics' small reductions (an
    all-gather of a few numbers each, ``collectives.small_sum``)."""
    total = {"small all_gather": statistics_reductions}
    for step in per_micro_step:
        for kind, count in step.items():
            total[kind] = total.get(kind, 0) + count
    return total


def bf16_overflow(rank, world, stage):
    """A non-finite gradient anywhere in a window discards the whole window (DeepSpeed's bf16
    overflow check): no parameter moves, the scheduler does not step, the next window trains."""
    model, batches = mlp(dtype=F32), regression_batches(2, 8, dtype=F32)
    eng = make_engine(copy.deepcopy(model), stage, 8, 2, bf16={"enabled": True},
                      lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5))
    before = flat(eng.full_state_dict())
    poisoned = [0]

    def loss_fn(model, batch):  # rank 1's second micro-batch has an infinite loss
        poisoned[0] += 1
        loss = mse_in_fp32(model, batch)
        return loss * float("inf") if rank == 1 and poisoned[0] == 2 else loss

    eng.train_batch(rank_slice(batches[0], eng.plan), loss_fn)
    unchanged = torch.equal(flat(eng.full_state_dict()), before)
    skipped, epoch = eng.skipped_steps, eng.lr_scheduler.last_epoch
    eng.train_batch(rank_slice(batches[1], eng.plan), mse_in_fp32)
    moved = not torch.equal(flat(eng.full_state_dict()), before)
    result = {"unchanged": unchanged, "skipped": skipped, "epoch": epoch, "moved": moved,
              "after": (eng.skipped_steps, eng.lr_scheduler.last_epoch, eng.global_steps)}
    eng.close()
    return result


def offload_case(rank, world, stage, defer=False):
    """DeepSpeed-only knobs pass through: optimizer (and at ZeRO-3 parameter) offload to CPU,
    with the torch optimizer instance Microstep hands over."""
    extra = {"offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        extra["offload_param"] = {"device": "cpu"}
    model, batches = mlp(dtype=F32), regression_batches(2, 16, dtype=F32)
    short = tuple(t[:12] for t in batches[1])
    expected = reference(model, [batches[0], short])
    eng = make_engine(copy.deepcopy(model), stage, 16, 2, defer=defer, zero_extra=extra)
    eng.train_batch(rank_slice(batches[0], eng.plan), mse)
    eng.train_batch(tuple(t[6 * rank:6 * rank + 6] for t in short), mse)
    return finish(eng, expected)


def auto_oom(rank, world, stage, **tripwire):
    """micro size auto with an out-of-memory injected on one rank: no hang, exact result."""
    batches = regression_batches(3, 16, dtype=F32)
    model = tripwire_mlp(**tripwire).float()
    expected = reference(tripwire_mlp().float(), batches)
    eng = engine.initialize(model, {"backend": "deepspeed", "train_batch_size": 16,
                                    "train_micro_batch_size_per_gpu": "auto",
                                    "zero_optimization": zero(stage, defer_reduction=stage == 2)}, optimizer=sgd)
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), mse)
    return finish(eng, expected, micro=eng.plan.micro_batch_sizes, changes=eng.micro_batch_tuner.changes)


def refused(rank, world, config, dtype=F32):
    """The ConfigError initialize raises (None when it does not)."""
    try:
        eng = engine.initialize(mlp(dtype=dtype), config, optimizer=sgd)
    except engine.ConfigError as error:
        return str(error)
    eng.close()
    return None


def json_config(rank, world, backend):
    """configs/deepspeed_zero2.json unchanged (its AdamW, WarmupLR, clipping 1.0, ZeRO-2 knobs)."""
    model, batches = mlp(dtype=F32), regression_batches(3, 16, dtype=F32)
    eng = engine.initialize(copy.deepcopy(model), str(CONFIGS / "deepspeed_zero2.json"),
                            overrides=[f"backend={backend}"])
    losses = [eng.train_batch(rank_slice(batch, eng.plan), mse) for batch in batches]
    result = {"params": flat(eng.full_state_dict()), "losses": losses, "lr": eng.optimizer.param_groups[0]["lr"],
              "plan": (eng.plan.train_micro_batch_size_per_gpu, eng.plan.gradient_accumulation_steps),
              "strategy": type(eng.strategy).__name__}
    eng.close()
    return result


def yaml_zero3(rank, world):
    """configs/deepspeed_zero3.yaml (backend, bf16 and ZeRO-3 knobs in the file) trains."""
    model, batches = mlp(dtype=F32), regression_batches(3, 64, dtype=F32)
    eng = engine.initialize(copy.deepcopy(model), str(CONFIGS / "deepspeed_zero3.yaml"))
    losses = [eng.train_batch(rank_slice(batch, eng.plan), mse_in_fp32) for batch in batches]
    result = {"losses": losses, "strategy": type(eng.strategy).__name__, "stage": eng.strategy.stage,
              "accumulation": eng.plan.gradient_accumulation_steps, "params": flat(eng.full_state_dict()),
              "initial": flat(state(model))}
    eng.close()
    return result


# name: (scenario, its arguments, its counters (micro-steps, optimizer steps, samples) on 2 ranks)
EXACTNESS = {
    "accumulation 1": (plan_case, {"micro": 4}, (3, 3, 24)),
    "accumulation 2": (plan_case, {"micro": 2}, (6, 3, 24)),
    "accumulation 4": (plan_case, {"micro": 1}, (12, 3, 24)),
    "balanced": (plan_case, {"micro": 2, "global_batch": 11, "split": "balanced"}, (9, 3, 33)),
    "tokens": (token_case, {}, (6, 3, 24)),
    "short windows": (short_windows, {}, (10, 3, 36)),
    "clipped + scheduler": (clipped_with_scheduler, {}, (6, 3, 24)),
    "failed batch": (failed_batch, {}, (8, 2, 32)),
}
# name: (what it breaks, the bug it must catch)
BROKEN = {
    "accumulation 2": gradient_doubled,
    "balanced": weighted_one_over_a,
    "tokens": weighted_one_over_a,
    "short windows": ignores_window_total,
}


def stage_scenarios(stage):
    scenarios = {}
    defers = (False, True) if stage >= 2 else (False,)
    for defer in defers:
        for name, (fn, kwargs, _) in EXACTNESS.items():
            scenarios[(name, defer)] = functools.partial(fn, stage=stage, defer=defer, **kwargs)
        scenarios[("collectives", defer)] = functools.partial(collectives, stage=stage, defer=defer)
        if not torch.cuda.is_available():
            scenarios[("fp16 refused", defer)] = functools.partial(refused, config={
                "backend": "deepspeed", "train_batch_size": 8, "fp16": {"enabled": True},
                "zero_optimization": zero(stage, **({"defer_reduction": defer} if stage >= 2 else {}))})
    for name, bug in BROKEN.items():
        fn, kwargs, _ = EXACTNESS[name]
        scenarios[(name, "broken")] = functools.partial(fn, stage=stage, breaks=bug, **kwargs)
    for key, partial in precision_scenarios("deepspeed", ("bf16",), (stage,)).items():
        scenarios[("precision", *key)] = partial
    scenarios["bf16 overflow"] = functools.partial(bf16_overflow, stage=stage)
    scenarios["activation checkpointing"] = functools.partial(checkpointing_case, stage=stage, precision={},
                                                              backend="deepspeed")
    # DeepSpeed's ZeRO-3 fetches parameters in hooks inside each block: dynamo captures nothing of
    # a checkpointed block there (it runs eager, docs/config.md), so ZeRO-3 compiles without checkpointing.
    scenarios["compile"] = functools.partial(compiled_case, stage=stage, precision={}, backend="deepspeed",
                                             checkpointing=stage < 3)
    if stage >= 2:
        for defer in defers:
            scenarios[("offload", defer)] = functools.partial(offload_case, stage=stage, defer=defer)
    if stage < 3:
        scenarios["auto, rank 1 forward"] = functools.partial(auto_oom, stage=stage, max_micro=3, ranks=(1,))
        scenarios["auto, rank 1 backward"] = functools.partial(auto_oom, stage=stage, max_micro=3, ranks=(1,),
                                                                where="backward")
    else:
        scenarios["auto refused"] = functools.partial(refused, config={
            "backend": "deepspeed", "train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
            "zero_optimization": zero(3)})
    if stage == 0:
        scenarios["float64 refused"] = functools.partial(refused, dtype=torch.float64, config={
            "backend": "deepspeed", "train_batch_size": 8})
    if stage == 2:
        scenarios.update({("json", b): functools.partial(json_config, backend=b) for b in ("torch", "deepspeed")})
    if stage == 3:
        scenarios["yaml zero3"] = yaml_zero3
    return scenarios


@needs_deepspeed
@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", STAGES)
def test_stage_equals_reference(stage):
    results = run_scenarios(stage_scenarios(stage), world_size=2, timeout=240, env=ENV)
    defers = (False, True) if stage >= 2 else (False,)
    for defer in defers:
        for name, (_, _, counters) in EXACTNESS.items():
            first, second = results[(name, defer)]
            for rank, result in enumerate((first, second)):
                assert result["diff"] < TOL, (name, defer, rank, result["diff"])
            assert torch.equal(first["params"], second["params"]), (name, defer)  # every rank, full state
            assert first["counters"] == counters, (name, defer, first["counters"])

        for name in ("accumulation 1", "accumulation 2", "accumulation 4", "balanced"):
            result = results[(name, defer)][0]
            accumulation = result["accumulation"]
            assert accumulation == {"accumulation 1": 1, "accumulation 2": 2, "accumulation 4": 4}.get(name, 3)
            # parameters move exactly when a window closes; the boundary is announced before step()
            assert all(stepped == moved for stepped, moved in result["moved"]), result["moved"]
            assert [stepped for stepped, _ in result["moved"]] == ([False] * (accumulation - 1) + [True]) * 2
            assert result["boundaries"] == [stepped for stepped, _ in result["moved"]]
            assert result["loss"] == pytest.approx(result["expected_loss"], rel=1e-5)
            if stage == 3:  # really partitioned: the module holds empty placeholders
                assert result["shapes"] == [(0,)], result["shapes"]
            assert result["linear_untouched"]

        tokens = results[("tokens", defer)][0]
        assert tokens["eval"] == pytest.approx(tokens["expected_eval"], rel=1e-5)
        clipped = results[("clipped + scheduler", defer)][0]
        assert clipped["lrs"] == [0.1, 0.05, 0.025] and clipped["scheduler_steps"] == 3
        assert clipped["norms"] == pytest.approx(clipped["expected_norms"], rel=1e-5)
        assert all(norm > 0.05 for norm in clipped["expected_norms"])  # clipping was active

        expected = expected_collectives(stage, defer)
        for got in results[("collectives", defer)]:
            assert got["manual"] == expected, (defer, got["manual"])
            assert got["manual clipped"] == expected_collectives(stage, defer, clipped=True), (defer, got)
            assert got["train_batch"] == window_total(expected, 1), (defer, got["train_batch"])  # + the window's totals
        for message in results.get(("fp16 refused", defer), []):
            assert "fp16.enabled: backend deepspeed runs fp16 on CUDA GPUs only" in message and "bf16" in message
        for result in results.get(("offload", defer), []):
            assert result["diff"] < TOL

    for name in BROKEN:
        for result in results[(name, "broken")]:
            assert result["diff"] > MISSED, (name, result["diff"])
    precision = {key[1:]: value for key, value in results.items() if isinstance(key, tuple) and key[0] == "precision"}
    assert_precision_results(precision, "deepspeed")
    for result in precision[("bf16", "mean", stage, False)]:
        assert result["dtype"] == "torch.bfloat16"  # DeepSpeed's bf16 holds the parameters in bf16
    assert max(results["activation checkpointing"]) < 1e-6  # Microstep's keys, applied before DeepSpeed wraps
    for diff, captured in results["compile"]:
        assert captured > 0 and diff < 1e-6, results["compile"]
    for result in results["bf16 overflow"]:
        assert result["unchanged"] and result["skipped"] == 1 and result["epoch"] == 0, result
        assert result["moved"] and result["after"] == (1, 1, 2), result
    for name in ("auto, rank 1 forward", "auto, rank 1 backward"):
        if name in results:
            first, second = results[name]
            assert first["diff"] < TOL and second["diff"] < TOL, name
            assert first["micro"] == second["micro"] and first["changes"] == second["changes"]
            assert first["changes"] and first["changes"][0]["ranks"] == [1], first["changes"]
    if "auto refused" in results:
        for message in results["auto refused"]:
            assert "auto with backend deepspeed needs ZeRO stage 0, 1 or 2" in message
    if "float64 refused" in results:
        for message in results["float64 refused"]:
            assert "float64 parameters" in message and "model.float()" in message
    if "yaml zero3" in results:
        first, second = results["yaml zero3"]
        assert (first["strategy"], first["stage"], first["accumulation"]) == ("DeepSpeedStrategy", 3, 4)
        assert torch.equal(first["params"], second["params"]) and all(map(math.isfinite, first["losses"]))
        assert (first["params"] - first["initial"]).abs().max() > 1e-4  # it trained (bf16 parameters)
    if ("json", "deepspeed") in results:  # the same config on both backends trains the same
        ds, torch_run = results[("json", "deepspeed")][0], results[("json", "torch")][0]
        assert ds["strategy"] == "DeepSpeedStrategy" and ds["plan"] == (4, 2)
        assert (ds["params"] - torch_run["params"]).abs().max().item() < TOL
        assert ds["losses"] == pytest.approx(torch_run["losses"], rel=1e-5)
        assert ds["lr"] == pytest.approx(torch_run["lr"])


# -- fp16: refused on CPU, its arithmetic checked where DeepSpeed's CPU accelerator runs it ------
ONEDNN_FP16 = torch.ops.mkldnn._is_mkldnn_fp16_supported()


def fp16_case(rank, world, force_accelerator=False, **kwargs):
    """precision_case in fp16, the CPU-only refusal lifted by the documented switch (set in ENV_FP16):
    the stage-0 loss scale, the ZeRO optimizers' scaled step and the window weighting GPUs run.
    ``force_accelerator``: DeepSpeed's CPU accelerator told fp16 is supported where oneDNN lacks it."""
    if force_accelerator:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
        CPU_Accelerator.is_fp16_supported = lambda self: True
    return precision_case(rank, world, backend="deepspeed", precision="fp16", **kwargs)


ENV_FP16 = {**ENV, CPU_FP16_SWITCH: "1"}


@needs_deepspeed
@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the ranks' DeepSpeed would pick its CUDA accelerator, "
                    "while this runs fp16 on DeepSpeed's CPU accelerator (gloo ranks)")
def test_fp16_arithmetic_on_every_stage():
    """DeepSpeed 0.19's engine.backward leaves the stage-0 fp16 loss scale out while its fp16
    optimizer divides by it: updates were 1/scale of the right ones before the strategy applied
    the scale itself. Clipping, token losses and a short window, as for bf16. On every CPU: where
    oneDNN lacks fp16, DeepSpeed's CPU accelerator refuses it only by its is_fp16_supported(), and
    PyTorch's own CPU fp16 kernels run the same arithmetic once that is forced."""
    scenarios = {}
    for stage in STAGES:
        for loss in ("mean", "tokens"):
            case = functools.partial(fp16_case, stage=stage, loss=loss, force_accelerator=not ONEDNN_FP16)
            scenarios[("fp16", loss, stage, False)] = case
            scenarios[("fp16", loss, stage, "broken")] = functools.partial(case, breaks=ignores_window_total)
    results = run_scenarios(scenarios, world_size=2, timeout=200, env=ENV_FP16)
    assert_precision_results(results, "deepspeed")
    assert all(result["dtype"] == "torch.float16" for per_rank in results.values() for result in per_rank)


# -- checkpoints -----------------------------------------------------------------------------------
CKPT_BATCH, CKPT_STEPS, CKPT_FIRST = 8, 5, 2


CKPT_SETTINGS = [(0, False), (1, False), (2, False), (2, True), (3, False), (3, True)]  # (stage, defer)


def ckpt_name(stage, defer=False):
    return f"stage{stage}" + ("-deferred" if defer else "")


def ckpt_config(stage, defer=False):
    return {"backend": "deepspeed", "train_batch_size": CKPT_BATCH, "train_micro_batch_size_per_gpu": 2, "seed": 0,
            "zero_optimization": zero(stage, **({"defer_reduction": defer} if stage >= 2 else {})),
            "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_num_steps": 3,
                                                               "warmup_type": "linear"}}}


def ckpt_dataset():
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(28, 8, generator=g), torch.randn(28, 3, generator=g))


def ckpt_engine(stage, seed=0, defer=False):
    eng = engine.initialize(mlp(seed, dtype=F32), ckpt_config(stage, defer))
    return eng, DistributedBatches(ckpt_dataset(), eng.plan, seed=11)




def ckpt_snapshot(eng, data):
    return {"params": flat(eng.full_state_dict()), "counters": (eng.global_steps, eng.global_samples),
            "lr": eng.optimizer.param_groups[0]["lr"], "data": data.state_dict(), "rand": torch.rand(3)}


def save_continue_resume(rank, world, root):
    """Per stage and defer setting: train, save, keep training (uninterrupted); a fresh engine
    from another initialisation loads and trains the same steps (resumed)."""
    out = {}
    for stage, defer in CKPT_SETTINGS:
        path = os.path.join(root, ckpt_name(stage, defer))
        eng, data = ckpt_engine(stage, defer=defer)
        train_steps(eng, data, CKPT_FIRST)
        eng.save_checkpoint(path, data=data, client_state={"note": stage})
        train_steps(eng, data, CKPT_STEPS - CKPT_FIRST)
        straight = ckpt_snapshot(eng, data)
        eng.close()
        eng, data = ckpt_engine(stage, seed=99, defer=defer)
        client = eng.load_checkpoint(path, data=data)
        train_steps(eng, data, CKPT_STEPS - CKPT_FIRST)
        out[(stage, defer)] = {"straight": straight, "resumed": ckpt_snapshot(eng, data), "client": client}
        eng.close()
    return out


def resume_on_one_rank(rank, world, root):
    out = {}
    for stage in STAGES:
        eng, data = ckpt_engine(stage, seed=99)
        try:
            eng.load_checkpoint(os.path.join(root, f"stage{stage}"), data=data)
        except CheckpointError as error:
            out[stage] = str(error)
        else:
            train_steps(eng, data, CKPT_STEPS - CKPT_FIRST)
            out[stage] = ckpt_snapshot(eng, data)
        eng.close()
    wrong_stage, _ = ckpt_engine(1)
    with pytest.raises(CheckpointError) as error:
        wrong_stage.load_checkpoint(os.path.join(root, "stage2"))
    out["wrong stage"] = str(error.value)
    for stage in (0, 3):  # saved on one rank, resumed on two (test_checkpoint_resumes_on_more_ranks)
        eng, data = ckpt_engine(stage)
        train_steps(eng, data, CKPT_FIRST)
        eng.save_checkpoint(os.path.join(root, f"one{stage}"), data=data)
        train_steps(eng, data, CKPT_STEPS - CKPT_FIRST)
        out[f"one{stage}"] = ckpt_snapshot(eng, data)
        eng.close()
    torch_engine = engine.initialize(mlp(dtype=F32), {**ckpt_config(2), "backend": "torch"})
    with pytest.raises(CheckpointError) as error:
        torch_engine.load_checkpoint(os.path.join(root, "stage2"))
    out["torch backend"] = str(error.value)
    return out


def resume_on_two_ranks(rank, world, root):
    out = {}
    for stage in (0, 3):
        eng, data = ckpt_engine(stage, seed=99)
        eng.load_checkpoint(os.path.join(root, f"one{stage}"), data=data)
        train_steps(eng, data, CKPT_STEPS - CKPT_FIRST)
        out[stage] = ckpt_snapshot(eng, data)
        eng.close()
    return out


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ds_ckpt"))
    two = run_distributed(save_continue_resume, world_size=2, args=(root,), timeout=240, env=ENV)
    one = run_distributed(resume_on_one_rank, world_size=1, args=(root,), timeout=240, env=ENV)
    more = run_distributed(resume_on_two_ranks, world_size=2, args=(root,), timeout=240, env=ENV)
    return root, two, one[0], more


@needs_deepspeed
@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(60, func_only=True)  # the fixture's runs are bounded by their own timeouts
def test_checkpoint_resume_equals_uninterrupted(checkpoint_runs):
    root, two, _, _ = checkpoint_runs
    # no leftovers of the universal conversions
    assert sorted(os.listdir(root)) == sorted(["one0", "one3"] + [ckpt_name(*setting) for setting in CKPT_SETTINGS])
    for stage, defer in CKPT_SETTINGS:
        manifest = json.loads(Path(root, ckpt_name(stage, defer), "manifest.json").read_text())
        assert manifest["state_format"] == "deepspeed" and manifest["world_size"] == 2
        assert "model_optimizer/microstep_deepspeed.json" in manifest["files"]
        for rank in range(2):
            run = two[rank][(stage, defer)]
            assert run["client"] == {"note": stage}
            straight, resumed = run["straight"], run["resumed"]
            assert resumed["counters"] == straight["counters"] == (CKPT_STEPS, CKPT_STEPS * CKPT_BATCH)
            assert resumed["lr"] == straight["lr"] and resumed["data"] == straight["data"]
            assert torch.equal(resumed["params"], straight["params"]), (stage, defer)  # bitwise
            assert torch.equal(resumed["rand"], straight["rand"])  # RNG restored


@needs_deepspeed
@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(60, func_only=True)
def test_checkpoint_resumes_on_another_world_size(checkpoint_runs):
    """2 -> 1: stage 0 loads directly; ZeRO-1/2/3 state goes through DeepSpeed's universal
    checkpoint. Same training up to the summation order."""
    _, two, one, _ = checkpoint_runs
    for stage in STAGES:
        got, expected = one[stage], two[0][(stage, False)]["straight"]
        assert isinstance(got, dict), got
        assert got["counters"] == expected["counters"] and got["lr"] == expected["lr"]
        assert (got["params"] - expected["params"]).abs().max().item() < TOL, stage
    assert "saved by DeepSpeed at ZeRO stage 2; this engine runs stage 1" in one["wrong stage"]
    assert "'deepspeed' layout" in one["torch backend"]


@needs_deepspeed
@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(60, func_only=True)
def test_checkpoint_resumes_on_more_ranks(checkpoint_runs):
    """1 -> 2 ranks (ZeRO-3 through the universal checkpoint; the new rank's RNG is re-seeded)."""
    _, _, one, more = checkpoint_runs
    for stage in (0, 3):
        expected = one[f"one{stage}"]
        for got in more:
            got = got[stage]
            assert got["counters"] == expected["counters"] and got["lr"] == expected["lr"]
            assert got["data"] == expected["data"]
            assert (got["params"] - expected["params"]).abs().max().item() < TOL, stage


# -- the demo under the deepspeed launcher lives in tests/integration/test_launch.py -----------------------------


# -- without processes --------------------------------------------------------------------------
def test_config_translation_leaves_accumulation_to_microstep():
    config = load_config({"backend": "deepspeed", "train_batch_size": 64, "gradient_accumulation_steps": 4,
                          "zero_optimization": {"stage": 2, "defer_reduction": False, "overlap_comm": True,
                                                "offload_optimizer": {"device": "cpu", "pin_memory": True}},
                          "bf16": {"enabled": True}, "steps_per_print": 7, "wall_clock_breakdown": True,
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    ds = deepspeed_config(config, world_size=4)
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    assert tuple(ds[key] for key in batch_keys) == (4, 1, 1)
    assert ds["gradient_clipping"] == 0.0  # stated: DeepSpeed's default would be 1.0
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True,
                                       "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert ds["steps_per_print"] == 7 and ds["wall_clock_breakdown"] is True
    assert "optimizer" not in ds and "scheduler" not in ds  # handed over as torch instances
    assert ds["zero_allow_untested_optimizer"] is True and ds["zero_force_ds_cpu_optimizer"] is False


def test_config_translation_stage3_and_user_overrides():
    config = load_config({"backend": "deepspeed", "train_batch_size": 8, "gradient_clipping": 1.5,
                          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                          "fp16": {"enabled": True, "initial_scale_power": 8}, "zero_allow_untested_optimizer": False,
                          "checkpoint": {"load_universal": False}})
    ds = deepspeed_config(config, world_size=2)
    # ZeRO-3 would otherwise patch torch.nn.functional.linear process-wide
    assert ds["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0,
                                       "memory_efficient_linear": False}
    assert ds["gradient_clipping"] == 1.5 and ds["train_batch_size"] == 2
    assert ds["fp16"]["enabled"] and ds["fp16"]["initial_scale_power"] == 8 and ds["fp16"]["loss_scale"] == 0.0
    assert ds["zero_allow_untested_optimizer"] is False  # the user's own value is kept
    assert ds["checkpoint"] == {"load_universal": False}
    config = load_config({"backend": "deepspeed", "train_batch_size": 8,
                          "zero_optimization": {"stage": 3, "memory_efficient_linear": True}})
    assert deepspeed_config(config, 2)["zero_optimization"]["memory_efficient_linear"] is True


def test_the_deepspeed_json_config_translates_unchanged():
    config = load_config(CONFIGS / "deepspeed_zero2.json", ["backend=deepspeed"])
    ds = deepspeed_config(config, world_size=2)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                       "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000}
    assert ds["gradient_clipping"] == 1.0 and ds["steps_per_print"] == 10 and ds["wall_clock_breakdown"] is False
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 2)


def test_the_zero3_yaml_config_translates():
    config = load_config(CONFIGS / "deepspeed_zero3.yaml")
    assert config.backend == "deepspeed" and config.deepspeed_extras == {"steps_per_print": 100}
    ds = deepspeed_config(config, world_size=2)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["overlap_comm"] is True
    assert ds["zero_optimization"]["memory_efficient_linear"] is False
    assert "defer_reduction" not in ds["zero_optimization"] and "shard_unit_size" not in ds["zero_optimization"]
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 1.0


def test_what_deepspeed_cannot_do_is_refused_before_it_starts():
    def problems(**config):
        return " ".join(deepspeed_backend_problems(load_config({"backend": "deepspeed", "train_batch_size": 8, **config})))

    assert "gradient_allreduce_op: 'sum'" in problems(gradient_allreduce_op="sum")
    assert "auto with backend deepspeed needs ZeRO stage 0, 1 or 2" in problems(
        train_micro_batch_size_per_gpu="auto", zero_optimization={"stage": 3})
    assert "explore" in problems(train_micro_batch_size_per_gpu="explore",
                                 zero_optimization={"stage": 2, "defer_reduction": False})
    assert "needs zero_optimization.defer_reduction: true" in problems(train_micro_batch_size_per_gpu="auto",
                                                                     zero_optimization={"stage": 2})
    assert problems(train_micro_batch_size_per_gpu="auto", zero_optimization={"stage": 2, "defer_reduction": True}) == ""
    assert problems(zero_optimization={"stage": 3}) == ""
    if not torch.cuda.is_available():
        for stage in STAGES:
            fp16 = problems(fp16={"enabled": True}, zero_optimization={"stage": stage})
            assert "fp16.enabled: backend deepspeed runs fp16 on CUDA GPUs only" in fp16 and "bf16" in fp16


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA GPU")
def test_fp16_on_a_cpu_only_machine_is_refused_by_initialize_and_validate(tmp_path, capsys, monkeypatch):
    from engine.cli import main

    config = {"backend": "deepspeed", "train_batch_size": 8, "fp16": {"enabled": True}}
    monkeypatch.setenv(CPU_FP16_SWITCH, "1")  # the documented switch lifts it (test_fp16_arithmetic_on_every_stage)
    assert deepspeed_backend_problems(load_config(config)) == []
    monkeypatch.delenv(CPU_FP16_SWITCH)
    with pytest.raises(engine.ConfigError, match=r"fp16.enabled: .*CUDA GPUs only.*bf16: \{enabled: true\}"):
        engine.initialize(mlp(dtype=F32), config, optimizer=sgd)  # before any process group or DeepSpeed import
    path = tmp_path / "fp16.json"
    path.write_text(json.dumps(config))
    assert main(["validate", str(path)]) == 2
    assert "fp16.enabled: backend deepspeed runs fp16 on CUDA GPUs only" in capsys.readouterr().err


def test_without_deepspeed_the_torch_backend_works_and_deepspeed_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now fails
    eng = engine.initialize(mlp(dtype=F32), {"train_batch_size": 4}, optimizer=sgd)
    x, y = regression_batches(1, 4, dtype=F32)[0]
    eng.train_batch((x, y), mse)
    with pytest.raises(engine.ConfigError, match=r"pip install 'microstep\[deepspeed\]'.*backend: torch"):
        engine.initialize(mlp(dtype=F32), {"backend": "deepspeed", "train_batch_size": 4}, optimizer=sgd)


def test_import_engine_does_not_import_deepspeed():
    code = ("import sys, engine; engine.initialize; "
            "assert 'deepspeed' not in sys.modules, sorted(m for m in sys.modules if 'deepspeed' in m)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
