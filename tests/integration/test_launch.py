"""python -m launch: command construction, signals and exit codes, and real 2-process runs."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from engine import errors as engine_errors
from launch.cli import ERROR_REPORT_DIR, TORCHRUN_SIGNALS, LaunchError, build_command, build_parser, main, run, worker_errors
from tests.support.dist_utils import repo_first_on_path

REPO = Path(__file__).resolve().parents[2]
PROBE = "examples/param_unchanged.py"  # any script: the command tests only build commands
# deepspeed compiles its CPU ops (e.g. the shm comm op) on first use; keep them across runs.
TORCH_EXTENSIONS_DIR = str(REPO / ".cache" / "torch_extensions")


def command(*argv, python="PY"):
    return build_command(build_parser().parse_args(list(argv)), python=python)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("PET_SIGNALS_TO_HANDLE", raising=False)


# --------------------------------------------------------------------------- commands


def test_torchrun_single_node_is_standalone():
    assert command("--nproc-per-node", "2", PROBE, "--lr", "0.1", "--nnodes", "9") == [
        "PY", "-m", "launch.torchrun", "--nproc-per-node", "2", "--signals-to-handle", TORCHRUN_SIGNALS,
        "--standalone", PROBE, "--lr", "0.1", "--nnodes", "9",  # after the script: the script's arguments
    ]


def test_torchrun_passes_sigusr1_to_its_workers(monkeypatch):
    """Slurm's warning before a time limit; torchrun's own list lacks it (it would die of it)."""
    handled = command(PROBE)[command(PROBE).index("--signals-to-handle") + 1].split(",")
    assert {"SIGTERM", "SIGINT", "SIGUSR1"} <= set(handled)
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR2")  # the user's choice stays
    assert command(PROBE)[5:7] == ["--signals-to-handle", "SIGTERM,SIGUSR2"]


def test_one_process_by_default():
    assert command(PROBE)[3:5] == ["--nproc-per-node", "1"]
    assert command("--launcher", "deepspeed", PROBE)[3:5] == ["--num_gpus", "1"]


def test_torchrun_multi_node():
    assert command("--nproc_per_node", "4", "--nnodes", "2", "--node-rank", "1",
                   "--master-addr", "node0", "--master-port", "29600", PROBE) == [
        "PY", "-m", "launch.torchrun", "--nproc-per-node", "4", "--signals-to-handle", TORCHRUN_SIGNALS,
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "node0", "--master-port", "29600", PROBE,
    ]


def test_torchrun_single_node_with_fixed_port():
    cmd = command("--nproc-per-node", "2", "--master-port", "29601", PROBE)
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--master-addr") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--master-port") + 1] == "29601"


def test_deepspeed_single_node():
    cmd = command("--launcher", "deepspeed", "--nproc-per-node", "2", PROBE, "--x")
    assert cmd[:5] == ["PY", "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    assert 0 < int(cmd[cmd.index("--master_port") + 1]) < 65536  # a free port, not 29500
    assert cmd[-2:] == [PROBE, "--x"]
    assert "--hostfile" not in cmd and "--no_ssh" not in cmd


def test_deepspeed_multi_node(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=4\nnode1 slots=4\n")
    cmd = command("--launcher", "deepspeed", "--nproc-per-node", "4", "--nnodes", "2",
                  "--hostfile", str(hostfile), "--master-addr", "node0", PROBE)
    assert cmd == ["PY", "-m", "deepspeed.launcher.runner", "--num_gpus", "4",
                   "--hostfile", str(hostfile), "--num_nodes", "2", "--master_addr", "node0",
                   "--master_port", "29500", PROBE]
    per_node = command("--launcher", "deepspeed", "--nnodes", "2", "--node-rank", "1",
                       "--hostfile", str(hostfile), PROBE)
    assert per_node[per_node.index("--no_ssh") + 1:][:2] == ["--node_rank", "1"]
    assert "--num_gpus" not in per_node  # the hostfile's slots decide


@pytest.mark.parametrize("argv, message", [
    (["missing.py"], "script not found: missing.py"),
    (["--nnodes", "2", PROBE], "needs --master-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "a", PROBE], "below --nnodes 2"),
    (["--hostfile", PROBE, PROBE], "--hostfile is for --launcher deepspeed"),
    (["--launcher", "deepspeed", "--nnodes", "2", PROBE], "needs --hostfile"),
    (["--launcher", "deepspeed", "--hostfile", "nope", PROBE], "hostfile not found: nope"),
])
def test_invalid_launches(argv, message):
    with pytest.raises(LaunchError, match=message):
        command(*argv)


def test_deepspeed_missing_gives_the_install_hint(monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    with pytest.raises(LaunchError, match=r"pip install 'microstep\[deepspeed\]'"):
        command("--launcher", "deepspeed", PROBE)


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "0", PROBE], "0 is below the minimum of 1"),
    (["--nproc-per-node", "two", PROBE], "'two' is not an integer"),
    (["--master-port", "70000", PROBE], "not a TCP port"),
    (["missing.py"], "script not found"),
])
def test_main_reports_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_main_prints_the_command_on_one_line(capsys):
    assert main(["--dry-run", "--nproc-per-node", "2", PROBE, "a b"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("[launch] ") and err.rstrip().endswith(f"{PROBE} 'a b'")


# --------------------------------------------------------------------------- run()

CHILD = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
try:
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    sys.exit(8)
"""


