"""``featurestore export --attention NAME``: an attention map saved by ``probe --head abmil
--save-attention NAME`` as one h5 file per evaluated slide, in the layout of CLAM's heatmap
"blockmap" files (``create_heatmaps.py``): ``attention_scores`` ``[n, 1]`` float32 and ``coords``
``[n, 2]`` as the bag stores them (level-0 pixels, or micrometres where the split records them),
one row per patch in the bag's order. The root attributes say which map, split, run and fold the
scores come from. A stale map (its split rewritten since the probe) is refused, never exported.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from featurestore.core.bag_attention import open_attention
from featurestore.errors import InvalidOption
from featurestore.extract.bag_export import ExportResult, check_file_stem, export_bar, prepare_out, write_h5
from featurestore.format import attention

SUFFIX = "_blockmap.h5"  # CLAM's name for a slide's attention scores and coordinates


def export_attention(store: Any, dataset: str, encoder: str, split: str, name: str, *, out: str,
                     overwrite: bool = False, progress: bool = True) -> ExportResult:
    """Write map ``name`` of bag split ``dataset/encoder/split`` of ``store`` (an open FeatureStore)
    under ``out``, one ``<slide>_blockmap.h5`` per slide the probe evaluated."""
    started = time.perf_counter()
    bags = store.open_bags(dataset, encoder, split)
    key = f"{dataset}/{encoder}/{split}"
    amap = open_attention(store.storage, bags.key, name, bags.metadata)
    amap.check_current()
    folds = amap.fold
    evaluated = [i for i in range(len(bags)) if int(folds[i]) != attention.NOT_EVALUATED]
    if not evaluated:
        raise InvalidOption(f"attention map {name!r} of {key} evaluated no bag: nothing to export")
    for i in evaluated:
        check_file_stem(bags.ids[i], key)
    paths = {i: os.path.join(out, f"{bags.ids[i]}{SUFFIX}") for i in evaluated}
    prepare_out(list(paths.values()), out, overwrite)
    probe = amap.lineage.get("probe") or {}
    root = {"attention_map": name, "split": key, "generation": bags.metadata.get("generation"),
            "head": probe.get("head"), "seed": probe.get("seed"), "eval_split": probe.get("eval_split")}
    bar = export_bar(len(evaluated), "slide", progress)
    try:
        for i in evaluated:
            scores = amap.bag(i, bags.offsets)
            coords = None if bags.coords_unit is None else bags.coords.read_numpy(bags.rows_of(i))
            coords_attrs = {} if coords is None else {"unit": bags.coords_unit,
                                                      "patch_size_level0": bags.patch_size_of(i)}
            write_h5(paths[i], np.asarray(scores, np.float32)[:, None], coords,
                     {"features": {}, "coords": coords_attrs, "root": {**root, "slide_id": bags.ids[i],
                                                                        "fold": int(folds[i])}},
                     features_name="attention_scores")
            bar.update(1)
    finally:
        bar.close()
    return ExportResult(key, f"attention {name}", out, len(evaluated), len(paths), time.perf_counter() - started)
