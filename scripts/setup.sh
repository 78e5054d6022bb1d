#!/usr/bin/env bash
# Create .venv with featurestore and its extras. Torch goes in first, pinned, so that nothing
# pulls a different build: TORCH_SPEC overrides it (e.g. TORCH_SPEC="torch" for the newest CUDA
# build on a GPU host). EXTRAS picks the project extras (default: dev = everything for the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-dev}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing $TORCH_SPEC"
  python -m pip install --quiet "$TORCH_SPEC"
fi
echo "[setup] installing featurestore[$EXTRAS]"
python -m pip install --quiet -e ".[$EXTRAS]"
