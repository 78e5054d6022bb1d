"""A split's two sizes (``featurestore.format.sizes``), from metadata alone, against the files the
writers really put on disk: ``stored`` is the byte count of every chunk file of the numeric arrays
(strings and ``zarr.json`` documents are what it leaves out, and says so), ``data`` the values'."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import featurestore
from featurestore.format.sizes import UNCOUNTED, SplitSize, bytes_text, split_size

STRINGS = ("bag_ids", "bag_attrs", "ids")  # vlen-utf8 arrays: sized by their values, not counted


def chunk_file_bytes(store: str, split: str) -> int:
    root = Path(store) / "d" / "e" / split
    total = 0
    for folder, _, files in os.walk(root):
        rel = Path(folder).relative_to(root).parts
        if rel and rel[0] in STRINGS:
            continue
        total += sum(os.path.getsize(Path(folder) / f) for f in files if f != "zarr.json")
    return total


def add_bags(store: object, split: str, lengths: list[int], dim: int, **options: object) -> None:
    w = store.create_bag_split("d", "e", split, dim=dim, dtype="float16", **options)  # type: ignore[attr-defined]
    labelled = options.get("label_dtype") is not None
    for i, n in enumerate(lengths):
        w.add_bag(f"slide-{i:03d}", np.ones((n, dim), np.float32), coords=np.zeros((n, 2), np.int64),
                  **({"label": i % 3} if labelled else {}))  # fmt: skip
    w.commit()


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("sizes") / "store")
    store = featurestore.open_store(path, mode="a")
    # The demo's case: 2,181 patches of 32 float16 in default (8 MiB) chunks: one whole chunk.
    add_bags(store, "small", [110] * 19 + [91], 32, label_dtype="int64")
    add_bags(store, "chunked", [30, 0, 45, 17, 58], 8, chunk_bytes=16 * 8 * 2)  # 150 rows in 16-row chunks
    add_bags(store, "no-bags", [], 8)
    add_bags(store, "um", [3, 4], 8, coords_dtype="float32", coords_unit="um", label_dtype="uint8")
    w = store.create_split("d", "e", "dense", num_samples=23, sample_shape=(4, 8), dtype="float16",
                           label_dtype="int64", chunk_bytes=5 * 4 * 8 * 2)  # fmt: skip
    w.write(0, np.ones((23, 4, 8), np.float32), labels=np.arange(23))
    w.commit()
    w = store.create_split("d", "e", "ids", num_samples=3, sample_shape=(8,), dtype="bfloat16", ids=["a", "b", "c"])
    w.write(0, np.ones((3, 8), np.float32))
    w.commit()
    return path


@pytest.mark.parametrize("split", ["small", "chunked", "no-bags", "um", "dense", "ids"])
def test_stored_bytes_are_the_chunk_files_on_disk(store_path: str, split: str) -> None:
    size = split_size(featurestore.open_store(store_path).split_info("d", "e", split))
    assert size.stored == chunk_file_bytes(store_path, split)
    assert size.floor == (split != "dense") and not size.notes == (split == "dense")


def test_data_bytes_are_the_values(store_path: str) -> None:
    store = featurestore.open_store(store_path)
    sizes = {s: split_size(store.split_info("d", "e", s)) for s in ("small", "chunked", "um", "dense", "ids")}
    assert sizes["small"].data == 2181 * (32 * 2 + 2 * 8) + 20 * 8  # features, coords, int64 labels
    assert sizes["chunked"].data == 150 * (8 * 2 + 2 * 8)  # no labels
    assert sizes["um"].data == 7 * (8 * 2 + 2 * 4) + 2 * 1  # float32 coords, uint8 labels
    assert sizes["dense"].data == 23 * (4 * 8 * 2 + 8)
    assert sizes["ids"].data == 3 * 8 * 2
    # the demo's small split: 170.5 KiB of data, a whole 8 MiB (+2 MiB coords) chunk on storage
    assert sizes["small"].data_text() == "170.5 KiB"
    assert sizes["small"].stored_text() == "at least 10.0 MiB (bag ids and attributes not counted)"
    assert sizes["dense"].stored_text() == bytes_text(chunk_file_bytes(store_path, "dense"))


def test_uncommitted_bag_split_is_not_counted(tmp_path: Path) -> None:
    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    w = store.create_bag_split("d", "e", "wip", dim=8)
    w.add_bag("a", np.ones((3, 8), np.float32))
    w.close()
    size = split_size(store.split_info("d", "e", "wip"))
    assert size == SplitSize(None, None)
    assert size.data_text() == size.stored_text() == UNCOUNTED


def test_a_dense_split_being_written_has_no_storage_figure(tmp_path: Path) -> None:
    """It showed its planned full size "on storage" (ls, info, the page) with 8 of 40 samples written."""
    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    w = store.create_split("d", "e", "wip", num_samples=40, sample_shape=(4,), dtype="float16")
    w.write(0, np.zeros((8, 4), np.float32))
    w.close()
    size = split_size(store.split_info("d", "e", "wip"))
    assert size.stored_text() == UNCOUNTED and size.data == 40 * 4 * 2  # the split's planned data, said as such


def test_bytes_text() -> None:
    assert [bytes_text(n) for n in (0, 1023, 1024, 139_571, 10 << 20, 5 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "136.3 KiB", "10.0 MiB", "5.0 TiB"]


def test_compressed_features_are_counted_uncompressed_and_said_so(tmp_path: Path) -> None:
    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    w = store.create_split("d", "e", "z", num_samples=10, sample_shape=(8,), dtype="float16", compressor="zstd",
                           chunk_rows=4)  # fmt: skip
    w.write(0, np.zeros((10, 8), np.float32))
    w.commit()
    size = split_size(store.split_info("d", "e", "z"))
    assert size.data == 10 * 8 * 2 and size.stored is not None and size.stored >= 3 * 4 * 8 * 2
    assert not size.floor and size.stored_text().endswith("(features counted uncompressed, stored with zstd)")
