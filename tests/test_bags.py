"""Bag splits, local: writer, reader, layout and the format's promises (docs/FORMAT.md, "Slide bags")."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch
from reader_contract import expected_bits as stored_bits

from featurestore import open_store
from featurestore.errors import (
    BagNotFound,
    DuplicateBag,
    FeatureStoreError,
    Float16Overflow,
    IncompleteSplit,
    IndexOutOfRange,
    ShapeMismatch,
    SplitExists,
    UnsupportedFormatVersion,
    WrongSplitKind,
)
from featurestore.format import bags as bag_format

DIM = 8
ODD_IDS = ["../x", "a/b", "ünïcödé-切片", "<script>alert(1)</script>", "zarr.json", " spaced ", "C:\\slide.svs"]


def make_bags(seed: int = 0, lengths: tuple[int, ...] = (25, 3, 0, 12, 7, 10, 40)) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, n in enumerate(lengths):
        bag_id = ODD_IDS[i % len(ODD_IDS)] + ("" if i < len(ODD_IDS) else str(i))
        out[bag_id] = (rng.standard_normal((n, DIM)).astype(np.float32), rng.integers(0, 100_000, (n, 2)))
    return out


def write(root: Any, data: dict[str, Any], *, dtype: str = "float16", order: list[str] | None = None,
          chunk_rows: int = 10, split: str = "train", **kw: Any) -> dict[str, Any]:
    store = open_store(str(root), mode="a")
    itemsize = 4 if dtype == "float32" else 2
    writer = store.create_bag_split("ds", "enc", split, dim=DIM, dtype=dtype, chunk_bytes=chunk_rows * DIM * itemsize, **kw)
    for bag_id in order or list(data):
        features, coords = data[bag_id]
        writer.add_bag(bag_id, features, coords=coords, label=len(bag_id) % 3, attrs={"name": bag_id, "mpp": 0.25})
    return writer.commit()


def tree_bytes(root: Any, split: str = "train") -> dict[str, bytes]:
    """Every file of a split but its group document (timestamps, generation), bag_stats and
    chunk_seals (sealed with the generation)."""
    top = os.path.join(str(root), "ds", "enc", split)
    out = {}
    for directory, _, files in os.walk(top):
        for name in files:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, top)
            if rel != "zarr.json" and not rel.startswith(("bag_stats", "chunk_seals")):
                out[rel] = open(path, "rb").read()
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip_bit_exact(tmp_path: Any, dtype: str) -> None:
    data = make_bags()
    meta = write(tmp_path, data, dtype=dtype)
    assert meta["kind"] == "bags" and meta["format_version"] == 2 and meta["status"] == "complete"
    assert meta["bags"]["count"] == len(data) and meta["num_samples"] == sum(len(f) for f, _ in data.values())
    bags = open_store(str(tmp_path)).open_bags("ds", "enc", "train")
    assert len(bags) == len(data) and bags.ids == sorted(data) and bags.dim == DIM and bags.dtype == dtype
    for bag_id, (features, coords) in data.items():
        got, got_coords = bags.read_numpy(bag_id)
        assert got.shape == (len(features), DIM)
        np.testing.assert_array_equal(got.view(stored_bits(features, dtype).dtype), stored_bits(features, dtype))
        np.testing.assert_array_equal(got_coords, coords)
        tensor, coord_tensor = bags.read(bag_id)
        expected_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        assert tensor.dtype == expected_dtype and coord_tensor.dtype == torch.int64
        assert bags.attrs(bag_id) == {"name": bag_id, "mpp": 0.25}
        assert bags.lengths[bags.index(bag_id)] == len(features)
    np.testing.assert_array_equal(bags.labels, [len(i) % 3 for i in sorted(data)])


def test_empty_bag_and_bag_larger_than_a_chunk(tmp_path: Any) -> None:
    data = make_bags(lengths=(0, 95, 0))  # 95 rows over chunks of 10
    write(tmp_path, data)
    bags = open_store(str(tmp_path)).open_bags("ds", "enc", "train")
    empty = [b for b in data if len(data[b][0]) == 0]
    for bag_id in empty:
        features, coords = bags.read_numpy(bag_id)
        assert features.shape == (0, DIM) and coords.shape == (0, 2)
    big = next(b for b in data if len(data[b][0]) == 95)
    np.testing.assert_array_equal(bags.read_numpy(big)[0], data[big][0].astype(np.float16))
    assert list(bags.lengths) == [len(data[b][0]) for b in sorted(data)]


def test_only_empty_bags(tmp_path: Any) -> None:
    meta = write(tmp_path, make_bags(lengths=(0, 0)))
    assert meta["num_samples"] == 0 and meta["bags"]["count"] == 2
    bags = open_store(str(tmp_path)).open_bags("ds", "enc", "train")
    assert list(bags.lengths) == [0, 0] and bags.read_numpy(0)[0].shape == (0, DIM)


def test_rows_subset_and_out_buffer(tmp_path: Any) -> None:
    data = make_bags()
    write(tmp_path, data, dtype="bfloat16")
    bags = open_store(str(tmp_path)).open_bags("ds", "enc", "train")
    bag_id = max(data, key=lambda b: len(data[b][0]))
    rows = np.array([0, 3, 17, 39])
    out = np.empty((4, DIM), np.uint16)
    features, coords = bags.read_numpy(bag_id, rows=rows, out=out)
    assert features is out
    np.testing.assert_array_equal(out, stored_bits(data[bag_id][0], "bfloat16")[rows])
    np.testing.assert_array_equal(coords, data[bag_id][1][rows])
    with pytest.raises(IndexOutOfRange):
        bags.read_numpy(bag_id, rows=np.array([40]))
    with pytest.raises(ShapeMismatch):
        bags.read_numpy(bag_id, out=np.empty((3, DIM), np.uint16))


def test_same_bytes_whatever_the_arrival_order_and_sessions(tmp_path: Any) -> None:
    data = make_bags(lengths=(25, 3, 0, 12, 7, 10, 40, 1, 9))
    ids = list(data)
    write(tmp_path / "sorted", data, order=sorted(ids))
    write(tmp_path / "shuffled", data, order=ids[::-1])
    # three sessions (a resume after each close), bags in yet another order
    store = open_store(str(tmp_path / "sessions"), mode="a")
    parts = [ids[4:], ids[:2], ids[2:4]]
    for n, part in enumerate(parts):
        writer = store.create_bag_split("ds", "enc", "train", dim=DIM, chunk_bytes=10 * DIM * 2, resume=n > 0)
        assert writer.done_ids == set().union(*parts[:n])
        for bag_id in part:
            features, coords = data[bag_id]
            writer.add_bag(bag_id, features, coords=coords, label=len(bag_id) % 3, attrs={"name": bag_id, "mpp": 0.25})
        writer.close()
    writer.commit()
    reference = tree_bytes(tmp_path / "sorted")
    assert tree_bytes(tmp_path / "shuffled") == reference
    assert tree_bytes(tmp_path / "sessions") == reference
    assert not os.path.exists(tmp_path / "sessions" / "ds" / "enc" / "train" / "segments")


def test_single_writer_in_id_order_links_chunks(tmp_path: Any) -> None:
    """Bags added in id order by one writer are already laid out: commit links, copies nothing."""
    data = make_bags(lengths=(30, 20, 10))
    store = open_store(str(tmp_path), mode="a")
    writer = store.create_bag_split("ds", "enc", "train", dim=DIM, chunk_bytes=10 * DIM * 2)
    for bag_id in sorted(data):
        writer.add_bag(bag_id, data[bag_id][0], coords=data[bag_id][1])
    writer.close()
    segment = tmp_path / "ds" / "enc" / "train" / "segments" / writer.segment
    inodes = [os.stat(segment / "features" / "c" / str(i) / "0").st_ino for i in range(6)]
    writer.commit()
    final = tmp_path / "ds" / "enc" / "train" / "features" / "c"
    assert [os.stat(final / str(i) / "0").st_ino for i in range(6)] == inodes


def test_zarr_python_reads_the_split_without_featurestore(tmp_path: Any) -> None:
    import zarr

    data = make_bags()
    write(tmp_path, data, dtype="float32")
    group = zarr.open_group(str(tmp_path / "ds" / "enc" / "train"), mode="r")
    offsets = group["offsets"][:]
    ids = [str(v) for v in group["bag_ids"][:]]
    labels = group["labels"][:]
    features, coords = group["features"], group["coords"]
    assert ids == sorted(data) and len(offsets) == len(ids) + 1
    for i, bag_id in enumerate(ids):
        np.testing.assert_array_equal(features[offsets[i] : offsets[i + 1]], data[bag_id][0])
        np.testing.assert_array_equal(coords[offsets[i] : offsets[i + 1]], data[bag_id][1])
        assert labels[i] == len(bag_id) % 3
        assert json.loads(str(group["bag_attrs"][i]))["name"] == bag_id
    assert group.attrs["featurestore"]["kind"] == "bags"


def test_unknown_id_and_position(tmp_path: Any) -> None:
    write(tmp_path, make_bags())
    bags = open_store(str(tmp_path)).open_bags("ds", "enc", "train")
    with pytest.raises(BagNotFound) as caught:
        bags.read("no-such-slide")
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, FeatureStoreError)
    assert "no-such-slide" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(IndexOutOfRange):
        bags.read(len(bags))


def test_ids_are_data_never_paths(tmp_path: Any) -> None:
    write(tmp_path, make_bags())
    names = set()
    for directory, dirs, files in os.walk(tmp_path):
        names.update(dirs)
        names.update(files)
    assert not names & {"x", "a", "b", "<script>alert(1)</script>"}
    assert not os.path.exists(tmp_path / "ds" / "enc" / "x")


def test_refusals(tmp_path: Any) -> None:
    store = open_store(str(tmp_path), mode="a")
    writer = store.create_bag_split("ds", "enc", "train", dim=DIM)
    with pytest.raises(Float16Overflow):
        writer.add_bag("hot", np.full((2, DIM), 1e5, np.float32))
    with pytest.raises(ShapeMismatch, match="coords"):
        writer.add_bag("short", np.zeros((3, DIM), np.float32), coords=np.zeros((2, 2), np.int64))
    with pytest.raises(ShapeMismatch):
        writer.add_bag("wide", np.zeros((3, DIM + 1), np.float32))
    writer.add_bag("ok", np.zeros((3, DIM), np.float32))
    with pytest.raises(DuplicateBag):
        writer.add_bag("ok", np.zeros((3, DIM), np.float32))
    assert writer.done_ids == {"ok"}  # refused bags left nothing behind
    writer.commit()
    with pytest.raises(SplitExists):
        store.create_bag_split("ds", "enc", "train", dim=DIM)
    with pytest.raises(WrongSplitKind, match="open_bags"):
        store.open("ds", "enc", "train")
    with pytest.raises(WrongSplitKind):
        store.create_split("ds", "enc", "train", num_samples=3, sample_shape=(DIM,), resume=True)
    assert store.split_kind("ds", "enc", "train") == "bags"


def test_incomplete_split_is_not_read(tmp_path: Any) -> None:
    store = open_store(str(tmp_path), mode="a")
    writer = store.create_bag_split("ds", "enc", "train", dim=DIM)
    writer.add_bag("a", np.zeros((3, DIM), np.float32))
    writer.close()
    with pytest.raises(IncompleteSplit):
        store.open_bags("ds", "enc", "train")


def test_version_1_reader_refuses_a_bag_split(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader of format version 1 (READ_FORMAT_VERSION 1) refuses it with one clear line."""
    write(tmp_path, make_bags())
    from featurestore.format import layout

    monkeypatch.setattr(layout, "READ_FORMAT_VERSION", 1)
    with pytest.raises(UnsupportedFormatVersion, match="upgrade featurestore"):
        open_store(str(tmp_path)).split_info("ds", "enc", "train")


