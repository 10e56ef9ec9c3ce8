"""Run a test function on several gloo ranks, each in its own fresh process.

    def _all_reduce_ranks(rank, world_size, scale):   # module level: see below
        t = torch.tensor([rank * scale])
        dist.all_reduce(t)
        return t.item()

    @pytest.mark.distributed
    @pytest.mark.timeout(60)
    def test_sum():
        assert run_distributed(_all_reduce_ranks, world_size=2, args=(3,)) == [3, 3]

``fn`` must be a **module-level function** (or a ``functools.partial`` of one) with
picklable arguments and return value: the child processes import it by module and name,
so lambdas, nested functions and functions defined in ``__main__`` do not work.

Each rank runs ``fn(rank, world_size, *args)`` after ``engine.distributed.process_group.init_distributed``
has set up a gloo process group. Its environment is the caller's ``os.environ`` at the
time of the call (so ``monkeypatch.setenv`` reaches it), then MASTER_ADDR=127.0.0.1, a
free MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, OMP_NUM_THREADS=1,
TORCH_EXTENSIONS_DIR (unless the caller's environment sets it: the checkout's
``.cache/torch_extensions``, see below), then ``env``. The process-group timeout is ``max(timeout / 2, 10)`` seconds. The run

* returns the per-rank return values in rank order;
* fails fast: when a rank raises, the others are killed and the error shows every failing
  rank's traceback (earliest first: later ones are usually peers losing their connection);
* fails after ``timeout`` seconds (start-up included) naming the ranks that did not
  finish, with their Python stacks at that moment;
* counts a rank as done once it has delivered its result, so a crash while exiting (gloo
  sometimes aborts with "terminate called without an active exception") is harmless;
* echoes each rank's stdout/stderr to this process's stderr, prefixed by rank;
* stops ranks still running at the end with SIGINT first (KeyboardInterrupt: their ``finally``
  blocks run), then SIGKILL after a second.

DeepSpeed on CPU compiles its shared-memory comm op at every ``deepspeed.initialize`` on first
use (3 to 7 minutes on a loaded 2-core machine) into TORCH_EXTENSIONS_DIR, under a lock file
that every later build or load waits on, without a timeout. Hence one cache per checkout,
built once and kept (not the home directory's, which every checkout and virtual environment
on the machine shares), the SIGINT, which lets torch's build remove its lock when a run is
stopped mid-build (a SIGKILL left it behind and every later DeepSpeed run hung), and a timeout
message that names the lock files when a rank waits on one.

Start-up cost: processes come from a fork server that has already imported torch, engine's
core, deepspeed, torch's inductor and transformers' model base (tests/support/rank_preload.py), so
only the first call in a pytest worker pays those imports (~10 s on a loaded machine); later calls cost ~0.15 s plus what
the scenario imports beyond them (engine is only preloaded when importable from the directory
pytest runs in, or installed). ``start_method="spawn"`` gives fully fresh interpreters at
~3 s per call or more on a loaded machine. To save even the fork and the process-group
set-up, run several checks in one set of ranks with :func:`run_scenarios`, or let ``fn``
loop over cases itself and return a dict.
"""
from __future__ import annotations

import faulthandler
import functools
import gc
import multiprocessing
import multiprocessing.connection
import glob
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

from launch.cli import free_port

DEFAULT_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() \
    else "spawn"
EXIT_GRACE_SECONDS = 5.0  # after delivering results, ranks get this long to exit cleanly
ERROR_GRACE_SECONDS = 0.5  # after the first error, collect the other ranks' errors this long
STACK_DUMP_WAIT_SECONDS = 0.5
PORT_RETRIES = 2  # free_port() can race with another process grabbing the same port
INTERRUPT_GRACE_SECONDS = 1.0  # after SIGINT, ranks get this long to run their finally blocks
TORCH_EXTENSIONS_DIR = Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions"


class DistributedRunError(AssertionError):
    """A rank raised, died without a result, or the run timed out."""


# --------------------------------------------------------------------------- child side


