"""Per-slide h5 feature files, as the extractors users import from write them; a bag split writer
with its first bag, for the tests of what add_bag refuses; the bags a killed writer left complete."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np

TRIDENT_COORDS_ATTRS = {"patch_size": 256, "patch_size_level0": 512, "level0_magnification": 40,
                        "target_magnification": 20}


def h5_slides(root: Path, lengths: dict[str, int], dim: int, dtype: Any = np.float16, coords_dtype: Any = np.int64,
              seed: int = 0, trident: bool = False) -> dict[str, Any]:
    """One h5 per slide: features [n, dim], coords [n, 2]; returns {slide: (features, coords)}.
    ``trident``: as TRIDENT writes it (features in h5 chunks of one row, its coords and encoder
    attributes); otherwise the coords carry only ``patch_size_level0``."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for slide, n in lengths.items():
        features = rng.standard_normal((n, dim)).astype(dtype)
        coords = rng.integers(0, 50_000, (n, 2)).astype(coords_dtype)
        with h5py.File(root / f"{slide}.h5", "w") as f:
            if trident:
                f.create_dataset("features", data=features, chunks=(1, dim) if n else None)
                f.create_dataset("coords", data=coords).attrs.update({**TRIDENT_COORDS_ATTRS, "name": slide})
                f["features"].attrs["encoder"] = "uni_v1"
            else:
                f["features"], f["coords"] = features, coords
                f["coords"].attrs["patch_size_level0"] = 512
        out[slide] = (features, coords)
    return out


def writer_after_one_bag(root: Path, dim: int, label: Any) -> tuple[Any, Any]:
    """The store at ``root`` and the writer of its new bag split ds/enc/s (``dim`` channels), which
    holds bag "a" (two rows of ones) with ``label``."""
    from featurestore import open_store

    store = open_store(str(root), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=dim)
    writer.add_bag("a", np.ones((2, dim), np.float16), label=label)
    return store, writer


def complete_bags(store: Path, name: tuple[str, str, str]) -> int:
    """Bags of the split being written at ``store`` that are complete on storage, as a resume finds
    them (core.bag_commit.collect, read-only): what a kill test waits for before its SIGKILL. A
    record file alone may name none (a bag spanning several chunks)."""
    import featurestore
    from featurestore.core.bag_commit import collect

    if not store.joinpath(*name, "zarr.json").exists():
        return 0
    opened = featurestore.open_store(str(store))
    return len(collect(opened.storage, "/".join(name), opened.split_info(*name)).records)
