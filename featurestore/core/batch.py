"""A checked batch ready for the chunk buffers, and the torch-free way to make one.

The writer turns every ``write()`` into a :class:`Prepared`: the stored-dtype bytes on the host
plus per-sample statistics (:class:`~featurestore.format.stats.RowStats`). With torch installed
that is featurestore.core.device_stats, on the device the features are on; this module is the
numpy fallback for hosts without torch (same checks, same messages, same formulas) and the
error texts both share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from featurestore.errors import DtypeMismatch, Float16Overflow, NonFiniteValues
from featurestore.format import dtypes
from featurestore.format.stats import RowStats, row_stats_numpy

KINDS = ("float32", "float16", "bfloat16", "float64")


@dataclass
class Prepared:
    """A checked batch: its stored-dtype bytes on the host and its per-sample statistics."""

    stored: np.ndarray  # [B, *sample_shape] in the storage dtype (bfloat16 as uint16 bits)
    rows: RowStats
    kind: str  # the source dtype name
    aliases_source: bool  # ``stored`` is the caller's own memory (no cast was needed)


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise DtypeMismatch(
            f"features of dtype {kind} cannot be stored: pass float32, float16, bfloat16 "
            "(torch or ml_dtypes) or float64 values"
        )
    return kind


def is_exact(kind: str, logical: str) -> bool:
    """Whether storing ``kind`` values as ``logical`` loses nothing (no error figures needed)."""
    return kind == logical or (logical == "float32" and kind in ("float16", "bfloat16"))


def in_rows(rows: str, refused: np.ndarray) -> str:
    """``rows`` and which of them hold the refused values (``refused``: a flag per row of the
    batch), so a batch of many is not searched by hand: "samples [0, 200) (1 of them; first: the
    batch's row 137)". A batch of one is named by ``rows`` alone."""
    hit = np.flatnonzero(refused)
    if len(refused) < 2 or not len(hit):
        return rows
    return f"{rows} ({len(hit)} of them; first: the batch's row {int(hit[0])})"


def non_finite(nan: int, inf: int, rows: str) -> NonFiniteValues:
    return NonFiniteValues(
        f"{nan} NaN and {inf} Inf values in the features of {rows}: featurestore does not "
        "store non-finite values. Check the encoder (run it with --precision fp32) and its input"
    )


def float16_overflow(over: int, largest: float, rows: str) -> Float16Overflow:
    return Float16Overflow(
        f"{over} values of {rows} exceed float16's range +-65504 (abs max {largest:.6g}); "
        "nothing of this batch was stored. Use --dtype bfloat16 (float32's range, ~4e-3 "
        "relative error) or --dtype float32 (exact)"
    )


def bfloat16_overflow(over: int, largest: float, rows: str) -> NonFiniteValues:
    return NonFiniteValues(
        f"{over} values of {rows} would round to Inf in bfloat16 (abs max {largest:.6g}, "
        "bfloat16's largest finite value is ~3.3895e38); nothing of this batch was stored. "
        "Use --dtype float32 (exact)"
    )


def float32_overflow(over: int, largest: float, rows: str) -> NonFiniteValues:
    return NonFiniteValues(
        f"{over} float64 values of {rows} would round to Inf in float32 (abs max {largest:.6g}, "
        "float32's largest finite value is ~3.4028e38), the first step of every cast; nothing of "
        "this batch was stored. Scale the features down"
    )


# float64 values at or beyond this magnitude round (to nearest even) to Inf in float32: halfway
# between float32's largest finite value (2**128 - 2**104) and 2**128.
FLOAT32_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def prepare_numpy(source: np.ndarray, logical: str, channels: int, start: int) -> Prepared:
    """:func:`featurestore.core.device_stats.prepare` without torch."""
    kind = check_kind(dtypes.source_dtype_name(source))
    source = np.ascontiguousarray(source)
    rows = f"samples [{start}, {start + len(source)})"
    row_max = dtypes.row_abs_max(source)
    refuse_out_of_range(source, kind, logical, row_max, rows)
    # float64 is rounded to float32 first, as on the other paths; the error is measured against
    # the float64 values themselves
    stored = dtypes.quantize(source.astype(np.float32) if kind == "float64" else source, logical)
    stats = row_stats_numpy(source, stored, logical, is_exact(kind, logical), channels)
    stats.abs_max[:] = row_max
    return Prepared(stored, stats, kind, aliases_source=np.shares_memory(stored, source))


def refuse_out_of_range(source: np.ndarray, kind: str, logical: str, abs_max: np.ndarray, rows: str) -> None:
    """The host paths' refusals from each row's abs max (inf or NaN for a row holding a
    non-finite value): non-finite values, float16 overflow, values that round to Inf in
    bfloat16. The counts in the message are taken (slowly) only for a refused batch.
    ``source``: bfloat16 as ml_dtypes values or uint16 bits."""
    largest = float(abs_max.max()) if len(abs_max) else 0.0
    if np.isfinite(largest) and not (logical == "float16" and largest > dtypes.FLOAT16_MAX) and not (
            logical == "bfloat16" and largest >= dtypes.BFLOAT16_ROUNDS_TO_INF) and not (
            kind == "float64" and largest >= FLOAT32_ROUNDS_TO_INF):
        return
    wide = dtypes.stored_as_float32(source.view(np.uint16), "bfloat16") if kind == "bfloat16" else source
    if not np.isfinite(largest):  # NaN bits are the largest magnitudes, so a NaN shows here too
        raise non_finite(int(np.isnan(wide).sum()), int(np.isinf(wide).sum()), in_rows(rows, ~np.isfinite(abs_max)))
    if logical == "float16":
        raise float16_overflow(int((np.abs(wide) > dtypes.FLOAT16_MAX).sum()), largest,
                               in_rows(rows, abs_max > dtypes.FLOAT16_MAX))
    if logical == "float32":
        raise float32_overflow(int((np.abs(wide) >= FLOAT32_ROUNDS_TO_INF).sum()), largest,
                               in_rows(rows, abs_max >= FLOAT32_ROUNDS_TO_INF))
    raise bfloat16_overflow(int((np.abs(wide) >= dtypes.BFLOAT16_ROUNDS_TO_INF).sum()), largest,
                            in_rows(rows, abs_max >= dtypes.BFLOAT16_ROUNDS_TO_INF))