@pytest.mark.parametrize("sig, code", [("SIGTERM", 7), ("SIGINT", 8)])
def test_run_forwards_signals_and_the_exit_code(sig, code):
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from launch.cli import run; "
         f"sys.exit(run([sys.executable, '-c', {CHILD!r}]))"],
        stdout=subprocess.PIPE, text=True,
    )
    assert launcher.stdout.readline().strip() == "ready"
    launcher.send_signal(getattr(__import__("signal"), sig))
    assert launcher.wait(timeout=30) == code


COUNTING_CHILD = """
import os, signal, sys, time
received = []
signal.signal(signal.SIGTERM, lambda *_: received.append(1))
print(os.getpid(), flush=True)
while not received:
    time.sleep(0.01)
time.sleep(0.5)  # a second delivery would arrive meanwhile
sys.exit(10 + len(received))
"""


def test_under_a_slurm_step_signals_are_not_forwarded_again():
    """Slurm signals every process of a step; the launcher must not add a second delivery
    (torchrun, signalled again while it waits for its workers, abandons them)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from launch.cli import run; "
         f"sys.exit(run([sys.executable, '-c', {COUNTING_CHILD!r}], forward=False))"],
        stdout=subprocess.PIPE, text=True,
    )
    child = int(launcher.stdout.readline())
    for pid in (launcher.pid, child):  # as Slurm's scancel --signal does
        os.kill(pid, signal.SIGTERM)
    assert launcher.wait(timeout=30) == 11  # the child got SIGTERM once, the launcher lived on


RUNNER_WITH_WORKER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(worker.pid, flush=True)
time.sleep(60)  # dies on SIGTERM without passing it on, like the deepspeed runner
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_run_signals_the_whole_process_group():
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from launch.cli import run; "
         f"sys.exit(run([sys.executable, '-c', {RUNNER_WITH_WORKER!r}]))"],
        stdout=subprocess.PIPE, text=True,
    )
    worker = int(launcher.stdout.readline())
    launcher.terminate()
    assert launcher.wait(timeout=30) == 128 + 15
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the launcher's grandchild survived SIGTERM"


def test_run_exit_codes():
    assert run([sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert run([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]) == 128 + 9


# --------------------------------------------------------------------------- real runs


DEMO = "examples/param_unchanged.py"
DEMO_LINE = re.compile(r"rank (\d): iteration (\d), first 10 elements of param: (tensor\(\[.*?\]\))", re.S)


@pytest.fixture(scope="module")
def launched():
    """The main demo under the three launchers, started together: they mostly wait on imports."""
    env = dict(os.environ, PYTHONPATH=repo_first_on_path(REPO))
    env.setdefault("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)
    commands = {
        "launch": [sys.executable, "-m", "launch", "--nproc-per-node", "2", DEMO],
        # the deepspeed launcher runs the demo on the deepspeed backend too (ZeRO-3, gathered params)
        "deepspeed": [sys.executable, "-m", "launch", "--launcher", "deepspeed",
                      "--nproc-per-node", "2", DEMO, "--set", "backend=deepspeed", "--set", "zero_optimization.stage=3",
                      "--set", "zero_optimization.stage3_param_persistence_threshold=0"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2", DEMO],
    }
    start = time.monotonic()
    procs = {name: subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
             for name, cmd in commands.items()}
    yield procs, start
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finished(launched, name):
    procs, start = launched
    out, err = procs[name].communicate(timeout=150)
    print(f"{name}: finished {time.monotonic() - start:.1f}s after the start")
    return procs[name].returncode, out, err


def check_demo_output(out: str) -> None:
    """Both ranks print 8 iterations with the same parameters, which move only at 3 and 7."""
    printed = {(int(rank), int(i)): param for rank, i, param in DEMO_LINE.findall(out)}
    assert sorted(printed) == [(r, i) for r in (0, 1) for i in range(8)], out
    assert all(printed[(0, i)] == printed[(1, i)] for i in range(8)), out
    moved = [i for i in range(1, 8) if printed[(0, i)] != printed[(0, i - 1)]]
    assert moved == [3, 7], out
    assert out.count("parameter updated at iterations [3, 7] (gradient_accumulation_steps = 4)") == 2, out


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["launch", "torchrun"])
def test_demo_under_torchrun(launched, name):
    code, out, err = finished(launched, name)
    assert code == 0, err
    check_demo_output(out)
    if name == "launch":
        assert "[launch] " in err and "launch.torchrun" in err


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(180)
def test_demo_under_deepspeed_launcher(launched):
    code, out, err = finished(launched, "deepspeed")
    assert code == 0, err
    check_demo_output(out)
    assert "deepspeed.launcher.runner --num_gpus 2" in err and "backend=deepspeed" in err


class WriteRecorder:
    """A stdout that keeps every write() apart, as an unbuffered stream (``python -u``) issues them."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return len(text)

    def flush(self):
        pass


