#!/usr/bin/env bash
# int8 on a GPU host (a few minutes): the CUDA tests of the loaders (int8 dequantized on the
# device among them), then a cold epoch of an int8 split beside its float16 twin, float32 out on
# the GPU (scripts/int8_epoch.py). Wheels the box lacks go in .whl/ (scripts/gpu_env.sh).
# Usage: OUT=dir SAMPLES=512 bash scripts/gpu_int8.sh
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
scratch="$PWD/.int8-epoch"  # on the repository's disk: a tmpfs /tmp would never be cold
df -hT "$PWD" | tail -1
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
  tests/test_int8_loaders.py tests/test_loader_local.py tests/test_bag_loader.py -k "cuda" 2>&1 \
  | tee "$OUT/cuda-tests.txt" | tail -8
timeout 330 python3 scripts/int8_epoch.py "$scratch" --samples "${SAMPLES:-512}" --device cuda --repeats 3 2>&1 \
  | tee "$OUT/int8-epoch.txt"
rm -rf "$scratch"
