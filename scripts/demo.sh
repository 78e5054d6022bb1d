#!/usr/bin/env bash
# The demo command: set up .venv (scripts/setup.sh) and run `featurestore demo` on built-in data.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-demo} bash scripts/setup.sh
. .venv/bin/activate
exec featurestore demo "$@"
