"""One seal model for cached reads: a cached chunk file this process did not fetch is checked
against the split's ``chunk_seals`` (either kind, int8 ``scales`` included), with no request per
chunk; only where the table seals nothing (a dense split committed before it existed, an older
int8 bag split's scales) against the stored objects' crc32c trailers by ranged GETs.

The requests are counted on the real storage (SeaweedFS) by a pass-through wrapper of its
``read_ranges``: a trailer check is a batch of 4-byte ranges.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.cli import main
from featurestore.core import seals
from featurestore.core.storage import LocalStorage
from featurestore.format import layout
from featurestore.format.seals import SEALED_ARRAYS

DIM, ROWS, N = 8, 16, 160
DENSE = ("ds", "enc", "dense")


def _write_dense(url: str, options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    values = (1000 + np.arange(N * DIM).reshape(N, DIM) // DIM).astype(np.float32)
    labels = np.arange(N, dtype=np.int64) + 1000
    writer = featurestore.open_store(url, mode="a", **options).create_split(
        *DENSE, num_samples=N, sample_shape=(DIM,), dtype="float32", chunk_rows=ROWS,
        label_shape=(), label_dtype="int64")
    writer.write(0, values, labels=labels)
    writer.commit()
    return values, labels


def _int8_bags(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"slide-{i:02d}": rng.standard_normal((int(rng.integers(3, 30)), DIM)).astype(np.float32) * (i + 1)
            for i in range(6)}


def _write_int8_bags(url: str, options: dict[str, Any], split: str, seed: int) -> None:
    writer = featurestore.open_store(url, mode="a", **options).create_bag_split(
        "ds", "enc", split, dim=DIM, dtype="int8", chunk_bytes=ROWS * DIM)
    for bag_id, x in _int8_bags(seed).items():
        writer.add_bag(bag_id, x)
    writer.commit()


_FILL = textwrap.dedent("""
    import sys, json, numpy as np, featurestore
    url, cache, options, kind, split = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
    store = featurestore.open_store(url, cache_dir=cache, **options)
    if kind == "bags":
        bags = store.open_bags("ds", "enc", split)
        for bag_id in bags.ids:
            bags.read_numpy(bag_id)
    else:
        dense = store.open("ds", "enc", split)
        dense.read_numpy(np.arange(len(dense)))
        dense.labels.read_numpy(np.arange(len(dense)))
""")


def _fill_in_another_process(url: str, cache: Path, options: dict[str, Any], kind: str, split: str) -> None:
    """The cache filled by another process: this one did not fetch (so did not check) its files."""
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _FILL, url, str(cache), json.dumps(options), kind, split],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def _cache_files(root: Path, split: str, array: str) -> list[str]:
    found = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
             if f.isdigit() and array in d.split(os.sep) and split in d.split(os.sep)]
    return sorted(found, key=lambda p: [int(part) for part in p.split(os.sep) if part.isdigit()])


def _count_trailer_gets(store: featurestore.FeatureStore) -> list[int]:
    """Batches of 4-byte ranged GETs (crc32c trailers) the store's storage is asked for."""
    storage, batches = store.storage, []
    read_ranges = storage.read_ranges

    def counted(keys: Any, starts: Any, ends: Any) -> Any:
        if any(e - s == layout.CRC_BYTES for s, e in zip(starts, ends)):
            batches.append(len(keys))
        return read_ranges(keys, starts, ends)

    storage.read_ranges = counted
    return batches


@pytest.mark.parametrize("array", ["features", "labels"])
@pytest.mark.parametrize("table", [True, False], ids=["sealed", "committed-before-the-table"])
def test_a_swapped_cached_dense_chunk_is_found_by_the_table(seaweed_url: str, seaweed: Any, tmp_path: Path,
                                                           array: str, table: bool) -> None:
    options = dict(seaweed.storage_options)
    cache = tmp_path / "cache"
    values, labels = _write_dense(seaweed_url, options)
    if not table:  # as a split committed before chunk_seals existed
        featurestore.open_store(seaweed_url, mode="a", **options).storage.delete_tree(
            "/".join(DENSE) + "/chunk_seals")
    _fill_in_another_process(seaweed_url, cache, options, "dense", "dense")
    files = _cache_files(cache, "dense", array)
    assert len(files) == N // ROWS
    shutil.copyfile(files[1], files[0])  # chunk 1's file, its own crc32c valid, at chunk 0's path
    store = featurestore.open_store(seaweed_url, cache_dir=str(cache), **options)
    trailer_gets = _count_trailer_gets(store)
    reader = store.open(*DENSE)
    assert reader.path == "cached"
    np.testing.assert_array_equal(reader.read_numpy(np.arange(N)), values)
    np.testing.assert_array_equal(reader.labels.read_numpy(np.arange(N)), labels)
    with open(files[0], "rb") as a, open(files[1], "rb") as b:
        assert a.read() != b.read()  # found, fetched again
    if table:
        assert trailer_gets == []  # the table, read once, sealed every chunk: no ranged trailer GET
    else:
        assert trailer_gets and sum(trailer_gets) == 2 * N // ROWS  # each cached chunk's trailer, once


