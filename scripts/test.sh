#!/usr/bin/env bash
# The test command: set up .venv (scripts/setup.sh) and run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
