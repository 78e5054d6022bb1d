"""The fused statistics kernel (numba): imported only when numba is installed.

See featurestore.core.fused_stats for what it computes and why; this module is the compiled part.
Everything is IEEE float32/float64 arithmetic without fast-math (no reassociation, no FMA
contraction), so results are the numpy reference's, bit for bit.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from featurestore.format.stats import GROUP, REL_ERROR_FLOOR

# Stored encodings; each kernel below fixes its pair as constants. COPY: the source's bits.
SAME, FLOAT16, BFLOAT16, FLOAT32, COPY = 0, 1, 2, 3, 4


# Channels per work item. Splitting a row costs: float32 -> float16 (integer rounding) on one
# core of the 2-core test host took 1.13 ns per value at [1024, 3072] with 4096-channel items,
# 1.23 with 1024 and 1.59 with 512 (1.20 / 1.84 / 2.43 at [256, 1536]). 4096 keeps an item's
# ~112 bytes of accumulators per channel within L2; samples are the other axis of parallelism.
BLOCK = 4096


@intrinsic
def f32_bits(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


# No fast-math: the numpy reference's IEEE results, bit for bit.
jit = numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")


@jit
def soft_half_to_f32(h: Any) -> Any:
    """float16 bits -> float32, exactly. No branch (the loop vectorises): every case is
    computed and one selected."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    magnitude = h & np.uint32(0x7FFF)
    normal = (magnitude << np.uint32(13)) + np.uint32(0x38000000)  # rebias the exponent 15 -> 127
    special = normal + np.uint32(0x38000000)  # exponent 31 (Inf, NaN) -> 255
    subnormal = f32_bits(np.float32(magnitude) * np.float32(5.9604644775390625e-08))  # m * 2**-24
    exponent = magnitude >> np.uint32(10)
    bits = subnormal if exponent == 0 else (special if exponent == 31 else normal)
    return bits_f32(bits | sign)


