"""Encoding and checking one chunk: raw little-endian rows (optionally zstd), then crc32c.

This is byte-for-byte what zarr-python produces for the codec chain
``[bytes(little), (zstd), crc32c]``: the crc32c trailer is 4 little-endian bytes over everything
before it (the zarr v3 ``crc32c`` codec).
"""

from __future__ import annotations

import crc32c as _crc32c
import numpy as np

from featurestore.format.layout import CRC_BYTES, parse_compressor


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """crc32c of ``data``, continuing from ``value`` (the crc of the bytes before it)."""
    return _crc32c.crc32c(data, value)


def crc_trailer(value: int) -> bytes:
    """The 4 little-endian bytes a chunk ends with."""
    return value.to_bytes(CRC_BYTES, "little")


def crc_bytes(payload: bytes | memoryview) -> bytes:
    return crc_trailer(crc32c(payload))


def encode(rows: np.ndarray, compressor: str | None) -> memoryview | bytes:
    """A chunk's payload (its crc32c trailer is added by ``Storage.write_sealed``): a zero-copy
    view of the rows when uncompressed."""
    if not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows)
    payload: memoryview | bytes = memoryview(rows).cast("B")
    if compressor is not None:
        from numcodecs import Zstd

        _, level = parse_compressor(compressor)
        payload = bytes(Zstd(level=level).encode(payload))
    return payload


def check(raw: bytes | memoryview, expected_payload_bytes: int | None) -> str | None:
    """Why a stored chunk is damaged, or None when its size and crc32c are right."""
    if expected_payload_bytes is not None and len(raw) != expected_payload_bytes + CRC_BYTES:
        return f"size {len(raw)} bytes, expected {expected_payload_bytes + CRC_BYTES}"
    if len(raw) < CRC_BYTES:
        return f"size {len(raw)} bytes, too short for a crc32c"
    view = memoryview(raw)
    if crc_bytes(view[:-CRC_BYTES]) != bytes(view[-CRC_BYTES:]):
        return "crc32c mismatch (flipped or truncated bytes)"
    return None
