"""An int8 split read over HTTP as float32 values: what the datasets open for a server's int8 split.

The local datasets hand the loaders int8 codes and the split's scales table, and the loaders
dequantize into the batch (or on the GPU). A server sends a read's codes with only the scales rows
that read needs (``?dtype=int8``, docs/SERVER.md), so over HTTP the codes are dequantized as each
response arrives, by the remote reader and with the store's formula: the datasets see a float32
split whose reads give the same bits as ``read_numpy(dtype="float32")`` on the store, while the
wire still carries codes (a quarter of float32's bytes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featurestore.format import dtypes

VALUES = "float32"


class _Values:
    """What both readers share: the wrapped reader's attributes (its ``read`` already gives an
    int8 split's float32 values), its dtype seen as float32."""

    dtype = VALUES
    numpy_dtype = np.dtype(np.float32)

    def __init__(self, codes: Any) -> None:
        self.codes_reader = codes

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped reader's
        return getattr(self.codes_reader, name)

    def __repr__(self) -> str:
        return f"{self.codes_reader!r} (int8 codes dequantized to float32 as they arrive)"

    def __len__(self) -> int:
        return len(self.codes_reader)


class DenseValues(_Values):
    """A ``RemoteFeatureArray`` of an int8 split, read as float32 values."""

    read_into = None  # the HTTP reader's features+labels request answers codes: values come by read_numpy

    def read_numpy(self, indices: Any, out: np.ndarray | None = None, dtype: str | None = None) -> np.ndarray:
        return self.codes_reader.read_numpy(indices, out=out, dtype=dtype or VALUES)  # type: ignore[no-any-return]


class BagValues(_Values):
    """A ``RemoteBagArray`` of an int8 split, read as float32 values."""

    def read_numpy(self, bag: int | str, rows: Any = None, out: np.ndarray | None = None,
                   dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        return self.codes_reader.read_numpy(bag, rows=rows, out=out, dtype=dtype or VALUES)  # type: ignore[no-any-return]


def values_over_http(reader: Any) -> Any:
    """``reader`` itself, or for an int8 split the wrapper that reads its values."""
    if not dtypes.is_int8(getattr(reader, "dtype", "")):
        return reader
    from client.remote_bag_array import RemoteBagArray

    return BagValues(reader) if isinstance(reader, RemoteBagArray) else DenseValues(reader)
