#!/usr/bin/env bash
# The compatibility subset on the newest tested torch (2.14.1), beside the main suite's 2.13:
# the framework adapters, pipeline and tensor parallelism (the torch internals they lean on)
# and a Hugging Face model under a pipeline. Its own venv, .venv-torch2.14; idempotent like
# scripts/setup.sh. Extra arguments go to pytest. Cost measured in docs/compatibility.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-torch2.14
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is ignored" >&2); }
pip_install "torch==2.14.1" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
pip_install -r requirements/ci.txt
pip_install --no-deps -e .
# DeepSpeed's compiled op is built against one torch: keep 2.14's apart from the main suite's
export TORCH_EXTENSIONS_DIR=$PWD/.cache/torch_extensions-2.14
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" -m pytest -q tests/distributed/test_adapters.py tests/distributed/test_pipeline.py \
    tests/distributed/test_tensor_parallel.py tests/integration/test_pipeline_hf.py tests/integration/test_verify.py "$@"
