"""The int8 encoding of one chunk (or bag) and its statistics in one pass, as a numba kernel.

The numpy path (format.int8.encode, int8.decode, format.stats.row_stats_numpy) makes some twenty
passes over a chunk, several through float64 temporaries twice its size; measured at about a
third of a float16 write's speed. Here each value is read once after the absmax: divided by its
position's scale, rounded, clipped, stored as its code, multiplied back, and its moments and
error figures summed, in the same operations, precisions and order as the numpy path (format.stats
spells the order out: GROUP tokens summed, then added to the float64 total; the per-row sums
over channels stay numpy's), so both give the same codes, scales and statistics bits.
Only featurestore.core.quantize_int8 imports this module, when numba is available
(core.fused_stats.available).
"""

from __future__ import annotations

import numba
import numpy as np

from featurestore.format.int8 import QMAX
from featurestore.format.stats import GROUP, REL_ERROR_FLOOR

_kernel = numba.njit(nogil=True, cache=True, error_model="numpy")
_FLOOR = np.float32(REL_ERROR_FLOOR)
_HALF_OVER = np.float32(QMAX + 0.5)
_QMAX = np.float32(QMAX)


@_kernel
def absmax(flat: np.ndarray) -> np.ndarray:  # pragma: no cover (compiled)
    """Per position (column) of ``[R, P]`` float32: the largest |value| over the rows."""
    out = np.zeros(flat.shape[1], np.float32)
    for r in range(flat.shape[0]):
        for p in range(flat.shape[1]):
            out[p] = max(out[p], abs(flat[r, p]))
    return out


@_kernel
def encode_measure(src: np.ndarray, scales: np.ndarray, codes: np.ndarray, first: np.ndarray, second: np.ndarray,
                   err_sq: np.ndarray, src_sq: np.ndarray, abs_err: np.ndarray, rel_err: np.ndarray,
                   reference: np.ndarray, saturated: np.ndarray, lo: int, hi: int) -> None:  # pragma: no cover
    """``src`` ``[B, T, C]`` float32 (contiguous); ``scales`` flat per position: ``[T * C]`` (a
    chunk: scales per token and channel) or ``[C]`` (a bag seen as one sample); ``codes`` ``[B, T, C]`` int8 out. Per sample and
    channel: sums of (value back - the sample's token-0 value back) and of its square, of error**2
    and of source**2 (float64, format.stats._group_sums' order); per sample: max |error| and max
    relative error (float32); ``reference``: the token-0 values back; ``saturated``: each sample's
    count of saturated values. Samples ``[lo, hi)`` only: each owns its outputs, so threads may
    share a chunk's samples (core.fused_stats.run_items) and change no bit."""
    tokens, channels = src.shape[1], src.shape[2]
    per_token = scales.shape[0] == tokens * channels
    head = tokens - tokens % GROUP
    zero = np.float32(0.0)
    # Per channel, for the token at hand: its four summands, then the group and total sums.
    # Branch-free inner loops over channels (selects, per-channel maxima) so LLVM vectorizes them.
    terms = np.empty((4, channels), np.float64)
    group = np.empty((4, channels), np.float64)
    total = np.empty((4, channels), np.float64)
    tail = np.empty((4, channels), np.float64)
    most_abs = np.empty(channels, np.float32)
    most_rel = np.empty(channels, np.float32)
    for b in range(lo, hi):
        over = 0
        total[:] = 0.0
        tail[:] = 0.0
        most_abs[:] = zero
        most_rel[:] = zero
        for c in range(channels):  # the token-0 values back: each sample's reference
            s = scales[c]
            ratio = np.float32(src[b, 0, c] / s) if s > 0 else zero
            q = min(max(np.float32(np.rint(ratio)), -_QMAX), _QMAX) + zero
            reference[b, c] = np.float64(np.float32(q * s))
        for t in range(tokens):
            base = t * channels if per_token else 0
            for c in range(channels):
                x = src[b, t, c]
                s = scales[base + c]
                ratio = np.float32(x / s) if s > 0 else zero
                over += 1 if abs(ratio) > _HALF_OVER else 0
                # + 0: a code is an integer, so -0.0 (rint of a small negative) comes back as +0.0
                q = min(max(np.float32(np.rint(ratio)), -_QMAX), _QMAX) + zero
                codes[b, t, c] = np.int8(q)
                v = np.float32(q * s)  # the value back, float32 (int8.decode)
                dev = np.float64(v) - reference[b, c]
                error = np.float32(v - x)
                absolute = abs(error)
                magnitude = abs(x)
                most_abs[c] = max(most_abs[c], absolute)
                rel = np.float32(absolute / magnitude) if magnitude >= _FLOOR else zero
                most_rel[c] = max(most_rel[c], rel)
                e64 = np.float64(error)
                m64 = np.float64(magnitude)
                terms[0, c] = dev
                terms[1, c] = dev * dev
                terms[2, c] = e64 * e64
                terms[3, c] = m64 * m64
            if t >= head:  # the tail's own sum (format.stats._group_sums)
                for k in range(4):
                    for c in range(channels):
                        tail[k, c] += terms[k, c]
            elif t % GROUP == 0:
                group[:] = terms
            else:
                for k in range(4):
                    for c in range(channels):
                        group[k, c] += terms[k, c]
                if t % GROUP == GROUP - 1:
                    for k in range(4):
                        for c in range(channels):
                            total[k, c] += group[k, c]
        for c in range(channels):  # total + tail
            first[b, c] = total[0, c] + tail[0, c]
            second[b, c] = total[1, c] + tail[1, c]
            err_sq[b, c] = total[2, c] + tail[2, c]
            src_sq[b, c] = total[3, c] + tail[3, c]
        abs_err[b] = most_abs.max()
        rel_err[b] = most_rel.max()
        saturated[b] = over
