"""Checkpoints: resuming equals never stopping (every ZeRO stage, 2 ranks and 2 -> 1), the
state that must survive (optimizer, scheduler, loss scaler, RNG, data position), and the
failures that must be clear (mid-window, damaged, foreign, interrupted saves)."""

import copy
import json
import os
import random
import re
import shutil
import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import engine
from engine.state.checkpoint import MANIFEST, CheckpointError
from engine.batching.data import DistributedBatches
from tests.support.dist_utils import run_distributed
from tests.support.reference import mlp, mse, train_steps

STAGES = [0, 1, 2, 3]
SETTINGS = [(0, False), (1, False), (2, False), (2, True), (3, False), (3, True)]  # (stage, defer_reduction)
GLOBAL_BATCH, STEPS, FIRST_PART = 8, 5, 2
DATASET_SIZE = 28  # 3 batches per epoch: the resumed part crosses an epoch boundary


def config(stage=0, defer=False, **extra):
    zero = {"stage": stage, "defer_reduction": defer} if stage >= 2 else {"stage": stage}
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 2, "seed": 0,
            "zero_optimization": zero, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_num_steps": 3,
                                                               "warmup_type": "linear"}}, **extra}


def dataset():
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(DATASET_SIZE, 8, generator=g, dtype=torch.float64),
                                          torch.randn(DATASET_SIZE, 3, generator=g, dtype=torch.float64))


def new_engine(stage, seed=0, defer=False):
    eng = engine.initialize(mlp(seed), config(stage, defer))
    return eng, DistributedBatches(dataset(), eng.plan, seed=11)


def name(stage, defer=False):
    return f"stage{stage}" + ("-deferred" if defer else "")




def optimizer_state(eng) -> dict:
    """{name.key: full tensor} of the parameters this rank's optimizer holds."""
    names = {id(p): n for n, p in eng.module.named_parameters()}
    stepped = [p for group in eng.optimizer.param_groups for p in group["params"]]
    if not all(id(p) in names for p in stepped):  # ZeRO-1/2 on FSDP2: the module holds gathered copies
        names = {id(p): n for (n, _), p in zip(eng.module.named_parameters(), stepped, strict=True)}
    out = {}
    for group in eng.optimizer.param_groups:
        for p in group["params"]:
            for key, value in eng.optimizer.state[p].items():
                value = value.full_tensor() if hasattr(value, "full_tensor") else value
                out[f"{names[id(p)]}.{key}"] = value.detach().clone().double()
    return out


def snapshot(eng, data) -> dict:
    return {"params": torch.cat([v.flatten() for v in eng.full_state_dict().values()]),
            "counters": (eng.micro_steps, eng.global_steps, eng.global_samples, eng.skipped_steps),
            "lr": eng.optimizer.param_groups[0]["lr"], "optimizer": optimizer_state(eng),
            "data": data.state_dict(), "rand": torch.rand(4), "accumulation": eng.plan.gradient_accumulation_steps}


def union(per_rank: list[dict]) -> dict:
    merged = {}
    for state in per_rank:
        merged.update(state)
    return merged


def assert_same_run(got: dict, expected: dict, tol: float, same_world: bool = True) -> None:
    # micro_steps counts this rank's micro-steps: it grows faster once accumulation is larger
    first = 0 if same_world else 1
    assert got["counters"][first:] == expected["counters"][first:]
    assert got["lr"] == pytest.approx(expected["lr"], rel=1e-15)
    assert got["data"] == expected["data"]
    assert (got["params"] - expected["params"]).abs().max().item() <= tol


def assert_same_optimizer(got: dict, expected: dict, tol: float) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert (got[key] - value).abs().max().item() <= tol, key


# -- multi-process scenarios -----------------------------------------------------------------
def _straight_and_first_part(rank, world, root):
    results = {}
    for stage, defer in SETTINGS:
        eng, data = new_engine(stage, defer=defer)
        train_steps(eng, data, STEPS)
        straight = snapshot(eng, data)
        eng, data = new_engine(stage, defer=defer)
        train_steps(eng, data, FIRST_PART)
        eng.save_checkpoint(os.path.join(root, name(stage, defer)), data=data,
                            client_state={"note": f"stage {stage}", "rank": rank})
        results[(stage, defer)] = straight
    return results


