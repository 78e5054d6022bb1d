"""Logical dtypes, their storage dtypes, and the conversions between them.

Zarr v3 has no bfloat16, so a bfloat16 array is stored as its raw ``uint16`` bits with
``logical_dtype: "bfloat16"`` in the metadata (docs/FORMAT.md). Everything here is numpy-only;
torch is imported lazily by the two helpers that take or return tensors, so the server and the
read path run without torch.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from featurestore.errors import DtypeMismatch

FEATURE_DTYPES = ("float32", "float16", "bfloat16", "int8")
# int8 splits hold codes plus a float32 ``scales`` array (docs/FORMAT.md "int8"): the codes alone
# are not the features, so every path that turns stored values into features asks ``is_int8``.
INT8 = "int8"
FLOAT16_MAX = 65504.0
# float32 values at or beyond this magnitude round (to nearest even) to Inf in bfloat16: it is
# halfway between bfloat16's largest finite value (0x7F7F, ~3.3895e38) and 2**128.
BFLOAT16_ROUNDS_TO_INF = float(np.array(0x7F7F8000, np.uint32).view(np.float32))

_STORAGE = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"),
            "int8": np.dtype("i1")}
_ZARR_NAME = {"float32": "float32", "float16": "float16", "bfloat16": "uint16", "int8": "int8"}
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def check_feature_dtype(dtype: str) -> str:
    if dtype not in FEATURE_DTYPES:
        raise DtypeMismatch(
            f"unsupported feature dtype {dtype!r}: use one of {', '.join(FEATURE_DTYPES)}"
        )
    return dtype


def is_int8(logical: str) -> bool:
    return logical == INT8


def storage_dtype(logical: str) -> np.dtype:
    """The numpy dtype of the bytes on storage (little-endian; bfloat16 -> uint16 bits)."""
    if logical in _STORAGE:
        return _STORAGE[logical]
    return np.dtype(logical).newbyteorder("<")


def zarr_data_type(logical: str) -> str:
    return _ZARR_NAME.get(logical, np.dtype(logical).name)


def as_numpy(values: Any) -> np.ndarray:
    """A numpy view (or CPU copy) of a torch tensor or array-like, keeping bfloat16 exact.

    torch bfloat16 becomes an ``ml_dtypes.bfloat16`` array over the same bits.
    """
    if isinstance(values, np.ndarray):
        return values
    module = type(values).__module__
    if module.startswith("torch"):
        import torch

        tensor = values.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.contiguous().view(torch.int16).numpy().view(BFLOAT16)
        return tensor.numpy()
    return np.asarray(values)


def source_dtype_name(array: np.ndarray) -> str:
    if array.dtype == BFLOAT16:
        return "bfloat16"
    return array.dtype.name


def quantize(source: np.ndarray, logical: str) -> np.ndarray:
    """Cast float values to the storage representation of ``logical`` (round to nearest even).

    float16 uses numpy's cast (the tests pin equality with ``astype(np.float16)``); bfloat16 uses
    ml_dtypes' RNE cast, then its bits as uint16. Values from bfloat16 pass through float32 first,
    which is exact.
    """
    if source.dtype == BFLOAT16 and logical != "bfloat16":
        source = source.astype(np.float32)
    if logical == "float32":
        return source.astype(np.float32, copy=False)
    if logical == "float16":
        return source.astype(np.float16, copy=False)
    if logical == "bfloat16":
        return source.astype(BFLOAT16, copy=False).view(np.uint16)
    raise DtypeMismatch(f"cannot quantize to {logical!r}")


def stored_as_float32(stored: np.ndarray, logical: str) -> np.ndarray:
    """Decode stored values to float32 (exact for all three feature dtypes)."""
    if logical == "bfloat16":
        return stored.view(BFLOAT16).astype(np.float32)
    return stored.astype(np.float32, copy=False)


def to_torch(array: np.ndarray, logical: str) -> Any:
    """Zero-copy torch view of a stored numpy array (uint16 bits -> torch.bfloat16)."""
    import torch

    tensor = torch.from_numpy(array)
    if logical == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor


def torch_dtype(logical: str) -> Any:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(
        logical
    ) or getattr(torch, np.dtype(logical).name)


# Sign-cleared bit patterns order like magnitudes, and every pattern at or above the exponent's
# all-ones value is Inf or NaN; an integer max over the masked bits gives both the abs max and the
# finiteness check in one vectorised pass, where numpy's float16 max is emulated and ~100x slower.
_MAGNITUDE = {
    np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00),
    BFLOAT16: (np.uint16, 0x7FFF, 0x7F80),
    np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, 0x7F800000),
}


def row_abs_max(values: np.ndarray) -> np.ndarray:
    """Largest |value| of each row (first axis) as float64; inf for a row holding Inf or NaN."""
    rows = values.reshape(len(values), -1) if len(values) else values.reshape(0, 1)
    if rows.shape[1] == 0:
        return np.zeros(len(values))
    spec = _MAGNITUDE.get(values.dtype)
    if spec is None or not values.flags.c_contiguous:
        top = np.abs(rows.astype(np.float64)).max(axis=1)
        return np.where(np.isfinite(top), top, np.inf)
    uint, mask, non_finite = spec
    bits = np.bitwise_and(rows.view(uint), uint(mask)).max(axis=1)
    top = bits.view(values.dtype).astype(np.float64)
    top[bits >= non_finite] = np.inf
    return top
