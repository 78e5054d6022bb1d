"""Where things live in a store and the Zarr v3 documents that describe them (docs/FORMAT.md).

Every array is chunked along its first axis only; chunk ``i`` of array ``A`` of a split holds
rows ``[i * chunk_rows, (i + 1) * chunk_rows)`` under the key ``<split>/A/c/i/0/.../0``
(zarr's default key encoding). Uncompressed chunks are the rows' raw little-endian bytes followed
by a 4-byte little-endian crc32c of those bytes (zarr's ``crc32c`` codec), so a local chunk file
can be memory-mapped. Edge chunks are full size, padded with the fill value, as zarr writes them.
"""

from __future__ import annotations

import json
import math
from typing import Any

FORMAT_NAME = "featurestore"
# Version 1: the store root and dense splits. Version 2 adds bag splits (a split document with
# ``kind: "bags"``, docs/FORMAT.md "Slide bags"); only bag splits are written as version 2, so a
# version-1 reader still reads the root and every dense split, and refuses a bag split with
# UnsupportedFormatVersion instead of misreading it.
# Version 3 adds int8 splits (int8 codes in ``features`` plus a float32 ``scales`` array): only
# they are written as version 3, so an older reader refuses them instead of reading codes as
# features.
FORMAT_VERSION = 1
BAGS_FORMAT_VERSION = 2
INT8_FORMAT_VERSION = 3
READ_FORMAT_VERSION = 3  # the newest version this code reads
ZARR_JSON = "zarr.json"
CRC_BYTES = 4

FEATURES = "features"
LABELS = "labels"
IDS = "ids"
# One row of float64 partial sums per feature chunk (featurestore.format.stats), chunked like the
# features so each chunk's owner writes its own row: the reports of several writers then merge.
CHUNK_STATS = "chunk_stats"
# int8 splits only: float32 [num_chunks, *sample_shape], one row per features chunk, chunked one
# row per chunk; features chunk i's values are ``codes * scales[i]`` (docs/FORMAT.md "int8").
SCALES = "scales"


def split_key(dataset: str, encoder: str, split: str) -> str:
    return f"{dataset}/{encoder}/{split}"


def chunk_key(array_key: str, index: int, ndim: int) -> str:
    return f"{array_key}/c/{index}" + "/0" * (ndim - 1)


def chunk_rows_for(sample_nbytes: int, chunk_bytes: int, num_samples: int) -> int:
    """Samples per chunk: as many whole samples as fit in ``chunk_bytes`` (at least one)."""
    rows = max(1, int(chunk_bytes) // max(1, int(sample_nbytes)))
    return max(1, min(rows, max(1, num_samples)))


def num_chunks(num_samples: int, chunk_rows: int) -> int:
    return math.ceil(num_samples / chunk_rows) if num_samples else 0


def group_document(attributes: dict[str, Any] | None = None) -> bytes:
    doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
    return _dump(doc)


def array_document(
    *,
    shape: tuple[int, ...],
    chunk_rows: int,
    data_type: str,
    compressor: str | None = None,
    attributes: dict[str, Any] | None = None,
    dimension_names: list[str] | None = None,
) -> bytes:
    """The ``zarr.json`` of an array written by featurestore's own chunk writer."""
    fill: Any = 0.0 if data_type.startswith("float") else 0
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compressor is not None:
        name, level = parse_compressor(compressor)
        codecs.append({"name": name, "configuration": {"level": level, "checksum": False}})
    codecs.append({"name": "crc32c"})
    doc: dict[str, Any] = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": data_type,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [chunk_rows, *shape[1:]]},
        },
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": attributes or {},
        "storage_transformers": [],
    }
    if dimension_names is not None:
        doc["dimension_names"] = dimension_names
    return _dump(doc)


def parse_compressor(compressor: str) -> tuple[str, int]:
    """``"zstd"`` or ``"zstd:5"`` -> (name, level). Only zstd is offered: it is in every zarr."""
    from featurestore.errors import InvalidOption

    name, _, level = str(compressor).partition(":")
    if name != "zstd" or (level and not level.lstrip("-").isdigit()):
        raise InvalidOption(
            f"unsupported compressor {compressor!r}: use 'zstd' or 'zstd:LEVEL', or none (None; on the "
            "command line, leave --compressor out): uncompressed, memory-mappable"
        )
    return name, int(level) if level else 3


def is_compressed(array_doc: dict[str, Any]) -> bool:
    return any(c.get("name") not in ("bytes", "crc32c") for c in array_doc.get("codecs", []))


def array_chunk_rows(array_doc: dict[str, Any]) -> int:
    return int(array_doc["chunk_grid"]["configuration"]["chunk_shape"][0])


def load_document(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)


def _dump(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=False, allow_nan=False) + "\n").encode()
