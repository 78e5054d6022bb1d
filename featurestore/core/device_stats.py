"""Cast, precision checks and per-sample statistics of a batch, in torch, where the batch is.

During extraction the features sit on the encoder's device. Everything the writer needs from the
full-precision values (the non-finite and overflow checks, the cast to the stored dtype, the
quantization error against the source, abs max, the per-channel moments of the stored values) is
computed there, vectorised, and only the stored-dtype bytes plus ``[B]`` / ``[B, C]`` float64
partials cross to the host. On the CPU the same code runs on torch's threads.

torch is imported inside the functions (the first batch pays it), so importing the core, this
module included, never loads torch.

Determinism: every figure is computed per sample (rows never mix), so a chunk's statistics row,
folded from its samples in row order (``format.stats.fold_rows``), does not depend on the batch
cut, the writer count or a resume. Within a sample:

* maxima (abs max, max abs/relative error) and the stored bytes are exact (IEEE round to nearest
  even; an integer max over sign-cleared bits), identical on every device;
* sums are taken per (sample, channel) — never into a single output, which torch's CPU reduction
  would split across threads — over groups of ``GROUP`` values, then in float64. The groups are
  float32 where the stored dtype is float16; for bfloat16/float32 (values up to 3.4e38, whose
  squares overflow float32) and for float64 sources they are float64. On
  the CPU the order depends only on the shape (pinned across thread counts and batch cuts by
  tests/test_device_stats.py). On CUDA the kernels sum in another order: on an H100, sums of
  squares agreed with the CPU's within 1e-8 relative, M2 within 7.5e-7, means within 6e-7 (1e-4
  for means near zero); bytes and maxima exactly (``featurestore bench extract --device cuda``
  prints these figures; docs/EXTRACT.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore.core.batch import (
    FLOAT32_ROUNDS_TO_INF,
    Prepared,
    bfloat16_overflow,
    check_kind,
    float16_overflow,
    float32_overflow,
    in_rows,
    is_exact,
    non_finite,
)
from featurestore.format import dtypes
from featurestore.format.stats import GROUP, REL_ERROR_FLOOR, RowStats

if TYPE_CHECKING:
    import torch



@cache
def _dtypes() -> tuple[dict[str, Any], dict[Any, str], dict[Any, tuple[Any, int, int]]]:
    """(logical -> torch dtype, torch dtype -> kind, bit specs), built on the first batch."""
    import torch

    logical = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    kinds = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
             torch.float64: "float64"}
    # Sign-cleared bit patterns order like magnitudes, and every pattern at or above the
    # exponent's all-ones value is Inf or NaN: one integer max gives both the abs max and the
    # finiteness check.
    bits = {
        torch.float16: (torch.int16, 0x7FFF, 0x7C00),
        torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
        torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
    }
    return logical, kinds, bits


# Values per tile: on the CPU small enough that a tile's passes stay in cache (2 MiB of float32);
# on an accelerator large enough to amortise kernel launches, and a bound on its scratch memory.
TILE_VALUES = 1 << 19
DEVICE_TILE_VALUES = 1 << 24


def source_kind(tensor: torch.Tensor) -> str:
    return check_kind(_dtypes()[1].get(tensor.dtype) or str(tensor.dtype).removeprefix("torch."))


def prepare(source: torch.Tensor, logical: str, channels: int, start: int) -> Prepared:
    """Check, cast and measure ``source`` ([B, *sample_shape]) on its device for ``logical``.

    Raises NonFiniteValues / Float16Overflow (naming the rows) before anything is returned.
    """
    if source.device.type == "cpu":
        # On the stats thread: its own torch thread count, set once, not toggled per batch
        # (re-sizing OpenMP's team costs milliseconds on a many-core host).
        return _stats_thread().submit(_run, source, logical, channels, start, True).result()
    return _run(source, logical, channels, start, False)


def _run(source: torch.Tensor, logical: str, channels: int, start: int, cap: bool) -> Prepared:
    import torch

    if cap and torch.get_num_threads() != stats_threads():
        torch.set_num_threads(stats_threads())  # this thread's own OpenMP team only
    with torch.inference_mode():  # also in a writer thread: no autograd records, no version counters
        return _prepare(source, logical, channels, start)


_STATS_THREAD: list[ThreadPoolExecutor] = []


# A forked child inherits the executor without its thread: work given to it would wait forever.
os.register_at_fork(after_in_child=_STATS_THREAD.clear)


def _stats_thread() -> ThreadPoolExecutor:
    if not _STATS_THREAD:
        _STATS_THREAD.append(ThreadPoolExecutor(1, thread_name_prefix="featurestore-stats"))
    return _STATS_THREAD[0]


def stats_threads() -> int:
    """torch intra-op threads for CPU statistics: ``FEATURESTORE_STATS_THREADS``, default
    min(8, cores // 2) (at least 1).

    Half the cores: the put threads, the caller and (in extraction) the encoder want the others.
    On a loaded 2-core host 2 intra-op threads measured 10x slower than 1 (OpenMP barriers across
    descheduled threads); on a quiet 16-core host 8 threads ~3x faster than 1 for float32 input.
    CPU statistics run on one dedicated thread whose OpenMP team has this size, so the caller's
    (and the encoder's) own thread count is untouched. The figures do not depend on it (tests).
    """
    return threads_setting(max(1, min(8, (os.cpu_count() or 1) // 2)))


def threads_setting(default: int) -> int:
    """``FEATURESTORE_STATS_THREADS`` when set to a whole number (at least 1), else ``default``:
    one variable for both CPU statistics paths, each with its own default."""
    value = os.environ.get("FEATURESTORE_STATS_THREADS", "")
    if value.strip().isdigit():
        return max(1, int(value))
    return default


def _prepare(source: torch.Tensor, logical: str, channels: int, start: int) -> Prepared:
    import torch

    kind = source_kind(source)
    x = source.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    count = len(x)
    flat = x.reshape(count, -1)
    # One small device-to-host copy (and sync) before the cast: a refused batch stores nothing.
    abs_max = _row_abs_max(flat).cpu().numpy()
    _check_range(flat, abs_max, kind, logical, f"samples [{start}, {start + count})")
    target = _dtypes()[0][logical]
    exact = is_exact(kind, logical)
    tokens = flat.shape[1] // channels if channels else 0
    # float64 is rounded to float32 first (as on the other paths); the error is measured against
    # the float64 values themselves
    source = x.reshape(count, tokens, channels)
    if kind == "float64":
        x = x.to(torch.float32)
    stored = x if x.dtype == target else x.to(target)
    shaped = stored.reshape(count, tokens, channels)
    zeros = torch.zeros((count, channels), dtype=torch.float64, device=x.device)
    first, second, sq_error, sq_source = zeros, zeros.clone(), zeros.clone(), zeros.clone()
    # abs, relative; float64 for a float64 source (its own error), else float32 (exact)
    max_error = torch.zeros((2, count), dtype=_error_dtype(source.dtype), device=x.device)
    reference = shaped[:, :1, :].to(_work(shaped.dtype))
    for rows, span in _tiles(count, tokens, channels, x.device.type):
        values = shaped[rows, span]
        a, b = _moment_sums(values, reference[rows])
        first[rows] += a
        second[rows] += b
        if not exact:
            e, r, sq_e, sq_s = _errors(source[rows, span], values, wide=logical != "float16")
            torch.maximum(max_error[0, rows], e, out=max_error[0, rows])
            torch.maximum(max_error[1, rows], r, out=max_error[1, rows])
            sq_error[rows] += sq_e
            sq_source[rows] += sq_s
    mean = reference[:, 0, :].to(torch.float64) + first / max(1, tokens)
    m2 = (second - first * first / max(1, tokens)).clamp_(min=0.0)
    host = stored.cpu() if stored.device.type != "cpu" else stored
    if host.dtype == torch.bfloat16:
        array = host.view(torch.int16).numpy().view(np.uint16)
    else:
        array = host.numpy()
    maxima = max_error.to(torch.float64).cpu().numpy()
    rows = RowStats(abs_max, maxima[0], maxima[1], sq_error.sum(dim=1).cpu().numpy(),
                    sq_source.sum(dim=1).cpu().numpy(), mean.cpu().numpy(), m2.cpu().numpy())
    return Prepared(array, rows, kind, aliases_source=stored.data_ptr() == x.data_ptr()
                    and x.device.type == "cpu")


def _row_abs_max(flat: torch.Tensor) -> torch.Tensor:
    """Largest |value| of each row as float64; inf for a row holding Inf or NaN."""
    import torch

    if flat.shape[1] == 0:
        return torch.zeros(len(flat), dtype=torch.float64, device=flat.device)
    spec = _dtypes()[2].get(flat.dtype)
    if spec is None:  # float64
        top = flat.abs().amax(dim=1)
        return torch.where(torch.isfinite(top), top, torch.inf)
    bits_dtype, mask, non_finite = spec
    bits = torch.bitwise_and(flat.view(bits_dtype), mask).amax(dim=1)
    top = bits.view(flat.dtype).to(torch.float64)
    return torch.where(bits >= non_finite, torch.inf, top)


def _check_range(flat: torch.Tensor, abs_max: np.ndarray, kind: str, logical: str, rows: str) -> None:
    import torch

    largest = float(abs_max.max()) if len(abs_max) else 0.0
    if not np.isfinite(largest):
        raise non_finite(int(torch.isnan(flat).sum()), int(torch.isinf(flat).sum()), in_rows(rows, ~np.isfinite(abs_max)))
    if logical == "float16" and largest > dtypes.FLOAT16_MAX:
        raise float16_overflow(int((flat.abs() > dtypes.FLOAT16_MAX).sum()), largest,
                               in_rows(rows, abs_max > dtypes.FLOAT16_MAX))
    if logical == "bfloat16" and largest >= dtypes.BFLOAT16_ROUNDS_TO_INF:
        raise bfloat16_overflow(int((flat.abs() >= dtypes.BFLOAT16_ROUNDS_TO_INF).sum()), largest,
                                in_rows(rows, abs_max >= dtypes.BFLOAT16_ROUNDS_TO_INF))
    if kind == "float64" and largest >= FLOAT32_ROUNDS_TO_INF:  # float32 is every cast's first step
        raise float32_overflow(int((flat.abs() >= FLOAT32_ROUNDS_TO_INF).sum()), largest,
                               in_rows(rows, abs_max >= FLOAT32_ROUNDS_TO_INF))


def _work(stored: torch.dtype) -> torch.dtype:
    """float16 deviations square below 1.8e10, safe in float32; bfloat16/float32 values (up to
    ~3.4e38) are worked in float64."""
    import torch

    return torch.float32 if stored == torch.float16 else torch.float64


def _tiles(count: int, tokens: int, channels: int, device: str) -> Iterator[tuple[slice, slice]]:
    """(rows, tokens) tiles of about TILE_VALUES values, in an order fixed by the sample shape.

    Small tiles keep the CPU's passes in cache; a sample larger than a tile is cut along its
    tokens at multiples of GROUP, the same cuts for every batch.
    """
    budget = TILE_VALUES if device == "cpu" else DEVICE_TILE_VALUES
    row_values = max(1, tokens * channels)
    if row_values <= budget or tokens <= GROUP:
        step = max(1, budget // row_values)
        for lo in range(0, count, step):
            yield slice(lo, min(count, lo + step)), slice(0, tokens)
        return
    span = max(GROUP, budget // max(1, channels) // GROUP * GROUP)
    for row in range(count):
        for lo in range(0, tokens, span):
            yield slice(row, row + 1), slice(lo, min(tokens, lo + span))


def _moment_sums(values: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample, per-channel sums of (value - reference) and its square, as float64.

    Deviations from each sample's first token keep the sums of squares from cancelling when a
    channel's mean is large against its spread.
    """
    import torch

    deviation = torch.sub(values.to(reference.dtype), reference)
    first = group_sums(deviation)
    return first, group_sums(deviation.mul_(deviation))


def _error_dtype(source: torch.dtype) -> torch.dtype:
    import torch

    return torch.float64 if source == torch.float64 else torch.float32


def _errors(source: torch.Tensor, stored: torch.Tensor, *, wide: bool) -> tuple[torch.Tensor, ...]:
    """Per-sample max |error| and max relative error (exact: float32, or float64 for a float64
    source), per-sample per-channel sums of error**2 and source**2 (float64).

    ``wide``: the stored dtype reaches 3.4e38 (bfloat16, float32), whose squares overflow
    float32, so errors and magnitudes are squared in float64 (format.stats.error_figures)."""
    import torch

    n = len(source)
    work = _error_dtype(source.dtype)
    src = source.to(work)
    error = stored.to(work, copy=True).sub_(src)  # copy: stored may be float32 already
    low, high = torch.aminmax(error.view(n, -1), dim=1)
    magnitude = src.abs()
    relative = torch.where(magnitude >= REL_ERROR_FLOOR, error.abs() / magnitude.clamp(min=REL_ERROR_FLOOR), 0.0)
    if wide or work == torch.float64:
        error = error.to(torch.float64)  # a new tensor unless already float64: squared in place below
        magnitude = magnitude.to(torch.float64)
    return (torch.maximum(high, low.neg()), relative.view(n, -1).amax(dim=1),
            group_sums(error.mul_(error)), group_sums(magnitude.mul_(magnitude)))


def group_sums(values: torch.Tensor) -> torch.Tensor:
    """``[n, T, C]`` -> per-sample, per-channel sums ``[n, C]`` in float64, GROUP tokens at a time.

    Every output is one (sample, channel): torch's CPU reductions then give each output to one
    thread whole, in an order fixed by the shape, so thread counts do not change the sums.
    """
    import torch

    n, tokens, channels = values.shape
    head = tokens - tokens % GROUP
    total = torch.zeros((n, channels), dtype=torch.float64, device=values.device)
    if head:
        groups = values[:, :head].reshape(n, head // GROUP, GROUP, channels).sum(dim=2)
        total += groups.sum(dim=1, dtype=torch.float64)
    if head < tokens:
        total += values[:, head:].sum(dim=1, dtype=torch.float64)
    return total