def test_statistics_and_report(tmp_path: Any) -> None:
    data = make_bags()
    meta = write(tmp_path, data, dtype="float16")
    values = np.concatenate([f for f, _ in data.values()])
    stored = values.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(meta["channel_stats"]["mean"], stored.mean(axis=0), rtol=1e-9, atol=1e-12)
    q = meta["quantization"]
    assert q["source_dtype"] == "float32" and q["stored_dtype"] == "float16" and not q["exact"]
    assert q["values"] == values.size
    assert q["max_abs_error"] == pytest.approx(float(np.abs(stored - values).max()))


def test_coords_in_micrometres_and_no_coords(tmp_path: Any) -> None:
    store = open_store(str(tmp_path), mode="a")
    writer = store.create_bag_split("ds", "enc", "um", dim=DIM, coords_unit="um", coords_dtype="float32",
                                    patch_size_level0=224)
    coords = np.array([[0.5, 1.25], [112.0, 3.5]], np.float32)
    writer.add_bag("s1", np.ones((2, DIM), np.float32), coords=coords)
    writer.add_bag("s2", np.ones((1, DIM), np.float32))
    meta = writer.commit()
    assert meta["bags"]["coords"] == {"unit": "um", "dtype": "float32"} and meta["bags"]["patch_size_level0"] == 224
    bags = store.open_bags("ds", "enc", "um")
    np.testing.assert_array_equal(bags.read_numpy("s1")[1], coords)
    assert np.isnan(bags.read_numpy("s2")[1]).all()
    assert bags.patch_size_of("s1") == bags.patch_size_of(1) == 224  # the split's


