"""``featurestore export`` of an embedding split (``featurestore embed``: one ``[E]`` vector per slide
or per patient, with ids): one file per row, where the field's tools keep slide and patient
embeddings (docs/EXTRACT.md, "Export").

- **trident**: ``<out>/<id>.h5`` holding ``features`` ``(E,)``, as TRIDENT writes a slide embedding;
- **stamp**: ``<out>/<id>.h5`` holding ``feats`` ``(E,)`` with the root attributes STAMP's
  patient- and slide-level datasets read: ``feat_type`` (``patient`` for a split grouped by a
  column, else ``slide``) and ``encoder``.

Values are written in the stored dtype (float16, float32); bfloat16, which HDF5 lacks, and int8
(dequantized) as float32. Labels go to ``<out>/labels.csv`` keyed by the ids' column (the split's
``--group-by`` column, else ``slide_id``). A split whose bags changed since it was computed
(stale lineage) is refused: its files would look current. Files are written under a temporary name
and renamed, as bag exports are (featurestore.extract.bag_export).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from featurestore.errors import InvalidOption
from featurestore.extract.bag_export import (LABELS_CSV, ExportResult, atomic_write, check_file_stem, export_bar,
                                             labels_csv, prepare_out, write_h5)
from featurestore.format import dtypes
from featurestore.format import lineage as lineage_format

__all__ = ["FORMATS", "export_embeddings"]

FORMATS = ("trident", "stamp")
_BLOCK_ROWS = 4096  # rows read at a time: the vectors of a whole cohort need not sit in memory


def export_embeddings(store: Any, dataset: str, encoder: str, split: str, *, fmt: str, out: str,
                      overwrite: bool = False, progress: bool = True) -> ExportResult:
    """Write every row of the embedding split ``dataset/encoder/split`` of ``store`` (an open
    FeatureStore) under ``out`` as one file per id, in format ``fmt`` (``FORMATS``)."""
    from featurestore.core.lineage import stale_fix, stale_reason

    key = f"{dataset}/{encoder}/{split}"
    array = store.open(dataset, encoder, split)
    if fmt not in FORMATS:
        raise InvalidOption(f"split {key} holds one vector per row; --format {fmt} writes bags of patches: export "
                            f"it with --format {' or '.join(FORMATS)}")
    if len(array.sample_shape) != 1 or array.ids is None:
        raise InvalidOption(f"split {key} is a dense split of {list(array.sample_shape)} samples"
                            f"{'' if array.ids is not None else ' without ids'}: featurestore export writes bag splits "
                            "and embedding splits ([n, E] with ids, featurestore embed); read it with FeatureDataset")
    if reason := stale_reason(store, array.metadata):
        raise InvalidOption(f"split {key} is stale ({reason}): its files would look current; "
                            f"{stale_fix(reason, key, store.url)}, then export")
    ids = list(array.ids)
    for sample_id in ids:
        check_file_stem(sample_id, key)
    doc = lineage_format.of(array.metadata) or {}
    grouped_by = doc.get("group_by")
    paths = [os.path.join(out, f"{sample_id}.h5") for sample_id in ids]
    targets = paths + ([os.path.join(out, LABELS_CSV)] if array.labels is not None else [])
    prepare_out(targets, out, overwrite)
    name = "feats" if fmt == "stamp" else "features"
    root = {"feat_type": "patient" if grouped_by else "slide", "encoder": encoder} if fmt == "stamp" else {
        "encoder": encoder}
    started = time.perf_counter()
    with export_bar(len(ids), "row", progress) as bar:
        for start in range(0, len(ids), _BLOCK_ROWS):
            block = _vectors(array, np.arange(start, min(start + _BLOCK_ROWS, len(ids))))
            for offset, vector in enumerate(block):
                write_h5(paths[start + offset], vector, None, {"root": root, "features": {}, "coords": {}}, name)
            bar.update(len(block))
    if array.labels is not None:
        names = array.metadata.get("label_names") or (array.metadata.get("label_info") or {}).get("classes")
        id_column = grouped_by or "slide_id"
        # grouped by a bag attribute named label: the labels' column takes another name than the ids'
        text = labels_csv(ids, array.labels.read_numpy(np.arange(len(ids))), names, id_column,
                          label_column="split_label" if id_column == "label" else "label")
        atomic_write(os.path.join(out, LABELS_CSV), text.encode("utf-8"))
    return ExportResult(key, fmt, out, len(ids), len(targets), time.perf_counter() - started)


def _vectors(array: Any, rows: np.ndarray) -> np.ndarray:
    """Rows as HDF5 holds them: float16 and float32 as stored, bfloat16 and int8 as float32."""
    if dtypes.is_int8(array.dtype):
        return array.read_numpy(rows, dtype="float32")
    values = array.read_numpy(rows)
    return dtypes.stored_as_float32(values, array.dtype) if array.dtype == "bfloat16" else values
