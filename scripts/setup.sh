#!/usr/bin/env bash
# Create .venv with the pinned CPU environment and Microstep installed in editable mode.
# Idempotent: re-running only checks what is there. Elsewhere than on our CI machines, a CPU
# build of torch comes from PyTorch's index: TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Each step says what it does first: the first run downloads torch (a few hundred MB) and
# prints nothing else for a minute or two.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
say() { echo "[setup] $*" >&2; }
if [ -x .venv/bin/python ]; then
  say ".venv exists: checking what is installed (quick when nothing is missing)"
else
  say "creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
fi
# (the grep drops this machine's notes about absent local package indexes)
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is ignored" >&2); }
say "torch 2.13.0${TORCH_INDEX:+ from $TORCH_INDEX} (a few hundred MB the first time)"
pip_install "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
say "the pinned test and tool dependencies (requirements/ci.txt)"
pip_install -r requirements/ci.txt
say "Microstep itself, editable (pip install -e .)"
pip_install --no-deps -e .
.venv/bin/python -c "import torch, engine; print(f'setup ok: torch {torch.__version__}, microstep at {engine.__path__[0]}')"
say "use it: source .venv/bin/activate (then python, microstep), or call .venv/bin/python / .venv/bin/microstep"
