#!/usr/bin/env bash
# Create .venv with the pinned CPU environment and Microstep installed in editable mode.
# Idempotent: re-running only checks what is there. Elsewhere than on our CI machines, a CPU
# build of torch comes from PyTorch's index: TORCH_INDEX=https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# (the grep drops this machine's notes about absent local package indexes)
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is ignored" >&2); }
pip_install "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
pip_install -r requirements/ci.txt
pip_install --no-deps -e .
.venv/bin/python -c "import torch, engine; print(f'setup ok: torch {torch.__version__}, microstep at {engine.__path__[0]}')"