def _child(rank: int, world_size: int, fn: Callable, args: tuple, environ: dict,
           pg_timeout: float, conn, log_path: str) -> None:
    # Behave like a fresh process started now: the parent's current environment, and
    # stdout/stderr into a per-rank log the parent reads back.
    os.environ.clear()
    os.environ.update(environ)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    faulthandler.enable()  # segfaults and aborts print their stack to the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks on timeout
    # SIGINT raises KeyboardInterrupt (the stop at the end relies on it) even where pytest was
    # started in the background by a shell, which makes its children ignore SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        import torch

        torch.set_num_threads(1)
        from engine.distributed.process_group import init_distributed, shutdown

        init_distributed(timeout_seconds=pg_timeout, backend="gloo")
        # What is loaded by now (torch, the scenario's module and what it imports) lives as long as
        # the rank: kept out of the collector's scans, which DeepSpeed's ZeRO-3 start-up runs in full.
        gc.freeze()
        message = pickle.dumps(("ok", fn(rank, world_size, *args)))
    except BaseException:
        message = pickle.dumps(("error", (time.time(), traceback.format_exc())))
        _deliver(conn, message)
        os._exit(1)  # peers may be stuck in a collective: skip the shutdown barrier
    _deliver(conn, message)
    shutdown()


def _deliver(conn, message: bytes) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(message)
    conn.close()


# --------------------------------------------------------------------------- parent side


def _preload_modules() -> list[str]:
    # The fork server imports these once; each rank is then a cheap fork of it. A module
    # that fails to import with anything but ImportError would kill the server, so engine
    # is only preloaded when it imports cleanly here; what ranks import later (engine's core,
    # deepspeed, inductor, transformers) through tests.support.rank_preload, which never raises.
    try:
        import engine  # noqa: F401
    except Exception:
        return ["torch", "torch.distributed"]
    return ["torch", "torch.distributed", "engine", "tests.support.rank_preload"]


def _check_importable(fn: Callable, args: tuple) -> None:
    target = fn.func if isinstance(fn, functools.partial) else fn
    qualname = getattr(target, "__qualname__", "")
    if "<" in qualname or getattr(target, "__module__", None) == "__main__":
        raise TypeError(
            f"run_distributed needs a module-level function the child can import; got "
            f"{target!r}. Move it to the top level of a module."
        )
    try:
        pickle.dumps((fn, args))
    except Exception as error:
        raise TypeError(f"fn and args must be picklable: {error}") from error


class _Run:
    """One attempt: world_size processes, their result pipes and logs."""

    def __init__(self, fn, world_size, args, timeout, env, start_method):
        self.world_size = world_size
        self.timeout = timeout
        self.logdir = tempfile.mkdtemp(prefix="run_distributed_")
        context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            context.set_forkserver_preload(_preload_modules())  # used when the server starts
        environ = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                       OMP_NUM_THREADS="1")
        environ.setdefault("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR))
        environ.update(env or {})
        self.extensions_dir = environ["TORCH_EXTENSIONS_DIR"]
        pg_timeout = max(timeout / 2, 10.0)
        self.procs, self.readers = [], []
        for rank in range(world_size):
            reader, writer = context.Pipe(duplex=False)
            rank_env = dict(environ, RANK=str(rank), LOCAL_RANK=str(rank))
            proc = context.Process(
                target=_child, name=f"rank{rank}",
                args=(rank, world_size, fn, args, rank_env, pg_timeout, writer, self.log(rank)),
            )
            proc.start()
            writer.close()  # so a dead child shows up as EOF on the reader
            self.procs.append(proc)
            self.readers.append(reader)

    def log(self, rank: int) -> str:
        return os.path.join(self.logdir, f"rank{rank}.log")

    def read_log(self, rank: int) -> str:
        try:
            with open(self.log(rank), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def collect(self) -> tuple[dict[int, Any], list[tuple[float, int, str]]]:
        """Wait for results; stop at the first failure (after a short grace) or timeout."""
        deadline = time.monotonic() + self.timeout
        results: dict[int, Any] = {}
        errors: list[tuple[float, int, str]] = []
        pending = set(range(self.world_size))
        while pending:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + ERROR_GRACE_SECONDS)
            if now >= deadline:
                break
            waitables = [self.readers[r] for r in pending] + [self.procs[r].sentinel
                                                                 for r in pending]
            multiprocessing.connection.wait(waitables, timeout=deadline - now)
            for rank in sorted(pending):
                outcome = self._poll(rank)
                if outcome is None:
                    continue
                pending.discard(rank)
                status, payload = outcome
                if status == "ok":
                    results[rank] = payload
                else:
                    when, text = payload
                    errors.append((when, rank, text))
        return results, sorted(errors)

    def _poll(self, rank: int):
        reader, proc = self.readers[rank], self.procs[rank]
        if reader.poll():
            try:
                return pickle.loads(reader.recv_bytes())
            except EOFError:
                pass
        elif proc.is_alive():
            return None
        proc.join()
        text = (f"exited with code {proc.exitcode} without a result; its output:\n"
                f"{_tail(self.read_log(rank))}")
        return "error", (time.time(), text)

    def describe_failure(self, results: dict, errors: list) -> str | None:
        """None when every rank delivered; otherwise the message to fail with."""
        if errors:
            report = "\n".join(f"--- rank {rank} ---\n{text}" for _, rank, text in errors)
            return f"{len(errors)} of {self.world_size} ranks failed (earliest first):\n{report}"
        missing = [r for r in range(self.world_size) if r not in results]
        if not missing:
            return None
        for rank in missing:  # faulthandler in the child prints its stacks to the log
            if self.procs[rank].is_alive():
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_SECONDS)
        stacks = "\n".join(f"--- rank {r}: output and stacks ---\n{_tail(self.read_log(r))}"
                           for r in missing)
        return (f"timeout after {self.timeout}s: ranks {missing} did not finish "
                f"(ranks {sorted(results)} delivered results).{self._lock_hint(stacks)}\n{stacks}")

    def _lock_hint(self, stacks: str) -> str:
        if "file_baton.py" not in stacks:
            return ""
        locks = sorted(glob.glob(os.path.join(self.extensions_dir, "**", "lock"), recursive=True))
        return (" A rank waits on a torch extension build lock (DeepSpeed compiles its CPU ops on "
                "first use, minutes on a loaded machine): either a build is still running (rerun once "
                "it is done) or a killed process left its lock; with no compiler running, remove "
                f"{' '.join(locks) or 'the lock file (none left now under ' + self.extensions_dir + ')'}.")

    def finish(self, wait: bool) -> None:
        """Let ranks exit (bounded), kill the rest, echo logs, clean up."""
        if wait:
            end = time.monotonic() + EXIT_GRACE_SECONDS
            for proc in self.procs:
                proc.join(max(0.0, end - time.monotonic()))
        running = [proc for proc in self.procs if proc.is_alive()]
        for proc in running:
            os.kill(proc.pid, signal.SIGINT)
        end = time.monotonic() + INTERRUPT_GRACE_SECONDS
        for proc in running:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
            proc.close()
        for reader in self.readers:
            reader.close()
        for rank in range(self.world_size):
            text = self.read_log(rank)
            if text:
                sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        shutil.rmtree(self.logdir, ignore_errors=True)


