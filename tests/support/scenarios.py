"""Scenarios and checks shared by several test modules (one process or several ranks, the torch
and the DeepSpeed backends): a loss function that fails mid-window, the misuses of the engine's
API, mixed precision against the float64 reference."""

from __future__ import annotations

import copy
import functools
import importlib.util
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import engine
from bench.model_transforms import lm, lm_loss, tokens
from engine.batching.microbatch import split_batch
from tests.support.broken import ignores_window_total, intact
from tests.support.reference import (
    TinyLM, max_param_diff, mlp, mse, reference_train, regression_batches, sgd, state, token_batches, token_loss_mean,
    token_loss_sum,
)

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed")


# -- clipping with a learning-rate schedule -----------------------------------------------------
def halving_schedule(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def clipped_reference(ref, batches, clip: float) -> list[float]:
    """Trains ``ref`` in place, one SGD step per global batch with clipping at ``clip`` and the
    halving schedule; returns the gradient norm before each clip."""
    optimizer = sgd(ref.parameters())
    scheduler = halving_schedule(optimizer)
    norms = []
    for batch in batches:
        optimizer.zero_grad()
        mse(ref, batch).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        optimizer.step()
        scheduler.step()
    return norms


def train_recording(eng, rank_batches) -> dict:
    """``eng.train_batch`` over this rank's batches; the learning rate before each window, the
    reported gradient norms and the scheduler's position after."""
    lrs, norms = [], []
    for batch in rank_batches:
        lrs.append(eng.optimizer.param_groups[0]["lr"])
        eng.train_batch(batch, mse)
        norms.append(float(eng.last_window.step.grad_norm))
    return {"lrs": lrs, "norms": norms, "lr_after": eng.optimizer.param_groups[0]["lr"],
            "scheduler_steps": eng.lr_scheduler.last_epoch}


# -- a loss function that raises mid-window ------------------------------------------------------
def train_batch_failing_at(eng, batch, call: int = 3) -> None:
    """``eng.train_batch(batch)`` with ``mse`` raising in its ``call``-th micro-batch; checks that
    the error reached the caller."""
    calls = [0]

    def breaks_at(model, micro_batch):
        calls[0] += 1
        if calls[0] == call:
            raise ValueError("a bad micro-batch")
        return mse(model, micro_batch)

    with pytest.raises(ValueError, match="a bad micro-batch"):
        eng.train_batch(batch, breaks_at)


# -- misuse: clear errors that change nothing ---------------------------------------------------
def _local(eng, extra=0):
    """A per-device batch for this rank's plan (``extra`` samples more)."""
    return regression_batches(1, eng.plan.per_device_batch_size + extra)[0]


def _micro_step(eng):
    x, y = _local(eng)
    eng.backward(mse(eng, (x[:2], y[:2])))
    eng.step()


def _fill_window(eng):
    x, y = _local(eng)
    for micro_batch in split_batch((x, y), eng.plan.micro_batch_sizes):
        eng.backward(mse(eng, micro_batch))


def _pair_loss(eng):
    x, y = _local(eng)
    return ((eng(x[:2]) - y[:2]) ** 2).sum(), 6


# name: (what runs first, the misuse, what the error says). Engines: global batch 8, micro 2.
MISUSES = {
    "step without backward": (None, lambda eng: eng.step(),
                              r"step\(\) called without a backward\(\) since the last step\(\)"),
    "backward after the window's last": (_fill_window, lambda eng: eng.backward(mse(eng, tuple(t[:2] for t in _local(eng)))),
                                         r"backward\(\) called \d+ times in a window of \d+ micro-steps: call step\(\) after every"),
    "non-scalar loss": (None, lambda eng: eng.backward((eng(_local(eng)[0][:2]) - _local(eng)[1][:2]) ** 2),
                        r"scalar \(0-dim\) tensor.*got shape \(2, 3\).*\.mean\(\)"),
    "loss without grad": (None, lambda eng: eng.backward(mse(eng, tuple(t[:2] for t in _local(eng))).detach()),
                          r"the loss does not require grad: it was computed without the model's parameters, or under "
                          r"torch.no_grad\(\)"),
    "loss that is not a tensor": (None, lambda eng: eng.train_batch(_local(eng), lambda m, b: 1.0),
                                  r"the loss must be a scalar tensor .* or a pair \(loss_sum, num_items\).*; got a float"),
    "(loss, logits) returned": (None, lambda eng: eng.train_batch(_local(eng), lambda model, batch: (
        mse(model, batch), model(batch[0]))), r"; got a tuple of 2: \(a tensor of shape \[\], a tensor of shape \[2, 3\]\): "
                                              r"a pair is read as \(loss_sum, num_items\), and a tensor of shape \[2, 3\] is "
                                              r"not a count. Returning \(loss, logits\) .* Return the loss alone"),
    "loss_fn(outputs, labels) without a pipeline": (
        None, lambda eng: eng.train_batch(_local(eng), lambda outputs, labels: F.mse_loss(outputs, labels)),
        r"without a pipeline the engine calls loss_fn\(model, micro_batch\); yours takes \(outputs, labels\), a "
        r"model's outputs. Decorate it with @engine.loss_on_outputs"),
    "mixed loss kinds": (_micro_step, lambda eng: eng.backward(_pair_loss(eng)),
                         r"one window mixes mean losses and \(sum, count\) losses; use one kind per window"),
    "train_batch mid-window": (_micro_step, lambda eng: eng.train_batch(_local(eng), mse),
                               r"train_batch\(\) called in the middle of a manual-loop window \(1 micro-steps done\): "
                               r"finish it with step\(\) first"),
    "train_batch without a loss function": (None, lambda eng: eng.train_batch(_local(eng)),
                                            r"no loss function: pass loss_fn\(model, micro_batch\) to "
                                            r"train_batch\(\)/eval_batch\(\) or to engine.initialize"),
    "eval_batch without a loss function": (None, lambda eng: eng.eval_batch(_local(eng)), r"no loss function"),
    "batch larger than the plan's": (None, lambda eng: eng.train_batch(_local(eng, extra=1), mse),
                                     r"got a batch of \d+ samples but the plan gives this rank .* pass exactly \d+ samples"),
    "backward without a forward through the engine": (  # an error on several ranks only
        None, lambda eng: eng.backward(mse(eng.module, tuple(t[:2] for t in _local(eng)))),
        r"backward\(\) without a forward through the engine: call eng\(x\), not eng.module\(x\)"),
}
SEVERAL_RANKS_ONLY = {"backward without a forward through the engine"}


def misuse_errors(engine_factory) -> dict[str, tuple[str, bool]]:
    """Each misuse on a fresh engine: {name: (the error's message, whether it left the
    counters and the window as they were)}; a misuse that raised nothing reports None."""
    found = {}
    for name, (prepare, misuse, _) in MISUSES.items():
        eng = engine_factory()
        if prepare is not None:
            prepare(eng)
        before = (eng.micro_steps, eng.global_steps, eng.global_samples, eng.window_micro_steps)
        try:
            misuse(eng)
        except engine.EngineUsageError as error:
            after = (eng.micro_steps, eng.global_steps, eng.global_samples, eng.window_micro_steps)
            found[name] = (str(error), after == before)
        else:
            found[name] = None
    return found


def assert_misuse_errors(found: dict, world_size: int) -> None:
    for name, (_, _, message) in MISUSES.items():
        if world_size == 1 and name in SEVERAL_RANKS_ONLY:
            assert found[name] is None, name  # one process: eng.module(x) is the model itself
            continue
        assert found[name] is not None, f"{name}: no error"
        text, unchanged = found[name]
        assert re.search(message, text), (name, text)
        assert unchanged, name


# -- half precision on the shapes that break: clipping, token losses, a short window ----------------
F32 = torch.float32
# Each clipping threshold lies between the window norms: 0.89, 1.26 and 0.88 (the short
# window) for mean losses, 0.24, 0.31 and 0.21 for token losses. So clipping acts on the
# second window only, and a wrongly scaled window is not rescued by being clipped to the same
# norm as the right one.
PRECISION_CASES = {"mean": (mse, mse, 1.0), "tokens": (token_loss_sum, token_loss_mean, 0.29)}
# Allowed distance to the float64 reference. Measured (2 ranks, every stage alike): torch bf16
# parameters 3.0e-4, torch fp16 parameters 3.4e-5, torch bf16 autocast 2.3e-4, DeepSpeed bf16
# (bf16 parameters) 1.9e-3. A short window weighted as a full one, and token losses weighted by
# samples (tests.support.broken.ignores_window_total), miss every one of them: measured 1.9e-2 with mean
# losses, 7.8e-3 to 8.1e-3 with token losses.
TOLERANCE = {("torch", "bf16"): 1e-3, ("torch", "fp16"): 2e-4, ("torch", "bf16 autocast"): 1e-3,
             ("deepspeed", "bf16"): 4e-3,
             ("deepspeed", "fp16"): 1e-3}  # measured 1.8e-4 and 2.3e-4 (fp16 parameters), where it runs
# How each precision is written in a config.
HALF_PRECISION = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}},
                  "bf16 autocast": {"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}}}


def share(batch, rank, world):
    """This rank's contiguous 1/world of a batch (tuple or mapping of tensors)."""
    if isinstance(batch, dict):
        n = next(iter(batch.values())).shape[0] // world
        return {k: v[n * rank:n * (rank + 1)] for k, v in batch.items()}
    n = batch[0].shape[0] // world
    return tuple(t[n * rank:n * (rank + 1)] for t in batch)


def precision_batches(loss):
    """Three global batches of 8; the last one short (4 samples, or 6 token sequences)."""
    if loss == "mean":
        batches = regression_batches(3, 8, dtype=F32)
        batches[2] = tuple(t[:4] for t in batches[2])
        return mlp(dtype=F32), batches
    batches = token_batches(3, 8)
    batches[2] = {k: v[:6] for k, v in batches[2].items()}
    model = TinyLM(dtype=F32)
    with torch.no_grad():  # embeddings of order 0.1, not 1: bf16 parameters round to 2^-8 of their size
        model.embed.weight.mul_(0.1)
    return model, batches


def precision_case(rank, world, backend, stage, precision, loss, defer=False, breaks=intact):
    """An fp32 model trained in ``precision`` (torch: half-precision parameters, or autocast,
    with fp32 master weights and, for fp16, the loss scaler; DeepSpeed: its bf16 mode) on three windows with clipping, the
    last one short, against the float64 full-batch reference of the same initial weights."""
    loss_fn, reference_loss, clip = PRECISION_CASES[loss]
    model, batches = precision_batches(loss)
    doubled = [{k: v for k, v in b.items()} if isinstance(b, dict) else tuple(t.double() for t in b) for b in batches]
    expected = reference_train(copy.deepcopy(model).double(), doubled, reference_loss, sgd, clip=clip)
    zero = {"stage": stage, **({"defer_reduction": defer} if stage >= 2 else {})}
    if backend == "deepspeed" and stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    half = copy.deepcopy(HALF_PRECISION[precision])
    if backend == "deepspeed" and precision == "fp16":  # fp16 gradients: a scale that fits them from the start
        half["fp16"]["initial_scale_power"] = 8
    config = {"backend": backend, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": zero, "gradient_clipping": clip, **half}
    eng = breaks(engine.initialize(copy.deepcopy(model), config, optimizer=sgd))
    norms = []
    for batch in batches:
        eng.train_batch(share(batch, rank, world), loss_fn)
        norm = eng.last_window.step.grad_norm
        norms.append(None if norm is None else float(norm))  # None: an fp16 overflow skipped the window
    result = {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "norms": norms,
              "skipped": eng.skipped_steps, "samples": eng.global_samples,
              "dtype": str(next(eng.module.parameters()).dtype)}
    eng.close()
    return result


def precision_scenarios(backend, precisions, stages):
    """Every stage (both defer settings at ZeRO-2/3), both losses; the broken variant too."""
    scenarios = {}
    for stage in stages:
        for defer in ((False, True) if stage >= 2 else (False,)):
            for precision in precisions:
                for loss in PRECISION_CASES:
                    scenarios[(precision, loss, stage, defer)] = functools.partial(
                        precision_case, backend=backend, stage=stage, precision=precision, loss=loss, defer=defer)
                    if not defer:
                        scenarios[(precision, loss, stage, "broken")] = functools.partial(
                            precision_case, backend=backend, stage=stage, precision=precision, loss=loss,
                            breaks=ignores_window_total)
    return scenarios


def assert_precision_results(results: dict, backend: str) -> None:
    for (precision, loss, stage, variant), per_rank in results.items():
        case = (backend, precision, loss, stage, variant)
        for result in per_rank:
            assert result["skipped"] == 0 and result["samples"] == 8 + 8 + (4 if loss == "mean" else 6), case
            if variant == "broken":
                assert result["diff"] > TOLERANCE[(backend, precision)], (case, result["diff"])
                continue
            assert result["diff"] < TOLERANCE[(backend, precision)], (case, result["diff"])
            clip = PRECISION_CASES[loss][2]
            assert [norm > clip for norm in result["norms"]] == [False, True, False], (case, result["norms"])
        assert per_rank[0]["norms"] == per_rank[1]["norms"], case  # one norm, the same on every rank


# -- activation checkpointing ------------------------------------------------------------------
CHECKPOINTING = {"activation_checkpointing": {"enabled": True}}


def two_windows(model, config: dict, share) -> dict:
    """The full state after two windows of ``share`` on a copy of the LM ``model`` (SGD)."""
    eng = engine.initialize(copy.deepcopy(model), config, optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    for _ in range(2):
        eng.train_batch(share, lm_loss)
    state = eng.full_state_dict()
    eng.close()
    return state


def every_stage_and_precision(case) -> dict:
    """``case`` at ZeRO stages 0-3, in fp32 and in bf16, keyed (stage, precision name)."""
    return {(stage, name): functools.partial(case, stage=stage, precision=precision)
            for stage in (0, 1, 2, 3) for name, precision in (("fp32", {}), ("bf16", {"bf16": {"enabled": True}}))}


def checkpointing_case(rank, world, stage, precision, backend="torch"):
    """Two windows with and without checkpointing: the largest parameter difference."""
    model, batch = lm(layers=2, width=32), tokens(8, 16)
    share = batch[4 * rank:4 * rank + 4]
    runs = {}
    for name, features in {"without": {}, "with": CHECKPOINTING}.items():
        config = {"backend": backend, "train_batch_size": 8, "gradient_accumulation_steps": 2,
                  "zero_optimization": {"stage": stage}, **precision, **features}
        runs[name] = two_windows(model, config, share)
    return max_param_diff(runs["with"], runs["without"])


def compiled_case(rank, world, stage, precision, backend="torch", checkpointing=True):
    """Two windows compiled (aot_eager: dynamo's capture and AOT autograd, no code generation)
    and eager, both checkpointed unless told: (largest parameter difference, calls captured)."""
    model, batch = lm(layers=2, width=32), tokens(8, 16)
    share = batch[4 * rank:4 * rank + 4]
    runs = {}
    torch._dynamo.reset()  # the previous scenario's graphs would serve this one: capture anew
    counters.clear()
    for name, features in {"eager": {}, "compiled": {"compile": {"enabled": True, "backend": "aot_eager"}}}.items():
        config = {"backend": backend, "train_batch_size": 8, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
                  "activation_checkpointing": {"enabled": checkpointing}, **precision, **features}
        runs[name] = two_windows(model, config, share)
    return max_param_diff(runs["compiled"], runs["eager"]), counters["stats"]["calls_captured"]
