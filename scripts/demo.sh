#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main demo: gradient accumulation 4 on 2 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m launch --nproc-per-node 2 examples/param_unchanged.py "$@"