@jit
def soft_f32_to_half(x: Any) -> Any:
    """float16 bits of x, rounded to nearest even. Finite input in float16's range only: the
    caller refuses overflow and non-finite batches before their bytes are used."""
    u = f32_bits(x)
    sign = u & np.uint32(0x80000000)
    u ^= sign
    # Normal range: round the 13 low mantissa bits away (ties to even) in float32's own layout,
    # then rebias the exponent (127 -> 15). Below 2**-14 the FPU rounds: |x| + 0.5 has an ulp of
    # 2**-24, float16's subnormal step. Both are computed and one selected: no branch, so the
    # loop vectorises.
    rounded = (u + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    normal = (rounded - np.uint32(0x38000000)) >> np.uint32(13)
    subnormal = f32_bits(bits_f32(u) + np.float32(0.5)) - np.uint32(0x3F000000)
    out = subnormal if u < np.uint32(0x38800000) else normal
    return np.uint16(out | (sign >> np.uint32(16)))


@jit
def soft_half_value(x: Any) -> Any:
    """float32(float16(x)) without going through the bits (same rounding as soft_f32_to_half)."""
    u = f32_bits(x)
    sign = u & np.uint32(0x80000000)
    u ^= sign
    rounded = (u + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    subnormal = f32_bits((bits_f32(u) + np.float32(0.5)) - np.float32(0.5))
    return bits_f32((subnormal if u < np.uint32(0x38800000) else rounded) | sign)


# float16 <-> float32 in hardware (x86-64 F16C, AArch64 FCVT): LLVM's fpext / fptrunc, IEEE
# round-to-nearest-even, the same bits as the integer versions above (tests/test_fused_stats.py
# checks both on every float16 and every tie). Measured on the 2-core test host, per value, one
# core, [256, 384]: float16 copy + statistics 0.55 -> 0.33 ns, float32 -> float16 0.95 -> 0.50 ns.
@intrinsic
def hard_half_to_f32(typingctx: Any, h: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def hard_f32_to_half(typingctx: Any, x: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@jit
def hard_half_value(x: Any) -> Any:
    return hard_half_to_f32(hard_f32_to_half(x))


def _hardware_half() -> bool:
    """Whether numba's target lowers fpext/fptrunc of half to instructions. Where it cannot
    (x86-64 without F16C, or ``NUMBA_CPU_NAME=generic``), LLVM emits calls to ``__extendhfsf2`` /
    ``__truncsfhf2``, which numba does not link: LLVM aborts the process. So a probe (scalar and
    vector) is compiled to assembly for numba's CPU name and features, outside numba's JIT engine
    (a module added there would abort the next link), and read for those calls."""
    import llvmlite.binding as llvm
    from numba.core import codegen, config

    module = ir.Module(name="featurestore_half_probe")
    for lanes in (1, 16):
        bits = ir.IntType(16) if lanes == 1 else ir.VectorType(ir.IntType(16), lanes)
        half = ir.HalfType() if lanes == 1 else ir.VectorType(ir.HalfType(), lanes)
        single = ir.FloatType() if lanes == 1 else ir.VectorType(ir.FloatType(), lanes)
        function = ir.Function(module, ir.FunctionType(bits, [bits]), name=f"probe{lanes}")
        builder = ir.IRBuilder(function.append_basic_block())
        wide = builder.fpext(builder.bitcast(function.args[0], half), single)
        builder.ret(builder.bitcast(builder.fptrunc(builder.fadd(wide, wide), half), bits))
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=config.CPU_NAME or llvm.get_host_cpu_name(),
        features=config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features(),
        opt=2)
    code = machine.emit_assembly(llvm.parse_assembly(str(module)))
    return not any(helper in code for helper in ("hfsf2", "sfhf2", "gnu_h2f", "gnu_f2h"))


HARDWARE_HALF = _hardware_half()
if HARDWARE_HALF:
    half_to_f32, f32_to_half, half_value = hard_half_to_f32, hard_f32_to_half, hard_half_value
else:
    half_to_f32, f32_to_half, half_value = soft_half_to_f32, soft_f32_to_half, soft_half_value


@jit
def f32_to_bfloat16(x: Any) -> Any:
    u = f32_bits(x)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@jit
def load(src: Any, index: int, kind: int) -> Any:
    if kind == FLOAT16:
        return half_to_f32(src[index])
    if kind == BFLOAT16:
        return bits_f32(np.uint32(src[index]) << np.uint32(16))
    return np.float32(src[index])


@jit
def store(x: Any, out: Any, index: int, kind: int, src: Any) -> Any:
    """Write x's stored encoding; return the stored value as float32."""
    if kind == COPY:  # the source's own bits, unchanged
        out[index] = src[index]
        return x
    if kind == FLOAT16:
        out[index] = f32_to_half(x)
        return half_value(x)
    if kind == BFLOAT16:
        b = f32_to_bfloat16(x)
        out[index] = b
        return bits_f32(np.uint32(b) << np.uint32(16))
    if kind == FLOAT32:
        out[index] = x
    return x


@jit
def stored_value(x: Any, kind: int) -> Any:
    """What ``store`` would return for x, without writing it."""
    if kind == FLOAT16:
        return half_value(x)
    if kind == BFLOAT16:
        return bits_f32(np.uint32(f32_to_bfloat16(x)) << np.uint32(16))
    return x


@jit
def accumulate(x: Any, v: Any, ref: Any, exact: bool, wide: bool, floor: Any, c: int, s0: Any, s1: Any,
               s2: Any, s3: Any, w0: Any, w1: Any, w2: Any, w3: Any, top_error: Any, top_relative: Any) -> None:
    """Add one value to its channel's sums: s0..s3 float32 (or float64 for the tail), w0..w3 the
    float64 sums of a wide (bfloat16/float32) stored dtype, whose values (up to 3.4e38) square
    beyond float32's range (format.stats.error_figures)."""
    if wide:
        d64 = np.float64(v) - np.float64(ref[c])
        w0[c] += d64
        w1[c] += d64 * d64
    else:
        d = v - ref[c]
        s0[c] += d
        s1[c] += d * d
    if not exact:
        e = v - x
        a = abs(x)
        ae = abs(e)
        top_error[c] = ae if ae > top_error[c] else top_error[c]
        r = ae / (a if a >= floor else floor)  # no branch: the quotient is dropped below the floor
        r = r if a >= floor else np.float32(0.0)
        top_relative[c] = r if r > top_relative[c] else top_relative[c]
        if wide:
            e64 = np.float64(e)
            a64 = np.float64(a)
            w2[c] += e64 * e64
            w3[c] += a64 * a64
        else:
            s2[c] += e * e
            s3[c] += a * a


@jit
def body(src: Any, src_kind: int, out: Any, out_kind: int, stored_kind: int, tokens: int,
         channels: int, stride: int, exact: bool, wide: bool, sums: Any, maxima: Any, first: int,
         last: int) -> None:
    """One pass over a batch.

    src: flat, sample b at ``b * stride`` (samples of a strided batch, e.g. an encoder's tokens
    without the CLS token, are read in place); out: flat ``[B * tokens * channels]`` (unused
    when ``out_kind == SAME``);
    sums: ``[4, B, C]`` float64 (sum of deviations from token 0, of their squares, of error**2, of
    source**2); maxima: ``[3, B, C]`` float32 (source |x| as integer bits, max |error|, max
    relative error) reduced over channels by the caller.
    """
    blocks = (channels + BLOCK - 1) // BLOCK
    head = tokens - tokens % GROUP
    floor = np.float32(REL_ERROR_FLOOR)
    for item in range(first, last):
        b = item // blocks
        c0 = (item % blocks) * BLOCK
        width = min(BLOCK, channels - c0)
        base = b * stride + c0
        out_base = b * tokens * channels + c0
        # One 1-D array per accumulator (not rows of a 2-D one): LLVM then vectorises the channel
        # loop (8 or 16 channels per instruction) instead of running it scalar.
        ref = np.empty(width, np.float32)  # each channel's stored token 0: deviations from it
        for c in range(width):
            ref[c] = stored_value(load(src, base + c, src_kind), stored_kind)
        g0, g1, g2, g3 = (np.zeros(width, np.float32), np.zeros(width, np.float32),
                          np.zeros(width, np.float32), np.zeros(width, np.float32))
        gw0, gw1, gw2, gw3 = (np.zeros(width, np.float64), np.zeros(width, np.float64),
                              np.zeros(width, np.float64), np.zeros(width, np.float64))
        t0, t1, t2, t3 = (np.zeros(width, np.float64), np.zeros(width, np.float64),
                          np.zeros(width, np.float64), np.zeros(width, np.float64))
        tail0, tail1, tail2, tail3 = (np.zeros(width, np.float64), np.zeros(width, np.float64),
                                      np.zeros(width, np.float64), np.zeros(width, np.float64))
        top_bits = np.zeros(width, np.uint32)
        top_error = np.zeros(width, np.float32)
        top_relative = np.zeros(width, np.float32)
        for t in range(tokens):
            # Row views, indexed from 0 by range(): numba then drops its negative-index
            # wraparound, which otherwise keeps the loop scalar (measured 3x slower).
            row = base + t * channels
            out_at = out_base + t * channels
            src_row = src[row:row + width]
            out_row = out[out_at:out_at + width] if out_kind != SAME else out[0:0]
            if t < head:
                for c in range(width):
                    x = load(src_row, c, src_kind)
                    top_bits[c] = max(top_bits[c], f32_bits(x) & np.uint32(0x7FFFFFFF))
                    v = store(x, out_row, c, out_kind, src_row)
                    accumulate(x, v, ref, exact, wide, floor, c, g0, g1, g2, g3, gw0, gw1, gw2, gw3,
                               top_error, top_relative)
                if (t + 1) % GROUP == 0:  # a group ends: fold it into the float64 totals
                    for c in range(width):
                        if wide:
                            t0[c] += gw0[c]
                            t1[c] += gw1[c]
                            t2[c] += gw2[c]
                            t3[c] += gw3[c]
                        else:
                            t0[c] += np.float64(g0[c])
                            t1[c] += np.float64(g1[c])
                            t2[c] += np.float64(g2[c])
                            t3[c] += np.float64(g3[c])
                        g0[c] = g1[c] = g2[c] = g3[c] = 0.0
                        gw0[c] = gw1[c] = gw2[c] = gw3[c] = 0.0
            else:  # the tail: each value straight into float64, as the numpy reference does
                for c in range(width):
                    x = load(src_row, c, src_kind)
                    top_bits[c] = max(top_bits[c], f32_bits(x) & np.uint32(0x7FFFFFFF))
                    v = store(x, out_row, c, out_kind, src_row)
                    accumulate(x, v, ref, exact, wide, floor, c, tail0, tail1, tail2, tail3, tail0, tail1,
                               tail2, tail3, top_error, top_relative)
        for c in range(width):
            sums[0, b, c0 + c] = t0[c] + tail0[c]
            sums[1, b, c0 + c] = t1[c] + tail1[c]
            sums[2, b, c0 + c] = t2[c] + tail2[c]
            sums[3, b, c0 + c] = t3[c] + tail3[c]
            maxima[0, b, c0 + c] = bits_f32(top_bits[c])
            maxima[1, b, c0 + c] = top_error[c]
            maxima[2, b, c0 + c] = top_relative[c]


# One compiled kernel per (source, stored) pair: the encodings are constants there, so the hot
# loop holds no branch on them (a generic kernel measured ~3x slower). Each runs work items
# [first, last) without the GIL; fused_stats splits a batch's items over its own threads. numba's
# parallel=True (prange) compiled the same loop ~1.7x slower per value at 384 channels, and its
# OpenMP team spins on a loaded host.
entry = numba.njit(nogil=True, cache=True, error_model="numpy")


@entry
def f32_f16(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, 0, out, FLOAT16, FLOAT16, tokens, channels, stride, False, False, sums, maxima, first, last)


@entry
def f32_bf16(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, 0, out, BFLOAT16, BFLOAT16, tokens, channels, stride, False, True, sums, maxima, first, last)


@entry
def f16_same(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, FLOAT16, out, SAME, FLOAT16, tokens, channels, stride, True, False, sums, maxima, first, last)


@entry
def f32_same(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, 0, out, SAME, FLOAT32, tokens, channels, stride, True, True, sums, maxima, first, last)


@entry
def bf16_same(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, BFLOAT16, out, SAME, BFLOAT16, tokens, channels, stride, True, True, sums, maxima, first, last)


@entry
def f16_f32(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, FLOAT16, out, FLOAT32, FLOAT32, tokens, channels, stride, True, True, sums, maxima, first, last)


@entry
def bf16_f32(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, BFLOAT16, out, FLOAT32, FLOAT32, tokens, channels, stride, True, True, sums, maxima, first, last)


@entry
def f16_bf16(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, FLOAT16, out, BFLOAT16, BFLOAT16, tokens, channels, stride, False, True, sums, maxima, first, last)


@entry
def bf16_f16(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, BFLOAT16, out, FLOAT16, FLOAT16, tokens, channels, stride, False, False, sums, maxima, first, last)


@entry
def f32_f32(src, out, tokens, channels, stride, sums, maxima, first, last):  # a float64 source, rounded to float32
    body(src, 0, out, FLOAT32, FLOAT32, tokens, channels, stride, False, True, sums, maxima, first, last)


# The same values into a new array (the caller keeps its buffer): the copy rides the one pass.
@entry
def f16_copy(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, FLOAT16, out, COPY, FLOAT16, tokens, channels, stride, True, False, sums, maxima, first, last)


@entry
def bf16_copy(src, out, tokens, channels, stride, sums, maxima, first, last):
    body(src, BFLOAT16, out, COPY, BFLOAT16, tokens, channels, stride, True, True, sums, maxima, first, last)