def _resume(rank, world, root):
    """Every two-rank checkpoint resumed on ``world`` ranks (2, or 4: each rank then runs one
    micro-step per window instead of two)."""
    results = {}
    for stage, defer in SETTINGS:
        eng, data = new_engine(stage, seed=99, defer=defer)  # another initialisation: the load must replace it
        client = eng.load_checkpoint(os.path.join(root, name(stage, defer)), data=data)
        assert client == {"note": f"stage {stage}", "rank": 0}
        train_steps(eng, data, STEPS - FIRST_PART)
        results[(stage, defer)] = snapshot(eng, data)
    return results


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    straight = run_distributed(_straight_and_first_part, world_size=2, args=(root,), timeout=150)
    resumed = run_distributed(_resume, world_size=2, args=(root,), timeout=150)
    return root, straight, resumed


# The module fixture's runs are bounded by their own timeouts: not charged to the first test.
@pytest.mark.distributed
@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("stage,defer", SETTINGS)
def test_resume_equals_uninterrupted_on_two_ranks(two_rank_runs, stage, defer):
    _, straight, resumed = two_rank_runs
    for rank in range(2):
        expected, got = straight[rank][(stage, defer)], resumed[rank][(stage, defer)]
        assert_same_run(got, expected, 1e-12)
        assert torch.equal(got["rand"], expected["rand"]), "RNG state not restored"
    assert_same_optimizer(union([r[(stage, defer)]["optimizer"] for r in resumed]),
                          union([r[(stage, defer)]["optimizer"] for r in straight]), 1e-12)
    if stage == 1:  # ZeRO-1: each rank holds a disjoint part of the optimizer state
        assert not resumed[0][(1, False)]["optimizer"].keys() & resumed[1][(1, False)]["optimizer"].keys()


@pytest.mark.distributed
@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("stage", STAGES)
def test_resume_two_ranks_on_one_process(two_rank_runs, stage):
    root, straight, _ = two_rank_runs
    eng, data = new_engine(stage, seed=99)
    assert eng.world_size == 1 and eng.plan.gradient_accumulation_steps == 4
    eng.load_checkpoint(os.path.join(root, name(stage)), data=data)
    train_steps(eng, data, STEPS - FIRST_PART)
    got, expected = snapshot(eng, data), straight[0][(stage, False)]
    assert expected["accumulation"] == 2 and got["accumulation"] == 4
    assert_same_run(got, expected, 1e-10, same_world=False)
    assert got["counters"][0] == 2 * FIRST_PART + 4 * (STEPS - FIRST_PART)
    assert torch.equal(got["rand"], expected["rand"])  # rank 0's generator
    assert_same_optimizer(got["optimizer"], union([r[(stage, False)]["optimizer"] for r in straight]), 1e-10)


@pytest.mark.distributed
@pytest.mark.timeout(120, func_only=True)
def test_resume_two_ranks_on_four(two_rank_runs):
    """2 -> 4, every stage and defer setting: accumulation 2 -> 1, the sharded state re-split
    four ways, ranks 2 and 3 (new) re-seeded; the same training up to the summation order."""
    root, straight, _ = two_rank_runs
    four = run_distributed(_resume, world_size=4, args=(root,), timeout=100)
    for setting in SETTINGS:
        expected = straight[0][setting]
        for got in four:
            got = got[setting]
            assert got["accumulation"] == 1, setting
            assert_same_run(got, expected, 1e-10, same_world=False)
        assert_same_optimizer(union([r[setting]["optimizer"] for r in four]),
                              union([r[setting]["optimizer"] for r in straight]), 1e-10)
        assert [torch.equal(r[setting]["rand"], s[setting]["rand"]) for r, s in zip(four, straight)] == [True, True]
        assert not any(torch.equal(four[r][setting]["rand"], straight[0][setting]["rand"]) for r in (2, 3))


