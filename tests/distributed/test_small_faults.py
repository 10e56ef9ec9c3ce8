"""The small faults of issue 25: each with the run that showed it."""

import errno
import functools
import io
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import engine
from engine.state import checkpoint
from tests.support.dist_utils import DistributedRunError, run_distributed
from tests.support.reference import mlp, mse, regression_batches, sgd
from tests.support.scenarios import share

F32 = torch.float32
REPO = Path(__file__).resolve().parents[2]


def zero3_warnings(rank, world):
    """A ZeRO-3 run whose monitor records every window (peak memory measured on CPU)."""
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "shard_unit_size": 100},  # every layer a unit of its own
              "monitor": {"enabled": True, "progress": False}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = engine.initialize(mlp(dtype=F32), config, optimizer=sgd)
        for batch in regression_batches(2, 8, dtype=F32):
            eng.train_batch(share(batch, rank, world), mse)
        peak = eng.last_window.peak_memory_bytes
        eng.close()
    return {"warnings": [str(w.message) for w in caught if "non-leaf" in str(w.message)], "peak": peak}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_zero3_runs_print_no_non_leaf_grad_warning():
    for result in run_distributed(zero3_warnings, world_size=2, timeout=100):
        assert result["peak"] and result["peak"] > 0
        assert result["warnings"] == [], result["warnings"][:1]


def test_keep_last_removes_a_link_in_dir_never_what_it_points_to(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "manifest.json").write_text("{}")  # looks like a checkpoint's
    (outside / "precious.pt").write_bytes(b"data")
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / "step_00000000").symlink_to(outside, target_is_directory=True)
    config = {"train_batch_size": 8, "checkpoint": {"dir": str(directory), "every_steps": 1, "keep_last": 1}}
    eng = engine.initialize(mlp(dtype=F32), config, optimizer=sgd)
    for batch in regression_batches(2, 8, dtype=F32):
        eng.train_batch(batch, mse)
    eng.close()
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000002"]
    assert sorted(p.name for p in outside.iterdir()) == ["manifest.json", "precious.pt"]


SECOND_SIGTERM = """
import os, signal, sys, time
import torch
import engine
import engine.state.preemption as preemption
from tests.support.reference import mlp, mse, regression_batches, sgd
preemption.REPEAT_AFTER_SECONDS = 0.05
config = {{"train_batch_size": 8, "checkpoint": {{"dir": sys.argv[1]}}}}
eng = engine.initialize(mlp(dtype=torch.float32), config, optimizer=sgd)
try:
    for step, batch in enumerate(regression_batches(3, 8, dtype=torch.float32)):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        eng.train_batch(batch, mse)
finally:  # the scheduler repeats the signal while the stopped run winds down
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    if {close}:
        eng.close()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
"""


