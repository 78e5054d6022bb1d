#!/usr/bin/env bash
# Create .venv with featurestore and its extras. Torch goes in first, pinned, so that nothing
# pulls a different build: TORCH_SPEC overrides it (e.g. TORCH_SPEC="torch" for the newest CUDA
# build on a GPU host). EXTRAS picks the project extras (default: dev = everything for the tests).
#
# It prints a few "[setup]" lines, not pip's progress. pip runs with --quiet; the only lines
# filtered out of its output are "Location '...' is ignored: it is neither a file nor a directory"
# warnings, which come from a pip config pointing at index directories that do not exist on this
# machine (they say nothing about featurestore), and setuptools' editable-install notice (below).
# Every other warning and every error still shows,
# and a failing pip still fails the script. VERBOSE=1 shows pip's whole output.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-dev}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VERBOSE=${VERBOSE:-0}

pip_quiet() {
  if [ "$VERBOSE" = 1 ]; then
    python -m pip "$@"
    return
  fi
  local status
  set +e
  python -m pip --quiet "$@" 2>&1 \
    | grep -v -E "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$"
  status=${PIPESTATUS[0]}
  set -e
  return "$status"
}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
echo "[setup] upgrading pip"
pip_quiet install --upgrade pip || echo "[setup] (pip upgrade failed; continuing with $(python -m pip --version | cut -d' ' -f1-2))"
# Versions come from the installed metadata, not by importing torch (which warns without numpy).
torch_version() { python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null; }
if torch_version >/dev/null; then
  echo "[setup] torch $(torch_version) already installed"
else
  echo "[setup] installing $TORCH_SPEC"
  pip_quiet install "$TORCH_SPEC"
fi
# Keep the torch build just installed: extras that depend on torch (timm -> torchvision) must pick
# versions that match it instead of replacing it with another build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$(torch_version)" > "$constraints"
echo "[setup] installing featurestore[$EXTRAS] (editable; keeping $(cat "$constraints"))"
# setuptools announces every editable install of a flat layout with several top-level packages
# (featurestore, server, client) with a multi-line "Editable installation." notice
# (InformationOnly, not a deprecation); this filter silences that one message and nothing else.
PYTHONWARNINGS="ignore:Editable installation" pip_quiet install -c "$constraints" -e ".[$EXTRAS]"
# Byte-compiled sources, as a (non-editable) pip install leaves them: every process that imports
# featurestore (each CLI call, each bench child, the tests' subprocesses) then loads .pyc files
# instead of compiling ~250 modules, which it does on every start where PYTHONDONTWRITEBYTECODE=1
# keeps Python from caching them (0.68 -> 0.5 s to import the CLI here). checked-hash: each import
# checks the .pyc against its source's hash, so a source edited since is compiled again, never
# read stale (a timestamp check misses an edit of the same size within its second).
echo "[setup] byte-compiling featurestore, client and server"
python -m compileall -q --invalidation-mode checked-hash featurestore client server > /dev/null
echo "[setup] done: featurestore $(python -c 'import importlib.metadata as m; print(m.version("featurestore"))') in .venv (activate with: . .venv/bin/activate)"
