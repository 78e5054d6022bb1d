"""A reader opened before an overwrite keeps serving the generation it opened, consistently, or
raises ``SplitChanged`` naming the split: never rows of two generations, never "damaged store"
(featurestore.core.generation, one check shared by every read path). And the chunk cache checks a
cached file against the split's seal for its position, and treats a directory at a chunk's path
as a damaged entry.

Every path is driven for real: local mmap and pread (with a tiny map cache, so maps are evicted
and files reopened), a BagLoader across epochs, ranged GETs and the chunk cache on SeaweedFS, and
HTTP through the server app."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.core import chunk_maps
from featurestore.errors import MissingChunks, SplitChanged

DIM, CHUNK_ROWS, N = 8, 16, 20  # bags: 20 bags, chunks of 16 rows


def _bag_data(seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Bags of seed-dependent lengths; every value names its generation (the integer part)."""
    rng = np.random.default_rng(seed)
    data = {}
    for i in range(N):
        n = int(rng.integers(1, 40))
        features = (seed * 100 + i + np.arange(n * DIM).reshape(n, DIM) % 16 / 32).astype(np.float16)
        coords = np.stack([np.full(n, seed), np.arange(n) + 1000 * i], axis=1).astype(np.int64)
        data[f"slide-{i:02d}"] = (features, coords)
    return data


def _write_bags(url: str, options: dict[str, Any], seed: int, overwrite: bool = False) -> dict[str, Any]:
    data = _bag_data(seed)
    writer = featurestore.open_store(url, mode="a", **options).create_bag_split(
        "ds", "enc", "bags", dim=DIM, dtype="float16", label_dtype="int64", overwrite=overwrite,
        chunk_bytes=CHUNK_ROWS * DIM * 2)
    for i, (bag_id, (features, coords)) in enumerate(data.items()):
        writer.add_bag(bag_id, features, coords=coords, label=i)
    writer.commit()
    return data


