"""Run Python with installed packages made absent (tests/support/absent_packages/sitecustomize.py):
how the DeepSpeed facade's tests prove it works where DeepSpeed (and accelerate) were never
installed, with the real package as the control in another process of the same test."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.dist_utils import repo_first_on_path

REPO = Path(__file__).resolve().parents[2]
BLOCKER = Path(__file__).resolve().parent / "absent_packages"


def environment(absent: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """os.environ for a child process: the repository first on PYTHONPATH, one thread per process,
    and ``absent`` packages made unimportable (the blocker first on PYTHONPATH)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_first_on_path(REPO), **extra}
    env.pop("MICROSTEP_ABSENT_PACKAGES", None)
    if absent:
        env["PYTHONPATH"] = os.pathsep.join([str(BLOCKER), env["PYTHONPATH"]])
        env["MICROSTEP_ABSENT_PACKAGES"] = ",".join(absent)
    return env


def finish(process: subprocess.Popen, timeout: int = 300) -> str:
    """The process's stdout, once it has exited 0 (its output in the failure otherwise)."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    return out
