"""`python -m launch`: run a training script on N processes per node.

A thin front over torchrun (``python -m launch.torchrun``: torchrun's own entry point, the
default) and the deepspeed launcher (``python -m deepspeed.launcher.runner``). It validates the
arguments, prints the one command it runs to stderr, forwards SIGINT / SIGTERM / SIGHUP /
SIGUSR1 to it and exits with its exit code, or with the workers' own code when they all
stopped for such a signal (torchrun, signalled, exits 1 whatever its workers did).

Stopped by such a signal, the launcher's last line says what the workers did: saved and stopped
(their stop code, 75 by default), or stopped without saving (no ``checkpoint.dir``: setting it
makes the signal save at the next window boundary). Neither torchrun nor the workers print a
traceback for it.

A Microstep error (config, batch plan, checkpoint, ranks disagreeing) that ends the workers is
printed once, as the last thing on the screen: the workers report it instead of printing
their tracebacks (``engine.distributed.error_report``), ``launch.torchrun`` leaves out torchrun's failure
report for it, and the launcher prints it after the launcher it ran has exited.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

DEFAULT_MASTER_PORT = 29500
WORKER_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_site")
DEEPSPEED_INSTALL_HINT = "pip install 'microstep[deepspeed]'"
# SIGUSR1 is Slurm's usual warning before a time limit (sbatch --signal); the engine saves and
# stops on it (checkpoint.stop_signals), so it must not end the launcher.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
# torchrun's agent handles these (it passes the one it gets to its workers and waits
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds for them); its default list lacks SIGUSR1, which
# would kill it and leave its workers without the agent that waits for them. Only its
# --signals-to-handle sets the list (PET_SIGNALS_TO_HANDLE, its default, is honoured).
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# Where the engine's ranks write their exit code when they stop for a signal (engine.state.preemption).
STOP_REPORT_DIR = "MICROSTEP_STOP_REPORT_DIR"
# Where the workers write an uncaught Microstep error (engine.distributed.error_report), for the launcher to print once.
ERROR_REPORT_DIR = "MICROSTEP_ERROR_REPORT_DIR"


class LaunchError(ValueError):
    """The arguments cannot make a valid launch."""


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is below the minimum of {low}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch",
        description="Run a training script on N processes per node under torchrun or the "
        "deepspeed launcher. Everything after the script path is passed to the script.",
    )
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=_positive_int, default=None,
                        help="processes per node, usually one per GPU (default 1; with a "
                        "deepspeed --hostfile, the hostfile's slots)")
    parser.add_argument("--nnodes", type=_positive_int, default=1,
                        help="number of nodes (default 1)")
    parser.add_argument("--node-rank", "--node_rank", type=_non_negative_int, default=None,
                        help="this node's index in [0, nnodes); needed for multi-node torchrun")
    parser.add_argument("--master-addr", "--master_addr", default=None,
                        help="address of node 0 (needed for multi-node torchrun)")
    parser.add_argument("--master-port", "--master_port", type=_port, default=None,
                        help=f"port on node 0 (default: a free port on one node, "
                        f"{DEFAULT_MASTER_PORT} on several)")
    parser.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="torchrun",
                        help="which launcher starts the processes (default torchrun)")
    parser.add_argument("--hostfile", default=None,
                        help="deepspeed hostfile ('host slots=N' lines) for multi-node runs")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command without running it")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments for the script")
    return parser


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _validate(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.script):
        raise LaunchError(f"script not found: {args.script}")
    if args.node_rank is not None and args.node_rank >= args.nnodes:
        raise LaunchError(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes}")
    if args.hostfile is not None and not os.path.isfile(args.hostfile):
        raise LaunchError(f"hostfile not found: {args.hostfile}")
    if args.launcher == "torchrun":
        if args.hostfile is not None:
            raise LaunchError("--hostfile is for --launcher deepspeed; with torchrun, start "
                              "`python -m launch` on every node with --nnodes/--node-rank/"
                              "--master-addr")
        if args.nnodes > 1 and (args.master_addr is None or args.node_rank is None):
            raise LaunchError("multi-node torchrun needs --master-addr (node 0's address) "
                              "and --node-rank (this node's index) on every node")
    else:
        if importlib.util.find_spec("deepspeed") is None:
            raise LaunchError("--launcher deepspeed needs the deepspeed package: "
                              f"{DEEPSPEED_INSTALL_HINT}")
        if args.nnodes > 1 and args.hostfile is None:
            raise LaunchError("multi-node deepspeed needs --hostfile listing the nodes "
                              "(see launch/hostfile.example)")


def _torchrun_command(args: argparse.Namespace, python: str) -> list[str]:
    nproc = str(args.nproc_per_node or 1)
    signals = os.environ.get("PET_SIGNALS_TO_HANDLE", TORCHRUN_SIGNALS)
    cmd = [python, "-m", "launch.torchrun", "--nproc-per-node", nproc, "--signals-to-handle", signals]
    if args.nnodes == 1 and args.master_addr is None and args.master_port is None:
        # One node: torchrun picks a free port itself, so concurrent jobs cannot collide.
        return cmd + ["--standalone", args.script, *args.script_args]
    return cmd + [
        "--nnodes", str(args.nnodes),
        "--node-rank", str(args.node_rank or 0),
        "--master-addr", args.master_addr or "127.0.0.1",
        "--master-port", str(args.master_port or DEFAULT_MASTER_PORT),
        args.script, *args.script_args,
    ]


def _deepspeed_command(args: argparse.Namespace, python: str) -> list[str]:
    cmd = [python, "-m", "deepspeed.launcher.runner"]
    if args.nproc_per_node is not None or args.hostfile is None:
        # --num_gpus caps the slots used per node; on a CPU-only machine it is also what
        # makes the runner start N local processes (it otherwise counts NUMA nodes).
        cmd += ["--num_gpus", str(args.nproc_per_node or 1)]
    if args.hostfile is not None:
        cmd += ["--hostfile", args.hostfile, "--num_nodes", str(args.nnodes)]
    if args.master_addr is not None:
        cmd += ["--master_addr", args.master_addr]
    # The runner's fixed default (29500) collides between concurrent single-node jobs.
    port = args.master_port or (free_port() if args.nnodes == 1 else DEFAULT_MASTER_PORT)
    cmd += ["--master_port", str(port)]
    if args.node_rank is not None:
        # Each node is started on its own (like torchrun) instead of over ssh from node 0.
        cmd += ["--no_ssh", "--node_rank", str(args.node_rank)]
    return cmd + [args.script, *args.script_args]


def build_command(args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """The launcher command for parsed arguments; raises LaunchError when they are invalid."""
    _validate(args)
    if args.launcher == "torchrun":
        return _torchrun_command(args, python)
    return _deepspeed_command(args, python)


def _signal_group(child: subprocess.Popen, signum: int) -> None:
    # The whole group, as a terminal would: the deepspeed runner dies on SIGTERM without
    # passing it on, which would leave its workers running.
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:  # already gone
        pass


def run(cmd: list[str], *, forward: bool = True, workers: int | None = None) -> int:
    """Run cmd; returns a shell-style exit code.

    ``forward``: pass termination signals on to cmd's process group, which runs in a session
    of its own. Otherwise (under a Slurm job step, which signals every process of the step
    itself) cmd stays in this process's group and each signal reaches it once: torchrun, given
    the same signal again while it waits for its workers, stops waiting and leaves them.
    ``workers``: the number of this node's workers; when this process was signalled and each
    of them reported the same exit code for its stop (engine.state.preemption), that code is returned.
    """
    child: subprocess.Popen | None = None
    pending: list[int] = []  # signals that arrived before the child existed
    received: list[int] = []
    reports = tempfile.mkdtemp(prefix="microstep-stop-") if workers else None
    errors = tempfile.mkdtemp(prefix="microstep-errors-")

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        if not forward:
            return
        if child is None:
            pending.append(signum)
        else:
            _signal_group(child, signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in FORWARDED_SIGNALS}
    try:
        # Forwarding, cmd gets a session of its own: a Ctrl-C in the terminal reaches this
        # process only, which passes it on once, instead of reaching cmd twice.
        env = dict(os.environ, **{ERROR_REPORT_DIR: errors})
        # the workers' Ctrl-C before the engine handles it: no traceback (launch/worker_site/sitecustomize.py)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [WORKER_SITE, os.environ.get("PYTHONPATH")]))
        if reports is not None:
            env[STOP_REPORT_DIR] = reports
        child = subprocess.Popen(cmd, start_new_session=forward, env=env)
        for signum in pending:
            _signal_group(child, signum)
        code = child.wait()
        code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as in a shell
        stopped = _reported_stop(reports, workers) if received and code != 0 and reports else None
        if stopped is not None:
            print(f"[launch] {signal.Signals(received[0]).name}: the {workers} worker(s) saved and stopped with "
                  f"exit code {stopped} ({cmd[2] if cmd[1:2] == ['-m'] else cmd[0]} exited {code}); exiting {stopped}",
                  file=sys.stderr, flush=True)
            code = stopped
        elif code != 0:
            reported = worker_errors(errors)
            if reported:
                print(reported, file=sys.stderr, flush=True)
            if received and workers:  # signalled, and not every worker saved: say so, last
                print(unsaved_stop(signal.Signals(received[0]), code), file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if reports is not None:
            shutil.rmtree(reports, ignore_errors=True)
        shutil.rmtree(errors, ignore_errors=True)
    return code


def unsaved_stop(sig: signal.Signals, code: int) -> str:
    """The launcher's last line when a signal stopped the workers without the save of a stop
    (``checkpoint.dir`` unset, or the signal came before the engine handled it)."""
    what = "Ctrl-C (SIGINT)" if sig == signal.SIGINT else sig.name
    return (f"[launch] {what}: the workers stopped without saving; exiting {code}. With checkpoint.dir set in the "
            f"config, {'a Ctrl-C' if sig == signal.SIGINT else sig.name} saves at the next window boundary and "
            "stops (exit 75), and the same command resumes from there")


def worker_errors(directory: str) -> str:
    """The Microstep errors the workers reported, once each: ``error: <message>`` when every
    reporting rank says the same, else one block per message naming its ranks, the first
    reported last (the others are usually its consequences on the peers)."""
    reports = []
    for name in os.listdir(directory):
        if not name.startswith("rank") or name.endswith(".partial"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                reports.append(json.load(f))
        except (OSError, ValueError):
            continue
    ranks: dict[tuple[str, str], list[int]] = {}
    first_seen: dict[tuple[str, str], float] = {}
    for report in sorted(reports, key=lambda r: r["time"]):
        key = (report["error"], report["message"])
        ranks.setdefault(key, []).append(report["rank"])
        first_seen.setdefault(key, report["time"])
    if len(ranks) == 1:
        (kind, message), = ranks
        return f"{kind}: {message}"
    blocks = sorted(ranks, key=lambda key: -first_seen[key])
    return "\n".join(f"{kind} on rank(s) {', '.join(map(str, sorted(ranks[(kind, message)])))}: {message}"
                     for kind, message in blocks)


def _reported_stop(directory: str, workers: int) -> int | None:
    """The exit code every one of ``workers`` reported for its stop, if they all did and agree."""
    names = os.listdir(directory)
    codes = set()
    for name in names:
        try:
            with open(os.path.join(directory, name)) as f:
                codes.add(int(f.read()))
        except (OSError, ValueError):
            return None
    return codes.pop() if len(names) == workers and len(codes) == 1 else None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cmd = build_command(args)
    except LaunchError as error:
        parser.error(str(error))  # exits with status 2
    print(f"[launch] {shlex.join(cmd)}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    workers = (args.nproc_per_node or 1) if args.launcher == "torchrun" else None
    return run(cmd, forward="SLURM_STEP_ID" not in os.environ, workers=workers)
