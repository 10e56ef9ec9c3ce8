"""engine.distributed.process_group: launch-environment parsing, helpers, and the run_distributed harness."""
import datetime
import functools
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.file_baton import FileBaton

from tests.support.dist_utils import TORCH_EXTENSIONS_DIR, DistributedRunError, run_distributed, run_scenarios
from engine.distributed import process_group as distributed
from engine.distributed.process_group import (
    DistributedEnvError,
    DistInfo,
    LaunchEnv,
    first_slurm_host,
    read_launch_env,
    strip_local_rank_arg,
)

TORCHRUN_ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
SLURM_ENV = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x4)",
             "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_ID": "123456"}
LAUNCH_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE",
               "MASTER_ADDR", "MASTER_PORT", *SLURM_ENV, "SLURM_NTASKS_PER_NODE",
               "SLURM_STEP_NODELIST"]


# --------------------------------------------------------------------------- env parsing


def test_no_launcher_means_single_process():
    assert read_launch_env({"PATH": "/bin", "MASTER_ADDR": "x"}) == LaunchEnv("none")


def test_torchrun_env():
    assert read_launch_env(TORCHRUN_ENV) == LaunchEnv("torchrun", 3, 1, 4, 2, "10.0.0.1", 29400)


def test_deepspeed_env_uses_local_size():
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_WORLD_SIZE"}
    env.update(LOCAL_SIZE="2", CROSS_RANK="1", CROSS_SIZE="2")
    assert read_launch_env(env).local_world_size == 2


def test_missing_local_rank_assumes_one_node():
    env = {k: v for k, v in TORCHRUN_ENV.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    parsed = read_launch_env(env)
    assert (parsed.local_rank, parsed.local_world_size) == (3, 4)


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"])
def test_half_set_env_names_the_missing_variable(missing):
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != missing}
    with pytest.raises(DistributedEnvError, match=missing) as info:
        read_launch_env(env)
    assert "python -m launch" in str(info.value)


@pytest.mark.parametrize("change, message", [
    ({"RANK": "x"}, "RANK='x' is not an integer"),
    ({"RANK": "4"}, "rank 4 is outside"),
    ({"LOCAL_RANK": "2"}, "local rank 2 is outside"),
    ({"MASTER_PORT": "70000"}, "not a valid TCP port"),
])
def test_inconsistent_env_is_rejected(change, message):
    with pytest.raises(DistributedEnvError, match=message):
        read_launch_env({**TORCHRUN_ENV, **change})


def test_slurm_env():
    parsed = read_launch_env(SLURM_ENV)
    assert parsed == LaunchEnv("slurm", 5, 1, 8, 2, "gpu07", 10000 + 123456 % 20000)


def test_slurm_uneven_tasks_per_node_and_overrides():
    env = {**SLURM_ENV, "SLURM_TASKS_PER_NODE": "3(x2),1", "SLURM_LOCALID": "0",
           "SLURM_STEP_NODELIST": "cpu[3-5]", "MASTER_PORT": "1234"}
    parsed = read_launch_env(env)
    assert (parsed.local_world_size, parsed.master_addr, parsed.master_port) == (1, "cpu3", 1234)
    env.update(SLURM_NTASKS_PER_NODE="4", MASTER_ADDR="head")
    parsed = read_launch_env(env)
    assert (parsed.local_world_size, parsed.master_addr) == (4, "head")