def _write_dense(url: str, options: dict[str, Any], seed: int, overwrite: bool = False, n: int = 160) -> np.ndarray:
    values = (seed * 1000 + np.arange(n * DIM).reshape(n, DIM) // DIM).astype(np.float32)
    writer = featurestore.open_store(url, mode="a", **options).create_split(
        "ds", "enc", "dense", num_samples=n, sample_shape=(DIM,), dtype="float32", chunk_rows=CHUNK_ROWS,
        label_shape=(), label_dtype="int64", overwrite=overwrite)
    writer.write(0, values, labels=np.arange(n) + seed * 1000)
    writer.commit()
    return values


def _one_generation_or_changed(read: Any, expected: Any, changes: list[str]) -> None:
    """``read()`` returns exactly ``expected`` (the opened generation) or raises SplitChanged."""
    try:
        got = read()
    except SplitChanged as error:
        message = str(error)
        assert "ds/enc/" in message and "open it again" in message and "\n" not in message, message
        changes.append(message)
        return
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        np.testing.assert_array_equal(g, e)


@pytest.fixture
def few_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A map cache of 3 maps (FEATURESTORE_MAX_MAPS=3): maps are evicted and files reopened."""
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(3, 1 << 40))


@pytest.fixture
def local_url(request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, few_maps: None) -> str:
    """A local store's URL, read with FEATURESTORE_LOCAL_READ = the test's parameter (``indirect``)
    and a map cache of 3 maps."""
    monkeypatch.setenv("FEATURESTORE_LOCAL_READ", request.param)
    return str(tmp_path / "store")


# ---------------------------------------------------------------------- local
@pytest.mark.parametrize("local_url", ["mmap", "pread", "auto"], indirect=True)
def test_local_bag_reader_opened_before_an_overwrite(local_url: str) -> None:
    old = _write_bags(local_url, {}, seed=1)
    early = featurestore.open_store(local_url).open_bags("ds", "enc", "bags")
    np.testing.assert_array_equal(early.read_numpy("slide-00")[0], old["slide-00"][0])
    _write_bags(local_url, {}, seed=2, overwrite=True)  # other lengths: the old offsets point anywhere
    changes: list[str] = []
    for bag_id in reversed(list(old)):  # far from the chunks read before the overwrite
        _one_generation_or_changed(lambda: early.read_numpy(bag_id), old[bag_id], changes)
    assert changes, "every bag of the old generation came back after the overwrite"
    assert "another generation" in changes[0]
    with pytest.raises(SplitChanged, match="ds/enc/bags"):  # nor the new generation's attributes
        early.attrs("slide-05")


@pytest.mark.parametrize("local_url", ["mmap", "pread"], indirect=True)
def test_local_dense_batches_never_mix_generations(local_url: str) -> None:
    old = _write_dense(local_url, {}, seed=1)
    early = featurestore.open_store(local_url).open("ds", "enc", "dense")
    np.testing.assert_array_equal(early.read_numpy([0, 1, 2]), old[[0, 1, 2]])  # chunk 0 mapped
    _write_dense(local_url, {}, seed=2, overwrite=True)
    changes: list[str] = []
    index = np.array([0, 1, 17, 40, 150])  # chunk 0 (open before) and chunks opened after
    _one_generation_or_changed(lambda: early.read_numpy(index), old[index], changes)
    _one_generation_or_changed(lambda: early.labels.read_numpy(index), index + 1000, changes)
    assert len(changes) == 2
    # A reader opened now reads the new generation only (no map of the old one is shared with it).
    fresh = featurestore.open_store(local_url).open("ds", "enc", "dense")
    new = (2000 + np.arange(160 * DIM).reshape(160, DIM) // DIM).astype(np.float32)
    np.testing.assert_array_equal(fresh.read_numpy(index), new[index])


def test_compressed_reads_never_mix_generations(tmp_path: Any) -> None:
    """The zarr path (compressed arrays) checks after each read too."""
    url = str(tmp_path / "store")
    store = featurestore.open_store(url, mode="a")
    for seed in (1, 2):
        writer = store.create_split("ds", "enc", "z", num_samples=64, sample_shape=(DIM,), dtype="float32",
                                    chunk_rows=CHUNK_ROWS, compressor="zstd", overwrite=True)
        writer.write(0, np.full((64, DIM), seed, np.float32))
        writer.commit()
        if seed == 1:
            early = featurestore.open_store(url).open("ds", "enc", "z")
            assert early.path == "zarr"
            np.testing.assert_array_equal(early.read_numpy([0, 40]), np.ones((2, DIM)))
    with pytest.raises(SplitChanged, match="ds/enc/z"):
        early.read_numpy([0, 40])


def test_a_chunk_gone_under_an_overwrite_is_split_changed_not_damage(tmp_path: Any) -> None:
    """The overwrite's delete caught between two reads: the reader says the split changed (not
    MissingChunks "damaged store")."""
    url = str(tmp_path / "store")
    _write_dense(url, {}, seed=1)
    early = featurestore.open_store(url).open("ds", "enc", "dense")
    store = featurestore.open_store(url, mode="a")
    store.create_split("ds", "enc", "dense", num_samples=160, sample_shape=(DIM,), dtype="float32",
                       chunk_rows=CHUNK_ROWS, overwrite=True)  # deleted, not written yet
    with pytest.raises(SplitChanged, match="ds/enc/dense"):
        early.read_numpy([100])
    # An untouched split whose chunk is really missing is still reported as damage.
    _write_dense(url, {}, seed=3, overwrite=True)
    reader = featurestore.open_store(url).open("ds", "enc", "dense")
    os.unlink(os.path.join(url, "ds/enc/dense/features/c/5/0"))
    with pytest.raises(MissingChunks, match="damaged store"):
        reader.read_numpy([90])


def test_bag_loader_across_epochs_and_an_overwrite(tmp_path: Any, few_maps: None) -> None:
    from client import BagDataset, BagLoader

    url = str(tmp_path / "store")
    old = _write_bags(url, {}, seed=1)
    loader = BagLoader(BagDataset(url, "ds", "enc", "bags"), batch_size=1, shuffle=False, device="cpu", dtype=None,
                       prefetch=1)
    ids = list(old)

    def epoch(number: int) -> list[np.ndarray]:
        loader.set_epoch(number)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [batch[0].numpy()[0].copy() for batch in loader]

    first = epoch(0)
    for bag_id, got in zip(ids, first):
        np.testing.assert_array_equal(got, old[bag_id][0].astype(np.float32))
    _write_bags(url, {}, seed=2, overwrite=True)
    with pytest.raises(SplitChanged, match="ds/enc/bags"):
        epoch(1)


# ---------------------------------------------------------------------- object storage, ranged
def test_ranged_readers_refuse_another_generation(seaweed_url: str, seaweed: Any) -> None:
    options = dict(seaweed.storage_options)
    old_bags = _write_bags(seaweed_url, options, seed=1)
    old_dense = _write_dense(seaweed_url, options, seed=1)
    store = featurestore.open_store(seaweed_url, **options)
    bags, dense = store.open_bags("ds", "enc", "bags"), store.open("ds", "enc", "dense")
    assert bags.features.path == "ranges" and dense.path == "ranges"
    np.testing.assert_array_equal(bags.read_numpy("slide-00")[0], old_bags["slide-00"][0])
    np.testing.assert_array_equal(dense.read_numpy([3, 40]), old_dense[[3, 40]])
    np.testing.assert_array_equal(dense.read_numpy([3, 40]), old_dense[[3, 40]])  # chunks checked: ranged GETs
    _write_bags(seaweed_url, options, seed=2, overwrite=True)
    _write_dense(seaweed_url, options, seed=2, overwrite=True)
    with pytest.raises(SplitChanged, match="ds/enc/bags"):
        bags.read_numpy("slide-19")
    with pytest.raises(SplitChanged, match="ds/enc/dense"):
        dense.read_numpy([3, 40])


# ---------------------------------------------------------------------- HTTP
def test_http_readers_refuse_another_generation(tmp_path: Any) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from client import FeatureClient
    from server import Settings, create_app

    url = str(tmp_path / "store")
    old_bags = _write_bags(url, {}, seed=1)
    old_dense = _write_dense(url, {}, seed=1)
    with TestClient(create_app(url, Settings())) as app, FeatureClient("http://testserver", http_client=app) as fc:
        bags, dense = fc.open_bags("ds", "enc", "bags"), fc.open("ds", "enc", "dense")
        np.testing.assert_array_equal(bags.read_numpy("slide-00")[0], old_bags["slide-00"][0])
        np.testing.assert_array_equal(dense.read_numpy([3, 40]), old_dense[[3, 40]])
        _write_bags(url, {}, seed=2, overwrite=True)
        _write_dense(url, {}, seed=2, overwrite=True)
        features, labels = np.empty((2, DIM), np.float32), np.empty(2, np.int64)
        for read in (lambda: bags.read_numpy("slide-01", rows=slice(0, 1)), lambda: bags.read_numpy(2, rows=[0]),
                     lambda: dense.read_numpy([3, 40]), lambda: dense.labels.read_numpy([3]),
                     lambda: dense.read_into([1, 2], features, labels), lambda: bags.attrs(0)):
            with pytest.raises(SplitChanged, match="ds/enc/"):
                read()
        # By name, the client opens the split again and reads the new generation.
        np.testing.assert_array_equal(fc.read_numpy("ds", "enc", "dense", [3]), [np.full(DIM, 2003, np.float32)])
        np.testing.assert_array_equal(fc.read_bag_numpy("ds", "enc", "bags", "slide-00")[0],
                                      _bag_data(2)["slide-00"][0])


# ---------------------------------------------------------------------- chunk cache
_READ_IN_A_NEW_PROCESS = textwrap.dedent("""
    import sys, json, numpy as np, featurestore
    url, cache, options, kind = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    store = featurestore.open_store(url, cache_dir=cache, **options)
    if kind == "bags":
        bags = store.open_bags("ds", "enc", "bags")
        out = {bag_id: [part.tolist() for part in bags.read_numpy(bag_id)] for bag_id in bags.ids}
    else:
        dense = store.open("ds", "enc", "dense")
        out = [dense.read_numpy(np.arange(160)).tolist(), dense.labels.read_numpy(np.arange(160)).tolist()]
    print(json.dumps(out))