@pytest.mark.parametrize("close", [False, True])
def test_a_second_sigterm_after_the_save_keeps_the_stop_exit_code(tmp_path, close):
    run = subprocess.run([sys.executable, "-c", SECOND_SIGTERM.format(close=close), str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 75, run.stderr[-2000:]
    assert "SIGTERM received: saved" in run.stderr and "SIGTERM again after the stop: ignored" in run.stderr
    assert (tmp_path / "step_00000002" / "manifest.json").is_file()


class _FullDisk(io.RawIOBase):
    """A file on a disk that fills up after ``room`` bytes."""

    def __init__(self, room: int):
        self.room = room

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return len(data)


def test_a_full_disk_is_reported_as_no_space_left(tmp_path, monkeypatch):
    eng = engine.initialize(mlp(dtype=F32), {"train_batch_size": 8}, optimizer=sgd)
    eng.train_batch(regression_batches(1, 8, dtype=F32)[0], mse)
    full = lambda *args, **kwargs: io.BufferedWriter(_FullDisk(700), buffer_size=64)  # noqa: E731
    monkeypatch.setattr(checkpoint, "open", full, raising=False)  # the engine's own files
    with pytest.raises(engine.CheckpointError, match="no space left on device writing .*engine_state.pt") as caught:
        eng.save_checkpoint(tmp_path / "ckpt")
    assert "unexpected pos" not in str(caught.value)
    assert not (tmp_path / "ckpt").exists()


def test_a_full_disk_under_the_model_state_is_reported_as_no_space_left(tmp_path, monkeypatch):
    """torch.distributed.checkpoint's writer swallows the write's error too: the free space tells."""
    eng = engine.initialize(mlp(dtype=F32), {"train_batch_size": 8}, optimizer=sgd)

    def full_disk(directory):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(eng.strategy, "save_training_state", full_disk)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil_usage(0))
    with pytest.raises(engine.CheckpointError, match=r"no space left on device \(0 bytes free"):
        eng.save_checkpoint(tmp_path / "ckpt")


def shutil_usage(free):
    import collections
    return collections.namedtuple("usage", "total used free")(10**9, 10**9 - free, free)


def peer_killed(rank, world, directory):
    """Rank 1 is killed (SIGKILL) after initialize; rank 0 then starts a window and writes down
    what it raised (the run's own report stops at rank 1's death)."""
    eng = engine.initialize(mlp(dtype=F32), {"train_batch_size": 8}, optimizer=sgd)
    (batch,) = regression_batches(1, 8, dtype=F32)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:  # rank 0's first collective meets rank 1's death (within the run's 1.5 s grace after it)
        eng.train_batch(share(batch, rank, world), mse)
    except Exception as error:
        Path(directory, "error.txt").write_text(f"{type(error).__name__}: {error}")
        raise


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_killed_peer_is_reported_as_a_closed_connection_not_a_timeout(tmp_path):
    """Issue 45: the survivor of a kill -9 said it "waited distributed.agreement_timeout_seconds
    (600 s)" when it failed 0.1 s after the death. It says when and how it lost the peer."""
    with pytest.raises(DistributedRunError):
        run_distributed(functools.partial(peer_killed, directory=str(tmp_path)), world_size=2, timeout=100)
    for _ in range(100):  # rank 0 may still be writing when the run reports rank 1's death
        if (tmp_path / "error.txt").exists() and (tmp_path / "error.txt").read_text():
            break
        time.sleep(0.1)
    survivor = (tmp_path / "error.txt").read_text()
    assert survivor.startswith("PeerLostError: rank 0 lost a peer "), survivor
    assert "s into waiting for its peers while starting a window, after global step 0" in survivor, survivor
    assert "a peer's connection closed, not a timeout: its process ended (killed, crashed or exited" in survivor
    assert "agreement_timeout_seconds (600 s)" not in survivor


# -- issue 45: a model that calls a module around its ZeRO-3 unit ---------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.experts = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.experts(torch.relu(self.inner(x)))


class _Bypassing(torch.nn.Module):
    """Calls each block's experts directly (``block.experts(x)``), or the blocks as they should be."""

    def __init__(self, bypass: bool):
        super().__init__()
        self.blocks, self.head, self.bypass = torch.nn.ModuleList([_Block(), _Block()]), torch.nn.Linear(8, 3), bypass

    def forward(self, x):
        for block in self.blocks:
            x = block.experts(x) if self.bypass else block(x)
        return self.head(x)


def bypassed_unit(rank, world, bypass):
    torch.manual_seed(0)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "shard_unit_size": 1}}  # every block a unit
    eng = engine.initialize(_Bypassing(bypass).double(), config, optimizer=sgd)
    batch = regression_batches(1, 8)[0]
    try:
        eng.train_batch(share(batch, rank, world), mse)
        eng.train_batch(share(batch, rank, world), mse)  # after the first window the hooks are gone
    except engine.EngineUsageError as error:
        return str(error)
    return eng.global_steps


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_module_called_around_its_zero3_unit_is_named_with_the_fix():
    """Issue 45: ``block.experts(x)`` instead of ``block(x)`` at ZeRO 3 crashed inside torch ("got mixed
    torch.Tensor and DTensor"); it is named at the first forward, on every rank. A model calling its
    units trains, and the check is gone after its first window."""
    for message in run_distributed(functools.partial(bypassed_unit, bypass=True), 2, timeout=100):
        assert message.startswith("ZeRO 3: 'blocks.0.experts' was called with its parameters still sharded: they "
                                  "are gathered in the forward of their unit 'blocks.0'"), message
        assert "Call the unit itself" in message
    assert run_distributed(functools.partial(bypassed_unit, bypass=False), 2, timeout=100) == [2, 2]
