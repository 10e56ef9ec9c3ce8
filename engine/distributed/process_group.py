"""The process group, set up from whatever launched this process.

Three launch styles are understood, in this order:

* torchrun, ``python -m launch`` and the deepspeed launcher: ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (+ ``LOCAL_WORLD_SIZE`` or deepspeed's
  ``LOCAL_SIZE``). Scripts started by the deepspeed launcher also receive
  ``--local_rank=N``; call :func:`strip_local_rank_arg` before argparse.
* Slurm (``srun python train.py``, one task per device): ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``; the master is the
  first host of the step's node list and the port is derived from ``SLURM_JOB_ID`` unless
  ``MASTER_ADDR`` / ``MASTER_PORT`` are set.
* Nothing: one process, no process group.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, MutableSequence

import torch
import torch.distributed as dist

from engine.distributed.agent_store import fresh_namespace
from engine.errors import DistributedEnvError

LAUNCH_HINT = (
    "Launch with `python -m launch --nproc-per-node N script.py` (or torchrun, the deepspeed "
    "launcher, or `srun` under Slurm), or unset RANK and WORLD_SIZE to run as one process."
)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: a single process without a process group


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as described by its launcher's environment."""

    source: str  # "torchrun" (also deepspeed / manual), "slurm" or "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None


# --------------------------------------------------------------------------- env parsing


def _int_var(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise DistributedEnvError(f"{name}={value!r} is not an integer.") from None


def _check_position(env: LaunchEnv) -> LaunchEnv:
    if env.world_size < 1:
        raise DistributedEnvError(f"world size must be >= 1, got {env.world_size}.")
    if not 0 <= env.rank < env.world_size:
        raise DistributedEnvError(f"rank {env.rank} is outside [0, {env.world_size}).")
    if not 0 <= env.local_rank < env.local_world_size:
        raise DistributedEnvError(
            f"local rank {env.local_rank} is outside [0, {env.local_world_size})."
        )
    if env.master_port is not None and not 0 < env.master_port < 65536:
        raise DistributedEnvError(f"master port {env.master_port} is not a valid TCP port.")
    return env


def _local_position(environ: Mapping[str, str], rank: int, world_size: int) -> tuple[int, int]:
    """(local_rank, local_world_size); without them, assume all ranks share one node."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):  # torchrun, deepspeed
        if name in environ:
            local_world_size = _int_var(environ, name)
            break
    else:
        local_world_size = world_size
    if "LOCAL_RANK" in environ:
        local_rank = _int_var(environ, "LOCAL_RANK")
    else:
        local_rank = rank % local_world_size
    return local_rank, local_world_size


def _torchrun_env(environ: Mapping[str, str]) -> LaunchEnv:
    missing = [n for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if n not in environ]
    if missing:
        present = [n for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if n in environ]
        raise DistributedEnvError(
            f"Half-set distributed environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. {LAUNCH_HINT}"
        )
    rank, world_size = _int_var(environ, "RANK"), _int_var(environ, "WORLD_SIZE")
    local_rank, local_world_size = _local_position(environ, rank, world_size)
    return LaunchEnv(
        "torchrun", rank, local_rank, world_size, local_world_size,
        environ["MASTER_ADDR"], _int_var(environ, "MASTER_PORT"),
    )


def _expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed list, e.g. "4(x2),3" -> [4, 4, 3]."""
    counts = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise DistributedEnvError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}.")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list, e.g. "gpu[07-09,12],cpu1" -> "gpu07"."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first item
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    host = nodelist[:end].strip()
    # Each bracket group is a list of numbers and ranges; keep its first number as written
    # (with its zero padding).
    while "[" in host:
        host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m[1])[0], host, count=1)
    if not host:
        raise DistributedEnvError(f"cannot parse a host from Slurm node list {nodelist!r}.")
    return host


