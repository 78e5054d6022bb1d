"""int8 batches into float batches, for both loaders' transfers (docs/LOADER.md "int8 splits").

An int8 split stores codes and float32 scales: a dense row's values are ``codes[r] *
scales[r // chunk_rows]``, a bag's ``codes * scales[bag]`` (format.int8). The loaders read the codes
at their stored width (a quarter of float32's bytes) and dequantize only where the batch is made:

* CPU: :func:`into` multiplies the gathered codes into the batch handed out: float32 and float16
  batches in one pass of a numba kernel (core.int8_dequant_kernel, no temporary; numpy's formula
  with its float32 product and gathered scales was measured at ~2x a float16 split's upcast) once
  a process has dequantized enough to pay for loading it (:data:`WARM_AFTER_VALUES`); before
  that, other dtypes, and every batch without numba, in numpy blocks of rows (one block of
  gathered scales as the only float32 temporary, not the batch).
* CUDA: a dense split's scales table goes to the device once when it is small
  (:data:`DEVICE_TABLE_BYTES`), and then only each row's chunk crosses with the codes; a larger
  table sends the scale rows each batch needs, once each (:func:`batch_scales`), in the host slot
  beside the codes (:class:`ChunkScales`). :func:`on_device` multiplies there, the int8 -> float
  upcast inside the multiply.

Either way each value is ``float32(code * scale)``, then rounded once to the batch's dtype: the
values ``FeatureArray.read_numpy(dtype="float32")`` (and ``"float16"``) give.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import threading
import warnings
from typing import Any

import numpy as np
import torch

from featurestore.core import fork_wait
from featurestore.core.collector_pause import collector_paused
from featurestore.format import int8

BLOCK_BYTES = 1 << 20  # float32 scales gathered per block of a shuffled batch (stays in cache)
# A dense split's whole scales table is kept on the device up to this size (it is 4 / chunk_rows
# of the codes' bytes: a split of up to ~8 GiB of codes in 128-row chunks): a shuffled batch then
# sends 8 bytes a row, not a float32 scales row per chunk it touches (up to 4x its codes' bytes).
DEVICE_TABLE_BYTES = 256 << 20
NUMPY_OUT = (torch.float32, torch.float16)  # dtypes format.int8 writes into directly
# Rent or buy: numba's import and the kernel's load from its cache take ~0.5 s of a core (a few
# seconds on a busy host), about numpy's time for this many values. A process starts the load once
# numpy has dequantized as many (kernel-shaped batches), so one that stops sooner never pays it
# (a fresh process's one epoch: measured 2x slower with the load beside it) and a longer one pays
# at most about what it had already spent.
WARM_AFTER_VALUES = 256 << 20
# An epoch known to dequantize this many values buys at once: the load overlaps its first reads and
# every batch after it takes the kernel (a fresh process's cold epoch at [1024, 3072], 3.2 Gi values:
# 1.25x -> 1.31x float16's samples/s, 30 % less CPU). A shorter one rents, as above.
WARM_AT_START_VALUES = 4 * WARM_AFTER_VALUES


def into(codes: np.ndarray, groups: np.ndarray, table: np.ndarray, out: torch.Tensor, *,
         threads: int = 1) -> torch.Tensor:
    """``out[r] = codes[r] * table[groups[r]]`` computed in float32, stored in ``out``'s dtype.

    ``codes``: int8 ``[n, *S]``; ``groups``: each row's scale row (a dense row's chunk, a bag's
    position); ``table``: float32 ``[g, *S]``; ``out``: a CPU tensor ``[n, *S]``. float32 and
    float16 outputs take the one-pass numba kernel (:mod:`featurestore.core.int8_dequant_kernel`)
    when it is loaded and the arrays are C-contiguous, on ``threads`` threads (the loaders call it
    from each of their read threads: 1); anything else, and a process's first
    :data:`WARM_AFTER_VALUES` values and those while the kernel loads (:func:`warm_up_soon`),
    the numpy formula in blocks of rows. The same bits either way."""
    n = len(codes)
    if n == 0:
        return out
    if out.dtype in NUMPY_OUT and _kernel_fits(codes, groups, table, out):
        kernels = _STATE.get("kernels")
        if kernels is not None and _run_kernel(kernels, codes, groups, table, out, threads):
            return out
        _STATE["numpy_values"] = _STATE.get("numpy_values", 0) + codes.size  # unlocked: a tally
        if _STATE["numpy_values"] >= WARM_AFTER_VALUES:
            warm_up_soon()
    return numpy_into(codes, groups, table, out)


def numpy_into(codes: np.ndarray, groups: np.ndarray, table: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """:func:`into` with numpy (format.int8.dequantize_into) in blocks of rows: any dtype and
    strides, and the reference the kernel's bits are tested against."""
    n = len(codes)
    if n == 0:
        return out
    direct = out.dtype in NUMPY_OUT
    target = out.numpy() if direct else None
    step = max(1, BLOCK_BYTES // max(4 * (codes.size // n), 1))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        if target is not None:
            int8.dequantize_into(codes[lo:hi], groups[lo:hi], table, target[lo:hi])
        else:  # bfloat16, float64: the float32 values, then torch's one rounding to the dtype
            block = int8.dequantize_into(codes[lo:hi], groups[lo:hi], table, np.empty(codes[lo:hi].shape, np.float32))
            out[lo:hi].copy_(torch.from_numpy(block))
    return out


def _kernel_fits(codes: np.ndarray, groups: np.ndarray, table: np.ndarray, out: torch.Tensor) -> bool:
    """Whether the kernel's flat indexing applies: C-contiguous int8 codes, float32 table and
    output of matching shapes (every group a row of the table is the kernel's own check)."""
    return (codes.dtype == np.int8 and table.dtype == np.float32 and out.device.type == "cpu"
            and codes.flags.c_contiguous and table.flags.c_contiguous and out.is_contiguous()
            and tuple(out.shape) == codes.shape and table.shape[1:] == codes.shape[1:]
            and groups.ndim == 1 and len(groups) == len(codes) and groups.dtype.kind in "iu")


def _run_kernel(kernels: Any, codes: np.ndarray, groups: np.ndarray, table: np.ndarray, out: torch.Tensor,
                threads: int) -> bool:
    """The kernel into ``out``; False (nothing written) when a group is not a row of the table:
    numpy's formula keeps its own answer there (an IndexError, a negative index's wrap)."""
    n = len(codes)
    groups = groups.astype(np.int64, copy=False)
    if not kernels.groups_fit(groups, len(table)):
        return False
    flat_out = out.numpy().reshape(n, -1)
    if out.dtype == torch.float16:
        kernel, flat_out = kernels.to_float16, flat_out.view(np.uint16)
    else:
        kernel = kernels.to_float32
    args = (codes.reshape(n, -1), groups, table.reshape(len(table), -1), flat_out)
    if threads <= 1 or n < 2:
        kernel(*args, 0, n)
        return True
    from featurestore.core import fused_stats

    # Its thread pool: the kernel drops the GIL, and rows own their outputs (no bit changes).
    fused_stats.run_items(kernel, args, n, threads)
    return True


_STATE: dict[str, Any] = {}  # "kernels": the loaded module; "thread": its load; "numpy_values": the tally
_LOCK = threading.Lock()


def warm_up_soon() -> None:
    """Load the kernel on a thread, once per process (again in a forked child, whose copy of the
    thread is gone). Nothing without numba or with ``FEATURESTORE_FUSED_STATS=0`` (the switch of
    the writer's kernels too): the numpy formula stays."""
    if ("kernels" in _STATE or os.environ.get("FEATURESTORE_FUSED_STATS", "1").strip() == "0"
            or not _numba_installed()):
        return
    with _LOCK:
        thread = _STATE.get("thread")
        if _STATE.get("failed") or (thread is not None and thread.is_alive()):
            return
        # Not a daemon: the process waits for the load before it finalizes (fused_stats.warm_up_soon).
        thread = _STATE["thread"] = threading.Thread(target=_warm, name="featurestore-dequantize-warm-up",
                                                     daemon=False)
        thread.start()


def warm_up_for(values: int) -> None:
    """Start the kernel's load now if an epoch about to run will dequantize at least
    :data:`WARM_AT_START_VALUES` values (the loaders call it as an epoch starts)."""
    if values >= WARM_AT_START_VALUES:
        warm_up_soon()


def wait_warm(timeout: float | None = None) -> bool:
    """Start the warm-up if needed and wait for it: whether the kernel is in use now."""
    warm_up_soon()
    thread = _STATE.get("thread")
    if thread is not None:
        thread.join(timeout)
    return "kernels" in _STATE


def _before_fork() -> None:
    # A DataLoader worker forked as an epoch starts: why in featurestore.core.fork_wait.
    fork_wait.wait_for_loads([_STATE.get("thread")])


os.register_at_fork(before=_before_fork)


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def _warm() -> None:
    try:
        with collector_paused():  # numba's import: half the load's CPU went to the collector
            kernels = importlib.import_module("featurestore.core.int8_dequant_kernel")
            one = np.zeros((1, 1), np.int8)
            at = np.zeros(1, np.int64)
            scale = np.ones((1, 1), np.float32)
            kernels.groups_fit(at, 1)
            kernels.to_float32(one, at, scale, np.empty((1, 1), np.float32), 0, 1)
            kernels.to_float16(one, at, scale, np.empty((1, 1), np.uint16), 0, 1)
    except Exception as error:  # noqa: BLE001 - a broken numba install must not stop a loader
        _STATE["failed"] = True
        warnings.warn(f"featurestore: the int8 dequantize kernel is off ({error}); int8 batches are "
                      "dequantized with numpy (slower, the same values). Set NUMBA_CACHE_DIR to a "
                      "writable directory if numba could not cache it.", RuntimeWarning, stacklevel=1)
        return
    _STATE["kernels"] = kernels


def batch_scales(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scale rows a batch needs, each once (sorted), and each row's place among them: a
    sequential batch needs one or two chunks' scales, a shuffled one at most one per row."""
    needed, place = np.unique(groups, return_inverse=True)
    return needed, place.astype(np.int64).reshape(-1)


def on_device(codes: torch.Tensor, scales: torch.Tensor, place: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """Codes ``[n, *S]`` (int8) times their scales on the codes' device, in ``dtype``.

    ``scales``: ``[u, *S]`` float32 with ``place`` ``[n]`` each row's among them (one row: all
    share it, no gather), or, with ``place`` None, already broadcastable against the codes. The
    multiply promotes to float32 and writes ``dtype`` itself (one rounding, as on the CPU)."""
    if place is not None:
        scales = scales[0] if scales.shape[0] == 1 else scales.index_select(0, place)
    if dtype == torch.float32:
        return torch.mul(codes, scales)
    return torch.mul(codes, scales, out=torch.empty(codes.shape, dtype=dtype, device=codes.device))


class ChunkScales:
    """A dense int8 split's scales on the CUDA path: which bytes a batch stages in its host slot
    (:meth:`stage`), and its codes times their scales on the device (:meth:`multiply`)."""

    def __init__(self, table: np.ndarray, device: torch.device, stream: Any) -> None:
        self.table = table
        self.row_bytes = int(table[0].nbytes) if len(table) else 0
        self.device_table: torch.Tensor | None = None
        if table.nbytes <= DEVICE_TABLE_BYTES:  # once, on the side stream every batch is made on
            with torch.cuda.device(device), torch.cuda.stream(stream):
                self.device_table = torch.from_numpy(table).to(device)

    def stage(self, slot: Any, groups: np.ndarray) -> int:
        """Into ``slot.scales``: each row's place (int64) in the device table, or among the batch's
        scale rows, which follow (float32, each chunk's once). Returns the bytes to copy."""
        if self.device_table is not None:
            needed, place = None, groups.astype(np.int64)
        else:
            needed, place = batch_scales(groups)
        nbytes = place.nbytes + (0 if needed is None else len(needed) * self.row_bytes)
        slot.reserve_scales(nbytes)
        slot.scales[: place.nbytes].numpy().view(np.int64)[:] = place
        if needed is not None:
            rows = slot.scales[place.nbytes:nbytes].numpy().view(np.float32).reshape(len(needed), *self.table.shape[1:])
            np.take(self.table, needed, axis=0, out=rows)
        return nbytes

    def multiply(self, codes: torch.Tensor, staged: torch.Tensor, groups: np.ndarray,
                 dtype: torch.dtype) -> torch.Tensor:
        """``codes`` (on the device) times their scales, from ``staged`` (what :meth:`stage` wrote,
        copied to the device) and the batch's chunks ``groups`` (on the host)."""
        b = len(groups)
        place = staged[: b * 8].view(torch.int64)
        if self.device_table is None:
            return on_device(codes, staged[b * 8:].view(torch.float32).view(-1, *self.table.shape[1:]), place, dtype)
        if b and groups.min() == groups.max():  # one chunk: its row broadcast, no gather
            return on_device(codes, self.device_table[int(groups[0])], None, dtype)
        return on_device(codes, self.device_table, place, dtype)
