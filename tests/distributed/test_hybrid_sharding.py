"""Hybrid sharding (``zero_optimization.shard_size``): ZeRO 2 / 3 shards within groups of data
ranks, replicas across them (FSDP2 over a (replicate, shard) mesh), on four gloo ranks against the
float64 full-batch reference with clipping; gradients averaged over the shard group only miss it;
each rank holds 1/2 of the model's parameters (1/4 without); checkpoints move between hybrid and
plain ZeRO 3 and onto two ranks; and on eight ranks under a tensor, a pipeline and a context dimension."""

from __future__ import annotations

import contextlib
import copy
import functools
import os

import pytest
import torch

import engine
from engine.distributed.mesh import DATA_SHARDING
from engine.strategies.fsdp import FullyShardedDataParallel
from tests.distributed.test_context_parallel import GPT_TOL, gpt_script
from tests.distributed.test_expert_parallel import differences, reference
from tests.distributed.test_mesh3d import batches, reference_token_mean, token_mean
from tests.support import broken
from tests.support.dist_utils import run_distributed, run_scenarios
from tests.support.moe_models import hf_loss, hf_moe, lm_batches
from tests.support.pipeline_helpers import data_share, reference_run
from tests.support.reference import max_param_diff, mlp, mse, rank_slice, regression_batches, sgd, state
from tests.support.scenarios import clipped_reference, halving_schedule
from tests.support.tp_models import PLAN, TinyTransformer

TOL = 1e-10
MISSED = 1e-4
TOL_HF, MISSED_HF = 1e-7, 1e-7  # a Hugging Face model: its cross entropy in float32
CLIP = 0.05
WIDTH, LAYERS = 16, 4
MODEL_BYTES = LAYERS * (WIDTH * WIDTH + WIDTH) * 8  # float64


def hybrid_config(stage, shard_size=2, defer=False, global_batch=16, **extra):
    zero = {"stage": stage, "defer_reduction": defer, "shard_unit_size": 300}
    if shard_size is not None:
        zero["shard_size"] = shard_size
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
            **extra}


@contextlib.contextmanager
def shard_group_only():
    """Broken: each shard group sharded and averaged on its own (no all-reduce over the replicas)."""
    original = FullyShardedDataParallel.sharding_mesh
    FullyShardedDataParallel.sharding_mesh = lambda self: self.groups.submesh(DATA_SHARDING)
    try:
        yield
    finally:
        FullyShardedDataParallel.sharding_mesh = original


def clipped(rank, world, stage, defer=False, broken=False, offload=None, extra=None):
    """train_batch with clipping and a scheduler: parameters and the reported norms are the full batch's.
    ``offload``: ``zero_optimization``'s offload keys (FSDP2's host offload of the hybrid shards); ``extra``:
    more config sections."""
    model, batches = mlp(), regression_batches(3, 16)
    ref = copy.deepcopy(model)
    expected_norms = clipped_reference(ref, batches, CLIP)
    config = hybrid_config(stage, defer=defer, gradient_clipping=CLIP)
    config["zero_optimization"].update(offload or {})
    config.update(extra or {})
    with shard_group_only() if broken else contextlib.nullcontext():
        eng = engine.initialize(copy.deepcopy(model), config, optimizer=sgd, lr_scheduler=halving_schedule)
    norms = []
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), mse)
        norms.append(float(eng.last_window.step.grad_norm))
    mesh = eng.strategy.mesh
    return {"diff": max_param_diff(eng.full_state_dict(), state(ref)), "norms": norms, "expected_norms": expected_norms,
            "mesh": (mesh.data_replicate, mesh.data_shard), "describe": mesh.describe()}


def manual_with_flush(rank, world, stage):
    """The manual loop, a window closed early by flush, then a short window in train_batch."""
    model, batches = mlp(), regression_batches(3, 16)
    flushed = tuple(t[:8] for t in batches[1])
    short = tuple(t[:12] for t in batches[2])
    expected = copy.deepcopy(model)
    optimizer = sgd(expected.parameters())
    for batch in (batches[0], flushed, short):
        optimizer.zero_grad()
        mse(expected, batch).backward()
        optimizer.step()
    eng = engine.initialize(copy.deepcopy(model), hybrid_config(stage), optimizer=sgd)
    x, y = rank_slice(batches[0], eng.plan)
    for micro in zip(x.split(2), y.split(2)):
        eng.backward(mse(eng, micro))
        eng.step()
    x, y = (t[2 * rank:2 * rank + 2] for t in flushed)  # one micro-step of two, then flush
    eng.backward(mse(eng, (x, y)))
    eng.step()
    eng.step(flush=True)
    eng.train_batch(tuple(t[3 * rank:3 * rank + 3] for t in short), mse)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected))}


