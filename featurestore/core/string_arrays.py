"""Zarr ``string`` arrays (vlen-utf8) of a split: bag ids, bag attributes, sample ids.

zarr-python encodes them (every Zarr v3 reader reads them), into memory; the files are then put
on the store like any other, the chunks first and the array's ``zarr.json`` last. Created on the
store itself, zarr would also write each parent group's ``zarr.json`` "if absent": on an
object store that ignores ``If-None-Match`` (older MinIO or Ceph, AWS S3 before August 2024)
that put replaced the store root's, the dataset's, the encoder's and the split's documents with
empty groups, and the store was no longer a featurestore.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featurestore.core.storage import Storage
from featurestore.format import layout

__all__ = ["STRING_CHUNK", "put_strings"]

STRING_CHUNK = 65536


def put_strings(storage: Storage, array_key: str, values: list[str], *, compressors: Any = "auto") -> None:
    """``values`` as the string array ``array_key`` (what was there removed first); ``compressors``
    as zarr's ``create_array`` takes them."""
    import zarr
    from zarr.storage import MemoryStore

    files: dict[str, Any] = {}
    array = zarr.create_array(store=MemoryStore(store_dict=files), shape=(len(values),), dtype=str,
                              chunks=(max(1, min(len(values), STRING_CHUNK)),), compressors=compressors)
    if values:
        array[:] = np.asarray(values, dtype=object)
    storage.delete_tree(array_key)
    for name in sorted(files, key=lambda k: k == layout.ZARR_JSON):  # the document last
        storage.write(f"{array_key}/{name}", files[name].to_bytes())
