"""Surviving faults with nothing lost: automatic checkpoints from the config, resume after a
killed rank (torchrun --max-restarts), stop signals saved at an agreed boundary, damaged
checkpoints skipped, keep_last, and agreements that give up on a peer in bounded time.

"Nothing lost" is checked against the uninterrupted run of the same job (tests/support/fault_job.py:
float64, SGD with momentum, a warm-up schedule, data crossing epochs), which itself equals
the plain-PyTorch full-batch reference: parameters and momentum to 1e-12, counters, learning
rate, data position and the random generators exactly. A step counted twice or lost moves
the parameters by ~1e-2.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import engine
from engine.autosave import checkpoint_name
from engine.state.checkpoint import MANIFEST, verify_checkpoint
from engine.config.checks import check_without_model
from engine.batching.data import DistributedBatches
from engine.config.optim import WarmupDecayLR
from engine.config.deepspeed import deepspeed_config
from tests.support import fault_job as job
from tests.support.dist_utils import run_distributed, run_scenarios
from tests.support.reference import mlp, mse, reference_train
from tests.support.scenarios import needs_deepspeed

REPO = Path(__file__).resolve().parents[2]
JOB = str(REPO / "tests" / "support" / "fault_job.py")
TOL = 1e-12


def assert_same_run(got: dict, expected: dict, tol: float = TOL) -> None:
    assert got["counters"] == expected["counters"]
    assert got["lr"] == expected["lr"]
    assert got["data"] == expected["data"]
    assert torch.equal(got["rand"], expected["rand"]), "the random generators differ"
    for part in ("params", "momentum"):
        assert got[part].keys() == expected[part].keys()
        for key, value in expected[part].items():
            assert (got[part][key] - value).abs().max().item() <= tol, f"{part} {key}"


def listing(directory) -> list[str]:
    return sorted(entry.name for entry in Path(directory).iterdir())


def steps(*numbers) -> list[str]:
    return [checkpoint_name(n) for n in numbers]


# -- two ranks, in-process: the uninterrupted runs, stop signals and their reruns ------------------
def _uninterrupted(rank, world, root, stage):
    eng = engine.initialize(mlp(0), job.config(stage, Path(root) / f"straight{stage}"))
    try:
        snapshot = job.snapshot(eng, job.train(eng))
        eng.checkpoints.wait()  # the last save, written in the background
        dist.barrier()  # rank 0 removes old checkpoints after a save, while the others go on
        return snapshot, listing(eng.autosave.dir)
    finally:
        eng.close()


def _stopped_by_signal(rank, world, root, name, calls):
    """Every rank in ``calls`` sends itself SIGTERM in its calls[rank]-th micro-batch loss."""
    eng = engine.initialize(mlp(0), job.config(0, Path(root) / name))
    loss_fn = job.FaultyLoss(calls.get(rank))
    try:
        job.train(eng, loss_fn)
    except engine.Preempted as stop:
        dist.barrier()  # rank 0 removes old checkpoints after a save, while the others go on
        manifest = json.loads((Path(stop.checkpoint) / MANIFEST).read_text())
        return {"code": stop.code, "signal": stop.signal_name, "checkpoint": Path(stop.checkpoint).name,
                "global_steps": eng.global_steps, "saved_step": manifest["global_steps"],
                "listing": listing(eng.autosave.dir)}
    finally:
        eng.close()
    return "not stopped"


def _rerun(rank, world, root, name):
    eng = engine.initialize(mlp(0), job.config(0, Path(root) / name))
    try:
        return job.snapshot(eng, job.train(eng))
    finally:
        eng.close()


def _peer_never_joins(rank, world, root, timeout):
    """Rank 1 waits in another collective (a default-group barrier) instead of saving."""
    config = job.config(0, Path(root) / "lonely", stop_signals=[])
    config["distributed"] = {"agreement_timeout_seconds": timeout}
    eng = engine.initialize(mlp(0), config)
    try:
        if rank == 1:
            dist.barrier()  # released by rank 0 once its save gave up
            return None
        started = time.monotonic()
        try:
            eng.save_checkpoint(Path(root) / "lonely" / "manual")
        except engine.CheckpointError as error:
            outcome = (time.monotonic() - started, str(error), type(error.__cause__).__name__)
        else:
            outcome = "saved without its peer"
        dist.barrier()
        return outcome
    finally:
        eng.close()


SIGNAL_ONLY_RANK1 = {1: 10}  # rank 1, window 5, its second micro-step: stop at step 5
SIGNAL_EVERY_RANK = {0: 7, 1: 8}  # window 4, different micro-steps: stop at step 4 (a periodic save)
AGREEMENT_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fault"))
    scenarios = {
        "straight0": functools.partial(_uninterrupted, root=root, stage=0),
        "straight3": functools.partial(_uninterrupted, root=root, stage=3),
        "stop_one": functools.partial(_stopped_by_signal, root=root, name="one", calls=SIGNAL_ONLY_RANK1),
        "rerun_one": functools.partial(_rerun, root=root, name="one"),
        "stop_every": functools.partial(_stopped_by_signal, root=root, name="every", calls=SIGNAL_EVERY_RANK),
        "rerun_every": functools.partial(_rerun, root=root, name="every"),
        "lonely": functools.partial(_peer_never_joins, root=root, timeout=AGREEMENT_TIMEOUT),
    }
    return run_scenarios(scenarios, world_size=2, timeout=180)


def full_batch_reference():
    """Plain PyTorch on the same global batches, one process."""
    data = job.dataset()
    order = DistributedBatches(data, engine.resolve_batch_plan(1, train_batch_size=job.GLOBAL_BATCH),
                               shuffle=True, seed=job.DATA_SEED)
    per_epoch = len(order)
    batches = []
    for step in range(job.STEPS):
        indices = order.global_batch_indices(step // per_epoch, step % per_epoch)
        batches.append(tuple(t[indices] for t in data.tensors))
    model = reference_train(
        mlp(0), batches, mse, lambda p: torch.optim.SGD(p, lr=job.LR, momentum=job.MOMENTUM),
        scheduler_factory=lambda o: WarmupDecayLR(o, total_num_steps=job.STEPS, warmup_num_steps=job.WARMUP))
    return {name: value.detach() for name, value in model.state_dict().items()}


@pytest.mark.distributed
def test_uninterrupted_run_equals_the_full_batch_reference(two_ranks):
    reference = full_batch_reference()
    for stage in (0, 3):
        for snapshot, directory in two_ranks[f"straight{stage}"]:
            assert snapshot["counters"][1:] == (job.STEPS, job.STEPS * job.GLOBAL_BATCH, 0)
            for name, value in reference.items():
                assert (snapshot["params"][name] - value).abs().max().item() <= 1e-10, (stage, name)
            assert directory == steps(6, 8)  # keep_last 2 of the saves at 2, 4, 6, 8


@pytest.mark.distributed
@pytest.mark.parametrize("name, stop_step, saved", [("one", 5, steps(4, 5)), ("every", 4, steps(2, 4))])
def test_stop_signal_saves_at_the_agreed_boundary_and_stops(two_ranks, name, stop_step, saved):
    """A signal on one rank only, or on every rank at different micro-steps: every rank saves
    at the same boundary, the first after the earliest signal, and stops."""
    for outcome in two_ranks[f"stop_{name}"]:
        assert outcome == {"code": 75, "signal": "SIGTERM", "checkpoint": checkpoint_name(stop_step),
                           "global_steps": stop_step, "saved_step": stop_step, "listing": saved}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["one", "every"])
def test_rerun_after_a_stop_equals_the_uninterrupted_run(two_ranks, name):
    for rank, (got, (expected, _)) in enumerate(zip(two_ranks[f"rerun_{name}"], two_ranks["straight0"])):
        assert got["resumed_from"].endswith(checkpoint_name(5 if name == "one" else 4))
        assert_same_run(got, expected)


@pytest.mark.distributed
def test_a_peer_that_never_joins_the_checkpoint_agreement_fails_in_bounded_time(two_ranks):
    seconds, message, cause = two_ranks["lonely"][0]
    assert AGREEMENT_TIMEOUT <= seconds < 60  # bounded by the setting, not the 600 s default
    assert "nothing was published" in message
    assert f"agreement_timeout_seconds ({AGREEMENT_TIMEOUT:g} s)" in message
    assert cause == "PeerLostError"


# -- a killed rank under torchrun --max-restarts 1 ------------------------------------------------
def run_job(out, *args, launcher=(), timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="10")
    return subprocess.run([sys.executable, *launcher, JOB, str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1")


@pytest.mark.distributed
@pytest.mark.parametrize("stage, blocking", [(0, True), (0, False), (3, False)])
def test_killed_rank_resumes_under_torchrun_with_nothing_counted_twice(two_ranks, tmp_path, stage, blocking):
    """Rank 1 is SIGKILLed in the middle of window 6 (the saves of steps 2 and 4 begun); torchrun
    restarts both ranks, which resume from the newest complete checkpoint and end equal to the
    uninterrupted run. A blocking save had finished step 4; a background one may still have
    been writing it, and then step 2 is the newest complete."""
    out = tmp_path / "run"
    result = run_job(out, "--stage", str(stage), "--kill-at", "11", *(["--blocking"] if blocking else []),
                     launcher=TORCHRUN)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "exitcode: -9" in result.stderr  # the kill happened, and the restart finished the job
    resumed = [step for step in (2, 4) if f"resuming from {checkpoint_name(step)}" in result.stderr]
    assert resumed == [4] if blocking else len(resumed) == 1, result.stderr[-4000:]
    for rank, (expected, _) in enumerate(two_ranks[f"straight{stage}"]):
        got = torch.load(out / f"rank{rank}.pt", weights_only=False)
        assert got["resumed_from"].endswith(checkpoint_name(resumed[0]))
        assert_same_run(got, expected)
    assert listing(out / "checkpoints") == steps(6, 8)


@pytest.mark.distributed
def test_a_rank_killed_during_a_background_write_resumes_from_the_last_complete_checkpoint(two_ranks, tmp_path):
    """Rank 1 is SIGKILLed inside the background write of step 4 (its files written, before the
    checksums): step 4 is never published, the restart resumes from step 2, ends equal to the
    uninterrupted run, and the half-written step 4 is swept away."""
    out = tmp_path / "run"
    result = run_job(out, "--kill-in-write", "4", launcher=TORCHRUN)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "exitcode: -9" in result.stderr
    assert "resuming from step_00000002" in result.stderr, result.stderr[-4000:]
    for rank, (expected, _) in enumerate(two_ranks["straight0"]):
        got = torch.load(out / f"rank{rank}.pt", weights_only=False)
        assert got["resumed_from"].endswith(checkpoint_name(2))
        assert_same_run(got, expected)
    assert listing(out / "checkpoints") == steps(6, 8)  # no .tmp- leftover either


def test_sigterm_during_a_background_write_waits_for_it_saves_and_resumes(tmp_path):
    """One process: SIGTERM arrives inside the background write of step 2. That write is
    finished and published, the next boundary after the signal (step 3, or later: training goes
    on while the write runs) saves and waits for its write, the process exits 75; the rerun
    resumes from there and equals the uninterrupted run."""
    out = tmp_path / "run"
    stopped = run_job(out, "--term-in-write", "2")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    [stop] = [int(n) for n in re.findall(r"SIGTERM received: saved \S+ at global step (\d+)", stopped.stderr)]
    assert 3 <= stop < job.STEPS
    assert "saved checkpoint " + str(out / "checkpoints" / checkpoint_name(2)) in stopped.stderr
    assert listing(out / "checkpoints")[-1] == checkpoint_name(stop)
    for name in listing(out / "checkpoints"):  # complete: the process waited for its writes
        verify_checkpoint(out / "checkpoints" / name)
    finished = run_job(out)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"resuming from {checkpoint_name(stop)}" in finished.stderr
    got = torch.load(out / "rank0.pt", weights_only=False)
    expected = trained(tmp_path / "straight")  # uninterrupted, in this process
    assert_same_run(got, expected, tol=1e-13)


def test_stop_signal_exits_with_the_documented_code_and_the_same_command_resumes(tmp_path):
    """One process: SIGTERM mid-window -> exit 75 after saving, no traceback; again -> done."""
    out = tmp_path / "run"
    stopped = run_job(out, "--term-at", "10")  # window 3 of 4 micro-steps
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "SIGTERM received: saved" in stopped.stderr and "Traceback" not in stopped.stderr
    assert listing(out / "checkpoints") == steps(2, 3)
    finished = run_job(out)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "resuming from step_00000003" in finished.stderr
    got = torch.load(out / "rank0.pt", weights_only=False)
    expected = trained(tmp_path / "straight")  # uninterrupted, in this process
    assert_same_run(got, expected, tol=1e-13)


def test_ctrl_c_saves_and_stops_like_sigterm_and_the_same_command_resumes(tmp_path):
    """One process with the default stop signals: a Ctrl-C mid-window saves at the boundary,
    exits 75 with no traceback, and the rerun resumes from that checkpoint."""
    out = tmp_path / "run"
    stopped = run_job(out, "--int-at", "10")  # window 3 of 4 micro-steps
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "SIGINT received: saved" in stopped.stderr and "Traceback" not in stopped.stderr
    assert "Ctrl-C again to stop at once" in stopped.stderr
    assert listing(out / "checkpoints") == steps(2, 3)
    finished = run_job(out)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "resuming from step_00000003" in finished.stderr


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun runs its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ValueError, IndexError, ProcessLookupError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


@pytest.mark.distributed
def test_sigusr1_to_the_launcher_saves_on_every_worker_and_exits_with_their_code(tmp_path):
    """Slurm's warning before a time limit, sent to `python -m launch`: torchrun passes it on
    to its two workers instead of dying of it, they save at the next boundary and exit 75, and
    the launcher exits 75 too (torchrun itself, signalled, exits 1)."""
    out = tmp_path / "run"
    stopped = _signal_under_the_launcher(out, signal.SIGUSR1)
    err = stopped.stderr
    assert stopped.returncode == 75, err[-4000:]
    assert "SIGUSR1 received: saved" in err and "exit code 75" in err  # rank 0, after the agreed save
    assert "SIGUSR1: the 2 worker(s) saved and stopped with exit code 75" in err
    [saved] = listing(out / "checkpoints")
    assert verify_checkpoint(out / "checkpoints" / saved)["world_size"] == 2


def _signal_under_the_launcher(out, sig, *job_args, group: bool = False) -> subprocess.CompletedProcess:
    """`python -m launch --nproc-per-node 2` of the job until stopped, given ``sig`` once both workers
    train: on the launcher, or (``group``) on its whole process group, as a terminal sends a Ctrl-C to
    its foreground job."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_STEP_ID"}
    env.update(OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="60")
    command = [sys.executable, "-m", "launch", "--nproc-per-node", "2", JOB, str(out), "--until-stopped", *job_args]
    launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=group)
    lines, err = queue.Queue(), []
    readers = [threading.Thread(target=lambda: [lines.put(line) for line in launcher.stdout], daemon=True),
               threading.Thread(target=lambda: err.extend(launcher.stderr), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        ready, deadline = 0, time.monotonic() + 120
        while ready < 2:
            ready += len(re.findall(r"ready \d+", lines.get(timeout=max(deadline - time.monotonic(), 0.01))))
        if group:
            os.killpg(launcher.pid, sig)
        else:
            launcher.send_signal(sig)
        launcher.wait(timeout=90)
    finally:
        if launcher.poll() is None:
            for pid in reversed(_process_tree(launcher.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            launcher.wait()
        for reader in readers:
            reader.join(timeout=10)
    return subprocess.CompletedProcess(command, launcher.returncode, "", "".join(err))


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("saving", [True, False], ids=["checkpoint.dir", "no checkpoint.dir"])
def test_ctrl_c_under_the_launcher_prints_no_traceback_and_says_what_happened_last(tmp_path, saving):
    out = tmp_path / "run"
    stopped = _signal_under_the_launcher(out, signal.SIGINT, *([] if saving else ["--no-checkpoint"]), group=True)
    err = stopped.stderr
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "SignalException" not in err, err[-4000:]
    assert "death signal" not in err and "closing signal" not in err, err[-4000:]
    last = err.rstrip().splitlines()[-1]
    if saving:
        assert stopped.returncode == 75, err[-4000:]
        assert last.startswith("[launch] SIGINT: the 2 worker(s) saved and stopped with exit code 75"), last
        assert len(listing(out / "checkpoints")) == 1
        assert err.count("Ctrl-C (SIGINT): saving at the next window boundary") == 1, err[-4000:]  # rank 0's
    else:
        assert stopped.returncode == 128 + signal.SIGINT, err[-4000:]
        assert last.startswith("[launch] Ctrl-C (SIGINT): the workers stopped without saving"), last
        assert "With checkpoint.dir set in the config, a Ctrl-C saves at the next window boundary" in last
        assert not (out / "checkpoints").exists()


# -- one process, in this one: damaged checkpoints, keep_last, resume rules ------------------------
def one_process(directory, **checkpoint):
    return engine.initialize(mlp(0), job.config(0, directory, stop_signals=[], **checkpoint))


def trained(directory, steps_=job.STEPS, **checkpoint):
    eng = one_process(directory, **checkpoint)
    try:
        return job.snapshot(eng, job.train(eng, steps=steps_))
    finally:
        eng.close()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("straight"))


@pytest.mark.parametrize("damage", ["truncate", "no manifest", "flipped bytes"])
def test_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, straight, damage, caplog):
    trained(tmp_path)
    newest = tmp_path / checkpoint_name(8)
    files = [p for p in newest.rglob("*") if p.is_file() and p.name != MANIFEST]
    victim = max(files, key=lambda p: p.stat().st_size)
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif damage == "flipped bytes":  # 64 bytes inside the largest shard, same size
        data = bytearray(victim.read_bytes())
        data[100:164] = bytes(b ^ 0x5A for b in data[100:164])
        victim.write_bytes(bytes(data))
    else:
        (newest / MANIFEST).unlink()
    with caplog.at_level(logging.INFO, logger="engine"):
        eng = one_process(tmp_path)
    try:
        assert eng.autosave.resumed_from == str(tmp_path / checkpoint_name(6)) and eng.global_steps == 6
        skipped = [r for r in caplog.records if r.levelno == logging.WARNING and "skipping" in r.getMessage()]
        assert len(skipped) == 1 and checkpoint_name(8) in skipped[0].getMessage()
        # said once, of the checkpoint loaded: never "resuming from" the damaged one before skipping it
        resuming = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
        assert len(resuming) == 1 and checkpoint_name(6) in resuming[0], resuming
        assert {"truncate": "truncated", "no manifest": "not a complete checkpoint",
                "flipped bytes": "differs from what was saved (checksum mismatch)"}[damage] in skipped[0].getMessage()
        got = job.snapshot(eng, job.train(eng))
    finally:
        eng.close()
    assert_same_run(got, straight)


def test_a_background_save_that_fails_raises_at_the_next_save_and_publishes_nothing(tmp_path, monkeypatch):
    """The write runs after train_batch returned: its failure is raised where the next save (or
    close) waits for it, as the blocking save's CheckpointError; nothing is published."""
    import engine.state.checkpoint as checkpoint_module

    def lost_disk(tmp, rank, world_size):
        raise OSError(5, "Input/output error")

    eng = engine.initialize(mlp(0), job.config(0, tmp_path, stop_signals=[], every_steps=1))
    batch = tuple(t[:job.GLOBAL_BATCH] for t in job.dataset().tensors)
    eng.train_batch(batch, job.mse)  # step 1: saved in the background
    eng.checkpoints.wait()
    assert listing(tmp_path) == steps(1) and eng.checkpoints.host_bytes > 0
    monkeypatch.setattr(checkpoint_module, "_agreed_checksums", lost_disk)
    try:
        eng.train_batch(batch, job.mse)  # step 2: its save's write fails in the background
        with pytest.raises(engine.CheckpointError, match=r"saving the checkpoint .*step_00000002 failed, nothing "
                                                         r"was published .*Input/output error"):
            eng.train_batch(batch, job.mse)  # step 3's save waits for step 2's first
    finally:
        monkeypatch.undo()
        eng.close()
    assert listing(tmp_path) == steps(1)  # no step 2, no temporary directory left


def test_loading_a_data_position_without_data_says_how_to_restore_it(tmp_path, caplog):
    trained(tmp_path, steps_=4)
    eng = one_process(tmp_path / "elsewhere")
    try:
        with caplog.at_level(logging.WARNING, logger="engine"):
            eng.load_checkpoint(tmp_path / checkpoint_name(4))
        assert eng.global_steps == 4
    finally:
        eng.close()
    [warning] = [r.getMessage() for r in caplog.records if "data position" in r.getMessage()]
    assert "holds a data position (epoch 1, batch 1)" in warning and "data=eng.batches(...)" in warning


@pytest.mark.parametrize("every, keep, kept",
                         [(1, 1, (8,)), (1, 3, (6, 7, 8)), (3, 2, (3, 6)), (2, None, (2, 4, 6, 8))])
def test_keep_last_keeps_exactly_that_many(tmp_path, every, keep, kept):
    trained(tmp_path, every_steps=every, keep_last=keep)
    assert listing(tmp_path) == steps(*kept)


def test_resume_never_and_resume_from_a_path(tmp_path, straight):
    first = tmp_path / "first"
    trained(first, steps_=4)
    with pytest.raises(engine.CheckpointError, match="resume: never, but checkpoint.dir .* already holds"):
        one_process(first, resume="never")
    # A path is where a run starts while its own dir is empty ...
    second = tmp_path / "second"
    eng = one_process(second, resume=str(first / checkpoint_name(2)))
    try:
        assert eng.global_steps == 2
        job.train(eng, steps=5)  # saves step 4 into its own dir
    finally:
        eng.close()
    # ... after which a restart continues from its own newest checkpoint, not from the path.
    eng = one_process(second, resume=str(first / checkpoint_name(2)))
    try:
        assert eng.autosave.resumed_from == str(second / checkpoint_name(4)) and eng.global_steps == 4
        got = job.snapshot(eng, job.train(eng))
    finally:
        eng.close()
    assert_same_run(got, straight)
    with pytest.raises(engine.CheckpointError, match="resume: .*does not exist"):
        one_process(tmp_path / "third", resume=str(tmp_path / "nowhere"))


def test_a_checkpoint_dir_that_cannot_be_written_fails_at_initialize(tmp_path):
    """Not at the first save, which may be the one a stop signal asked for."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(engine.CheckpointError, match="checkpoint.dir .*a_file/checkpoints cannot be written"):
        one_process(tmp_path / "a_file" / "checkpoints")
    eng = one_process(tmp_path / "new" / "checkpoints")  # a dir that does not exist yet is created
    eng.close()
    assert (tmp_path / "new" / "checkpoints").is_dir()


def test_batches_returns_the_same_data_for_the_same_arguments(tmp_path):
    eng = one_process(tmp_path)
    try:
        data = job.dataset()
        batches = eng.batches(data, seed=3)
        assert eng.batches(data, seed=3) is batches and eng.batches(data, seed=4) is not batches
        assert eng.batches(data, seed=4).state_dict()["seed"] == 4
    finally:
        eng.close()


def train_on_a_new_dataset_object_each_epoch(eng, steps: int):
    """The documented loop, but with the dataset made anew for every epoch (issue 45's probe)."""
    loss_fn, batches = job.FaultyLoss(), None
    while eng.global_steps < steps:
        batches = eng.batches(job.dataset(), shuffle=True, seed=job.DATA_SEED)
        for batch in batches:
            if eng.global_steps >= steps:
                break
            eng.train_batch(batch, loss_fn)
    return batches


def test_batches_of_a_new_object_for_the_same_data_continue_uninterrupted_and_resumed(tmp_path, straight):
    """Issue 45: eng.batches(dataset) given a new dataset object each epoch restarted at epoch 0
    silently (and a resumed run went 9.8e-3 off the uninterrupted one). The data is known by its
    length and order options, so both runs equal the documented loop's."""
    eng = one_process(tmp_path / "uninterrupted")
    try:
        assert_same_run(job.snapshot(eng, train_on_a_new_dataset_object_each_epoch(eng, job.STEPS)), straight)
    finally:
        eng.close()
    eng = one_process(tmp_path / "resumed")
    try:
        train_on_a_new_dataset_object_each_epoch(eng, 4)  # saves step 2 and 4 (mid-epoch 1)
    finally:
        eng.close()
    eng = one_process(tmp_path / "resumed")
    try:
        assert eng.global_steps == 4
        assert_same_run(job.snapshot(eng, train_on_a_new_dataset_object_each_epoch(eng, job.STEPS)), straight)
    finally:
        eng.close()


def test_batches_of_other_data_say_they_start_at_epoch_0(tmp_path, caplog):
    eng = one_process(tmp_path)
    try:
        data = job.dataset()
        batches = eng.batches(data, seed=3)
        next(iter(batches))
        with caplog.at_level(logging.WARNING, logger="engine"):
            other = eng.batches(torch.utils.data.Subset(data, range(24)), seed=3)
        assert other is not batches and (other.epoch, other.step) == (0, 0)
        assert (f"eng.batches(): other data (length 24, shuffle True, seed 3, drop_last True; was {len(data)}, "
                "True, 3, True): it starts at epoch 0, batch 0, and automatic checkpoints save its position from "
                "now on (the previous data stopped at epoch 0, batch 1)") in caplog.text
    finally:
        eng.close()


def test_an_explicit_load_after_the_automatic_resume_replaces_it(tmp_path, straight, caplog):
    """The automatic resume (step 4) applies its data position and random generators only when
    training starts; a load_checkpoint in between (step 2) must not be overridden by them."""
    trained(tmp_path, steps_=4)  # saves step 2 and 4
    eng = one_process(tmp_path)
    try:
        assert eng.global_steps == 4
        data = DistributedBatches(job.dataset(), eng.plan, shuffle=True, seed=job.DATA_SEED)
        with caplog.at_level(logging.INFO, logger="engine"):
            eng.load_checkpoint(tmp_path / checkpoint_name(2), data=data)
        assert eng.global_steps == 2
        assert eng.batches(job.dataset(), seed=job.DATA_SEED).state_dict()["step"] == 0  # not step 4's position
        loss_fn = job.FaultyLoss()
        while eng.global_steps < job.STEPS:
            for batch in data:
                if eng.global_steps >= job.STEPS:
                    break
                eng.train_batch(batch, loss_fn)
        got = job.snapshot(eng, data)
    finally:
        eng.close()
    assert_same_run(got, straight)  # the random generators too: step 2's, not step 4's
    assert "replaces the automatic resume" in caplog.text


def test_metrics_files_list_each_step_once_after_a_resume(tmp_path):
    """A run killed after step 5 (in the middle of writing a record; newest checkpoint: step 4)
    and resumed: steps 5.. are made again and must not appear twice."""
    jsonl, csv_path = tmp_path / "m.jsonl", tmp_path / "m.csv"

    def config():
        settings = job.config(0, tmp_path / "checkpoints", stop_signals=[])
        settings["monitor"] = {"enabled": True, "progress": False, "jsonl": str(jsonl), "csv": str(csv_path)}
        return settings

    killed = engine.initialize(mlp(0), config())
    job.train(killed, steps=5)
    killed.close()
    with jsonl.open("a") as f:
        f.write('{"kind": "train", "step": 6, "lo')  # cut short by the kill
    with csv_path.open("a") as f:
        f.write("6,0.5")
    resumed = engine.initialize(mlp(0), config())
    try:
        assert resumed.global_steps == 4
        job.train(resumed)
    finally:
        resumed.close()
    steps_ = list(range(1, job.STEPS + 1))
    assert [json.loads(line)["step"] for line in jsonl.read_text().splitlines()] == steps_
    assert [int(row["step"]) for row in csv.DictReader(csv_path.open())] == steps_


def test_stop_signal_handlers_are_given_back_when_the_last_engine_closes(tmp_path):
    """Two engines watch SIGTERM; closed in the order they were built, the second still hears
    it, and after both the handler from before is back (not the first engine's)."""
    before = signal.getsignal(signal.SIGTERM)
    first = engine.initialize(mlp(0), job.config(0, tmp_path / "a", stop_signals=["SIGTERM"]))
    second = engine.initialize(mlp(0), job.config(0, tmp_path / "b", stop_signals=["SIGTERM"]))
    try:
        first.close()
        handler = signal.getsignal(signal.SIGTERM)
        assert handler != before
        handler(signal.SIGTERM, None)  # what a delivery runs
        assert second.autosave.stop.received == signal.SIGTERM
    finally:
        second.close()
    assert signal.getsignal(signal.SIGTERM) == before


STOPPED_ELSEWHERE = """
import signal, sys, time
import engine.state.preemption as preemption
preemption.REPEAT_AFTER_SECONDS = {repeat}
if sys.argv[1] == "own handler":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
stop = preemption.StopSignals(["SIGTERM"])
stop.install()
print("ready", flush=True)
while stop.received is None:
    time.sleep(0.01)
print("received", flush=True)
while True:  # a rank that never reaches a boundary (hung in a collective, a long evaluation)
    time.sleep(0.01)
"""


def test_a_second_stop_signal_long_after_the_first_goes_to_the_handler_from_before():
    """A repeat within REPEAT_AFTER_SECONDS is the same event sent twice; a later one is given
    to the earlier handler: the default ends the process, a script's own runs."""
    repeat = 1.5
    script = STOPPED_ELSEWHERE.format(repeat=repeat)
    procs = {case: subprocess.Popen([sys.executable, "-c", script, case], cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for case in ("default", "own handler")}
    try:
        for proc in procs.values():
            assert proc.stdout.readline() == "ready\n"
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGTERM)  # a launcher forwarding it as well
        for proc in procs.values():
            assert proc.stdout.readline() == "received\n"
        first = time.monotonic()
        time.sleep(0.5)
        assert all(proc.poll() is None for proc in procs.values()), "a repeat right after the first ended it"
        time.sleep(max(0.0, first + repeat + 0.3 - time.monotonic()))
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {case: proc.wait(timeout=30) for case, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    errors = {case: proc.stderr.read() for case, proc in procs.items()}
    assert codes == {"default": -signal.SIGTERM, "own handler": 3}, errors
    assert all("SIGTERM again" in text for text in errors.values()), errors
    assert "SIGTERM already had a handler" in errors["own handler"]
    assert "already had a handler" not in errors["default"]


CTRL_C_TWICE = """
import sys, time
import engine.state.preemption as preemption
stop = preemption.StopSignals(["SIGINT"])
stop.install()
print("ready", flush=True)
while stop.received is None:
    time.sleep(0.01)
print("received", flush=True)
try:
    while True:  # a window that has not reached its boundary
        time.sleep(0.01)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(9)
"""


def test_a_second_ctrl_c_stops_at_once():
    """The first Ctrl-C is remembered (save at the next boundary); a second one, a key press
    later, goes to Python's own handler at once: KeyboardInterrupt, no 5 s wait."""
    # (SIGINT's default restored for the child: a shell that starts pytest in the background makes
    # its children ignore it, and Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_TWICE], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline() == "received\n"
        time.sleep(0.6)  # a person pressing the keys again
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = proc.stdout.read(), proc.stderr.read()
    assert (code, out) == (9, "interrupted\n"), err
    assert "SIGINT again" in err


def test_sigint_is_a_default_stop_signal():
    assert "SIGINT" in engine.load_config({"checkpoint": {"dir": "x"}}).checkpoint.stop_signals


def _deepspeed_resume(rank, world, root):
    """Two runs on the DeepSpeed backend: the first saves step 2 and 4, the second resumes."""
    config = job.config(0, root, stop_signals=[], tag_validation="Fail")
    config["backend"] = "deepspeed"
    data = torch.utils.data.TensorDataset(*(t.float() for t in job.dataset().tensors))  # DeepSpeed: no float64
    seen = []
    for attempt in range(2):
        eng = engine.initialize(mlp(0, dtype=torch.float32), config)
        try:
            seen.append((eng.strategy.ds_engine.checkpoint_tag_validation_fail(), eng.global_steps))
            while attempt == 0 and eng.global_steps < 5:
                for batch in eng.batches(data):
                    if eng.global_steps == 5:
                        break
                    eng.train_batch(batch, mse)
        finally:
            eng.close()
    return seen, eng.autosave.resumed_from


@needs_deepspeed
@pytest.mark.deepspeed
@pytest.mark.distributed
def test_deepspeed_backend_resumes_and_gets_its_checkpoint_keys(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    [(seen, resumed_from)] = run_distributed(_deepspeed_resume, world_size=1, args=(str(tmp_path),), timeout=240,
                                             env=env)
    assert seen == [(True, 0), (True, 4)]  # tag_validation: Fail reached DeepSpeed; resumed at step 4
    assert resumed_from == str(tmp_path / checkpoint_name(4))


def test_checkpoint_section_keys_and_deepspeed_pass_through():
    config = engine.load_config({"checkpoint": {"dir": "ckpt", "every_steps": 5, "tag_validation": "Fail",
                                                "load_universal": False}, "backend": "deepspeed"})
    assert config.checkpoint.dir == "ckpt" and config.checkpoint.resume == "auto"
    assert "checkpoint" not in config.deepspeed_extras
    assert deepspeed_config(config, 2)["checkpoint"] == {"tag_validation": "Fail", "load_universal": False}
    assert "checkpoint" not in deepspeed_config(engine.load_config({"backend": "deepspeed"}), 2)
    with pytest.raises(engine.ConfigError) as problems:
        engine.load_config({"checkpoint": {"every_steps": 5, "keep_last": 0, "stop_signals": ["SIGKILL"],
                                           "every_step": 1}})
    text = str(problems.value)
    for expected in ("checkpoint.every_step: unknown key; did you mean every_steps?",
                     "checkpoint.keep_last: must be > 0", "SIGKILL cannot be caught"):
        assert expected in text
    with pytest.raises(engine.ConfigError, match="every_steps needs dir"):
        engine.load_config({"checkpoint": {"every_steps": 5}})
    # without dir nothing saves, so a stop signal would stop nothing: said, not ignored
    for key, value in (("stop_signals", ["SIGUSR1"]), ("stop_exit_code", 3)):
        with pytest.raises(engine.ConfigError, match=f"checkpoint: {key} needs dir"):
            engine.load_config({"checkpoint": {key: value, "resume": "runs/elsewhere"}})


def test_deepspeeds_checkpoint_writer_is_refused():
    """Its writers publish files later (decoupled), on some ranks only (FAST) or never (MOCK):
    a manifest of sizes and an atomic rename cannot describe that."""
    config = engine.load_config({"backend": "deepspeed", "train_batch_size": 8,
                                 "checkpoint": {"dir": "ckpt", "writer": {"decoupled": True}}})
    [problem] = check_without_model(config)
    assert "checkpoint.writer: " in problem and "decoupled" in problem and "remove the key" in problem
    with pytest.raises(engine.ConfigError, match="checkpoint.writer"):
        engine.initialize(mlp(0), config)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0x5A for b in data[middle:middle + 64])  # same size
    path.write_bytes(bytes(data))


def _resume_past_damage(rank, world, root, victim_index):
    """Two ranks at ZeRO-2 save steps 2, 4, ..., 8; one file of step 8 is damaged (read by the rank
    whose share it is); both ranks resume from step 6."""
    directory = Path(root) / "checkpoints"
    eng = engine.initialize(mlp(0), job.config(2, directory, stop_signals=[]))
    job.train(eng)
    eng.close()
    if rank == 0:
        newest = directory / checkpoint_name(job.STEPS)
        names = sorted(json.loads((newest / MANIFEST).read_text())["checksums"])
        _flip(newest / names[victim_index % len(names)])
    dist.barrier()
    eng = engine.initialize(mlp(0), job.config(2, directory, stop_signals=[]))
    resumed = (eng.autosave.resumed_from, eng.global_steps)
    eng.close()
    explicit = None
    try:  # the damaged one named explicitly: an error on every rank
        engine.initialize(mlp(0), job.config(2, Path(root) / "empty", stop_signals=[],
                                             resume=str(directory / checkpoint_name(job.STEPS))))
    except engine.CheckpointError as error:
        explicit = str(error)
    return resumed, explicit


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim_index", [0, 1])
def test_two_ranks_share_the_checksums_and_skip_a_damaged_newest_checkpoint(tmp_path, victim_index):
    results = run_distributed(_resume_past_damage, 2, args=(str(tmp_path), victim_index), timeout=100)
    for rank, (resumed, explicit) in enumerate(results):
        assert resumed == (str(tmp_path / "checkpoints" / checkpoint_name(job.STEPS - 2)), job.STEPS - 2), rank
        assert explicit and "checkpoint.resume" in explicit and "checksum mismatch" in explicit, (rank, explicit)
