"""The HTTP wire contract, defined once and imported by both ``server/`` and ``client/``.

A data response is the raw C-order little-endian bytes of one array, described by two headers:
``X-Shape`` (``"64,256,384"``; ``""`` for a 0-d array) and ``X-Dtype`` (the *logical* dtype, e.g.
``bfloat16``). bfloat16 has no numpy/Zarr dtype, so its bits travel as ``uint16`` and only the
header says how to view them. ``Accept: application/x-npy`` asks for the same bytes behind a
standard ``.npy`` header (NPY format 1.0; bfloat16 is then ``<u2`` bits, as on storage).

This module must stay importable without torch, fastapi or httpx: the server image has no torch
and ``import client`` must not pull in the server stack.
"""

from __future__ import annotations

import ast
import math
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "DTYPE_HEADER",
    "NPY",
    "NPY_MAGIC",
    "OCTET_STREAM",
    "SHAPE_HEADER",
    "WireFormatError",
    "encode_shape",
    "expected_nbytes",
    "json_safe",
    "npy_header",
    "parse_npy_header",
    "parse_shape",
    "storage_dtype",
    "wants_npy",
]

SHAPE_HEADER = "X-Shape"
DTYPE_HEADER = "X-Dtype"
OCTET_STREAM = "application/octet-stream"
NPY = "application/x-npy"

# https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html: magic, version 1.0,
# little-endian uint16 header length, header padded with spaces and a newline so that the data
# starts on a 64-byte boundary (numpy's ARRAY_ALIGN).
NPY_MAGIC = b"\x93NUMPY"
_NPY_ALIGN = 64
_MAX_DIMS = 32  # numpy's own limit (NPY_MAXDIMS) in numpy < 2; plenty for features
_SHAPE_RE = re.compile(r"(?:0|[1-9][0-9]{0,18})(?:,(?:0|[1-9][0-9]{0,18}))*")


class WireFormatError(ValueError):
    """A header or payload that does not follow this contract."""


def storage_dtype(logical: str) -> np.dtype:
    """The little-endian numpy dtype whose bytes carry ``logical`` on storage and on the wire.

    ``bfloat16`` -> ``<u2`` (its bit pattern); every other name is a numpy dtype name
    (``float16``, ``float32``, ``uint8``, ``int64``, ...), forced to little-endian.
    """
    if logical == "bfloat16":
        return np.dtype("<u2")
    try:
        dtype = np.dtype(logical)
    except TypeError as error:
        raise WireFormatError(f"unknown dtype {logical!r} in {DTYPE_HEADER}") from error
    if dtype.kind not in "biuf" or dtype.itemsize == 0:
        raise WireFormatError(
            f"dtype {logical!r} cannot travel on the wire: only bool, integer and float arrays do"
        )
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


def encode_shape(shape: Iterable[int]) -> str:
    """``(64, 256, 384)`` -> ``"64,256,384"``; ``()`` -> ``""``."""
    return ",".join(str(int(dim)) for dim in shape)


def parse_shape(text: str) -> tuple[int, ...]:
    """Inverse of :func:`encode_shape`; refuses anything but non-negative decimal integers."""
    text = text.strip()
    if text == "":
        return ()
    if _SHAPE_RE.fullmatch(text) is None:
        raise WireFormatError(
            f"bad {SHAPE_HEADER} header {text!r}: expected comma-separated non-negative integers"
        )
    shape = tuple(int(part) for part in text.split(","))
    if len(shape) > _MAX_DIMS:
        raise WireFormatError(f"bad {SHAPE_HEADER} header: {len(shape)} dimensions")
    return shape


def expected_nbytes(shape: Iterable[int], dtype: np.dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def wants_npy(accept: str | None) -> bool:
    """True when an ``Accept`` header names ``application/x-npy`` (with a non-zero q)."""
    if not accept:
        return False
    for item in accept.split(","):
        media, _, params = item.strip().partition(";")
        if media.strip().lower() != NPY:
            continue
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        return q > 0
    return False


def npy_header(shape: Iterable[int], dtype: np.dtype) -> bytes:
    """The NPY 1.0 preamble for a C-order array; the raw bytes follow it unchanged."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    dims = tuple(int(d) for d in shape)
    shape_repr = f"({dims[0]},)" if len(dims) == 1 else repr(dims)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape_repr}, }}"
    # magic (6) + version (2) + length (2) + text + padding + "\n" is a multiple of 64.
    unpadded = len(NPY_MAGIC) + 2 + 2 + len(text) + 1
    padding = -unpadded % _NPY_ALIGN
    encoded = (text + " " * padding + "\n").encode("latin-1")
    if len(encoded) > 0xFFFF:  # pragma: no cover - needs thousands of dimensions
        raise WireFormatError("npy header too long for format 1.0")
    return NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(encoded)) + encoded


def parse_npy_header(data: bytes | memoryview) -> tuple[int, tuple[int, ...], np.dtype]:
    """Parse an NPY 1.0/2.0 preamble: ``(data_offset, shape, dtype)``.

    Only C-order headers are accepted (the server never sends Fortran order). Uses
    ``ast.literal_eval``, which evaluates literals only, never code.
    """
    head = bytes(data[:12])
    if len(head) < 10 or head[:6] != NPY_MAGIC:
        raise WireFormatError("not an .npy payload (bad magic)")
    major = head[6]
    if major == 1:
        length, start = struct.unpack("<H", head[8:10])[0], 10
    elif major in (2, 3):
        if len(head) < 12:
            raise WireFormatError("truncated .npy header")
        length, start = struct.unpack("<I", head[8:12])[0], 12
    else:
        raise WireFormatError(f"unsupported .npy format version {major}")
    raw = bytes(data[start : start + length])
    if len(raw) != length:
        raise WireFormatError("truncated .npy header")
    try:
        header = ast.literal_eval(raw.decode("latin-1"))
        dtype = np.lib.format.descr_to_dtype(header["descr"])
        shape = tuple(int(d) for d in header["shape"])
        fortran = bool(header["fortran_order"])
    except (ValueError, SyntaxError, KeyError, TypeError) as error:
        raise WireFormatError(f"bad .npy header: {error}") from error
    if fortran:
        raise WireFormatError(".npy payload in Fortran order is not supported")
    if any(d < 0 for d in shape):
        raise WireFormatError(f"bad .npy shape {shape}")
    return start + length, shape, dtype


def json_safe(value: Any) -> Any:
    """Make metadata strict-JSON: non-finite floats become Zarr v3's ``"NaN"``/``"Infinity"``.

    Split metadata can hold NaN/Inf (a quantization report of a failed run); strict JSON
    encoders (Starlette's, ``allow_nan=False``) would fail on them with a 500.
    """
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return "NaN"
        return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    return value
