#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=${MICROSTEP_TEST_WORKERS:-2}
# How long a run takes on 2 cores, setup included, said before it starts (issue 55). 2 workers:
# 561 s of tests (1,314 tests, 2026-12-06, setup already done) on this 2-core machine while other
# sessions kept its load average near 5; 887 s in the same conditions before the ranks' fork server
# preloaded what they import (tests/support/rank_preload.py). One worker: estimated, not run whole:
# a sample of test files run both ways took 1.38x as long per file beside a second worker, so one
# worker takes about 2 / 1.38 = 1.45x the 2 workers' test time (~810 s).
case "$workers" in
  2) estimate="about 10 minutes with 2 workers" ;;
  0|1) estimate="about 14 minutes with one worker (an estimate; 2 workers: about 10)" ;;
  *) estimate="not measured with $workers workers (2 workers: about 10 minutes)" ;;
esac
echo "[test] $estimate on a 2-core machine, setup included; longer while other work runs (this machine: $(nproc) cores)" >&2
bash scripts/setup.sh
# DeepSpeed compiles a small shared-memory op on first use; keep it between runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The suite starts a few hundred Python processes (ranks, launchers, the CLI); where the environment
# says PYTHONDONTWRITEBYTECODE, each would compile the repository's sources again: compile them once.
.venv/bin/python -m compileall -q engine launch examples bench tests > /dev/null
# Two workers (pytest-xdist), each taking whole test files: a file's module fixtures run once, and
# the second core is not idle while a test waits on its ranks or on a launcher (the times above).
# One worker: MICROSTEP_TEST_WORKERS=0 bash scripts/test.sh
# -ra: the summary at the end names every skip with its reason (a test this machine cannot run), and
# every failure; written here, not only in pyproject's addopts (a bare -rs would replace it and drop the failures).
exec .venv/bin/python -m pytest -q -ra -n "$workers" --dist loadfile "$@"