""")


def _read_in_a_new_process(url: str, cache: Any, options: dict[str, Any], kind: str) -> Any:
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _READ_IN_A_NEW_PROCESS, url, str(cache), json.dumps(options), kind],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _cache_files(root: Any, array: str) -> list[str]:
    found = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
             if f.isdigit() and os.path.basename(d) == array]
    return sorted(found, key=lambda p: int(os.path.basename(p)))


@pytest.mark.parametrize(("kind", "array"), [("dense", "features"), ("dense", "labels"), ("bags", "features"),
                                             ("bags", "coords")])
def test_a_cached_file_swapped_for_another_chunk_is_fetched_again(seaweed_url: str, seaweed: Any, tmp_path: Any,
                                                                   kind: str, array: str) -> None:
    options = dict(seaweed.storage_options)
    cache = tmp_path / "cache"
    if kind == "bags":
        data = _write_bags(seaweed_url, options, seed=1)
        expected: Any = {bag_id: [f.tolist(), c.tolist()] for bag_id, (f, c) in data.items()}
    else:
        expected = [_write_dense(seaweed_url, options, seed=1).tolist(), list(range(1000, 1160))]
    assert _read_in_a_new_process(seaweed_url, cache, options, kind) == expected  # fills the cache
    files = _cache_files(cache, array)
    assert len(files) >= 3
    shutil.copyfile(files[1], files[0])  # chunk 1's file, its own crc32c valid, at chunk 0's path
    assert _read_in_a_new_process(seaweed_url, cache, options, kind) == expected
    with open(files[0], "rb") as a, open(files[1], "rb") as b:
        assert a.read() != b.read()  # fetched again


def test_a_directory_at_a_cached_chunk_path_is_a_damaged_entry(seaweed_url: str, seaweed: Any, tmp_path: Any,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    options = dict(seaweed.storage_options)
    cache = tmp_path / "cache"
    values = _write_dense(seaweed_url, options, seed=1)
    reader = featurestore.open_store(seaweed_url, cache_dir=str(cache), **options).open("ds", "enc", "dense")
    np.testing.assert_array_equal(reader.read_numpy(np.arange(160)), values)
    files = _cache_files(cache, "features")
    os.unlink(files[2])
    os.makedirs(os.path.join(files[2], "inner"))
    again = featurestore.open_store(seaweed_url, cache_dir=str(cache), **options).open("ds", "enc", "dense")
    with caplog.at_level(logging.WARNING, logger="featurestore"):
        for reader in (reader, again):
            for _ in range(2):
                np.testing.assert_array_equal(reader.read_numpy(np.arange(160)), values)
    assert os.path.isfile(files[2])  # removed and fetched again
    # One that cannot be removed (immutable): its chunk is read by ranges, the others from the cache.
    os.unlink(files[3])
    os.makedirs(os.path.join(files[3], "inner"))
    if subprocess.run(["chattr", "+i", files[3]], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here: the unremovable case needs an immutable directory")
    try:
        with caplog.at_level(logging.WARNING, logger="featurestore"):
            third = featurestore.open_store(seaweed_url, cache_dir=str(cache), **options).open("ds", "enc", "dense")
            for _ in range(2):
                np.testing.assert_array_equal(third.read_numpy(np.arange(160)), values)
        assert os.path.isdir(files[3])
    finally:
        subprocess.run(["chattr", "-i", files[3]], check=True)
    assert len([r for r in caplog.records if "not a chunk file" in r.getMessage()]) <= 1