def test_slurm_single_task_is_single_process():
    assert read_launch_env({**SLURM_ENV, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).source \
        == "none"


def test_slurm_without_nodelist_or_master_is_an_error():
    env = {k: v for k, v in SLURM_ENV.items() if k != "SLURM_JOB_NODELIST"}
    with pytest.raises(DistributedEnvError, match="SLURM_JOB_NODELIST"):
        read_launch_env(env)


def test_torchrun_vars_win_over_slurm():  # srun ... torchrun ...
    assert read_launch_env({**SLURM_ENV, **TORCHRUN_ENV}).source == "torchrun"


@pytest.mark.parametrize("nodelist, host", [
    ("node5", "node5"),
    ("gpu[07-10]", "gpu07"),
    ("gpu[12,3-4],cpu1", "gpu12"),
    ("a1,b[1-2]", "a1"),
    ("rack[2-3]-n[001-004]", "rack2-n001"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


# --------------------------------------------------------------------------- single process


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def test_init_without_launcher_is_single_process(no_launcher):
    info = distributed.init_distributed()
    assert info == DistInfo(0, 0, 1, 1, torch.device("cpu"), None)
    assert not distributed.is_distributed()
    assert (distributed.get_rank(), distributed.get_world_size()) == (0, 1)
    assert distributed.control_group() is None
    distributed.barrier()
    distributed.shutdown()
    distributed.shutdown()


@pytest.mark.parametrize("visible, local_rank, expected", [(4, 2, 2), (1, 3, 0), (2, 3, None)])
def test_gpu_per_local_rank(monkeypatch, visible, local_rank, expected):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    if expected is None:
        with pytest.raises(DistributedEnvError, match="only 2 are visible"):
            distributed._device_for(local_rank)
    else:
        assert distributed._device_for(local_rank) == torch.device("cuda", expected)
        assert chosen == [expected]


def test_init_with_half_set_env_fails(no_launcher, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedEnvError, match="MASTER_ADDR, MASTER_PORT missing"):
        distributed.init_distributed()


# --------------------------------------------------------------------------- --local_rank


@pytest.mark.parametrize("argv", [
    ["train.py", "--local_rank=2", "--lr", "1"],
    ["train.py", "--local_rank", "2", "--lr", "1"],
    ["train.py", "--lr", "1", "--local-rank=2"],
    ["train.py", "--local-rank", "2", "--lr", "1"],
])
def test_strip_local_rank_arg(argv, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_local_rank_arg(argv) == 2
    assert sorted(argv) == sorted(["train.py", "--lr", "1"])
    assert os.environ["LOCAL_RANK"] == "2"


def test_strip_local_rank_arg_defaults_to_sys_argv_and_keeps_env(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--local_rank=1", "--local_ranking"])
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert strip_local_rank_arg() == 1
    assert sys.argv == ["train.py", "--local_ranking"]
    assert os.environ["LOCAL_RANK"] == "0"


def test_strip_local_rank_arg_absent_or_bad(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    argv = ["train.py", "--lr", "1"]
    assert strip_local_rank_arg(argv) is None
    assert argv == ["train.py", "--lr", "1"] and "LOCAL_RANK" not in os.environ
    with pytest.raises(ValueError, match="integer"):
        strip_local_rank_arg(["--local_rank=one"])
    with pytest.raises(ValueError, match="needs a value"):
        strip_local_rank_arg(["train.py", "--local_rank"])


# --------------------------------------------------------------------------- real groups
# Functions run by the ranks live at module level so the child processes can import them.


def _describe_rank(rank, world_size):
    info = distributed.init_distributed()  # reuses the harness's group
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return {"info": (info.rank, info.local_rank, info.world_size, info.backend),
            "helpers": (distributed.get_rank(), distributed.get_world_size(),
                        distributed.is_distributed()),
            # agreements get a gloo communicator of their own, over every rank
            "control_is_world": distributed.control_group() is not dist.group.WORLD
            and dist.get_world_size(distributed.control_group()) == world_size,
            "sum": total.item(), "env": os.environ.get("MICROSTEP_PROBE"),
            "extensions": os.environ.get("TORCH_EXTENSIONS_DIR")}


def _shutdown_twice(rank, world_size):
    distributed.barrier()
    distributed.shutdown()
    distributed.shutdown()
    return distributed.is_distributed()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one exploded")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that never comes
    return rank


def _hang_on_rank_one(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def _build_under_an_extension_lock(rank, world_size):
    """Rank 0 holds a torch extension build's lock as torch's own build does (released in a
    finally block) and never finishes; rank 1 waits on it, as every later build or load does."""
    baton = FileBaton(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "op", "lock"))
    if rank == 0:
        os.makedirs(os.path.dirname(baton.lock_file_path))
        assert baton.try_acquire()
        try:
            time.sleep(600)
        finally:
            baton.release()
    else:
        while not os.path.exists(baton.lock_file_path):  # rank 0 takes it first
            time.sleep(0.05)
        baton.wait()
    return rank


def _abort_after_result(rank, world_size):
    # Simulates gloo's crash at exit: abort after the result has been delivered.
    from multiprocessing import util
    util.Finalize(None, os.abort, exitpriority=0)
    return rank * 10



def _restarts_on_one_agent_store(rank, world_size, port):
    """The harness joined through the agent store (the first start). Then two restarts, as a
    healthy node's agent makes them: rank 0's agent counts them, rank 1's does not; before
    the second, a worker that died while joining (its ticket) and a leader that died before
    its peers came (its generation) leave their keys behind."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=10))
    sums = []
    for restart, stale in ((1, None), (2, "dead workers")):
        distributed.shutdown()
        if stale is not None and rank == 1:
            store.add("microstep/tickets", 1)
            store.add("microstep/generations", 1)
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restart if rank == 0 else 0)
        distributed.init_distributed(timeout_seconds=10, backend="gloo")
        total = torch.tensor([rank + 1])
        dist.all_reduce(total)
        sums.append(total.item())
    return sums


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_restarted_workers_on_torchruns_shared_store_find_each_other():
    """torchrun's agent store keeps every start's keys; the restart counts of two agents need
    not agree (pytorch/pytorch#135712): the workers of each start still form their group."""
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": str(agent.port),
           "TORCHELASTIC_RESTART_COUNT": "0"}
    assert run_distributed(_restarts_on_one_agent_store, args=(agent.port,), env=env, timeout=90) == [[3, 3]] * 2
    assert agent.add("microstep/generations", 0) == 4  # three starts and the dead leader


def _a_new_agreement_timeout_replaces_the_control_group(rank, world_size):
    first = distributed.control_group()
    distributed.init_distributed(agreement_timeout_seconds=distributed.agreement_timeout_seconds() + 1)
    second = distributed.control_group()
    try:
        dist.get_global_rank(first, 0)
        old_group_registered = True
    except ValueError:  # not registered: destroyed
        old_group_registered = False
    dist.all_reduce(torch.ones(1), group=second)
    return second is not first, old_group_registered


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_run_distributed_returns_results_in_rank_order(monkeypatch):
    monkeypatch.setenv("MICROSTEP_PROBE", "from-parent")
    results = run_distributed(_describe_rank, world_size=3, timeout=90)
    assert [r["info"] for r in results] == [(r, r, 3, "gloo") for r in range(3)]
    assert [r["helpers"] for r in results] == [(r, 3, True) for r in range(3)]
    assert all(r["control_is_world"] and r["sum"] == 6 for r in results)
    assert all(r["env"] == "from-parent" for r in results)
    # one torch extension cache per checkout, not the home directory's that every checkout shares
    expected = os.environ.get("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR))
    assert [r["extensions"] for r in results] == [expected] * 3
    results = run_distributed(_describe_rank, env={"MICROSTEP_PROBE": "from-env"}, timeout=90)
    assert [r["env"] for r in results] == ["from-env"] * 2


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_run_scenarios_and_idempotent_shutdown():
    results = run_scenarios({"describe": _describe_rank,
                             "abort_after": _abort_after_result,
                             "new_control_group": _a_new_agreement_timeout_replaces_the_control_group,
                             "shutdown": _shutdown_twice}, timeout=90)
    assert [r["sum"] for r in results["describe"]] == [3, 3]
    assert results["abort_after"] == [0, 10]
    assert results["new_control_group"] == [(True, False)] * 2  # the superseded group was destroyed
    assert results["shutdown"] == [False, False]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_result_then_crash_at_exit_counts_as_success():
    assert run_distributed(_abort_after_result, timeout=90) == [0, 10]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_raising_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_raise_on_rank_one, timeout=90)
    message = str(info.value)
    assert "--- rank 1 ---" in message and "ValueError: rank one exploded" in message
    if "--- rank 0 ---" in message:  # rank 0 lost its peer: reported after the root cause
        assert message.index("--- rank 1 ---") < message.index("--- rank 0 ---")
    assert time.monotonic() - start < 30


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_hanging_rank_hits_the_timeout():
    # The budget covers starting both ranks and their rendezvous too: 10 s, which a loaded
    # 2-core machine meets (3 s did not always), and the hang then takes all of it.
    run_distributed(_shutdown_twice, timeout=60)  # a warm fork server first
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_hang_on_rank_one, timeout=10)
    message = str(info.value)
    assert "timeout after 10s" in message
    assert "ranks [1] did not finish" in message and "ranks [0] delivered" in message
    assert "_hang_on_rank_one" in message  # the hung rank's stack
    assert time.monotonic() - start < 40  # ended at its timeout, not at pytest's


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_run_stopped_mid_build_releases_the_extension_lock(tmp_path):
    """A run that times out while a rank builds a torch extension (DeepSpeed's CPU ops, on first
    use) names the lock its peer waits on and leaves no lock behind: a SIGKILL left one, and
    every later DeepSpeed run on the machine waited on it forever."""
    lock = tmp_path / "op" / "lock"
    run_distributed(_shutdown_twice, timeout=60)  # a warm fork server first: the 10 s below cover the ranks' start
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_build_under_an_extension_lock, timeout=10, env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    message = str(info.value)
    assert "ranks [0, 1] did not finish" in message
    assert "waits on a torch extension build lock" in message and f"remove {lock}." in message
    assert not lock.exists()


def test_run_distributed_rejects_functions_the_child_cannot_import():
    with pytest.raises(TypeError, match="module-level"):
        run_distributed(lambda rank, world_size: rank)
    with pytest.raises(TypeError, match="module-level"):
        run_distributed(functools.partial(lambda rank, world_size, x: x, x=1))
