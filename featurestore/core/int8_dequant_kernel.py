"""int8 codes times their scales into float32 or float16 in one pass, as a numba kernel.

The numpy formula (format.int8.dequantize_into) makes a float32 temporary of the product before
the store into a float16 buffer, and for shuffled rows a gathered copy of their scales: measured at
about twice the float16 -> float32 upcast a float16 split pays for the same rows. Here each value is
read once, multiplied in float32 (``float32(code) * scale``: the int8 -> float32 conversion is
exact, the product rounded once, as numpy does) and stored in the output's width: a float16 output
goes through LLVM's ``fptrunc`` (round to nearest even, subnormals kept, as numpy's cast), so both
paths give the same bits. Only client.dequantize imports this module, when numba is available.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_kernel = numba.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)


@intrinsic
def _half_bits(typingctx, value):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    """float32 -> the bits of its float16 rounding (LLVM ``fptrunc``: one round to nearest even;
    F16C or AVX512-FP16 hardware where the CPU has it, a library call otherwise)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@_kernel
def groups_fit(groups: np.ndarray, rows: int) -> bool:  # pragma: no cover (compiled)
    """Whether every group is a row of a ``rows``-row table (the kernels index unchecked)."""
    for r in range(groups.shape[0]):
        if groups[r] < 0 or groups[r] >= rows:
            return False
    return True


@_kernel
def to_float32(codes: np.ndarray, groups: np.ndarray, table: np.ndarray, out: np.ndarray,
               lo: int, hi: int) -> None:  # pragma: no cover (compiled)
    """``out[r] = float32(codes[r]) * table[groups[r]]`` for rows ``[lo, hi)``: ``codes`` int8
    ``[n, P]``, ``groups`` int64 ``[n]`` (each in ``[0, g)``: :func:`groups_fit`), ``table``
    float32 ``[g, P]``, ``out`` float32 ``[n, P]``, all C-contiguous."""
    for r in range(lo, hi):
        scales = table[groups[r]]
        row = codes[r]
        dest = out[r]
        for p in range(row.shape[0]):
            dest[p] = np.float32(row[p]) * scales[p]


@_kernel
def to_float16(codes: np.ndarray, groups: np.ndarray, table: np.ndarray, out: np.ndarray,
               lo: int, hi: int) -> None:  # pragma: no cover (compiled)
    """As :func:`to_float32`, the float32 product rounded once to float16: ``out`` is the float16
    buffer seen as uint16 ``[n, P]`` (numba has no float16 arithmetic on the CPU)."""
    for r in range(lo, hi):
        scales = table[groups[r]]
        row = codes[r]
        dest = out[r]
        for p in range(row.shape[0]):
            dest[p] = _half_bits(np.float32(row[p]) * scales[p])
