"""What a writer accepts: features in, a checked, cast and measured batch out.

``as_source`` takes what ``write()`` was given (a torch tensor on any device, or an array-like
of float32, float16, bfloat16 or float64) and keeps it where it is; ``prepare`` runs the precision
policy and the statistics on it through the fastest path there is: the fused one-pass kernel for
host memory when numba is installed (core.fused_stats), else torch where the batch is
(core.device_stats), else numpy (core.batch). Every writer of the store goes through here, so a
batch is accepted or refused, and measured, the same way whatever it writes to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from featurestore.core.batch import Prepared, prepare_numpy
from featurestore.errors import DtypeMismatch
from featurestore.format import dtypes

__all__ = ["as_source", "prepare", "warm_up_soon"]


def warm_up_soon(dtype: str) -> None:
    """Start loading, on a thread, the statistics kernel for host batches of ``dtype`` stored as
    ``dtype`` (its costly part, numba's import and target set-up, serves every other kind too):
    called when a split is created, so the load runs while the caller makes its first batch."""
    from featurestore.core import fused_stats

    fused_stats.warm_up_soon(dtype, dtype)


def as_source(features: Any) -> Any:
    """A torch tensor (kept where it is) when torch is installed, else a numpy array."""
    if type(features).__module__.startswith("torch"):
        return features
    array = dtypes.as_numpy(features)
    if not array.dtype.isnative:  # big-endian (an h5 or npy written so): the kernels read native values
        array = array.astype(array.dtype.newbyteorder("="))
    kind = dtypes.source_dtype_name(array)
    if kind not in ("float32", "float16", "bfloat16", "float64"):
        raise DtypeMismatch(
            f"features of dtype {kind} cannot be stored: pass float32, float16, bfloat16 "
            "(torch or ml_dtypes) or float64 values"
        )
    from featurestore.core import fused_stats

    if _torch_available() and not fused_stats.available():
        import torch

        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        if kind == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    return array


def prepare(source: Any, dtype: str, channels: int, start: int, *, private: bool,
            allocate: Callable[..., np.ndarray] = np.empty) -> Prepared:
    """The checked, cast and measured batch of ``source`` (from :func:`as_source`) for a split of
    logical ``dtype``; ``start`` names rows in messages, ``private`` says the result may not alias
    the caller's memory, ``allocate`` (a buffer pool's) gives the fused path its output buffers."""
    from featurestore.core import device_stats, fused_stats

    on_host = isinstance(source, np.ndarray) or source.device.type == "cpu"
    if on_host and fused_stats.available():
        array, kind = _host_array(source)
        return fused_stats.prepare(array, kind, dtype, channels, start, threads=fused_stats.threads(),
                                   private=private, allocate=allocate)
    if isinstance(source, np.ndarray):
        return prepare_numpy(source, dtype, channels, start)
    return device_stats.prepare(source, dtype, channels, start)


_TORCH: list[bool] = []


def _host_array(source: Any) -> tuple[np.ndarray, str]:
    """A host batch as numpy without copying (bfloat16 as its uint16 bits) and its dtype name."""
    if isinstance(source, np.ndarray):
        kind = dtypes.source_dtype_name(source)
        return (source.view(np.uint16) if kind == "bfloat16" else source), kind
    import torch

    tensor = source.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    from featurestore.core import device_stats

    return tensor.numpy(), device_stats.source_kind(tensor)


def _torch_available() -> bool:
    """Whether torch can be imported (checked once; the import itself waits for a batch)."""
    if not _TORCH:
        import importlib.util

        _TORCH.append(importlib.util.find_spec("torch") is not None)
    return _TORCH[0]
