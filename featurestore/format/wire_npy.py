"""The ``.npy`` framing of the HTTP wire contract (``Accept: application/x-npy``): the NPY 1.0
preamble a response carries before its raw bytes, and its parser; and the wire's one error type."""

from __future__ import annotations

import ast
import struct
from collections.abc import Iterable

import numpy as np

NPY = "application/x-npy"
# https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html: magic, version 1.0,
# little-endian uint16 header length, header padded with spaces and a newline so that the data
# starts on a 64-byte boundary (numpy's ARRAY_ALIGN).
NPY_MAGIC = b"\x93NUMPY"
_NPY_ALIGN = 64

class WireFormatError(ValueError):
    """A header or payload that does not follow this contract."""


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


__all__ = ["NPY", "NPY_MAGIC", "WireFormatError", "npy_header", "parse_npy_header", "wants_npy"]
