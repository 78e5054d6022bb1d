#!/usr/bin/env bash
# The test command: set up .venv (scripts/setup.sh) and run the whole suite on CPU.
# The tests run in one pytest-xdist worker process per core (2 on CI), at most 8: each worker
# holds torch (~0.5 GB) and starts its own SeaweedFS and moto servers. A test that must not share
# the machine with another can be pinned to one worker by an `xdist_group` mark (--dist loadgroup).
# FEATURESTORE_TEST_WORKERS overrides the count: a number, or 0 for one process (pdb, -x order).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# The suite needs ~2 GB of free disk under the temporary directory at its peak; say so up front
# rather than as hundreds of "No space left on device" errors.
tmp=${TMPDIR:-/tmp}
free_mb=$(df -Pm "$tmp" | awk 'NR==2 {print $4}')
if [ "${free_mb:-0}" -lt 2048 ]; then
  echo "[test] warning: only ${free_mb} MB free under $tmp; the suite needs ~2 GB: free space or set TMPDIR" >&2
fi
cores=$(nproc)
workers=${FEATURESTORE_TEST_WORKERS:-$((cores < 8 ? cores : 8))}
python -m pytest -q -n "$workers" --dist loadgroup "$@"
