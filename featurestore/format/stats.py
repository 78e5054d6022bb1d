"""Quantization report and per-channel statistics from per-chunk partial sums.

Each feature chunk gets one float64 row (``ChunkStats.to_row``) written by the chunk's owner
beside the chunk. A split's report is the fold of all rows in chunk order, so it does not depend
on which process wrote which chunk, on batch sizes or on arrival order: one writer, several
torchrun ranks and a resumed run all produce the same numbers.

Per chunk: counts, maxima (order-free), sums of squared error / squared source taken per sample
row then summed in row order, and per-channel mean and M2 (sum of squared deviations) over the
chunk's rows, merged across chunks with Chan et al.'s parallel update
(https://en.wikipedia.org/wiki/Algorithms_for_calculating_variance#Parallel_algorithm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Scalar slots at the start of a row; the channel mean and M2 follow (2 * channels values).
SCALARS = (
    "rows",
    "values",
    "abs_max",
    "max_abs_error",
    "max_rel_error",
    "sum_sq_error",
    "sum_sq_source",
    "nan_count",
    "inf_count",
    "overflow_count",
    "source_code",
)
NUM_SCALARS = len(SCALARS)
# Relative error is taken only where |x| is at least float16's smallest normal: below it every
# format loses relative precision by design (subnormals), and the ratio says nothing useful.
REL_ERROR_FLOOR = 6.103515625e-05
# The dtype of the values handed to ``write`` for a chunk, kept per chunk so that a process that
# only commits (every chunk written by other ranks, or by the run a resume continues) still
# reports the real source dtype. 0 = unknown (rows written before this slot existed).
SOURCE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 4}
SOURCE_NAMES = {code: name for name, code in SOURCE_CODES.items()}


def row_length(channels: int) -> int:
    return NUM_SCALARS + 2 * channels


@dataclass
class ChunkStats:
    channels: int
    rows: int = 0
    values: int = 0
    abs_max: float = 0.0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    sum_sq_error: float = 0.0
    sum_sq_source: float = 0.0
    nan_count: int = 0
    inf_count: int = 0
    overflow_count: int = 0
    source_code: int = 0
    mean: np.ndarray = field(default=None)  # type: ignore[assignment]
    m2: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.mean is None:
            self.mean = np.zeros(self.channels, np.float64)
        if self.m2 is None:
            self.m2 = np.zeros(self.channels, np.float64)

    def to_row(self) -> np.ndarray:
        head = [getattr(self, name) for name in SCALARS]
        return np.concatenate([np.asarray(head, np.float64), self.mean, self.m2])

    @classmethod
    def from_row(cls, row: np.ndarray) -> ChunkStats:
        channels = (len(row) - NUM_SCALARS) // 2
        values = {name: float(row[i]) for i, name in enumerate(SCALARS)}
        for name in ("rows", "values", "nan_count", "inf_count", "overflow_count", "source_code"):
            values[name] = int(values[name])
        mean = row[NUM_SCALARS : NUM_SCALARS + channels].astype(np.float64)
        m2 = row[NUM_SCALARS + channels :].astype(np.float64)
        return cls(channels=channels, mean=mean, m2=m2, **values)

    def merge(self, other: ChunkStats) -> None:
        """Fold ``other`` into self (Chan's update for mean/M2; max and sums otherwise)."""
        n_a = self.values // max(1, self.channels)
        n_b = other.values // max(1, other.channels)
        if n_b:
            total = n_a + n_b
            delta = other.mean - self.mean
            self.mean = self.mean + delta * (n_b / total)
            self.m2 = self.m2 + other.m2 + delta * delta * (n_a * n_b / total)
        self.rows += other.rows
        self.values += other.values
        self.abs_max = max(self.abs_max, other.abs_max)
        self.max_abs_error = max(self.max_abs_error, other.max_abs_error)
        self.max_rel_error = max(self.max_rel_error, other.max_rel_error)
        self.sum_sq_error += other.sum_sq_error
        self.sum_sq_source += other.sum_sq_source
        self.nan_count += other.nan_count
        self.inf_count += other.inf_count
        self.overflow_count += other.overflow_count
        # all chunks normally share one source dtype; if not, the widest one is reported
        self.source_code = max(self.source_code, other.source_code)


@dataclass
class RowStats:
    """Per-sample partial statistics of a batch or a chunk (``B`` rows, ``C`` channels).

    Computed for each sample alone (featurestore.core.device_stats, on the features' device, or
    ``row_stats_numpy`` without torch), so a chunk's statistics row, folded from its samples'
    partials in row order by :func:`fold_rows`, never depends on how the batches were cut.
    """

    abs_max: np.ndarray  # [B] largest |source value|
    max_abs_error: np.ndarray  # [B] largest |stored - source|
    max_rel_error: np.ndarray  # [B] largest |stored - source| / |source| where |source| >= floor
    sq_error: np.ndarray  # [B] sum of (stored - source)**2
    sq_source: np.ndarray  # [B] sum of source**2
    mean: np.ndarray  # [B, C] per-channel mean of the stored values over the sample's tokens
    m2: np.ndarray  # [B, C] per-channel sum of squared deviations from that mean

    @classmethod
    def zeros(cls, rows: int, channels: int) -> RowStats:
        scalar = [np.zeros(rows, np.float64) for _ in range(5)]
        return cls(*scalar, np.zeros((rows, channels), np.float64), np.zeros((rows, channels), np.float64))

    def __len__(self) -> int:
        return len(self.abs_max)

    def __getitem__(self, rows: slice) -> RowStats:
        return RowStats(*(getattr(self, name)[rows] for name in ROW_FIELDS))

    def __setitem__(self, rows: slice, other: RowStats) -> None:
        for name in ROW_FIELDS:
            getattr(self, name)[rows] = getattr(other, name)


ROW_FIELDS = ("abs_max", "max_abs_error", "max_rel_error", "sq_error", "sq_source", "mean", "m2")


def fold_rows(rows: RowStats, tokens: int, source_code: int) -> ChunkStats:
    """A chunk's statistics row from its samples' partials (``tokens`` values per channel each).

    Only fixed-order numpy reductions over the chunk's rows, so the result is a function of the
    per-sample partials alone. The channel moments merge equal-sized groups exactly: the mean of
    the sample means, and M2 = sum of the samples' M2 + tokens * sum of (sample mean - mean)**2.
    """
    channels = rows.mean.shape[1]
    stats = ChunkStats(channels=channels)
    n = len(rows)
    stats.rows = n
    stats.values = n * tokens * channels
    if n == 0:
        return stats
    stats.abs_max = float(rows.abs_max.max())
    stats.max_abs_error = float(rows.max_abs_error.max())
    stats.max_rel_error = float(rows.max_rel_error.max())
    stats.sum_sq_error = float(rows.sq_error.sum())
    stats.sum_sq_source = float(rows.sq_source.sum())
    stats.source_code = source_code
    mean = rows.mean.sum(axis=0) / n
    spread = rows.mean - mean
    stats.mean = mean
    stats.m2 = rows.m2.sum(axis=0) + tokens * np.einsum("ij,ij->j", spread, spread)
    return stats


# Values summed in float32 before the float64 accumulation: a group's float32 sum adds at most
# GROUP roundings (~1e-6 relative), and float32 arithmetic is ~4x faster than float64 on CPUs.
GROUP = 16


def row_stats_numpy(source: np.ndarray, stored: np.ndarray, logical: str, exact: bool,
                    channels: int) -> RowStats:
    """:class:`RowStats` without torch (the core writer on a host with no torch installed).

    ``source``: the values given to the writer (float64 ones unrounded: the error is the
    float64 -> stored one). Same formulas as featurestore.core.device_stats; numpy's summation
    order differs from torch's, so figures can differ from a torch-written split in the last bits.
    """
    from featurestore.format import dtypes

    count = len(source)
    out = RowStats.zeros(count, channels)
    if count == 0:
        return out
    src = source_values(source)
    out.abs_max[:] = np.abs(src.reshape(count, -1)).max(axis=1) if src.size else 0.0
    q32 = dtypes.stored_as_float32(stored, logical).reshape(count, -1, channels)
    work = np.float32 if logical == "float16" else np.float64
    reference = q32[:, :1, :].astype(work)
    deviation = q32.astype(work) - reference
    tokens = deviation.shape[1]
    first = _group_sums(deviation)
    second = _group_sums(deviation * deviation)
    out.mean[:] = reference[:, 0, :].astype(np.float64) + first / tokens
    out.m2[:] = np.maximum(second - first * first / tokens, 0.0)
    if not exact:
        figures = error_figures(src.reshape(q32.shape), q32, logical)
        out.max_abs_error[:], out.max_rel_error[:], out.sq_error[:], out.sq_source[:] = figures
    return out


def source_values(source: np.ndarray) -> np.ndarray:
    """The writer's input as float32 (bfloat16 and float16 widen exactly), float64 kept as is."""
    from featurestore.format import dtypes

    if source.dtype == dtypes.BFLOAT16:
        return dtypes.stored_as_float32(source.view(np.uint16), "bfloat16")
    if source.dtype == np.float64:
        return source
    return source.astype(np.float32, copy=False)


def error_figures(source: np.ndarray, stored: np.ndarray, logical: str) -> tuple[np.ndarray, ...]:
    """Per sample of ``[B, T, C]`` values: max |stored - source|, max relative error (where
    |source| >= REL_ERROR_FLOOR), and the sums of error**2 and of source**2.

    ``stored`` is the stored values as float32 (exact). The squares must hold any finite value
    of the stored dtype: a float16 one (|x| <= 65504, or a float16 subnormal) squares within
    float32's range, but bfloat16 and float32 reach 3.4e38, whose square overflows float32 (and
    below ~1e-19 underflows to 0), so for them errors and magnitudes are squared and summed in
    float64 (|x|**2 <= 1.2e77 there). A float64 source is measured in float64 throughout, against
    its own values, not their float32 rounding. The fused kernel (core/fused_kernel.py) sums in
    the same order and precision, so both give the same bits.
    """
    count = len(source)
    if source.dtype == np.float64:
        error = stored.astype(np.float64) - source
    else:
        error = stored - source
    magnitude = np.abs(source)
    absolute = np.abs(error)
    relative = np.divide(absolute, magnitude, out=np.zeros_like(absolute), where=magnitude >= REL_ERROR_FLOOR)
    if logical != "float16" or source.dtype == np.float64:
        error = error.astype(np.float64, copy=False)
        magnitude = magnitude.astype(np.float64, copy=False)
    return (absolute.reshape(count, -1).max(axis=1).astype(np.float64),
            relative.reshape(count, -1).max(axis=1).astype(np.float64),
            _group_sums(error * error).sum(axis=1), _group_sums(magnitude * magnitude).sum(axis=1))


def _group_sums(values: np.ndarray) -> np.ndarray:
    """``[B, T, C]`` -> per-row, per-channel sums ``[B, C]`` in float64 (GROUP rows at a time).

    The order is spelled out (one add per token) rather than left to ``ndarray.sum``, which sums
    a contiguous axis pairwise: it is the order of the fused kernel (core/fused_kernel.py), so
    both give the same bits.
    """
    count, tokens, channels = values.shape
    head = tokens - tokens % GROUP
    total = np.zeros((count, channels), np.float64)
    for lo in range(0, head, GROUP):
        group = values[:, lo].copy()
        for t in range(lo + 1, lo + GROUP):
            group += values[:, t]
        total += group
    tail = np.zeros((count, channels), np.float64)
    for t in range(head, tokens):
        tail += values[:, t]
    return total + tail


def merge_rows(rows: list[np.ndarray], channels: int) -> ChunkStats:
    total = ChunkStats(channels=channels)
    for row in rows:
        total.merge(ChunkStats.from_row(row))
    return total


def report(total: ChunkStats, *, source_dtype: str, logical_dtype: str) -> dict[str, Any]:
    """The ``quantization`` and ``channel_stats`` metadata of a split (docs/FORMAT.md)."""
    n_channel = total.values // max(1, total.channels)
    std = np.sqrt(total.m2 / n_channel) if n_channel else np.zeros(total.channels)
    rms_source = math.sqrt(total.sum_sq_source / total.values) if total.values else 0.0
    rms_error = math.sqrt(total.sum_sq_error / total.values) if total.values else 0.0
    rel_rms_error = rms_error / rms_source if rms_source and math.isfinite(rms_source) else (
        0.0 if rms_source == 0.0 else math.nan)
    # Every figure is finite for values the writer accepts (error_figures); a figure that still
    # is not (a row written by an older version whose float32 sums overflowed) is stored as null,
    # never as Infinity/NaN, which strict JSON (the split document) cannot hold.
    quantization: dict[str, Any] = {
        "source_dtype": source_dtype,
        "stored_dtype": logical_dtype,
        "exact": total.sum_sq_error == 0.0 and total.max_abs_error == 0.0,
        "values": total.values,
        "abs_max": total.abs_max,
        "max_abs_error": total.max_abs_error,
        "max_rel_error": total.max_rel_error,
        "rel_error_floor": REL_ERROR_FLOOR,
        "rms_error": rms_error,
        "rel_rms_error": rel_rms_error,
        "overflow_count": total.overflow_count,
        "nan_count": total.nan_count,
        "inf_count": total.inf_count,
    }
    if logical_dtype == "int8":  # codes clipped at +-127: 0 unless a scale fell below float32's range
        quantization["saturation_count"] = total.overflow_count
    quantization = {key: _json_number(value) for key, value in quantization.items()}
    channel_stats = {
        "axis": -1,
        "count": n_channel,
        "mean": [_json_number(float(v)) for v in total.mean],
        "std": [_json_number(float(v)) for v in std],
    }
    return {"quantization": quantization, "channel_stats": channel_stats}


def _json_number(value: Any) -> Any:
    """``value``, or None for a float that is infinite or NaN (not representable in JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
