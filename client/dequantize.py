"""int8 batches into float batches, for both loaders' transfers (docs/LOADER.md "int8 splits").

An int8 split stores codes and float32 scales: a dense row's values are ``codes[r] *
scales[r // chunk_rows]``, a bag's ``codes * scales[bag]`` (format.int8). The loaders read the codes
at their stored width (a quarter of float32's bytes) and dequantize only where the batch is made:

* CPU: :func:`into` multiplies the gathered codes into the batch handed out, in blocks of rows,
  so the only float32 temporary is one block of gathered scales (not the batch).
* CUDA: :func:`batch_scales` gives the scale rows a batch needs once each, with each row's place
  among them; they cross in the host slot beside the codes and :func:`on_device` multiplies there,
  the int8 -> float upcast inside the multiply.

Either way each value is ``float32(code * scale)``, then rounded once to the batch's dtype: the
values ``FeatureArray.read_numpy(dtype="float32")`` (and ``"float16"``) give.
"""

from __future__ import annotations

import numpy as np
import torch

from featurestore.format import int8

BLOCK_BYTES = 1 << 20  # float32 scales gathered per block of a shuffled batch (stays in cache)
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


def on_device(codes: torch.Tensor, scales: torch.Tensor, place: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Codes ``[n, *S]`` (int8) times their scales on the codes' device, in ``dtype``.

    ``scales``: ``[u, *S]`` float32 with ``place`` ``[n]`` each row's among them (one row: all
    share it, no gather), or, with ``place`` None, already broadcastable against the codes. The
    multiply promotes to float32 and writes ``dtype`` itself (one rounding, as on the CPU)."""
    if place is not None:
        scales = scales[0] if scales.shape[0] == 1 else scales.index_select(0, place)
    if dtype == torch.float32:
        return torch.mul(codes, scales)
    return torch.mul(codes, scales, out=torch.empty(codes.shape, dtype=dtype, device=codes.device))
