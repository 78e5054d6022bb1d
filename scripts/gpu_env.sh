# Sourced by the GPU-host scripts (scripts/gpu_check.sh, scripts/gpu_int8.sh): the repository root
# as the working directory, $OUT made, and on an offline GPU box the wheels it lacks (.whl/:
# zarr, numcodecs, crc32c, fastapi, ...) installed into /tmp/site first.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