def test_a_bags_patch_size_is_the_splits_else_its_own(tmp_path: Any) -> None:
    """Slide extraction records each slide's level-0 patch side on its bag (slides differ in
    magnification), none on the split."""
    store = open_store(str(tmp_path), mode="a")
    writer = store.create_bag_split("ds", "enc", "wsi", dim=DIM)
    for bag_id, attrs in (("x40", {"patch_size_level0": 512}), ("x20", {"patch_size_level0": 256}),
                          ("none", {}), ("bad", {"patch_size_level0": "big"})):
        writer.add_bag(bag_id, np.ones((1, DIM), np.float32), coords=np.zeros((1, 2), np.int64), attrs=attrs)
    writer.commit()
    bags = store.open_bags("ds", "enc", "wsi")
    assert bags.patch_size_level0 is None
    assert [bags.patch_size_of(b) for b in ("x40", "x20", "none", "bad")] == [512, 256, None, None]


def test_records_round_trip() -> None:
    record = bag_format.BagRecord("../x", 5, 3, 1, "{}", np.arange(4, dtype=np.float64))
    filled, [back] = bag_format.decode_records(bag_format.encode_records([record], 8).tobytes())
    assert filled == 8 and back.bag_id == "../x" and back.start == 5 and np.array_equal(back.stats, record.stats)