def test_int8_bag_scales_are_sealed_and_a_cached_file_checked_by_the_table(
        seaweed_url: str, seaweed: Any, tmp_path: Path) -> None:
    options = dict(seaweed.storage_options)
    cache = tmp_path / "cache"
    for split, seed in (("a", 1), ("b", 2)):
        _write_int8_bags(seaweed_url, options, split, seed)
        _fill_in_another_process(seaweed_url, cache, options, "bags", split)
    store = featurestore.open_store(seaweed_url, **options)
    table = seals.read_table(store.storage, "ds/enc/a")
    scales_rows = table[table[:, 0] == SEALED_ARRAYS.index(layout.SCALES)]
    assert len(scales_rows) == 1  # the scales array's one chunk, sealed
    raw = store.storage.read("ds/enc/a/scales/c/0/0")
    assert int(scales_rows[0, 2]) == int.from_bytes(raw[-4:], "little")
    want = store.open_bags("ds", "enc", "a")
    expected = {bag_id: want.read_numpy(bag_id, dtype="float32")[0] for bag_id in want.ids}

    # split b's scales file (same shape, its crc32c valid) at split a's path
    mine, other = _cache_files(cache, "a", layout.SCALES), _cache_files(cache, "b", layout.SCALES)
    assert len(mine) == len(other) == 1
    shutil.copyfile(other[0], mine[0])
    cached = featurestore.open_store(seaweed_url, cache_dir=str(cache), **options)
    trailer_gets = _count_trailer_gets(cached)
    got = cached.open_bags("ds", "enc", "a")
    assert got.features.path == "cached"
    for bag_id, x in expected.items():
        np.testing.assert_array_equal(got.read_numpy(bag_id, dtype="float32")[0], x)
    assert trailer_gets == []
    with open(mine[0], "rb") as a, open(other[0], "rb") as b:
        assert a.read() != b.read()  # found, fetched again


def test_an_int8_bag_split_sealed_before_its_scales_still_reads_and_verifies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_int8_bags(str(tmp_path), {}, "a", 1)
    storage, key = LocalStorage(str(tmp_path)), "ds/enc/a"
    table = seals.read_table(storage, key)
    older = table[table[:, 0] != SEALED_ARRAYS.index(layout.SCALES)]
    assert len(older) == len(table) - 1
    seals.put_array(storage, f"{key}/chunk_seals", older, attributes={"featurestore": {"arrays": list(SEALED_ARRAYS[:4])}})
    store = featurestore.open_store(str(tmp_path))
    bags = store.open_bags("ds", "enc", "a")
    for bag_id, x in _int8_bags(1).items():
        back = bags.read_numpy(bag_id, dtype="float32")[0]
        assert np.abs(back - x).max() <= np.abs(x).max(axis=0).max() / 127
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 0, capsys.readouterr().out


def test_a_swapped_int8_scales_chunk_is_found_by_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for split, seed in (("a", 1), ("b", 2)):
        _write_int8_bags(str(tmp_path), {}, split, seed)
    chunk = Path(tmp_path, "ds", "enc", "{}", "scales", "c", "0", "0")
    shutil.copyfile(str(chunk).format("b"), str(chunk).format("a"))
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) != 0
    out = capsys.readouterr().out
    assert "ds/enc/a/scales/c/0/0: crc32c" in out and "but the commit sealed" in out, out


def test_dense_int8_scales_are_sealed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = featurestore.open_store(str(tmp_path), mode="a")
    writer = store.create_split(*DENSE, num_samples=64, sample_shape=(DIM,), dtype="int8", chunk_rows=16)
    x = np.random.default_rng(0).standard_normal((64, DIM)).astype(np.float32)
    writer.write(0, x)
    writer.commit()
    key = "/".join(DENSE)
    table = seals.read_table(store.storage, key)
    count = len(table[table[:, 0] == SEALED_ARRAYS.index(layout.SCALES)])
    assert count == store.open(*DENSE).num_chunks >= 2
    chunks = Path(tmp_path, *DENSE, "scales", "c")
    a, b = chunks / "0" / "0", chunks / "1" / "0"
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(raw_b)
    b.write_bytes(raw_a)
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) != 0
    assert "scales/c/0/0: crc32c" in capsys.readouterr().out
    # an older table (no scales rows) still verifies clean once the chunks are back
    a.write_bytes(raw_a)
    b.write_bytes(raw_b)
    seals.put_array(store.storage, f"{key}/chunk_seals", table[table[:, 0] != SEALED_ARRAYS.index(layout.SCALES)])
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 0, capsys.readouterr().out