def _slurm_env(environ: Mapping[str, str]) -> LaunchEnv:
    rank, world_size = _int_var(environ, "SLURM_PROCID"), _int_var(environ, "SLURM_NTASKS")
    if world_size == 1:
        return LaunchEnv("none")
    if "SLURM_LOCALID" not in environ:
        raise DistributedEnvError(f"SLURM_LOCALID is missing. {LAUNCH_HINT}")
    local_rank = _int_var(environ, "SLURM_LOCALID")
    if "SLURM_NTASKS_PER_NODE" in environ and environ["SLURM_NTASKS_PER_NODE"].isdigit():
        local_world_size = int(environ["SLURM_NTASKS_PER_NODE"])
    elif "SLURM_TASKS_PER_NODE" in environ:
        per_node = _expand_tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
        node = _int_var(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
        local_world_size = per_node[min(node, len(per_node) - 1)]
    else:
        raise DistributedEnvError(
            f"SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE are both missing. {LAUNCH_HINT}"
        )

    master_addr = environ.get("MASTER_ADDR")
    if master_addr is None:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise DistributedEnvError(
                "Under Slurm, MASTER_ADDR is not set and neither is SLURM_JOB_NODELIST to "
                f"derive it from. {LAUNCH_HINT}"
            )
        master_addr = first_slurm_host(nodelist)
    if "MASTER_PORT" in environ:
        master_port = _int_var(environ, "MASTER_PORT")
    elif "SLURM_JOB_ID" in environ:
        # Same on every task of the job, different between jobs sharing a node, and below
        # the usual ephemeral range (32768+) so it rarely collides with client sockets.
        master_port = 10000 + _int_var(environ, "SLURM_JOB_ID") % 20000
    else:
        master_port = 29500
    return LaunchEnv("slurm", rank, local_rank, world_size, local_world_size,
                     master_addr, master_port)


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Parse the launcher's variables (``os.environ`` by default) without side effects."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _check_position(_torchrun_env(environ))
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return _check_position(_slurm_env(environ))
    return LaunchEnv("none")


# --------------------------------------------------------------------------- process group

_owns_group = False  # True when init_distributed created the default group
_atexit_registered = False
_control: tuple | None = None  # (the default group it belongs to, the control group, its timeout in s)
AGREEMENT_TIMEOUT_SECONDS = 600.0


def _device_for(local_rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    # One visible GPU: the scheduler gave each process its own (e.g. Slurm --gpus-per-task=1).
    index = 0 if visible == 1 else local_rank
    if index >= visible:
        raise DistributedEnvError(
            f"local rank {local_rank} needs GPU {local_rank}, but only {visible} are "
            f"visible. Start at most one process per GPU."
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(timeout_seconds: float = 1800, backend: str = "auto", *,
                     group_for_one_process: bool = False,
                     agreement_timeout_seconds: float = AGREEMENT_TIMEOUT_SECONDS) -> DistInfo:
    """Join (or create) the default process group described by the environment, and the
    control group beside it (see :func:`control_group`). Collective.

    Without a launcher this is a single process and no group is created (``backend`` None),
    unless ``group_for_one_process`` (a backend such as DeepSpeed needs a group even then):
    a one-rank gloo group on an in-memory store. An already-initialised group is reused as it
    is. ``backend="auto"`` picks nccl when CUDA is available, gloo otherwise.
    """
    info = _join_default_group(timeout_seconds, backend, group_for_one_process)
    if info.backend is not None:
        _ensure_control_group(agreement_timeout_seconds)
    return info


def _join_default_group(timeout_seconds: float, backend: str, group_for_one_process: bool) -> DistInfo:
    global _owns_group, _atexit_registered
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank, local_world_size = _local_position(os.environ, rank, world_size)
        return DistInfo(rank, local_rank, world_size, local_world_size,
                        _device_for(local_rank), dist.get_backend())

    env = read_launch_env()
    if env.source == "none" and not group_for_one_process:
        return DistInfo(0, 0, 1, 1, _device_for(0), None)
    if not dist.is_available():
        raise DistributedEnvError("this torch build has no torch.distributed support.")
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if env.source == "none":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        info = DistInfo(0, 0, 1, 1, _device_for(0), "gloo")
    else:
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        device = _device_for(env.local_rank)
        # env:// reads these; exporting them (Slurm case) also lets later tools see the job.
        for name, value in (("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port),
                            ("RANK", env.rank), ("WORLD_SIZE", env.world_size),
                            ("LOCAL_RANK", env.local_rank),
                            ("LOCAL_WORLD_SIZE", env.local_world_size)):
            os.environ.setdefault(name, str(value))
        store = _store_of_this_attempt(env, timeout)
        if store is None:
            dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                    world_size=env.world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout)
        info = DistInfo(env.rank, env.local_rank, env.world_size, env.local_world_size, device, backend)
    _owns_group = True
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True
    return info


def _store_of_this_attempt(env: LaunchEnv, timeout: datetime.timedelta):
    """Under torchrun, whose agent hosts one store for every start of its workers: a key space
    that no earlier start used, agreed through the store itself (``engine.distributed.agent_store``). None
    when there is nothing to fix (env:// as usual)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return fresh_namespace(store, env.rank, env.world_size, timeout)


def shutdown(barrier_timeout_seconds: float = 30) -> None:
    """Destroy the process group created by :func:`init_distributed`; idempotent.

    Ranks first meet at a barrier (bounded by the timeout) so none tears its connections
    down while a peer is still talking: on gloo, exiting without this sometimes aborts the
    process with "terminate called without an active exception". A group this module did
    not create is left to its owner.
    """
    global _owns_group, _control, _writer
    if not (_owns_group and dist.is_initialized()):
        _owns_group = False
        return
    if barrier_timeout_seconds > 0:
        try:
            _bounded_barrier(barrier_timeout_seconds)
        except Exception:  # a peer has already gone; tear down our side anyway
            pass
    _control = _writer = None
    dist.destroy_process_group()
    _owns_group = False


def _bounded_barrier(timeout_seconds: float) -> None:
    group = _control[1] if _control is not None else (dist.group.WORLD if dist.get_backend() == "gloo" else None)
    if group is None:
        # nccl without a gloo side group: bounded by the group's own timeout
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout_seconds))


def _shutdown_at_exit() -> None:
    # After an uncaught exception the peers are usually stuck in a collective: don't make
    # the failing rank wait for them, so its launcher notices the failure at once.
    crashed = getattr(sys, "last_value", None) is not None
    shutdown(barrier_timeout_seconds=0 if crashed else 10)


# --------------------------------------------------------------------------- helpers


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


_this_thread = threading.local()  # .control: a thread's own control group (a background checkpoint writer's)
_writer: tuple | None = None  # (the default group it belongs to, the background writer's group)


def background_control_group() -> dist.ProcessGroup | None:
    """A second gloo group like the control group, for a thread that runs its agreements and
    checkpoint collectives while the main thread trains (an asynchronous checkpoint write):
    sharing a group, the two threads' collectives would pair up with each other's on the peers.
    Created at the first call, which is therefore collective; None when not distributed."""
    global _writer
    if not is_distributed():
        return None
    if _writer is None or _writer[0] is not dist.group.WORLD:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=agreement_timeout_seconds()))
        _writer = (dist.group.WORLD, group)
    return _writer[1]


@contextlib.contextmanager
def control_group_of_this_thread(group: dist.ProcessGroup | None):
    """Inside, on this thread only, :func:`control_group` is ``group``: everything that agrees or
    gathers on the control group (checkpoint agreements, DCP's planning) uses it instead."""
    _this_thread.control = group
    try:
        yield
    finally:
        _this_thread.control = None


def control_group() -> dist.ProcessGroup | None:
    """A gloo group for agreements: small CPU-side collectives (flags, counts, strings) whose
    waits are bounded by the agreement timeout, not the training group's.

    It is a communicator of its own even when training uses gloo, so that an agreement a
    rank enters while a peer is still inside a training collective (ranks that ran different
    numbers of micro-steps, or a peer that died) times out with a clear error instead of
    mixing with that collective. :func:`init_distributed` creates it; a first use without
    it creates it then, which is itself a collective. None when not distributed.
    """
    if not is_distributed():
        return None
    own = getattr(_this_thread, "control", None)
    if own is not None:
        return own
    if _control is None or _control[0] is not dist.group.WORLD:
        _ensure_control_group(AGREEMENT_TIMEOUT_SECONDS)
    return _control[1]


def _ensure_control_group(timeout_seconds: float) -> None:
    """A control group of the current default group with this timeout: a new one when there
    is none yet or when the one there has another timeout (a config's own setting wins over
    the group a launcher or an earlier engine made). Collective."""
    global _control
    if _control is not None and _control[0] is dist.group.WORLD and _control[2] == timeout_seconds:
        return
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
    superseded = _control[1] if _control is not None and _control[0] is dist.group.WORLD else None
    _control = (dist.group.WORLD, group, timeout_seconds)
    if superseded is not None:
        # Every caller looks the group up again (control_group()), so nothing uses the old one.
        dist.destroy_process_group(superseded)


def agreement_timeout_seconds() -> float:
    """How long a collective on the control group waits for a peer before it gives up."""
    if _control is None or _control[0] is not dist.group.WORLD:
        return AGREEMENT_TIMEOUT_SECONDS
    return _control[2]


def is_peer_lost(error: BaseException) -> bool:
    """A collective that gave up on a peer: it waited past the group's timeout, or the peer's
    process is gone (gloo and nccl word both differently). A gloo group that timed out cannot
    be used again."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        words in text for words in ("timed out", "timeout", "connection reset", "connection closed", "pair closure"))


_LOCAL_RANK_FLAG = re.compile(r"--local[_-]rank(?:=(.*))?")


def strip_local_rank_arg(argv: MutableSequence[str] | None = None) -> int | None:
    """Remove ``--local_rank`` / ``--local-rank`` (``=N`` or ``N``) from argv in place.

    The deepspeed launcher (and the legacy ``torch.distributed.launch``) append it to the
    script's arguments; call this before argparse. Sets ``LOCAL_RANK`` if it is not set yet.
    Returns N, or None when the flag is absent.
    """
    argv = sys.argv if argv is None else argv
    found: int | None = None
    i = 0
    while i < len(argv):
        match = _LOCAL_RANK_FLAG.fullmatch(argv[i])
        if not match:
            i += 1
            continue
        value = match[1]
        if value is None:
            if i + 1 >= len(argv):
                raise ValueError(f"{argv[i]} needs a value.")
            value = argv[i + 1]
            del argv[i : i + 2]
        else:
            del argv[i]
        try:
            found = int(value)
        except ValueError:
            raise ValueError(f"--local_rank expects an integer, got {value!r}.") from None
    if found is not None:
        os.environ.setdefault("LOCAL_RANK", str(found))
    return found