def test_demo_writes_whole_lines(monkeypatch):
    """Every write is one or more whole lines: two ranks sharing a terminal cannot splice them."""
    from examples.param_unchanged import main as demo

    recorder = WriteRecorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    demo([])
    printed = [text for text in recorder.writes if text]
    assert len(printed) == 9 and all(text.endswith("\n") and text.count("\n") == 1 for text in printed), printed


def test_demo_in_one_process(capsys):
    from examples.param_unchanged import main as demo

    assert demo([]) == [3, 7]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration")]
    assert len(lines) == 8 and lines[0].startswith("iteration 0, first 10 elements of param: tensor([")


# --------------------------------------------------------------------------- the Slurm recipe

SLURM_STUBS = {  # just enough Slurm for launch/slurm.sbatch: its commands, and a job step
    "scontrol": 'if [ "$1" = show ]; then echo node0; else echo "scontrol $*" >> "$STUB_LOG"; fi\n',
    "scancel": 'echo "scancel $*" >> "$STUB_LOG"; kill -USR1 "$(cat "$STEP_PID")"\n',
    # the step: its ranks save and stop with STEP_CODE on the signal scancel passes on
    "srun": 'echo $$ > "$STEP_PID.tmp"; mv "$STEP_PID.tmp" "$STEP_PID"\n'
            'trap \'exit "$STEP_CODE"\' USR1\nwhile :; do sleep 0.05; done\n',
}


@pytest.mark.parametrize("step_code, requeued", [(75, True), (1, False)])
def test_slurm_recipe_requeues_only_a_saved_stop(tmp_path, step_code, requeued):
    """Near the time limit the recipe passes SIGUSR1 on to the job's processes and requeues the
    job only when they exit 75 (saved and stopped); a failure is not run again."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in SLURM_STUBS.items():
        (stubs / name).write_text("#!/bin/bash\n" + body)
        (stubs / name).chmod(0o755)
    log, step_pid = tmp_path / "slurm.log", tmp_path / "step.pid"
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", STUB_LOG=str(log), STEP_PID=str(step_pid),
               STEP_CODE=str(step_code), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node0", SLURM_CPUS_PER_TASK="1")
    script = subprocess.Popen(["bash", str(REPO / "launch" / "slurm.sbatch"), "train.py"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not step_pid.exists():
            assert time.monotonic() < deadline and script.poll() is None, "the step never started"
            time.sleep(0.02)
        script.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@120
        _, err = script.communicate(timeout=30)
    finally:
        if script.poll() is None:
            script.kill()
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(step_pid.read_text()), signal.SIGKILL)
    assert script.returncode == step_code, err
    calls = log.read_text().splitlines()
    assert calls == ["scancel --signal=USR1 4242"] + (["scontrol requeue 4242"] if requeued else []), err


# --------------------------------------------------------------------------- errors under launch

BUG_SCRIPT = """import os
import engine  # noqa: F401  (installs the error report the launcher asked for)
if os.environ["RANK"] == "1":
    raise ValueError("a bug, not a Microstep error")
