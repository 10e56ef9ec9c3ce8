#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main demo: gradient accumulation 4 on 2 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "[demo] examples/param_unchanged.py on 2 processes, gradient_accumulation = 4: each rank prints its" \
     "parameter after every micro-step; it moves only at iterations 3 and 7 (window boundaries)" >&2
exec .venv/bin/python -m launch --nproc-per-node 2 examples/param_unchanged.py "$@"