def modified_on_one_rank(rank, world, stage):
    """gathered_parameters(modifier_rank=1): rank 1's change reaches every rank's shard (each shard
    group's and each replica's), then training goes on exactly."""
    model, batches = mlp(), regression_batches(2, 16)
    eng = engine.initialize(copy.deepcopy(model), hybrid_config(stage), optimizer=sgd)
    with eng.gathered_parameters(modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                eng.module[0].weight.mul_(0.5)
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    expected = copy.deepcopy(model)
    optimizer = sgd(expected.parameters())
    for batch in batches:
        optimizer.zero_grad()
        mse(expected, batch).backward()
        optimizer.step()
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), mse)
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected))}


def square_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).double()


def local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def held_per_rank(rank, world, stage, shard_size):
    """Bytes of this rank's parameter pieces (ZeRO 3 rests sharded) and optimizer state (AdamW: 2 per element)."""
    eng = engine.initialize(square_model(), hybrid_config(stage, shard_size=shard_size),
                            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, WIDTH, generator=g, dtype=torch.float64),
             torch.randn(4, WIDTH, generator=g, dtype=torch.float64))
    eng.train_batch(batch, mse)
    moments = [v for s in eng.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"params": local_bytes(list(eng.strategy.module.parameters())), "optimizer": local_bytes(moments)}


def experts_hybrid(rank, world):
    """A Mixtral with its global router term, padded rows: the experts split over 2 of the 4 data ranks,
    the rest sharded in groups of 2 (ZeRO 3) replicated across them, activation checkpointing on."""
    model, windows = hf_moe(), lm_batches(2, 8, padded=True)
    expected = reference(model, windows, hf_loss)
    return differences(model, windows, hf_loss, expected,
                       [("exact", broken.intact), ("micro-batch term", broken.moe_micro_batch_term)],
                       zero_optimization={"stage": 3, "shard_size": 2}, activation_checkpointing={"enabled": True})


def checkpoint_across(rank, world, directory):
    """Saved with shard_size 2 (ZeRO 3) after two steps, resumed by plain ZeRO 3 and by ZeRO 2 with
    shard_size 2: the third step equals the uninterrupted hybrid run's; and plain into hybrid."""
    model, batches = mlp(), regression_batches(3, 16)
    results = {}
    for saved, resumed in (((3, 2), (3, None)), ((3, 2), (2, 2)), ((3, None), (3, 2))):
        path = os.path.join(directory, f"{saved}-{resumed}")
        eng = engine.initialize(copy.deepcopy(model), hybrid_config(saved[0], saved[1], gradient_clipping=CLIP),
                                optimizer=sgd)
        for i, batch in enumerate(batches):
            if i == 2:
                eng.save_checkpoint(path)
            eng.train_batch(rank_slice(batch, eng.plan), mse)
        straight = eng.full_state_dict()
        other = engine.initialize(mlp(seed=99), hybrid_config(resumed[0], resumed[1], gradient_clipping=CLIP),
                                  optimizer=sgd)
        other.load_checkpoint(path)
        other.train_batch(rank_slice(batches[2], other.plan), mse)
        results[(saved, resumed)] = max_param_diff(other.full_state_dict(), straight)
    return results


def resume_on_two(rank, world, directory):
    """The four-rank hybrid checkpoint (after two steps) on two ranks, plain ZeRO 3: the third step."""
    model, batches = mlp(), regression_batches(3, 16)
    ref = copy.deepcopy(model)
    clipped_reference(ref, batches, CLIP)  # the same three clipped steps (with the halving schedule)
    eng = engine.initialize(mlp(seed=99), hybrid_config(3, None, gradient_clipping=CLIP), optimizer=sgd,
                            lr_scheduler=halving_schedule)
    eng.load_checkpoint(os.path.join(directory, "four"))
    eng.train_batch(rank_slice(batches[2], eng.plan), mse)
    return max_param_diff(eng.full_state_dict(), state(ref))


