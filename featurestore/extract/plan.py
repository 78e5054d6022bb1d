"""The extraction plan: which samples are encoded together, and how many rows a chunk holds.

The plan is a pure function of ``(num_samples, chunk_rows, batch_size)``: batches never cross a
chunk boundary and start at the chunk's first row or a multiple of ``batch_size`` after it. Every
sample is therefore encoded in the same batch, with the same companions, whether the run is
fresh, resumed after a SIGKILL, or one rank of a torchrun job: encoders are not bit-exact across
batch compositions on every backend (cuBLAS picks kernels by shape), and the promise here is
byte-identical chunks. So that this never shrinks the batch, a new split's chunk holds a whole
multiple of ``batch_size`` rows (``chunk_rows_for``): ``--chunk-mb`` is rounded to it, and grown
to one batch when samples are large (a [1024, 3072] float16 sample is 6 MiB).
"""

from __future__ import annotations

import math

from featurestore.errors import InvalidOption
from featurestore.format import dtypes, int8

MAX_CHUNK_MB = 1 << 20  # 1 TiB: far past any useful chunk, and where int(chunk_mb << 20) stays exact


def plan_batches(chunks: list[int], chunk_rows: int, num_samples: int, batch_size: int) -> list[list[int]]:
    """Sample indices per batch for ``chunks``; see the module docstring for why it is fixed."""
    plan: list[list[int]] = []
    for chunk in chunks:
        lo, hi = chunk * chunk_rows, min((chunk + 1) * chunk_rows, num_samples)
        plan.extend(list(range(a, min(a + batch_size, hi))) for a in range(lo, hi, batch_size))
    return plan


def check_chunk_mb(chunk_mb: object) -> float:
    """``--chunk-mb`` (``chunk_mb=``) as a finite positive number of MiB, else one clear error:
    ``nan``, ``inf``, ``0`` and negative values are refused for ``extract`` and ``import`` alike."""
    if isinstance(chunk_mb, bool) or not isinstance(chunk_mb, (int, float)) or not (
            math.isfinite(chunk_mb) and 0 < chunk_mb <= MAX_CHUNK_MB):
        raise InvalidOption(f"--chunk-mb must be a finite positive number of MiB (at most {MAX_CHUNK_MB}), "
                            f"but got: {chunk_mb!r}: pass e.g. --chunk-mb 8")
    return float(chunk_mb)


def chunk_rows_for(sample_shape: tuple[int, ...], dtype: str, chunk_mb: float, batch_size: int) -> int:
    """Samples per chunk: a whole multiple of ``batch_size``, near ``chunk_mb`` MiB."""
    chunk_mb = check_chunk_mb(chunk_mb)
    sample_nbytes = dtypes.storage_dtype(dtype).itemsize
    for size in sample_shape:
        sample_nbytes *= int(size)
    rows = int8.chunk_rows(dtype, max(1, int(chunk_mb * (1 << 20)) // sample_nbytes), int8.MIN_CHUNK_ROWS)
    return batch_size if rows < batch_size else rows - rows % batch_size


def resolve_dtype(choice: str, output_dtype: str) -> str:
    """``--dtype auto``: keep float16/bfloat16 outputs as they are; float32 -> float16, under the
    writer's overflow guard (an overflow stops the run and says to use bfloat16 or float32)."""
    keep = output_dtype if output_dtype in ("float16", "bfloat16") else "float16"
    return keep if choice == "auto" else dtypes.check_feature_dtype(choice)
