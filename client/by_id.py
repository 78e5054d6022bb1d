"""``FeatureClient.read_ids``: a dense split's samples named by id, in one request (``wire.BY_ID``).

The answer has the ``/samples`` framing (features' bytes, then the labels' when the split has
them, each described by its own shape and dtype headers). Sample ids name slide or patient
embeddings, so these reads are small: the body is read whole, then split by the headers.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore import errors as fse
from featurestore.format import wire

if TYPE_CHECKING:
    from client.http import FeatureClient

__all__ = ["read_ids"]


def read_ids(client: FeatureClient, dataset: str, encoder: str, split: str, ids: Any
             ) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """``(features [n, ...] in the storage dtype, labels [n, ...] or None)`` of ``ids``, in their order."""
    if isinstance(ids, (str, bytes)) or not all(isinstance(i, str) for i in ids):
        raise fse.InvalidIndices(f"ids must be a list of sample ids (str), but got: {ids!r}"[:300])
    ids = list(ids)
    arr = client.open(dataset, encoder, split)
    parts = [(arr.sample_shape, arr.numpy_dtype, arr.dtype, wire.SHAPE_HEADER, wire.DTYPE_HEADER)]
    if arr.labels is not None:
        lab = arr.labels
        parts.append((lab.sample_shape, lab.numpy_dtype, lab.dtype, wire.LABELS_SHAPE_HEADER,
                      wire.LABELS_DTYPE_HEADER))
    path = wire.route(wire.BY_ID, dataset=dataset, encoder=encoder, split=split)
    url = client.url + path

    def fill(response: Any) -> list[np.ndarray]:
        body = memoryview(response.read())
        out, offset = [], 0
        for sample_shape, numpy_dtype, dtype, shape_header, dtype_header in parts:
            expected = (len(ids), *sample_shape)
            try:
                shape = wire.parse_shape(response.headers.get(shape_header, ""))
            except wire.WireFormatError as error:
                raise fse.ShapeMismatch(f"{url}: {error}") from None
            got = response.headers.get(dtype_header)
            if shape != expected or got != dtype:
                raise fse.ShapeMismatch(f"{url} answered {shape_header} {shape} {dtype_header} {got}, expected "
                                        f"{expected} {dtype}")
            nbytes = wire.expected_nbytes(shape, numpy_dtype)
            out.append(np.frombuffer(body[offset:offset + nbytes], numpy_dtype).reshape(shape).copy())
            offset += nbytes
        if offset != len(body):
            raise fse.ShapeMismatch(f"{url} answered {len(body)} bytes, its headers describe {offset}")
        return out

    headers = {"Accept": wire.OCTET_STREAM, "Accept-Encoding": "identity", "Content-Type": "application/json"}
    got = client._send("POST", path, stream_into=fill, headers=headers, content=json.dumps({"ids": ids}).encode())
    return got[0], (got[1] if len(got) > 1 else None)
