"""The model's own loss (``m(**batch).loss``) on two ranks against the float64 full-batch reference:
data 2 at ZeRO 0 (train_batch) and ZeRO 3 (the manual loop), token budgets, tensor 2, pipeline 2 (the
last stage applies the model's own loss), the DeepSpeed backend and its facade; the per-micro-batch
mean (the loss left unread) misses, and so does every mesh with the one accounting broken
(engine.accounting without its boundary multiplier)."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch

import engine
from engine.memory import storage_bytes
from tests.support import broken, own_loss as o
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, rank_slice, reference_train, sgd, state

pytest.importorskip("transformers")

# The DeepSpeed backend trains in float32 (it refuses float64): against the same model and batches in
# float32 in one process; the unread mean misses by 1e-3 and more there too.
F32_TOL = 1e-5


def data_parallel(rank, world, *, stage=0, manual=False, breaking=None,
                  kind="causal", extra=None):
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           **(extra or {})}
    eng = engine.initialize(o.model(kind), cfg, optimizer=sgd)
    if breaking is not None:
        breaking(eng)
    data = o.batches(kind, 2)
    result = o.compare(eng, kind, data, manual=manual)
    trained = reference_train(o.model(kind), data, o.own_loss, sgd)
    with torch.no_grad():
        expected = o.own_loss(trained, data[0]).item()
    return {**result, "eval": eng.eval_batch(rank_slice(data[0], eng.plan), o.own_loss), "expected_eval": expected}


def token_budget(rank, world, packing=False):
    cfg = {"train_batch_size": 8, "micro_batch_tokens": 24, "packing": packing}
    eng = engine.initialize(o.model("causal"), cfg, optimizer=sgd)
    result = o.compare(eng, "causal", o.batches("causal", 2), manual=False)
    report = eng.last_window
    return {**result, "micro_steps": report.micro_steps, "real": report.real_tokens, "padded": report.padded_tokens}


def float32_run(rank, world, *, facade: bool, breaking=None):
    """The DeepSpeed backend through ``engine.initialize`` (train_batch), or the DeepSpeed facade's
    manual loop (``model_engine(**batch).loss``), in float32."""
    data = [{k: v.float() if v.is_floating_point() else v for k, v in b.items()} for b in o.batches("causal", 2)]
    model = o.model("causal").float()
    expected = reference_train(model, data, o.own_loss, sgd)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "backend": "deepspeed",
           "zero_optimization": {"stage": 2}}
    if facade:
        import engine.compat.deepspeed as deepspeed

        cfg = {**cfg, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
        model_engine, *_ = deepspeed.initialize(model=copy.deepcopy(model), config=cfg)
        rows = model_engine.train_micro_batch_size_per_gpu()
        for batch in data:
            mine = rank_slice(batch, model_engine.engine.plan)
            for start in range(0, 4, rows):
                loss = model_engine(**{k: v[start:start + rows] for k, v in mine.items()}).loss
                model_engine.backward(loss)
                model_engine.step()
        trained = model_engine.engine.full_state_dict()
    else:
        eng = engine.initialize(copy.deepcopy(model), cfg, optimizer=sgd)
        if breaking is not None:
            breaking(eng)
        for batch in data:
            eng.train_batch(rank_slice(batch, eng.plan), o.own_loss)
        trained = eng.full_state_dict()
    return {"diff": max_param_diff(trained, state(expected))}


def derived_mean(rank, world, *, lengths):
    """``.loss * 1.0`` (a mean the engine cannot read) on rows whose items per row are ``lengths``'; the
    warnings it logs on this rank."""
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("engine").addHandler(handler)
    try:
        eng = engine.initialize(o.model("causal"), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2},
                                optimizer=sgd)
        data = o.batches("causal", 2, lengths=lengths)
        for batch in data:
            eng.train_batch(rank_slice(batch, eng.plan), lambda m, b: m(**b).loss * 1.0)
    finally:
        logging.getLogger("engine").removeHandler(handler)
    expected = state(reference_train(o.model("causal"), data, o.own_loss, sgd))
    return {"diff": max_param_diff(eng.full_state_dict(), expected),
            "warned": [m for m in seen if "cannot read as (sum, count)" in m]}


MESHES = {"zero 0": {}, "zero 3": {"zero_optimization": {"stage": 3}}, "tensor 2": {"tensor_parallel": {"size": 2}},
          "pipeline 2": {"pipeline": {"stages": 2}}}
# The one accounting broken (G / U left out): every mesh and backend that asks it misses.
BROKEN_ACCOUNTING = {f"{mesh}, broken accounting": functools.partial(
    data_parallel, extra=extra, breaking=broken.accounting_without_window_total) for mesh, extra in MESHES.items()}
BROKEN_ACCOUNTING["deepspeed backend, broken accounting"] = functools.partial(
    float32_run, facade=False, breaking=broken.accounting_without_window_total)

SCENARIOS = {
    "zero 0, train_batch": data_parallel,
    "zero 0, unread": functools.partial(data_parallel, breaking=o.unread),
    "zero 3, manual loop": functools.partial(data_parallel, stage=3, manual=True),
    "zero 3, manual loop, unread": functools.partial(data_parallel, stage=3, manual=True, breaking=o.unread),
    "zero 2, token classification": functools.partial(data_parallel, stage=2, kind="tokens"),
    "token budget": token_budget,
    "token budget, packed": functools.partial(token_budget, packing=True),
    "tensor 2": functools.partial(data_parallel, extra={"tensor_parallel": {"size": 2}}),
    "pipeline 2": functools.partial(data_parallel, extra={"pipeline": {"stages": 2}}),
    "pipeline 2, unread": functools.partial(data_parallel, extra={"pipeline": {"stages": 2}}, breaking=o.unread_on_pipeline),
    "deepspeed backend": functools.partial(float32_run, facade=False),
    "deepspeed facade": functools.partial(float32_run, facade=True),
    **BROKEN_ACCOUNTING,
    # items per row equal within each rank (10 real tokens on rank 0, 3 on rank 1), different between them
    "unread mean, ranks differ": functools.partial(derived_mean, lengths=[10] * 4 + [3] * 4),
    "derived mean, every row alike": functools.partial(derived_mean, lengths=[6] * 8),
}


def pipeline_zero_1(rank, world, breaking=None, directory=None):
    """Pipeline 2 × data 2 at ZeRO 1 (Megatron's distributed optimizer with pipelining): each stage's two
    replicas own half of its optimizer state, counted in bytes (SGD's momentum buffers). ``directory``:
    saved after the first step, the second step taken on 4 plain data ranks from that checkpoint."""
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "pipeline": {"stages": 2}}
    eng = engine.initialize(o.model("causal"), cfg, optimizer=sgd)
    if breaking is not None:
        breaking(eng)
    data = o.batches("causal", 2)
    if directory is None:
        result = o.compare(eng, "causal", data, manual=False)
    else:
        o.train(eng, data[:1], manual=False)
        eng.save_checkpoint(directory)
        eng.close()
        eng = engine.initialize(o.model("causal"), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2},
                                optimizer=sgd)
        eng.load_checkpoint(directory)
        o.train(eng, data[1:], manual=False)
        reference = reference_train(o.model("causal"), data, o.own_loss, sgd)
        return {"diff": max_param_diff(eng.full_state_dict(), state(reference))}
    held = [buffer for per_param in eng.optimizer.state.values() for buffer in per_param.values()
            if isinstance(buffer, torch.Tensor)]
    return {**result, "owned share": storage_bytes(held) / storage_bytes(list(eng.module.parameters()))}


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_the_model_own_loss_on_two_ranks_equals_the_full_batch():
    results = run_scenarios(SCENARIOS, world_size=2, timeout=380)
    for name, per_rank in results.items():
        for result in per_rank:
            if "unread" in name or "broken" in name:
                assert result["diff"] > o.MISSED, (name, result["diff"])
                continue
            assert result["diff"] < (F32_TOL if "deepspeed" in name else o.TOL), (name, result["diff"])
            if "loss0" in result:  # the window's loss is the global batch's mean over its items
                assert result["loss0"] == pytest.approx(result["expected_loss0"], rel=1e-6), name
            if "eval" in result:
                assert result["eval"] == pytest.approx(result["expected_eval"], rel=1e-6), name
    # the unread mean is warned over every rank when it changes the objective, and only then
    assert all(len(r["warned"]) == 1 and "over every rank" in r["warned"][0] for r in results["unread mean, ranks differ"])
    assert all(not r["warned"] for r in results["derived mean, every row alike"])
    assert results["token budget"][0]["micro_steps"] > 1
    packed = results["token budget, packed"][0]  # documents end to end: the model computes no padding
    assert packed["padded"] == packed["real"] < results["token budget"][0]["padded"]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_pipeline_at_zero_1_on_four_ranks_equals_the_full_batch_and_owns_half_the_state(tmp_path):
    results = run_scenarios({"exact": pipeline_zero_1, "broken accounting": functools.partial(
        pipeline_zero_1, breaking=broken.accounting_without_window_total), "resumed on data 4": functools.partial(
        pipeline_zero_1, directory=str(tmp_path / "pipeline-zero-1"))}, world_size=4, timeout=380)
    assert all(result["diff"] < o.TOL for result in results["resumed on data 4"]), results["resumed on data 4"]
    for result in results["exact"]:
        assert result["diff"] < o.TOL and result["loss0"] == pytest.approx(result["expected_loss0"], rel=1e-6)
        assert 0.3 < result["owned share"] < 0.7, result  # whole parameters: near a half, not the whole
    assert all(result["diff"] > o.MISSED for result in results["broken accounting"])
