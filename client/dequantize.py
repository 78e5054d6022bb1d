"""int8 batches into float batches, for both loaders' transfers (docs/LOADER.md "int8 splits").

An int8 split stores codes and float32 scales: a dense row's values are ``codes[r] *
scales[r // chunk_rows]``, a bag's ``codes * scales[bag]`` (format.int8). The loaders read the codes
at their stored width (a quarter of float32's bytes) and dequantize only where the batch is made:

* CPU: :func:`into` multiplies the gathered codes into the batch handed out, in blocks of rows,
  so the only float32 temporary is one block of gathered scales (not the batch).
* CUDA: a dense split's scales table goes to the device once when it is small
  (:data:`DEVICE_TABLE_BYTES`), and then only each row's chunk crosses with the codes; a larger
  table sends the scale rows each batch needs, once each (:func:`batch_scales`), in the host slot
  beside the codes (:class:`ChunkScales`). :func:`on_device` multiplies there, the int8 -> float
  upcast inside the multiply.

Either way each value is ``float32(code * scale)``, then rounded once to the batch's dtype: the
values ``FeatureArray.read_numpy(dtype="float32")`` (and ``"float16"``) give.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from featurestore.format import int8

BLOCK_BYTES = 1 << 20  # float32 scales gathered per block of a shuffled batch (stays in cache)
# A dense split's whole scales table is kept on the device up to this size (it is 4 / chunk_rows
# of the codes' bytes: a split of up to ~8 GiB of codes in 128-row chunks): a shuffled batch then
# sends 8 bytes a row, not a float32 scales row per chunk it touches (up to 4x its codes' bytes).
DEVICE_TABLE_BYTES = 256 << 20
NUMPY_OUT = (torch.float32, torch.float16)  # dtypes format.int8 writes into directly


def into(codes: np.ndarray, groups: np.ndarray, table: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """``out[r] = codes[r] * table[groups[r]]`` computed in float32, stored in ``out``'s dtype.

    ``codes``: int8 ``[n, *S]``; ``groups``: each row's scale row (a dense row's chunk, a bag's
    position); ``table``: float32 ``[g, *S]``; ``out``: a contiguous CPU tensor ``[n, *S]``."""
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
