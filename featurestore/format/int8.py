"""int8 storage: symmetric absmax codes per (chunk, position), and their float values back.

Scheme (docs/FORMAT.md "int8"): for features chunk ``i`` and each position ``p`` of the sample
shape (token and channel), ``scale = absmax over the chunk's rows of |x[:, p]| / 127`` rounded to
float32, and ``code = clip(rint(x / scale), -127, 127)`` as int8 (0 where the scale is 0). The
value back is ``code * scale``: ``features[r] * scales[r // chunk_rows]``. Per position, so a
channel with massive activations or a high-norm prefix token spends its own range and leaves the
others' precision alone; per chunk, so the writer quantizes each chunk from its own rows (one
pass, resumable chunk by chunk, byte-identical whatever the batches). Every element is within
``scale / 2`` of its source (plus float32 rounding of the division and the product).

Bag splits apply the same codes per (bag, channel) instead of per (chunk, position): a commit
moves bags across chunks, their scales move with them (docs/FORMAT.md).

No I/O: ``core.quantize_int8`` calls :func:`encode` on each finished chunk or bag, the readers
call :func:`dequantize_into`. numpy only.
"""

from __future__ import annotations

import numpy as np

QMAX = 127  # symmetric: -128 is never written, so negation is exact and zero is a code
# Scales cost 4 bytes per position per chunk, 4 / chunk_rows of the codes' bytes: chunk sizes
# given in bytes are grown to at least this many rows (scales <= ~3% of the codes, so the split
# stays <= 0.52x its float16 bytes). Rows given explicitly are kept.
MIN_CHUNK_ROWS = 128


def chunk_rows(logical: str, rows: int, num_samples: int) -> int:
    """Rows per chunk for a split of ``logical`` dtype whose chunk size in bytes gives ``rows``."""
    if logical != "int8":
        return rows
    return max(rows, min(MIN_CHUNK_ROWS, max(1, int(num_samples))))


def encode(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """A chunk's rows ``[R, *S]`` (float32, finite) -> int8 codes ``[R, *S]``, float32 scales
    ``[*S]`` and the count of saturated values (|x / scale| beyond 127.5; none for finite float32
    input, since scales stay in float32's normal range)."""
    rows = np.ascontiguousarray(values, dtype=np.float32)
    flat = rows.reshape(len(rows), -1)
    absmax = np.abs(flat).max(axis=0) if len(flat) else np.zeros(flat.shape[1], np.float32)
    scales = scales_for(absmax)
    ratio = np.zeros(flat.shape, np.float32)
    np.divide(flat, scales, out=ratio, where=scales > 0)
    saturated = int(np.count_nonzero(np.abs(ratio) > QMAX + 0.5))
    np.rint(ratio, out=ratio)
    np.clip(ratio, -QMAX, QMAX, out=ratio)
    return ratio.astype(np.int8).reshape(rows.shape), scales.reshape(rows.shape[1:]), saturated


def _largest_scale() -> np.float32:
    """The largest float32 scale whose 127 times is finite in float32."""
    scale = np.float32(float(np.finfo(np.float32).max) / QMAX)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(QMAX) * scale):
            scale = np.nextafter(scale, np.float32(0))
    return scale


_LARGEST_SCALE = _largest_scale()


def scales_for(absmax: np.ndarray) -> np.ndarray:
    """Each position's float32 scale from its float32 absmax over the rows (``absmax / 127``)."""
    scales = (absmax.astype(np.float64) / QMAX).astype(np.float32)
    # A scale below float32's normal range divides inexactly (values of ~1e-40 would come back
    # saturated): such a position gets the smallest normal scale, its values within 6e-39. One
    # rounded up past float32's largest value / 127 would decode 127 as inf: kept below it.
    scales = np.minimum(scales, _LARGEST_SCALE)
    return np.where(absmax > 0, np.maximum(scales, np.finfo(np.float32).tiny), scales).astype(np.float32)


def decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One chunk's codes ``[R, *S]`` and its scales ``[*S]`` -> float32 values."""
    return np.multiply(codes, scales, dtype=np.float32)


def dequantize_into(codes: np.ndarray, chunk_of_row: np.ndarray, scales: np.ndarray,
                    out: np.ndarray) -> np.ndarray:
    """Rows of several chunks back to floats, vectorized: ``out[r] = codes[r] * scales[chunk_of_row[r]]``.

    ``scales``: the split's whole ``[num_chunks, *S]`` table; ``out``: float32 or float16 (a value
    beyond float16's range becomes inf there: read such splits as float32)."""
    if len(codes) == 0:
        return out
    cuts = np.flatnonzero(np.diff(chunk_of_row)) + 1
    if len(cuts) > 16:  # shuffled rows: one gather of their scales, one multiply
        return np.multiply(codes, scales[chunk_of_row], out=out, casting="same_kind")
    # Sequential rows: one multiply per run of one chunk, no [B, *S] gather of the scales.
    for lo, hi in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(codes)].tolist()):
        np.multiply(codes[lo:hi], scales[int(chunk_of_row[lo])], out=out[lo:hi], casting="same_kind")
    return out


def error_bound(scales: np.ndarray) -> np.ndarray:
    """The largest |value back - source| the scheme allows for each position of a chunk (float32
    rounding of the division and the product included)."""
    s = scales.astype(np.float64)
    return s * (0.5 + 2.0**-16) + QMAX * s * 2.0**-23 + QMAX * 2.0**-149
