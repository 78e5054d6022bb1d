#!/usr/bin/env bash
# The GPU checks of one device session (a few minutes on an H100/H200): the CUDA tests of the
# loaders, the device statistics and the probes, then scripts/gpu_probe_check.py (ABMIL CPU vs
# CUDA, the DDP example with nccl). On an offline GPU box, wheels for what it lacks go in .whl/
# (scripts/gpu_env.sh).
# Usage: OUT=dir bash scripts/gpu_check.sh
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'numpy', numpy.__version__)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
  tests/test_loader.py tests/test_loader_local.py tests/test_bag_loader.py tests/test_device.py tests/test_device_stats.py \
  tests/test_nanopath_recipe.py tests/test_int8_loaders.py -k "cuda or device" 2>&1 | tee "$OUT/cuda-tests.txt" | tail -25
timeout 240 python3 scripts/gpu_probe_check.py /tmp/gpu-store 2>&1 | tee "$OUT/probe.txt" | tail -12