def test_verify_clean_and_damaged(tmp_path: Any) -> None:
    from featurestore.core.verify import verify_store

    write(tmp_path, make_bags(), dtype="bfloat16")
    store = open_store(str(tmp_path))
    [check] = verify_store(store).checks
    assert check.problems == [] and check.chunks_checked > 10
    top = tmp_path / "ds" / "enc" / "train"
    # two features chunks of different bags swapped: each crc32c still valid, the bags' means differ
    a, b = top / "features" / "c" / "0" / "0", top / "features" / "c" / "7" / "0"
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(raw_b)
    b.write_bytes(raw_a)
    [check] = verify_store(store).checks
    assert any("do not match its statistics row" in p for p in check.problems)
    a.write_bytes(raw_a)
    b.write_bytes(raw_b)
    # a flipped byte in coords, and offsets that disagree with the features
    coords = top / "coords" / "c" / "0" / "0"
    raw = bytearray(coords.read_bytes())
    raw[3] ^= 1
    coords.write_bytes(bytes(raw))
    [check] = verify_store(store).checks
    assert any("coords/c/0/0: crc32c mismatch" in p for p in check.problems)


def test_ls_info_verify_cli(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from featurestore.cli import main

    write(tmp_path, make_bags())
    assert main(["ls", str(tmp_path)]) == 0
    assert "7 bags, 97x8" in capsys.readouterr().out
    assert main(["info", str(tmp_path), "ds", "enc", "train"]) == 0
    out = capsys.readouterr().out
    assert "bags: 7" in out and "patches: 97" in out and "dim: 8" in out
    assert main(["info", str(tmp_path), "ds/enc/train"]) == 0  # as ls prints it
    assert capsys.readouterr().out == out
    for names in (["ds/enc"], ["ds", "enc"], ["ds/enc/train", "x"]):
        with pytest.raises(SystemExit):
            main(["info", str(tmp_path), *names])
        assert "names no split: give DATASET ENCODER SPLIT, or DATASET/ENCODER/SPLIT" in capsys.readouterr().err
    assert main(["verify", str(tmp_path)]) == 0
    assert "ds/enc/train: ok" in capsys.readouterr().out


def test_same_id_from_two_writers_is_kept_once(tmp_path: Any) -> None:
    store = open_store(str(tmp_path), mode="a")
    first = store.create_bag_split("ds", "enc", "train", dim=DIM)
    second = store.create_bag_split("ds", "enc", "train", dim=DIM, resume=True)  # attached before either closed
    first.add_bag("dup", np.ones((2, DIM), np.float32))
    second.add_bag("dup", np.full((3, DIM), 2, np.float32))
    second.add_bag("other", np.zeros((1, DIM), np.float32))
    first.close()
    second.close()
    meta = store.create_bag_split("ds", "enc", "train", dim=DIM, resume=True).commit()
    bags = store.open_bags("ds", "enc", "train")
    assert bags.ids == ["dup", "other"] and meta["bags"]["count"] == 2
    segments = sorted([first.segment, second.segment])
    kept = 2 if segments[0] == first.segment else 3  # the first segment by name wins
    assert len(bags.read_numpy("dup")[0]) == kept


def test_cache_key_and_settings_are_checked_on_resume(tmp_path: Any) -> None:
    from featurestore.errors import CacheKeyMismatch, SplitSettingsMismatch

    store = open_store(str(tmp_path), mode="a")
    store.create_bag_split("ds", "enc", "train", dim=DIM, metadata={"cache_key": "a"}).close()
    with pytest.raises(CacheKeyMismatch):
        store.create_bag_split("ds", "enc", "train", dim=DIM, metadata={"cache_key": "b"}, resume=True)
    with pytest.raises(SplitSettingsMismatch):
        store.create_bag_split("ds", "enc", "train", dim=DIM, coords_unit="um", resume=True)
    with pytest.raises(ShapeMismatch):
        store.create_bag_split("ds", "enc", "train", dim=DIM + 1, resume=True)


def test_reader_pickles_for_dataloader_workers(tmp_path: Any) -> None:
    import pickle

    data = make_bags()
    write(tmp_path, data)
    bags = pickle.loads(pickle.dumps(open_store(str(tmp_path)).open_bags("ds", "enc", "train")))
    bag_id = sorted(data)[1]
    np.testing.assert_array_equal(bags.read_numpy(bag_id)[0], data[bag_id][0].astype(np.float16))


def test_complete_split_resumed_takes_no_new_bags(tmp_path: Any) -> None:
    write(tmp_path, make_bags())
    store = open_store(str(tmp_path), mode="a")
    writer = store.create_bag_split("ds", "enc", "train", dim=DIM, chunk_bytes=10 * DIM * 2, resume=True)
    assert writer.done_ids == set(make_bags())
    with pytest.raises(SplitExists, match="overwrite"):
        writer.add_bag("new", np.zeros((1, DIM), np.float32))
    assert writer.commit()["status"] == "complete"


def test_labels_every_bag_or_none(tmp_path: Any) -> None:
    from featurestore.errors import InvalidLabels

    store = open_store(str(tmp_path), mode="a")
    declared = store.create_bag_split("ds", "enc", "declared", dim=DIM, label_dtype="uint8")
    with pytest.raises(InvalidLabels, match="no label"):
        declared.add_bag("a", np.zeros((1, DIM), np.float32))
    from featurestore.errors import DtypeMismatch

    with pytest.raises(DtypeMismatch):
        declared.add_bag("a", np.zeros((1, DIM), np.float32), label=300)
    declared.add_bag("a", np.zeros((1, DIM), np.float32), label=3)
    assert declared.commit()["bags"]["labels"] == {"dtype": "uint8"}
    inferred = store.create_bag_split("ds", "enc", "inferred", dim=DIM)
    inferred.add_bag("a", np.zeros((1, DIM), np.float32), label=0.5)
    with pytest.raises(InvalidLabels, match="no label"):
        inferred.add_bag("b", np.zeros((1, DIM), np.float32))
    inferred.commit()
    assert store.open_bags("ds", "enc", "inferred").labels.dtype == np.float64
