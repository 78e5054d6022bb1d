"""Whether a features chunk is the one its statistics row describes: no I/O, bytes in.

A chunk file moved, swapped with another of the same split, or left by another run keeps a valid
crc32c of its own; only the statistics row beside it (sealed with the split's generation and the
chunk's index) says which rows belong there. ``featurestore verify`` and the resume check with
``--verify-chunks`` (``FeatureStore.create_split``) both use this one test.
"""

from __future__ import annotations

import numpy as np

from featurestore.format import dtypes, layout
from featurestore.format.metadata import SplitMetadata, unseal
from featurestore.format.stats import ChunkStats

# Per-channel means of a chunk recomputed here against its statistics row: both come from the same
# stored values, so they agree to float32 rounding; another chunk's rows miss by far more.
MEAN_RTOL = 1e-4


def features_match_stats(raw: bytes, meta: SplitMetadata, index: int, sealed_row: np.ndarray) -> str | None:
    """Whether a features chunk is the one its statistics row describes (row count, channel means)."""
    payload = memoryview(raw)[: -layout.CRC_BYTES]
    if meta.compressor is not None:
        from numcodecs import Zstd

        payload = memoryview(Zstd().decode(payload))
    storage = dtypes.storage_dtype(meta.logical_dtype)
    values = np.frombuffer(payload, storage)
    per_row = int(np.prod(meta.sample_shape))
    if values.size != meta.chunk_rows * per_row:
        return f"decodes to {values.size} values, expected {meta.chunk_rows * per_row}"
    lo = index * meta.chunk_rows
    count = min(meta.chunk_rows, meta.num_samples - lo)
    stats = ChunkStats.from_row(unseal(sealed_row, meta)[0])
    if stats.rows != count:
        return f"its statistics row counts {stats.rows} samples, the chunk holds {count}"
    if dtypes.is_int8(meta.logical_dtype):
        return None  # codes without their scales row say nothing of the channel means
    channels = meta.sample_shape[-1]
    stored = values[: count * per_row]
    mean = dtypes.stored_as_float32(stored, meta.logical_dtype).reshape(-1, channels).mean(axis=0, dtype=np.float64)
    scale = max(1.0, float(np.abs(stats.mean).max(initial=0.0)))
    if not np.allclose(mean, stats.mean, rtol=MEAN_RTOL, atol=MEAN_RTOL * scale):
        worst = int(np.argmax(np.abs(mean - stats.mean)))
        return (f"its channel means do not match its statistics row (channel {worst}: "
                f"{mean[worst]:.6g} vs {stats.mean[worst]:.6g}): a chunk file swapped, moved or "
                "written by another run")
    return None