"""


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_microstep_error_ends_a_two_process_run_once_as_the_last_line_and_a_bug_keeps_its_traceback(tmp_path):
    bug = tmp_path / "bug.py"
    bug.write_text(BUG_SCRIPT)
    env = dict(os.environ, PYTHONPATH=repo_first_on_path(REPO), OMP_NUM_THREADS="1")
    runs = {"mistake": [DEMO, "--set", "gradient_accumulaton=2"], "bug": [str(bug)]}
    procs = {name: subprocess.Popen([sys.executable, "-m", "launch", "--nproc-per-node", "2", *argv], cwd=REPO,
                                    env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, argv in runs.items()}
    out, err = procs["mistake"].communicate(timeout=150)
    _, bug_err = procs["bug"].communicate(timeout=150)
    code, bug_code = procs["mistake"].returncode, procs["bug"].returncode
    screen = (out + err).strip().splitlines()
    message = "ConfigError: --set: gradient_accumulaton: unknown key; did you mean gradient_accumulation?"
    assert code == 1
    assert screen[-1] == message, err
    assert len(screen) == 2 and screen[0].startswith("[launch] "), err  # the command, then the error once
    assert bug_code == 1
    assert "Traceback" in bug_err and "ValueError: a bug, not a Microstep error" in bug_err
    assert "Root Cause (first observed failure)" in bug_err  # torchrun's report: a real failure keeps it


def test_the_workers_errors_are_said_once_each_the_first_reported_last(tmp_path):
    from engine.distributed.error_report import write_report

    for rank, (error, at) in enumerate([(engine_errors.PeerError({2: 1}), 2.0), (engine_errors.PeerError({2: 1}), 3.0),
                                        (engine_errors.CheckpointError("checkpoint step_4: missing"), 1.0)]):
        with mock.patch.dict(os.environ, RANK=str(rank)), mock.patch("time.time", return_value=at):
            write_report(str(tmp_path), error)
    assert worker_errors(str(tmp_path)).splitlines() == [
        "PeerError on rank(s) 0, 1: rank(s) 2 failed in this window",
        "CheckpointError on rank(s) 2: checkpoint step_4: missing"]


def test_outside_the_launcher_a_microstep_error_keeps_python_s_own_report():
    env = {k: v for k, v in os.environ.items() if k != ERROR_REPORT_DIR}
    done = subprocess.run([sys.executable, "-c", "import engine; raise engine.ConfigError(['x: bad'])"], cwd=REPO,
                          env=dict(env, PYTHONPATH=repo_first_on_path(REPO)), text=True, capture_output=True)
    assert done.returncode == 1 and "Traceback" in done.stderr and "engine.errors.ConfigError: x: bad" in done.stderr


SLOW_START = """
import os, time
print("started", os.environ["RANK"], flush=True)
time.sleep(60)  # as a script importing torch: the engine handles no signal yet
"""


@pytest.mark.timeout(120)
def test_a_ctrl_c_before_the_engine_handles_it_prints_no_traceback(tmp_path):
    """A Ctrl-C while the workers start (before the engine is imported): each worker ends without Python's
    KeyboardInterrupt traceback (launch/worker_site), and the launcher's last line says what happened."""
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_first_on_path(REPO)}
    launcher = subprocess.Popen([sys.executable, "-m", "launch", "--nproc-per-node", "2", str(script)], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        started = [launcher.stdout.readline() for _ in range(2)]
        assert all(line.startswith("started") for line in started), started
        os.killpg(launcher.pid, signal.SIGINT)  # as a terminal sends a Ctrl-C to its foreground job
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip().splitlines()[-1].startswith("[launch] Ctrl-C (SIGINT): the workers stopped without saving")
