"""``FeatureClient.read_ids``: a dense split's samples named by id, in one request (``wire.BY_ID``).

The answer has the ``/samples`` framing (features' bytes, then the labels' when the split has
them, each described by its own shape and dtype headers), streamed into arrays allocated from the
split's structure (``client.open``, cached).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore import errors as fse
from featurestore.core.quantize_int8 import check_read_dtype
from featurestore.format import wire

if TYPE_CHECKING:
    from client.http import FeatureClient

__all__ = ["read_ids"]


def read_ids(client: FeatureClient, dataset: str, encoder: str, split: str, ids: Any, dtype: str | None = None
             ) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """``(features [n, ...], labels [n, ...] or None)`` of ``ids``, in their order: the features in
    the storage dtype (int8 codes for an int8 split), or as ``dtype`` values (as read_samples)."""
    if isinstance(ids, (str, bytes)):
        raise fse.InvalidIndices(f"ids must be a list of sample ids, not one {type(ids).__name__}: pass [{ids!r}]")
    ids = list(ids)
    bad = next((i for i in ids if not isinstance(i, str)), None)
    if bad is not None:
        raise fse.InvalidIndices(f"a sample id is a str, but got {type(bad).__name__} {bad!r}; use read_samples "
                                 "for positions")
    arr = client.open(dataset, encoder, split)
    if arr.dtype == wire.CODES or check_read_dtype(dtype, arr.dtype) is not None:
        # values, or codes with their chunks' scales: positions decide which
        return client.read_samples(dataset, encoder, split, arr.positions_of(ids), dtype=dtype)
    features = np.empty((len(ids), *arr.sample_shape), arr.numpy_dtype)
    labels = None if arr.labels is None else np.empty((len(ids), *arr.labels.sample_shape), arr.labels.numpy_dtype)
    path = wire.route(wire.BY_ID, dataset=dataset, encoder=encoder, split=split)
    per_row = arr.sample_nbytes + (arr.labels.sample_nbytes if arr.labels is not None else 0)
    rows = max(1, arr.max_response_bytes // max(per_row, 1))  # more ids than one answer may hold: pieces
    for start in range(0, max(len(ids), 1), rows):
        piece = slice(start, start + rows)
        parts = [(features[piece], arr.dtype, wire.SHAPE_HEADER, wire.DTYPE_HEADER)]
        if labels is not None:
            parts.append((labels[piece], arr.labels.dtype, wire.LABELS_SHAPE_HEADER, wire.LABELS_DTYPE_HEADER))
        client.fetch_parts("POST", path, parts, json_body={"ids": ids[piece]})
    return features, labels

