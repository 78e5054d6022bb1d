"""A CPU batch in one pass: the cast, the checks and every statistic, fused (numba, optional).

On the CPU, torch or numpy take ~20 passes over a float32 batch (cast, upcast, error, abs,
relative error, squares, group sums...), each through memory: about 0.2 GB/s of float16 output
on one core, a fraction of what a disk takes. The kernel (featurestore.core.fused_kernel) reads
each value once and keeps the rest in registers: the stored bits (float16 / bfloat16 rounded to
nearest even, or a float32 copy), the source's abs max, the per-channel moment sums of the stored
values, the error maxima and the per-channel sums of error**2 and source**2.

Its figures are the numpy reference's (``format.stats.row_stats_numpy``), bit for bit
(tests/test_fused_stats.py): the same sums over groups of ``GROUP`` tokens (float32 for a float16
stored dtype; float64 for bfloat16/float32, whose values square beyond float32's range), float64
over the groups and over a tail, in the same order. A float64 batch's error figures are taken
against its float64 values (``format.stats.error_figures``), not their float32 rounding. Work items are (sample, block of channels), each
owning its outputs, so the thread count changes no bit. numba is the ``numba`` extra: without it
the CPU path is torch's (``core.device_stats``) or numpy's, equal to this one to float32
group-sum rounding (~1e-6 relative).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import numpy as np

from featurestore.core import fork_wait
from featurestore.core.batch import Prepared, check_kind, is_exact, refuse_out_of_range
from featurestore.core.collector_pause import collector_paused
from featurestore.format import dtypes
from featurestore.format.stats import GROUP, RowStats, error_figures

_ENCODING = {"float16": 1, "bfloat16": 2, "float32": 3}  # fused_kernel.FLOAT16 / BFLOAT16 / FLOAT32
_SOURCE = {"float32": 0, "float16": 1, "bfloat16": 2}
# (source, stored) -> kernel name in fused_kernel; stored 0 means "as the source" (no cast).
_KERNELS = {(0, 1): "f32_f16", (0, 2): "f32_bf16", (0, 0): "f32_same", (1, 0): "f16_same",
            (2, 0): "bf16_same", (1, 3): "f16_f32", (2, 3): "bf16_f32", (1, 2): "f16_bf16", (2, 1): "bf16_f16",
            (0, 3): "f32_f32",
            (1, 1): "f16_copy", (2, 2): "bf16_copy"}
_OUT_DTYPE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
_POOL: list[tuple[int, ThreadPoolExecutor]] = []  # (workers, executor), made on first need
_POOL_LOCK = threading.Lock()


@cache
def available() -> bool:
    """numba importable, and not switched off by ``FEATURESTORE_FUSED_STATS=0``."""
    if os.environ.get("FEATURESTORE_FUSED_STATS", "1").strip() == "0":
        return False
    if not _numba_installed():
        return False
    try:  # compiles nothing yet, but numba must find a writable cache (else: set NUMBA_CACHE_DIR)
        with collector_paused():  # numba's import: half its CPU went to the cyclic collector
            importlib.import_module("featurestore.core.fused_kernel")
    except Exception as error:  # a broken numba install must not stop a write: torch/numpy do it
        warnings.warn(f"featurestore: the fused CPU statistics kernel is off ({error}); statistics "
                      "run as torch or numpy passes (slower). Set NUMBA_CACHE_DIR to a writable "
                      "directory if the error is about caching", RuntimeWarning, stacklevel=2)
        return False
    return True


def threads() -> int:
    """Threads for the kernel: ``FEATURESTORE_STATS_THREADS``, default min(8, cores).

    All cores, unlike torch's passes (cores // 2): these are plain threads, each on its own work
    items, with no OpenMP team to spin on a loaded host. On the 2-core test host a second thread
    measured as fast or faster in `bench write` and `bench extract`. The figures never depend on it.
    """
    from featurestore.core.device_stats import threads_setting

    return threads_setting(max(1, min(8, os.cpu_count() or 1)))


def prepare(source: np.ndarray, kind: str, logical: str, channels: int, start: int, *, threads: int,
            private: bool = False, allocate: Callable[[tuple[int, ...], Any], np.ndarray] = np.empty) -> Prepared:
    """Check, cast and measure a host batch ``[B, *sample_shape]`` (bfloat16 as uint16 bits).

    ``private``: the stored array must not share the caller's memory (the caller may reuse it
    once ``write`` returns). When no cast is needed the kernel then writes the copy in its one
    pass, instead of the writer copying afterwards. ``allocate(shape, dtype)`` makes the stored
    array (the writer's recycled buffers).

    Raises NonFiniteValues / Float16Overflow / NonFiniteValues-for-bfloat16 naming the rows, and
    then nothing was stored: the stored bytes go to a new array, never into ``source``.
    """
    from featurestore.core import fused_kernel

    check_kind(kind)
    count = len(source)
    wide_source = source
    rows_text = f"samples [{start}, {start + count})"
    if kind == "float64":  # checked with its own abs max, then rounded to float32 (the error's
        wide_max = dtypes.row_abs_max(source)  # reference)
        refuse_out_of_range(source, kind, logical, wide_max, rows_text)
        source = source.astype(np.float32)
    source, stride = _samples_in_place(source)
    src_kind = _SOURCE["float32" if kind == "float64" else kind]
    sample = int(np.prod(source.shape[1:], dtype=np.int64))
    channels = channels or 1
    tokens = sample // channels if count else 0
    exact = is_exact(kind, logical)
    same = kind == logical and not private and source.flags.c_contiguous
    out = source if same else allocate(tuple(source.shape), _OUT_DTYPE[logical])
    sums = np.zeros((4, count, channels), np.float64)
    maxima = np.zeros((3, count, channels), np.float32)
    if count and tokens:
        flat = _numba_view(_span(source, stride))
        kernel = getattr(fused_kernel, _KERNELS[(src_kind, 0 if same else _ENCODING[logical])])
        # Nothing is written when no cast is needed: an empty array of the same type then
        # (the source may be read-only).
        target = np.empty(0, flat.dtype) if same else _numba_view(out)
        items = count * -(-channels // fused_kernel.BLOCK)
        _run(kernel, (flat, target, tokens, channels, stride, sums, maxima), items, threads)
    if kind == "float64":
        abs_max = wide_max  # the float64 source's own, as on the other paths
    else:
        top = maxima[0].view(np.uint32).max(axis=1) if count else np.zeros(0, np.uint32)
        abs_max = np.where(top >= 0x7F800000, np.inf, top.view(np.float32).astype(np.float64))
        refuse_out_of_range(source, kind, logical, abs_max, rows_text)
    rows = RowStats.zeros(count, channels)
    rows.abs_max[:] = abs_max
    if count:
        first, second, sq_error, sq_source = sums
        rows.mean[:] = _reference(out, count, channels, logical) + first / max(1, tokens)
        rows.m2[:] = np.maximum(second - first * first / max(1, tokens), 0.0)
        if kind == "float64":
            # The kernel measured the error against the float32 rounding of the source; the
            # report is about the float64 -> stored cast (rare input: numpy passes are fine).
            figures = error_figures(wide_source.reshape(count, tokens, channels),
                                    dtypes.stored_as_float32(out, logical).reshape(count, tokens, channels),
                                    logical)
            rows.max_abs_error[:], rows.max_rel_error[:], rows.sq_error[:], rows.sq_source[:] = figures
        elif not exact:
            rows.max_abs_error[:] = maxima[1].max(axis=1)
            rows.max_rel_error[:] = maxima[2].max(axis=1)
            rows.sq_error[:] = sq_error.sum(axis=1)
            rows.sq_source[:] = sq_source.sum(axis=1)
    return Prepared(out, rows, kind, aliases_source=same and np.shares_memory(out, wide_source))


def warm_up(kind: str, logical: str, *, private: bool = False) -> None:
    """Import numba and load (or compile) the kernel that host batches of ``kind`` stored as
    ``logical`` will use, so the first ``write`` does not wait for it: ~0.3 s on the test host,
    a third of `bench extract`'s 512-image run when it sat on the critical path. Extraction runs
    this on a thread while its image workers start. Any failure is left for that first write,
    which meets it again and reports it (or falls back, as ``available`` says)."""
    try:
        if kind not in _SOURCE or logical not in _ENCODING or not available():
            return
        sample = np.zeros((1, GROUP, 8), np.uint16 if kind == "bfloat16" else kind)
        prepare(sample, kind, logical, 8, 0, threads=1, private=private)
    except Exception:  # noqa: BLE001 - see the docstring: the first write reports it
        pass


_WARMING: dict[tuple[str, str], threading.Thread] = {}


def warm_up_soon(kind: str, logical: str) -> None:
    """:func:`warm_up` on a thread, once per process (again in a forked child, whose copy of the
    thread is gone), without importing numba here: ~0.4 s on a quiet 2-core host, 1-3 s on a
    loaded one, that a first ``write`` otherwise spends before its first batch. Measuring a
    process's first batches with the numpy reference instead (the same bits) was tried and
    measured slower: ~14x the kernel's time per batch, on cores the load needs too."""
    if (os.environ.get("FEATURESTORE_FUSED_STATS", "1").strip() == "0" or not _numba_installed()
            or kind not in _SOURCE or logical not in _ENCODING):
        return
    with _POOL_LOCK:
        thread = _WARMING.get((kind, logical))
        if (kind, logical) in _WARMED or (thread is not None and thread.is_alive()):
            return
        # Not a daemon: the interpreter waits for it before it finalizes. A daemon thread still
        # loading (LLVM calls back into Python) when it does is ended inside C++ frames, and the
        # process aborts ("terminate called without an active exception") after its work is done.
        thread = _WARMING[(kind, logical)] = threading.Thread(
            target=_warm, args=(kind, logical), name="featurestore-warm-up", daemon=False)
        thread.start()


_WARMED: set[tuple[str, str]] = set()  # warm-ups finished (a fork's child inherits the kernels)


def _warm(kind: str, logical: str) -> None:
    # The kernel of a batch the writer copies (its default) first: a first write waits for the
    # load it needs, then the one of a donated batch (no cast: another kernel).
    warm_up(kind, logical, private=True)
    if kind == logical:
        warm_up(kind, logical)
    _WARMED.add((kind, logical))


@cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def _run(kernel: Any, args: tuple[Any, ...], items: int, threads: int) -> None:
    """Run work items [0, items) on up to ``threads`` threads (the kernel drops the GIL). Items
    own their outputs, so how they are split changes no bit."""
    threads = max(1, min(threads, items))
    if threads == 1:
        kernel(*args, 0, items)
        return
    bounds = [items * i // threads for i in range(threads + 1)]
    pool = _pool(threads - 1)
    futures = [pool.submit(kernel, *args, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
    kernel(*args, bounds[0], bounds[1])  # the caller's thread takes the first share
    for future in futures:
        future.result()


run_items = _run  # the int8 kernel's share of the same threads (core.quantize_int8)


def _after_fork_in_child() -> None:
    global _POOL_LOCK
    # A forked child inherits the pool without its threads: work given to it would wait forever.
    _POOL.clear()
    _POOL_LOCK = threading.Lock()


def _before_fork() -> None:
    fork_wait.wait_for_loads(list(_WARMING.values()))  # why: featurestore.core.fork_wait


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _pool(workers: int) -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL or _POOL[0][0] < workers:
            if _POOL:
                _POOL.pop()[1].shutdown(wait=False)
            _POOL.append((workers, ThreadPoolExecutor(workers, thread_name_prefix="featurestore-fused")))
        return _POOL[0][1]


def _samples_in_place(source: np.ndarray) -> tuple[np.ndarray, int]:
    """``source`` and its sample stride in elements: read in place when each sample is
    contiguous (a slice of tokens, e.g. without the CLS token), else a contiguous copy."""
    if source.ndim < 2 or len(source) < 2:
        source = np.ascontiguousarray(source)
        return source, int(np.prod(source.shape[1:], dtype=np.int64))
    sample = source[0]
    stride, rest = divmod(source.strides[0], source.itemsize)
    if sample.flags.c_contiguous and not rest and stride >= sample.size:
        return source, stride
    source = np.ascontiguousarray(source)
    return source, int(np.prod(source.shape[1:], dtype=np.int64))


def _span(source: np.ndarray, stride: int) -> np.ndarray:
    """A flat view from the first sample's first value to the last sample's last value."""
    if source.flags.c_contiguous:
        return source.reshape(-1)
    length = (len(source) - 1) * stride + int(np.prod(source.shape[1:], dtype=np.int64))
    return np.lib.stride_tricks.as_strided(source, shape=(length,), strides=(source.itemsize,),
                                           writeable=source.flags.writeable)


def _numba_view(values: np.ndarray) -> np.ndarray:
    """Flat, and float16 as its uint16 bits (numba has no float16 on the CPU)."""
    flat = values.reshape(-1)
    return flat.view(np.uint16) if flat.dtype == np.float16 else flat


def _reference(stored: np.ndarray, count: int, channels: int, logical: str) -> np.ndarray:
    """Each sample's stored token 0 as float64 (the deviations' origin)."""
    first_token = stored.reshape(count, -1)[:, :channels]
    return dtypes.stored_as_float32(first_token, logical).astype(np.float64)