def _save_on_one_load_on_two(rank, world, root):
    results = {}
    for stage in (1, 2, 3):
        eng, data = new_engine(stage=stage, seed=99)
        eng.load_checkpoint(os.path.join(root, name(stage)), data=data)
        train_steps(eng, data, STEPS - FIRST_PART)
        results[stage] = snapshot(eng, data)
    return results


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_resume_one_process_on_two_ranks(tmp_path):
    """1 -> 2 at ZeRO-1/2/3: saved by one process running the same config (nothing to shard
    there), resumed sharded: the ZeRO-1 ranks each pick their parameters' state from a full
    one, FSDP splits it into shards; rank 1 did not exist, so its generators are re-seeded."""
    expected = {}
    for stage in (1, 2, 3):
        eng, data = new_engine(stage=stage)
        assert eng.world_size == 1
        train_steps(eng, data, FIRST_PART)
        eng.save_checkpoint(tmp_path / name(stage), data=data)
        train_steps(eng, data, STEPS - FIRST_PART)
        expected[stage] = snapshot(eng, data)
    results = run_distributed(_save_on_one_load_on_two, world_size=2, args=(str(tmp_path),), timeout=90)
    for stage in (1, 2, 3):
        for got in results:
            assert_same_run(got[stage], expected[stage], 1e-10, same_world=False)
        assert_same_optimizer(union([r[stage]["optimizer"] for r in results]), expected[stage]["optimizer"], 1e-10)
        assert torch.equal(results[0][stage]["rand"], expected[stage]["rand"])
        assert not torch.equal(results[1][stage]["rand"], expected[stage]["rand"])


def _failures_agree(rank, world, path):
    """Errors found on one rank (or all) are raised on every rank: none is left waiting."""
    out = {}
    wrong = engine.initialize(mlp(hidden=32), config(stage=2))
    with pytest.raises(CheckpointError) as mismatch:
        wrong.load_checkpoint(path)
    out["mismatch"] = str(mismatch.value)
    eng, data = new_engine(stage=2)
    train_steps(eng, data, 3)
    real_save = torch.save

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device (simulated)")

    torch.save = disk_full if rank == 1 else real_save
    try:
        with pytest.raises(CheckpointError) as failed_save:
            eng.save_checkpoint(path, data=data)
    finally:
        torch.save = real_save
    out["save"] = str(failed_save.value)
    fresh, fresh_data = new_engine(stage=2)
    fresh.load_checkpoint(path, data=fresh_data)  # after rank 0 removed the temporary directory
    out["steps"] = fresh.global_steps
    out["listing"] = sorted(os.listdir(os.path.dirname(path)))
    eng.checkpoints.training_state = LateWriter(eng.checkpoints.training_state, rank)
    eng.save_checkpoint(path, data=data)
    fresh.load_checkpoint(path, data=fresh_data)  # every file's checksum is the file's as written
    out["late_steps"] = fresh.global_steps
    return out


class LateWriter:
    """A training state whose rank 0 finishes a file of its own after its peers are done (as
    DeepSpeed's state file): a peer that read it back for its checksum at once reads half of it.
    ``.late`` sorts second among the files: its checksum is rank 1's share."""

    def __init__(self, inner, rank):
        self.inner, self.rank = inner, rank

    def save_training_state(self, directory):
        self.inner.save_training_state(directory)
        if self.rank != 0:
            time.sleep(0.5)  # rank 0's half-written file is there
            return
        with open(os.path.join(directory, ".late"), "w") as f:
            f.write("half")
            f.flush()
            time.sleep(1.5)
            f.write(" and the rest")

    def __getattr__(self, name):  # the rest is the wrapped state's
        return getattr(self.inner, name)


@pytest.mark.distributed
@pytest.mark.timeout(120, func_only=True)
def test_failures_are_raised_on_every_rank(two_rank_runs, tmp_path):
    root, _, _ = two_rank_runs
    shutil.copytree(os.path.join(root, name(2)), tmp_path / "c")
    results = run_distributed(_failures_agree, world_size=2, args=(str(tmp_path / "c"),), timeout=90)
    for out in results:
        assert "shape mismatch: 0.weight: checkpoint (16, 8), model (32, 8)" in out["mismatch"]
        assert "nothing was published" in out["save"]
        assert "rank 1" in out["save"] and "No space left on device" in out["save"]
        assert out["listing"] == ["c"] and out["steps"] == FIRST_PART
        assert out["late_steps"] == 3


