"""The storage format, pinned: split metadata keys, the features zarr.json, chunk bytes, root
attributes, format-version refusal, missing stores and invalid names (docs/FORMAT.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import crc32c
import ml_dtypes
import numpy as np
import pytest

import featurestore
from featurestore.errors import (
    FeatureStoreError,
    InvalidName,
    NotAFeatureStore,
    StoreNotFound,
    UnsupportedFormatVersion,
)

VOLATILE = ("created", "completed", "generation")


def _write_golden(root: Path) -> dict[str, Any]:
    store = featurestore.open_store(str(root), mode="a")
    x = np.arange(6 * 2 * 3, dtype=np.float32).reshape(6, 2, 3) / 4  # exact in bfloat16
    w = store.create_split("pannuke", "tiny-vit", "train", num_samples=6, sample_shape=(2, 3),
                           dtype="bfloat16", chunk_bytes=48, label_dtype="int64",
                           metadata={"preprocessing": {"resize": 224}, "note": "golden"})
    w.write(0, x, labels=np.arange(6))
    return w.commit()


def _doc(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


GOLDEN_SPLIT = {
    "format": "featurestore",
    "format_version": 1,
    "status": "complete",
    "dataset": "pannuke",
    "encoder_name": "tiny-vit",
    "split": "train",
    "num_samples": 6,
    "sample_shape": [2, 3],
    "logical_dtype": "bfloat16",
    "source_dtype": "float32",
    "chunk_rows": 4,
    "compressor": None,
    "labels": {"shape": [], "dtype": "int64"},
    "ids": False,
    "encoder": {"name": "tiny-vit", "spec": None, "weights_hash": None},
    "preprocessing": {"resize": 224},
    "token_layout": None,
    "cache_key": None,
    "quantization": {
        "source_dtype": "float32", "stored_dtype": "bfloat16", "exact": True, "values": 36,
        "abs_max": 8.75, "max_abs_error": 0.0, "max_rel_error": 0.0,
        "rel_error_floor": 6.103515625e-05, "rms_error": 0.0, "rel_rms_error": 0.0,
        "overflow_count": 0, "nan_count": 0, "inf_count": 0,
    },
    "channel_stats": {"axis": -1, "count": 12, "mean": [4.125, 4.375, 4.625],
                      "std": [2.5890393971509975] * 3},
    "creator": {"name": "featurestore"},
    "note": "golden",
}

GOLDEN_FEATURES = {
    "zarr_format": 3,
    "node_type": "array",
    "shape": [6, 2, 3],
    "data_type": "uint16",
    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 2, 3]}},
    "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
    "fill_value": 0,
    "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
    "attributes": {"featurestore": {"logical_dtype": "bfloat16"}},
    "storage_transformers": [],
}


def test_split_metadata_and_features_document_are_pinned(tmp_path: Path) -> None:
    root = tmp_path / "store"
    returned = _write_golden(root)
    split_dir = root / "pannuke" / "tiny-vit" / "train"
    doc = _doc(split_dir / "zarr.json")
    assert set(doc) == {"zarr_format", "node_type", "attributes"}
    assert (doc["zarr_format"], doc["node_type"]) == (3, "group")
    assert set(doc["attributes"]) == {"featurestore"}
    meta = doc["attributes"]["featurestore"]
    assert meta == returned
    # The volatile keys sit after "creator", in this order, before the user's keys.
    assert list(meta)[list(meta).index("creator") + 1:][:3] == list(VOLATILE)
    assert len(meta["generation"]) == 13 and int(meta["generation"], 16) < 2**52
    meta_generation = meta["generation"]
    for key in VOLATILE:
        assert isinstance(meta.pop(key), str)
    assert meta["creator"].pop("version") == featurestore.__version__
    assert list(meta) == list(GOLDEN_SPLIT)  # key order too: the document is meant to be read
    std = meta["channel_stats"].pop("std")
    golden = json.loads(json.dumps(GOLDEN_SPLIT))
    assert std == pytest.approx(golden["channel_stats"].pop("std"), rel=1e-12)
    assert meta == golden

    assert _doc(split_dir / "features" / "zarr.json") == GOLDEN_FEATURES
    labels = _doc(split_dir / "labels" / "zarr.json")
    assert (labels["shape"], labels["data_type"], labels["chunk_grid"]["configuration"]["chunk_shape"]) == ([6], "int64", [4])
    stats = _doc(split_dir / "chunk_stats" / "zarr.json")
    # 11 scalars, mean and M2 per channel, then the seal: generation and chunk index.
    assert (stats["shape"], stats["data_type"]) == ([2, 11 + 2 * 3 + 2], "float64")
    row = np.frombuffer((split_dir / "chunk_stats" / "c" / "1" / "0").read_bytes()[:-4], np.float64)
    assert (int(row[-2]), int(row[-1])) == (int(meta_generation, 16), 1)

    # Golden bytes: an uncompressed chunk is the raw little-endian rows (the edge chunk padded
    # with the fill value to full chunk shape), then crc32c of those bytes, little-endian.
    x = np.arange(36, dtype=np.float32).reshape(6, 2, 3) / 4
    rows = np.zeros((4, 2, 3), np.uint16)
    rows[:2] = x[4:].astype(ml_dtypes.bfloat16).view(np.uint16)
    payload = rows.astype("<u2").tobytes()
    chunk = (split_dir / "features" / "c" / "1" / "0" / "0").read_bytes()
    assert chunk == payload + crc32c.crc32c(payload).to_bytes(4, "little")
    assert sorted(os.listdir(split_dir / "features" / "c")) == ["0", "1"]


def test_root_attributes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    featurestore.open_store(str(root), mode="a")
    assert _doc(root / "zarr.json") == {
        "zarr_format": 3, "node_type": "group",
        "attributes": {"featurestore": {"format": "featurestore", "version": 1}},
    }
    assert featurestore.open_store(str(root)).datasets() == []


def _set_version(path: Path, version: Any, *keys: str) -> None:
    doc = _doc(path)
    node = doc["attributes"]["featurestore"]
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = version
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("version", [99, 0, "1", None])
def test_unknown_root_version_is_refused(tmp_path: Path, version: Any) -> None:
    root = tmp_path / "store"
    _write_golden(root)
    _set_version(root / "zarr.json", version, "version")
    for mode in ("r", "a"):
        with pytest.raises(UnsupportedFormatVersion) as info:
            featurestore.open_store(str(root), mode=mode)
        assert repr(version) in str(info.value) and "upgrade" in str(info.value)


def test_unknown_split_version_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _write_golden(root)
    _set_version(root / "pannuke" / "tiny-vit" / "train" / "zarr.json", 99, "format_version")
    store = featurestore.open_store(str(root), mode="a")
    with pytest.raises(UnsupportedFormatVersion, match="99"):
        store.open("pannuke", "tiny-vit", "train")
    with pytest.raises(UnsupportedFormatVersion):
        store.split_metadata("pannuke", "tiny-vit", "train")
    with pytest.raises(UnsupportedFormatVersion):
        store.create_split("pannuke", "tiny-vit", "train", num_samples=6, sample_shape=(2, 3),
                           dtype="bfloat16", chunk_bytes=48, label_dtype="int64", resume=True)


def test_missing_store(tmp_path: Path, memory_url: str) -> None:
    for url in (str(tmp_path / "nowhere"), str(tmp_path), f"file://{tmp_path}/nowhere", memory_url, ""):
        with pytest.raises(StoreNotFound):
            featurestore.open_store(url)
    assert issubclass(StoreNotFound, FileNotFoundError)
    zarr_root = tmp_path / "plain-zarr"
    zarr_root.mkdir()
    (zarr_root / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(NotAFeatureStore):
        featurestore.open_store(str(zarr_root))
    with pytest.raises(FeatureStoreError):
        featurestore.open_store(str(tmp_path / "x"), mode="w")


BAD_NAMES = ["../x", "..", "", "a/b", "%2e%2e", "x" * 129, ".hidden", "a\\b", "a b", "a\x00b", "-x", None, 3,
             # reserved by the layout (featurestore.format.names): the group document at every
             # level (any case: case-insensitive file systems), and temporary files
             "zarr.json", "ZARR.JSON", "Zarr.Json", "train.tmp", "x.TMP"]


@pytest.mark.parametrize("bad", BAD_NAMES, ids=repr)
def test_invalid_names_are_refused(tmp_path: Path, bad: Any) -> None:
    root = tmp_path / "store"
    _write_golden(root)
    store = featurestore.open_store(str(root), mode="a")
    good = ["pannuke", "tiny-vit", "train"]
    for position in range(3):
        names = list(good)
        names[position] = bad
        with pytest.raises(InvalidName) as info:
            store.open(*names)
        assert repr(bad) in str(info.value)
        with pytest.raises(InvalidName):
            store.create_split(*names, num_samples=2, sample_shape=(2, 3), overwrite=True)
    with pytest.raises(InvalidName):
        store.encoders(bad)
    with pytest.raises(InvalidName):
        store.splits("pannuke", bad)
    # nothing was created outside (or inside) the store by the refused calls
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    assert store.datasets() == ["pannuke"] and store.splits("pannuke", "tiny-vit") == ["train"]


def test_names_of_the_arrays_inside_a_split_stay_valid(tmp_path: Path) -> None:
    """Only what sits beside a name in the layout is reserved: the arrays and chunk directories
    of a split live one level below its name, so they are fine as names."""
    store = featurestore.open_store(str(tmp_path / "store"), mode="a")
    names = ("features", "c", "chunk_stats")
    w = store.create_split(*names, num_samples=2, sample_shape=(2, 3), dtype="float32")
    w.write(0, np.ones((2, 2, 3), np.float32))
    w.commit()
    store.create_split("labels", "ids", "zarr", num_samples=2, sample_shape=(2, 3)).close()
    assert store.open(*names).shape == (2, 2, 3)
    assert store.datasets() == ["features", "labels"] and store.splits("labels", "ids") == ["zarr"]


def test_longest_valid_name(tmp_path: Path) -> None:
    store = featurestore.open_store(str(tmp_path / "store"), mode="a")
    name = "a" + "b._-" * 31 + "xyz"
    assert len(name) == 128
    w = store.create_split(name, "e", "s", num_samples=1, sample_shape=(2,), dtype="float32")
    w.write(0, np.ones((1, 2), np.float32))
    w.commit()
    assert store.datasets() == [name]


def test_user_metadata_cannot_set_the_splits_own_keys(tmp_path: Path) -> None:
    """metadata={"status": "complete"} marked an unwritten split complete (then unreadable as
    damaged); num_samples, generation, kind... misstated or broke the split the same way."""
    from featurestore.errors import InvalidMetadata

    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    for key, value in (("status", "complete"), ("num_samples", 5), ("generation", "abc"), ("channel_stats", "x"),
                       ("kind", "bags")):
        with pytest.raises(InvalidMetadata, match=f"metadata key '{key}' is the split's own"):
            store.create_split("d", "e", "m", num_samples=2, sample_shape=(4,), dtype="float16",
                               metadata={key: value})
        with pytest.raises(InvalidMetadata, match=f"metadata key '{key}' is the split's own"):
            store.create_bag_split("d", "e", "b", dim=4, metadata={key: value})
    ok = store.create_split("d", "e", "m", num_samples=2, sample_shape=(4,), dtype="float16",
                            metadata={"cache_key": "k", "encoder": {"name": "e"}, "note": "mine"})
    ok.write(0, np.ones((2, 4), np.float32))
    ok.commit()
    assert store.split_metadata("d", "e", "m")["note"] == "mine"


@pytest.mark.parametrize(("ids", "says"), [
    (["a", "a"], "ids\\[1\\] 'a' names an earlier sample too"),
    ([None, "x"], "ids\\[0\\] is None \\(NoneType\\): sample ids are strings"),
    ([1, 2], "ids\\[0\\] is 1 \\(int\\)"),
    (["\ud800", "x"], "is not valid Unicode text"),
])
def test_sample_ids_are_distinct_strings(tmp_path: Path, ids: list[object], says: str) -> None:
    """Duplicates made positions_of ambiguous, None and ints were stored as 'None' and '1', and a
    lone surrogate failed inside zarr, leaving a split in 'writing'."""
    from featurestore.errors import ShapeMismatch, SplitNotFound

    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    with pytest.raises(ShapeMismatch, match=says):
        store.create_split("d", "e", "s", num_samples=2, sample_shape=(4,), dtype="float16", ids=ids)  # type: ignore[arg-type]
    with pytest.raises((SplitNotFound, FeatureStoreError)):
        store.split_info("d", "e", "s")  # nothing was written


def test_commit_with_rows_missing_counts_them_all(tmp_path: Path) -> None:
    """4 of 20 rows written (one chunk begun): 16 never written, not the 4 left of that chunk."""
    from featurestore.errors import MissingChunks

    w = featurestore.open_store(str(tmp_path / "s"), mode="a").create_split(
        "d", "e", "s", num_samples=20, sample_shape=(2,), dtype="float32", chunk_rows=8)
    w.write(0, np.ones((4, 2), np.float32))
    with pytest.raises(MissingChunks, match="16 samples were never written \\(first in chunk 0, rows \\(0, 8\\)\\)"):
        w.commit()


def test_a_store_path_that_is_or_is_under_a_file_is_one_error(tmp_path: Path) -> None:
    """open_store(a file, mode="a") raised FileExistsError, a path under a file NotADirectoryError."""
    from featurestore.errors import InvalidOption

    (tmp_path / "f").write_text("")
    for url in (tmp_path / "f", tmp_path / "f" / "store"):
        with pytest.raises(InvalidOption, match="is, or is under, a file: a store is a directory"):
            featurestore.open_store(str(url), mode="a")
