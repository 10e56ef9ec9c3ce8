#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# DeepSpeed compiles a small shared-memory op on first use; keep it between runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The suite starts a few hundred Python processes (ranks, launchers, the CLI); where the environment
# says PYTHONDONTWRITEBYTECODE, each would compile the repository's sources again: compile them once.
.venv/bin/python -m compileall -q engine launch examples bench tests > /dev/null
# Two workers (pytest-xdist), each taking whole test files: a file's module fixtures run once, and
# the second core is not idle while a test waits on its ranks or on a launcher (about 10 minutes on
# 2 cores instead of 14). One worker: MICROSTEP_TEST_WORKERS=0 bash scripts/test.sh
# -ra: the summary at the end names every skip with its reason (a test this machine cannot run), and
# every failure; written here, not only in pyproject's addopts (a bare -rs would replace it and drop the failures).
exec .venv/bin/python -m pytest -q -ra -n "${MICROSTEP_TEST_WORKERS:-2}" --dist loadfile "$@"