# -- single process ----------------------------------------------------------------------------
def fp16_engine():
    cfg = config(fp16={"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 1})
    eng = engine.initialize(mlp(dtype=torch.float32), cfg)
    return eng, DistributedBatches(_float32(dataset()), eng.plan, seed=11)


def _float32(ds):
    return torch.utils.data.TensorDataset(*(t.float() for t in ds.tensors))


def randoms():
    return torch.rand(3), random.random(), np.random.rand(2)


def test_round_trip_with_loss_scaler_and_rng(tmp_path):
    eng, data = fp16_engine()
    train_steps(eng, data, 4)
    path = eng.save_checkpoint(tmp_path / "fp16", data=data, client_state={"epoch": 7, "t": torch.ones(2)})
    assert path == str(tmp_path / "fp16")
    scaler_state = eng.strategy.precision.scaler.state_dict()
    assert eng.skipped_steps > 0, "the test wants fp16 overflows in the saved history"
    train_steps(eng, data, 2)
    expected = snapshot(eng, data), eng.strategy.precision.scaler.state_dict(), randoms()

    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    fresh, fresh_data = fp16_engine()
    client = fresh.load_checkpoint(tmp_path / "fp16", data=fresh_data)
    assert client["epoch"] == 7 and torch.equal(client["t"], torch.ones(2))
    assert fresh.strategy.precision.scaler.state_dict() == scaler_state
    train_steps(fresh, fresh_data, 2)
    got = snapshot(fresh, fresh_data), fresh.strategy.precision.scaler.state_dict(), randoms()
    assert_same_run(got[0], expected[0], 0.0)
    assert torch.equal(got[0]["rand"], expected[0]["rand"])
    assert got[1] == expected[1]
    assert torch.equal(got[2][0], expected[2][0]) and got[2][1] == expected[2][1]
    assert np.array_equal(got[2][2], expected[2][2])


def test_manifest_and_layout(tmp_path):
    eng, data = new_engine(stage=0)
    train_steps(eng, data, 1)
    eng.save_checkpoint(tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    assert manifest["version"] == 2 and manifest["global_steps"] == 1 and manifest["world_size"] == 1
    assert {"engine_state.pt", "rank00000.pt", "model_optimizer/.metadata"} <= set(manifest["files"])
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temporary directory left behind


def test_a_version_1_checkpoint_still_loads(tmp_path):
    """Version 1 kept the engine's state, scheduler, loss scaler and tuner flat in engine_state.pt;
    version 2 keeps each stateful part under its name."""
    eng, data = new_engine(stage=0)
    train_steps(eng, data, 2)
    eng.save_checkpoint(tmp_path / "c", data=data)
    expected = snapshot(eng, data)
    state_file, manifest_file = tmp_path / "c" / "engine_state.pt", tmp_path / "c" / MANIFEST
    saved = torch.load(state_file, weights_only=True)
    flat = {**saved.pop("parts").pop("engine"), **saved}
    flat.update({name: state for name, state in torch.load(state_file, weights_only=True)["parts"].items()
                 if name != "engine"})
    torch.save(flat, state_file)
    manifest = json.loads(manifest_file.read_text())
    manifest["version"] = 1
    manifest["files"]["engine_state.pt"] = state_file.stat().st_size
    manifest.pop("checksums", None)  # version 1 had none
    manifest_file.write_text(json.dumps(manifest))

    resumed, resumed_data = new_engine(stage=0, seed=5)
    resumed.load_checkpoint(tmp_path / "c", data=resumed_data)
    restored = snapshot(resumed, resumed_data)
    assert torch.equal(restored["params"], expected["params"])
    assert restored["counters"] == expected["counters"] and restored["data"] == expected["data"]


def test_save_and_load_only_at_a_boundary(tmp_path):
    eng, data = new_engine(stage=0)
    (x, y) = next(iter(data))
    eng.backward(mse(eng, (x[:2], y[:2])))
    assert not eng.step()
    with pytest.raises(engine.EngineUsageError, match=r"middle of an accumulation window .*1 of 4.*after the step\(\)"):
        eng.save_checkpoint(tmp_path / "c")
    with pytest.raises(engine.EngineUsageError, match="load_checkpoint"):
        eng.load_checkpoint(tmp_path / "c")
    assert not (tmp_path / "c").exists() and not os.listdir(tmp_path)


@pytest.fixture
def saved(tmp_path):
    eng, data = new_engine(stage=0)
    train_steps(eng, data, 2)
    eng.save_checkpoint(tmp_path / "c", data=data)
    return tmp_path / "c"


def test_damaged_checkpoints_are_refused_clearly(saved):
    eng, data = new_engine(stage=0)
    shard = saved / "model_optimizer" / "__0_0.distcp"
    content = shard.read_bytes()
    shard.write_bytes(content[: len(content) // 2])
    with pytest.raises(CheckpointError, match=r"damaged: model_optimizer/__0_0.distcp has \d+ bytes, \d+ were written \(truncated\)"):
        eng.load_checkpoint(saved, data=data)
    shard.unlink()
    with pytest.raises(CheckpointError, match="__0_0.distcp is missing"):
        eng.load_checkpoint(saved)
    (saved / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is unreadable or corrupt"):
        eng.load_checkpoint(saved)
    (saved / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint: it has no manifest.json"):
        eng.load_checkpoint(saved)
    with pytest.raises(CheckpointError, match="no checkpoint at .*does not exist"):
        eng.load_checkpoint(saved.parent / "elsewhere")
    assert eng.global_steps == 0 and data.step == 0  # nothing was restored


def test_same_size_corruption_is_refused_clearly(saved):
    eng, _ = new_engine(stage=0)
    state = saved / "engine_state.pt"
    state.write_bytes(b"\0" * state.stat().st_size)
    with pytest.raises(CheckpointError, match="is damaged: engine_state.pt differs from what was saved"):
        eng.load_checkpoint(saved)
    manifest = json.loads((saved / MANIFEST).read_text())  # as an older Microstep wrote it: no checksums
    del manifest["checksums"]
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="engine_state.pt is corrupt or unreadable"):
        eng.load_checkpoint(saved)


@pytest.mark.parametrize("victim", ["rank00000.pt", "model_optimizer/__0_0.distcp", "model_optimizer/.metadata"])
def test_flipped_bytes_in_any_file_are_refused_before_anything_loads(saved, victim):
    eng, _ = new_engine(stage=0)
    before = eng.full_state_dict()
    path = saved / victim
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])  # same size
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"is damaged: {re.escape(victim)} differs from what was saved"):
        eng.load_checkpoint(saved)
    assert all(torch.equal(before[k], v) for k, v in eng.full_state_dict().items())


def test_foreign_checkpoints_are_refused_clearly(saved):
    wider = engine.initialize(mlp(hidden=32), config())
    with pytest.raises(CheckpointError, match=r"different model .*shape mismatch: 0.weight: checkpoint \(16, 8\), model \(32, 8\)"):
        wider.load_checkpoint(saved)
    deeper = engine.initialize(torch.nn.Sequential(mlp(), torch.nn.Linear(3, 3).double()), config())
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: 0\.0\.weight.*in the checkpoint but not in this model: 0\.bias, 0\.weight"):
        deeper.load_checkpoint(saved)
    bigger_batch = engine.initialize(mlp(), config(train_batch_size=16))
    with pytest.raises(CheckpointError, match="trained with train_batch_size 8 .* this engine has 16.*set train_batch_size: 8"):
        bigger_batch.load_checkpoint(saved)
    sgd = engine.initialize(mlp(), config(optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    with pytest.raises(CheckpointError, match="holds a torch.optim.adamw.AdamW optimizer state; this engine's optimizer is torch.optim.sgd.SGD"):
        sgd.load_checkpoint(saved)
    before = copy.deepcopy(sgd.full_state_dict())
    assert all(torch.equal(before[k], v) for k, v in sgd.full_state_dict().items())
    other_data = DistributedBatches(torch.utils.data.TensorDataset(torch.zeros(40, 8)), sgd.plan)
    eng, _ = new_engine(stage=0)
    with pytest.raises(CheckpointError, match="restoring the data position failed.*dataset_size: saved 28, now 40"):
        eng.load_checkpoint(saved, data=other_data)
    assert other_data.step == 0 and eng.global_steps == 0


def test_crash_during_save_keeps_the_previous_checkpoint(saved, monkeypatch):
    eng, data = new_engine(stage=0)
    train_steps(eng, data, 3)

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(dcp, "save", crash)
        with pytest.raises(CheckpointError, match="nothing was published.*disk full"):
            eng.save_checkpoint(saved, data=data)
    assert sorted(os.listdir(saved.parent)) == ["c"]  # the temporary directory is gone
    fresh, fresh_data = new_engine(stage=0)
    fresh.load_checkpoint(saved, data=fresh_data)
    assert fresh.global_steps == 2 and fresh_data.step == 2


def test_leftovers_of_a_killed_save_are_ignored_then_cleaned(saved):
    parent = saved.parent
    (parent / ".c.tmp-1-2").mkdir()  # killed while writing: no manifest
    (parent / ".c.tmp-1-2" / "rank00000.pt").write_bytes(b"partial")
    eng, data = new_engine(stage=0)
    eng.load_checkpoint(saved, data=data)
    assert eng.global_steps == 2
    train_steps(eng, data, 1)
    eng.save_checkpoint(saved, data=data)  # replaces the old checkpoint, sweeps the leftover
    assert sorted(os.listdir(parent)) == ["c"]
    fresh, _ = new_engine(stage=0)
    fresh.load_checkpoint(saved)
    assert fresh.global_steps == 3


def test_killed_between_the_two_renames_restores_the_previous_checkpoint(saved):
    parent = saved.parent
    os.replace(saved, parent / ".c.old-1-2")  # the old one moved aside, the new one never arrived
    eng, _ = new_engine(stage=0)
    eng.load_checkpoint(saved)
    assert eng.global_steps == 2 and sorted(os.listdir(parent)) == ["c"]


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("mine")
    eng, _ = new_engine(stage=0)
    with pytest.raises(CheckpointError, match="is not a checkpoint directory"):
        eng.save_checkpoint(tmp_path / "results")
    assert (tmp_path / "results" / "notes.txt").read_text() == "mine"


def test_auto_micro_batch_size_is_restored_when_it_fits(tmp_path, caplog):
    eng = engine.initialize(mlp(), config(train_micro_batch_size_per_gpu="auto"))
    eng.replan(eng.plan.with_micro_batch_size(4))  # what the tuner would have settled on
    eng.save_checkpoint(tmp_path / "auto")
    resumed = engine.initialize(mlp(), config(train_micro_batch_size_per_gpu="auto"))
    resumed.load_checkpoint(tmp_path / "auto")
    assert resumed.plan.train_micro_batch_size_per_gpu == 4 and resumed.plan.micro_batch_mode == "auto"
    fixed = engine.initialize(mlp(), config(train_micro_batch_size_per_gpu=2))
    with caplog.at_level("INFO", logger="engine"):
        fixed.load_checkpoint(tmp_path / "auto")
    assert fixed.plan.train_micro_batch_size_per_gpu == 2
    assert "not restored: the config fixes it at 2" in caplog.text


@pytest.mark.parametrize("stage", [0])
def test_save_before_any_step_does_not_touch_the_optimizer(tmp_path, stage):
    """Saving at step 0 must not create optimizer state (e.g. AdamW's step counter)."""
    eng, data = new_engine(stage)
    eng.save_checkpoint(tmp_path / "zero", data=data)
    assert not eng.optimizer.state
    reference, ref_data = new_engine(stage)
    resumed, res_data = new_engine(stage, seed=99)
    resumed.load_checkpoint(tmp_path / "zero", data=res_data)
    train_steps(reference, ref_data, 2)
    train_steps(resumed, res_data, 2)
    assert_same_run(snapshot(resumed, res_data), snapshot(reference, ref_data), 0.0)


class _Planted:
    """What a planted file holds: unpickling it runs code (here: creates a directory)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_planted_engine_file_runs_no_code_at_load(saved, tmp_path):
    marker = tmp_path / "code_ran"
    state = saved / "engine_state.pt"
    torch.save({"parts": _Planted(str(marker))}, state)
    manifest = json.loads((saved / MANIFEST).read_text())  # rewritten to match, as a planter would
    from engine.state.checkpoint import file_checksum
    manifest["files"]["engine_state.pt"] = state.stat().st_size
    manifest["checksums"]["engine_state.pt"] = file_checksum(state)
    (saved / MANIFEST).write_text(json.dumps(manifest))
    eng, _ = new_engine(stage=0)
    with pytest.raises(CheckpointError, match=r"engine_state.pt holds an object that torch.load\(weights_only=True\)"):
        eng.load_checkpoint(saved)
    assert not marker.exists()
