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
  would split across threads — over groups of ``GROUP`` values in float32 then in float64. On
  the CPU the order depends only on the shape (pinned across thread counts and batch cuts by
  tests/test_device_stats.py). On CUDA the kernels sum in another order: means, stds and rms
  errors agree with the CPU's within a relative 1e-6 (float32 group sums), maxima and bytes
  exactly (``featurestore bench device-stats`` measures it on a GPU).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore.core.batch import Prepared, bfloat16_overflow, check_kind, float16_overflow, is_exact, non_finite
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


# Rows are processed in blocks of about this many values: bounded scratch (64 MiB of float32 at
# most on the device) whatever the batch size. Blocks hold whole rows, so results do not change.
BLOCK_VALUES = 1 << 22


def source_kind(tensor: torch.Tensor) -> str:
    return check_kind(_dtypes()[1].get(tensor.dtype) or str(tensor.dtype).removeprefix("torch."))


def prepare(source: torch.Tensor, logical: str, channels: int, start: int) -> Prepared:
    """Check, cast and measure ``source`` ([B, *sample_shape]) on its device for ``logical``.

    Raises NonFiniteValues / Float16Overflow (naming the rows) before anything is returned.
    """
    import torch

    with torch.inference_mode():  # also in a writer thread: no autograd records, no version counters
        return _prepare(source, logical, channels, start)


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
    if kind == "float64":  # rounded to float32 first; the error is reported against that
        x = x.to(torch.float32)
    stored = x if x.dtype == target else x.to(target)
    tokens = flat.shape[1] // channels if channels else 0
    sums = torch.zeros((4, count), dtype=torch.float64, device=x.device)  # error figures per row
    mean = torch.zeros((count, channels), dtype=torch.float64, device=x.device)
    m2 = torch.zeros_like(mean)
    step = max(1, BLOCK_VALUES // max(1, flat.shape[1]))
    for lo in range(0, count, step):
        hi = min(count, lo + step)
        values = stored[lo:hi].reshape(hi - lo, tokens, channels)
        mean[lo:hi], m2[lo:hi] = _moments(values)
        if not exact:
            _errors(x[lo:hi].reshape(hi - lo, tokens, channels), values, sums[:, lo:hi])
    host = stored.cpu() if stored.device.type != "cpu" else stored
    if host.dtype == torch.bfloat16:
        array = host.view(torch.int16).numpy().view(np.uint16)
    else:
        array = host.numpy()
    partials = sums.cpu().numpy()
    rows = RowStats(abs_max, partials[0], partials[1], partials[2], partials[3],
                    mean.cpu().numpy(), m2.cpu().numpy())
    return Prepared(array, rows, kind, aliases_source=stored.data_ptr() == source.data_ptr()
                    and source.device.type == "cpu")


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
        raise non_finite(int(torch.isnan(flat).sum()), int(torch.isinf(flat).sum()), rows)
    if logical == "float16" and largest > dtypes.FLOAT16_MAX:
        raise float16_overflow(int((flat.abs() > dtypes.FLOAT16_MAX).sum()), largest, rows)
    if logical == "bfloat16" and largest >= dtypes.BFLOAT16_ROUNDS_TO_INF:
        raise bfloat16_overflow(int((flat.abs() >= dtypes.BFLOAT16_ROUNDS_TO_INF).sum()), largest, rows)


def _moments(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample, per-channel mean and M2 of stored values ``[n, T, C]``, as float64.

    Deviations from each sample's first token keep the sums of squares from cancelling when a
    channel's mean is large against its spread. float16 deviations square below 1.8e10, safe in
    float32; bfloat16/float32 values (up to ~3.4e38) are worked in float64.
    """
    import torch

    work = torch.float32 if values.dtype == torch.float16 else torch.float64
    tokens = values.shape[1]
    if tokens == 0:
        zeros = torch.zeros((values.shape[0], values.shape[2]), dtype=torch.float64, device=values.device)
        return zeros, zeros.clone()
    reference = values[:, :1, :].to(work)
    deviation = torch.sub(values.to(work), reference)
    first = group_sums(deviation)
    second = group_sums(deviation.mul_(deviation))
    mean = reference[:, 0, :].to(torch.float64) + first / tokens
    m2 = (second - first * first / tokens).clamp_(min=0.0)
    return mean, m2


def _errors(source: torch.Tensor, stored: torch.Tensor, out: torch.Tensor) -> None:
    """Per-sample max |error|, max relative error, sum error**2, sum source**2 into ``out`` [4, n]."""
    import torch

    n = len(source)
    src = source.to(torch.float32)
    error = stored.to(torch.float32, copy=True).sub_(src)  # copy: stored may be float32 already
    low, high = torch.aminmax(error.view(n, -1), dim=1)
    out[0] = torch.maximum(high, low.neg()).to(torch.float64)
    magnitude = src.abs()
    relative = torch.where(magnitude >= REL_ERROR_FLOOR, error.abs() / magnitude.clamp(min=REL_ERROR_FLOOR), 0.0)
    out[1] = relative.view(n, -1).amax(dim=1).to(torch.float64)
    out[2] = group_sums(error.mul_(error)).sum(dim=1)
    out[3] = group_sums(magnitude.mul_(magnitude)).sum(dim=1)


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
