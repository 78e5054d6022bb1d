"""numba kernels of the mean and max pooling: one pass over a piece of stored rows, no float64 copy.

numpy's float16 -> float64 conversion plus the sum ran at ~1.7 GB/s of float16 a core on the test
host, slower than the read it follows; here each stored value is decoded in registers (float16 and
bfloat16 bits -> float32 exactly, then float64) and added to its column's float64 accumulator,
rows in order: the same float64 sums as numpy's ``x.astype(float64).sum(0)``, bit for bit (no
fast-math: no reassociation). Imported only when numba is installed (featurestore.embed.pooling
falls back to numpy otherwise). Stored values are never Inf or NaN (the writer refuses them), so
the float16 decoder needs no case for them.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

# The float32 <-> uint32 bit casts of the fused quantize kernel: one definition of the IEEE bit view.
from featurestore.core.fused_kernel import bits_f32 as _bits_f32
from featurestore.core.fused_kernel import f32_bits as _f32_bits

jit = numba.njit(nogil=True, cache=True, error_model="numpy")


@numba.njit(inline="always")
def _half(h: Any) -> Any:
    """float16 bits -> float32, exactly (finite values); branch-free so the loop vectorises."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    magnitude = h & np.uint32(0x7FFF)
    normal = (magnitude << np.uint32(13)) + np.uint32(0x38000000)  # exponent 15 -> 127
    subnormal = _f32_bits(np.float32(magnitude) * np.float32(5.9604644775390625e-08))  # m * 2**-24
    bits = subnormal if (magnitude >> np.uint32(10)) == 0 else normal
    return _bits_f32(bits | sign)


@numba.njit(inline="always")
def _bfloat(h: Any) -> Any:
    return _bits_f32(np.uint32(h) << np.uint32(16))


@jit
def sum_half(bits: Any, acc: Any) -> None:
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            acc[j] += np.float64(_half(bits[i, j]))


@jit
def sum_bfloat(bits: Any, acc: Any) -> None:
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            acc[j] += np.float64(_bfloat(bits[i, j]))


@jit
def sum_float(x: Any, acc: Any) -> None:
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            acc[j] += np.float64(x[i, j])


@jit
def max_half(bits: Any, acc: Any) -> None:
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            acc[j] = max(acc[j], _half(bits[i, j]))


@jit
def max_bfloat(bits: Any, acc: Any) -> None:
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            acc[j] = max(acc[j], _bfloat(bits[i, j]))


@jit
def max_float(x: Any, acc: Any) -> None:
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            acc[j] = max(acc[j], x[i, j])


# (how, logical dtype) -> kernel; the stored array is passed as its storage dtype's bits for
# float16 and bfloat16 (uint16), as float32 for float32.
KERNELS = {("mean", "float16"): sum_half, ("mean", "bfloat16"): sum_bfloat, ("mean", "float32"): sum_float,
           ("max", "float16"): max_half, ("max", "bfloat16"): max_bfloat, ("max", "float32"): max_float}
