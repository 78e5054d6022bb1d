#!/usr/bin/env bash
# The writer on a GPU box, one command (a few minutes on an H100): the writer's CUDA statistics
# test, extraction wall vs encode-only for timm ViT-S/14 and ViT-L/14 (random weights, 224 px,
# float32 features stored float16) with the GPU's statistics of one batch against the CPU's, the
# zero-cost-encoder ceiling and the writer vs numpy tofile. Figures go to stdout and $OUT/*.json.
# Usage: bash scripts/gpu_writer_bench.sh   (OUT defaults to ./bench-gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-gpu}"
mkdir -p "$OUT"
if [ -d .gpu-wheels ]; then  # an offline box without the project's wheels: install what is missing
  pip install -q --no-deps --no-index --find-links .gpu-wheels --target /tmp/fs-deps crc32c ml_dtypes tqdm pytest 2>&1 | tail -2
  export PYTHONPATH="/tmp/fs-deps:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python -m pytest -q -p no:cacheprovider --noconftest tests/test_device_stats.py 2>&1 | tail -3
for model in vit_small_patch14_dinov2 vit_large_patch14_dinov2; do
  python -m featurestore.cli bench extract --device cuda --n 2048 --batch-size 64 --repeats 2 \
    --encoder "timm:$model,pretrained=false,img_size=224" --json "$OUT/extract-$model.json" 2>&1 | tail -5
done
python -m featurestore.cli bench extract --device cpu --encoder zero --image-size 32 --n 4096 --repeats 3 \
  --json "$OUT/extract-zero.json" 2>&1 | tail -4
python -m featurestore.cli bench write --repeats 3 --json "$OUT/write.json" 2>&1 | tail -6
