"""Pipeline parallelism against the float64 full-batch reference: pipeline 2 on 2 ranks with
every schedule, pipeline 2 × data 2 on 4 ranks; mean and (sum, count) losses, clipping on the
global norm over the stages, a short last window, a balanced plan (micro-batches of different
sizes in one schedule), an fp16 overflow on one stage only. The broken variant of DeepSpeed
#7773 (micro-batch gradients summed instead of averaged) misses the tolerance.

Every scenario runs on every rank and returns this rank's view of the result: the whole model
(``full_state_dict``, the same on every stage), counters and the reported loss."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.errors import ConfigError, EngineUsageError
from tests.broken import intact, summed_micro_batches
from tests.dist_utils import run_scenarios
from tests.reference import max_param_diff, mlp, regression_batches, sgd, state

TOL = 1e-10
MISSED = 1e-4
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero_bubble"]
VOCAB, WIDTH = 11, 8


def config(global_batch, micro, schedule="1f1b", **extra):
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
            "pipeline": {"stages": 2, "schedule": schedule}, **extra}


def mse_outputs(outputs, labels):
    """The pipeline's loss_fn: (outputs of the last stage, labels) -> the micro-batch mean."""
    return F.mse_loss(outputs, labels)


def reference_mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def token_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, VOCAB)).double()


def token_batches(steps, global_batch, seq=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (global_batch, seq), generator=g)
        labels = torch.randint(0, VOCAB, (global_batch, seq), generator=g)
        lengths = torch.randint(1, seq + 1, (global_batch,), generator=g)
        labels[torch.arange(seq)[None, :] >= lengths[:, None]] = -100
        batches.append((tokens, labels))
    return batches


def token_sum(outputs, labels):
    """(Σ over valid tokens, their count): weighted by the window's tokens over every rank."""
    loss = F.cross_entropy(outputs.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def reference_token_mean(model, batch):
    loss, count = token_sum(model(batch[0]), batch[1])
    return loss / count


def data_share(batch, eng):
    """This data-parallel rank's contiguous share (every stage of a replica gets the same)."""
    plan = eng.plan
    sizes = engine.batching.plan.split_evenly(batch[0].shape[0], plan.world_size)
    start = sum(sizes[:plan.rank])
    return tuple(t[start:start + sizes[plan.rank]] for t in batch)


def train(rank, world, *, schedule="1f1b", loss="mean", clip=0.0, short=False, split="strict", breaks=intact):
    """Three windows (the last a short one when ``short``) against the reference."""
    data_ranks = world // 2
    # strict: A = 4 micro-batches of 1; a short window: A = 2 of 2, then 2 and 1 (padded to 2)
    global_batch, micro = (4 * data_ranks, 2 if short else 1) if split == "strict" else (5 * data_ranks + 1, 2)
    if loss == "mean":
        model, batches, loss_fn, reference_loss = mlp(), regression_batches(3, global_batch), mse_outputs, reference_mse
    else:
        model, batches, loss_fn, reference_loss = token_model(), token_batches(3, global_batch), token_sum, \
            reference_token_mean
    if short:  # the end of an epoch: fewer samples than planned, as many micro-steps
        batches[-1] = tuple(t[:global_batch - 1] for t in batches[-1])
    expected, reference_losses = reference_run(model, batches, reference_loss, clip)
    eng = breaks(engine.initialize(copy.deepcopy(model),
                                   config(global_batch, micro, schedule, gradient_clipping=clip, batch_split=split),
                                   optimizer=sgd))
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


def reference_run(model, batches, loss_fn, clip):
    """The full-batch reference (SGD with momentum): the trained copy and each step's loss."""
    model = copy.deepcopy(model)
    optimizer, losses = sgd(model.parameters()), []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(float(loss.detach()))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model, losses


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
    scenarios["summed (DeepSpeed #7773)"] = functools.partial(train, breaks=summed_micro_batches)
    results = run_scenarios(scenarios, world_size=2, timeout=280)
    broken = results.pop("summed (DeepSpeed #7773)")
    for name, per_rank in results.items():
        assert_exact(per_rank), name
    assert all(result["diff"] > MISSED for result in broken)
