"""``RemoteFeatureArray``: one split's features (or labels) on a server, with the interface of a
local :class:`featurestore.FeatureArray`, so datasets and loaders treat both sources alike."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore import errors as fse
from featurestore.core.reader import as_index_array
from featurestore.format import wire

if TYPE_CHECKING:
    from client.http import FeatureClient

__all__ = ["RemoteFeatureArray"]


class RemoteFeatureArray:
    """A split's ``features`` (or ``labels``) over HTTP, with :class:`FeatureArray`'s interface.

    Reads larger than the server's byte cap are split into several requests, each written in
    place into the one output buffer.
    """

    def __init__(self, client: FeatureClient, key: tuple[str, str, str], layout: dict[str, Any],
                 metadata: dict[str, Any], *, labels: bool) -> None:  # fmt: skip
        self.client = client
        self.key = key
        self.name = "labels" if labels else "features"
        desc = layout["labels" if labels else "features"]
        self.shape: tuple[int, ...] = tuple(int(d) for d in desc["shape"])
        self.sample_shape = self.shape[1:]
        self.dtype: str = desc["dtype"]
        self.numpy_dtype = wire.storage_dtype(self.dtype)
        self.sample_nbytes = int(desc["sample_nbytes"])
        self.chunk_rows = int(desc["chunk_rows"])
        self.max_response_bytes = int(layout["max_response_bytes"])
        self.metadata = metadata
        self._has_ids = bool(layout.get("has_ids"))
        self._ids: list[str] | None = None
        self._base = "/v1/features/{}/{}/{}".format(*key)
        self._params = {"labels": "true"} if labels else {}
        self.labels: RemoteFeatureArray | None = None
        if not labels and layout.get("labels"):
            self.labels = RemoteFeatureArray(client, key, layout, metadata, labels=True)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"RemoteFeatureArray({self.client.url!r}, {'/'.join(self.key)}, {self.name}, " \
               f"shape={self.shape}, dtype={self.dtype!r})"  # fmt: skip

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.sample_nbytes

    @property
    def ids(self) -> list[str] | None:
        if self._has_ids and self._ids is None:
            self._ids = list(self.client._send("GET", self._base + "/ids")["ids"])
        return self._ids

    def read(self, indices: Any) -> Any:
        from featurestore.format.dtypes import to_torch

        return to_torch(self.read_numpy(indices), self.dtype)

    def read_range(self, start: int, stop: int) -> np.ndarray:
        if not (0 <= start <= stop <= len(self)):
            raise fse.IndexOutOfRange(
                f"range [{start}, {stop}) is outside [0, {len(self)}]: use 0 <= start <= stop <= {len(self)}"
            )
        return self.read_numpy(np.arange(start, stop, dtype=np.int64))

    def read_numpy(self, indices: Any, out: np.ndarray | None = None) -> np.ndarray:
        index = as_index_array(indices)
        shape = (len(index), *self.sample_shape)
        if out is None:
            out = np.empty(shape, self.numpy_dtype)
        elif out.shape != shape or out.dtype != self.numpy_dtype or not out.flags.c_contiguous:
            raise fse.ShapeMismatch(
                f"out has shape {out.shape} and dtype {out.dtype}; this read needs a C-contiguous "
                f"{shape} array of {self.numpy_dtype}"
            )
        if index.size:
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= len(self):
                raise fse.IndexOutOfRange(
                    f"index {low if low < 0 else high} is out of range for {self.client.url} "
                    f"{'/'.join(self.key)} {self.name} with {len(self)} samples: use indices in "
                    f"[0, {len(self) - 1}]"
                )
        rows = max(1, self.max_response_bytes // max(self.sample_nbytes, 1))
        for start in range(0, len(index), rows):
            self._read_piece(index[start : start + rows], out[start : start + rows])
        return out

    def _read_piece(self, index: np.ndarray, out: np.ndarray) -> None:
        first = int(index[0])
        # A contiguous ascending run goes as GET ?start&stop: no JSON body, and the server
        # reads it as one slice.
        if len(index) == 1 or (int(index[-1]) - first == len(index) - 1
                               and bool(np.all(np.diff(index) == 1))):  # fmt: skip
            params = {**self._params, "start": first, "stop": first + len(index)}
            self.client._fetch(self, "GET", self._base + "/batch", out, params=params)
        else:
            body = {"indices": index.tolist()}
            self.client._fetch(self, "POST", self._base + "/batch", out, params=self._params,
                               json=body)  # fmt: skip