def save_for_two(rank, world, directory):
    model, batches = mlp(), regression_batches(3, 16)
    eng = engine.initialize(copy.deepcopy(model), hybrid_config(3, 2, gradient_clipping=CLIP), optimizer=sgd,
                            lr_scheduler=halving_schedule)
    for batch in batches[:2]:
        eng.train_batch(rank_slice(batch, eng.plan), mse)
    eng.save_checkpoint(os.path.join(directory, "four"))
    return eng.global_steps


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_hybrid_sharding_on_four_ranks(tmp_path):
    scenarios = {
        ("clipped", 3): functools.partial(clipped, stage=3),
        ("clipped", 2): functools.partial(clipped, stage=2),
        ("clipped", "3 deferred"): functools.partial(clipped, stage=3, defer=True),
        ("clipped", "3 offloaded, compiled"): functools.partial(clipped, stage=3, offload={
            "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
            extra={"compile": {"enabled": True, "backend": "aot_eager"}}),
        ("clipped", "broken"): functools.partial(clipped, stage=3, broken=True),
        ("flush", 3): functools.partial(manual_with_flush, stage=3),
        ("flush", 2): functools.partial(manual_with_flush, stage=2),
        ("modified", 3): functools.partial(modified_on_one_rank, stage=3),
        ("held", 3, 2): functools.partial(held_per_rank, stage=3, shard_size=2),
        ("held", 3, None): functools.partial(held_per_rank, stage=3, shard_size=None),
        ("held", 2, 2): functools.partial(held_per_rank, stage=2, shard_size=2),
        ("held", 2, None): functools.partial(held_per_rank, stage=2, shard_size=None),
        "checkpoints": functools.partial(checkpoint_across, directory=str(tmp_path)),
        "save for two": functools.partial(save_for_two, directory=str(tmp_path)),
        "experts": experts_hybrid,
    }
    results = run_scenarios(scenarios, world_size=4, timeout=360)
    for key in [("clipped", 3), ("clipped", 2), ("clipped", "3 deferred"), ("clipped", "3 offloaded, compiled")]:
        for found in results[key]:
            assert found["diff"] < TOL, (key, found["diff"])
            assert found["mesh"] == (2, 2), found["describe"]
            assert found["norms"] == pytest.approx(found["expected_norms"], rel=1e-10), key
            assert all(norm > CLIP for norm in found["norms"])  # clipping acts
    assert all(found["diff"] > MISSED for found in results[("clipped", "broken")])
    assert all(found["diff"] < TOL for key in [("flush", 3), ("flush", 2), ("modified", 3)] for found in results[key])
    # each rank holds 1/2 of the parameters and of AdamW's moments with shard groups of 2, 1/4 without
    for rank in range(4):
        assert results[("held", 3, 2)][rank]["params"] == MODEL_BYTES // 2
        assert results[("held", 3, None)][rank]["params"] == MODEL_BYTES // 4
        for stage in (2, 3):
            assert results[("held", stage, 2)][rank]["optimizer"] == 2 * MODEL_BYTES // 2
            assert results[("held", stage, None)][rank]["optimizer"] == 2 * MODEL_BYTES // 4
    for key, diffs in results["checkpoints"][0].items():
        assert all(per_rank[key] < TOL for per_rank in results["checkpoints"]), (key, diffs)
    for found in results["experts"]:  # hybrid × experts × global balance × checkpointing
        assert found["exact"] < TOL_HF and found["micro-batch term"] > MISSED_HF, found
    two = run_distributed(resume_on_two, world_size=2, args=(str(tmp_path),), timeout=120)
    assert all(diff < TOL for diff in two), two


# -- with the other dimensions (eight ranks) ----------------------------------------------------------
def composed(rank, world, dims):
    """A Llama-shaped model (tests/support/tp_models.py) on data 4 = replicate 2 × shard 2 under a
    tensor or a pipeline dimension of 2, ZeRO 3, clipped: the full-batch reference's parameters."""
    model = TinyTransformer()
    windows = batches(2, 8, dense=True)
    expected, _ = reference_run(model, windows, reference_token_mean, CLIP)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": 3, "shard_size": 2}, **dims}
    eng = engine.initialize(copy.deepcopy(model), cfg, optimizer=sgd)
    loss_fn = token_mean if "pipeline" in dims else lambda m, batch: token_mean(m(batch[0]), batch[1])
    for window in windows:
        eng.train_batch(data_share(window, eng), loss_fn)
    mesh = eng.strategy.mesh
    return {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
            "mesh": (mesh.data_replicate, mesh.data_shard)}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hybrid_sharding_under_tensor_pipeline_and_context_on_eight_ranks():
    results = run_scenarios({"tensor": functools.partial(composed, dims={"tensor_parallel": {"size": 2, "plan": PLAN}}),
                             "pipeline": functools.partial(composed, dims={"pipeline": {"stages": 2,
                                                                                        "split": ["layers.1"]}}),
                             # context 2 × data 4 (replicate 2 × shard 2): each shard group holds 2 data × 2 context ranks
                             "context": functools.partial(gpt_script, stage=3, extra={
                                 "zero_optimization": {"stage": 3, "shard_size": 2}})},
                            world_size=8, timeout=240)
    assert all(found["diff"] < GPT_TOL for found in results.pop("context")), results
    for key, per_rank in results.items():
        assert all(found["diff"] < TOL and found["mesh"] == (2, 2) for found in per_rank), (key, per_rank)