def _tail(text: str, lines: int = 80) -> str:
    kept = text.splitlines()[-lines:]
    return "\n".join(kept) if kept else "(no output)"


def _address_in_use(errors) -> bool:
    return any("address already in use" in text.lower() or "EADDRINUSE" in text
               for _, _, text in errors)


def run_distributed(fn: Callable, world_size: int = 2, *, args: tuple = (),
                    timeout: float = 120, env: Mapping[str, str] | None = None,
                    start_method: str = DEFAULT_START_METHOD) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; see the module doc."""
    _check_importable(fn, args)
    for attempt in range(PORT_RETRIES + 1):
        run = _Run(fn, world_size, args, timeout, env, start_method)
        failure: str | None = "interrupted"  # e.g. Ctrl-C: kill the ranks without waiting
        try:
            results, errors = run.collect()
            failure = run.describe_failure(results, errors)
        finally:
            run.finish(wait=failure is None)
        if failure is None:
            return [results[r] for r in range(world_size)]
        if not (_address_in_use(errors) and attempt < PORT_RETRIES):
            raise DistributedRunError(failure)


def _run_each(rank: int, world_size: int, scenarios: list[tuple[str, Callable]]) -> list:
    import torch.distributed as dist

    results = []
    for name, fn in scenarios:
        try:
            results.append(fn(rank, world_size))
        except Exception as error:
            raise RuntimeError(f"scenario {name!r} failed on rank {rank}") from error
        if dist.is_initialized():  # keep scenarios apart: none starts before all left the last
            dist.barrier()
    return results


def run_scenarios(scenarios: Mapping[str, Callable], world_size: int = 2, *,
                  timeout: float = 120, env: Mapping[str, str] | None = None) -> dict[str, list]:
    """Run several ``fn(rank, world_size)`` one after another in the same set of ranks.

    Returns ``{name: per-rank results}``. Each fn follows the rules of
    :func:`run_distributed` (bind extra arguments with ``functools.partial``). The first
    failing scenario stops the run and is named in the error.
    """
    per_rank = run_distributed(_run_each, world_size, args=(list(scenarios.items()),),
                               timeout=timeout, env=env)
    return {name: [per_rank[r][i] for r in range(world_size)]
            for i, name in enumerate(scenarios)}


def repo_first_on_path(root) -> str:
    """A child process's PYTHONPATH: the repository, then what this process's already held
    (a machine's extra packages, e.g. a GPU machine's wheels under /tmp/site)."""
    return os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
