"""The local chunk cache behind the server, in forked workers and under bag splits: the same
bytes as without it, one generation check and one set of fetch threads per process."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from _chunk_cache_helpers import CHUNK_ROWS, N, SHAPE, _chunk_files, _open, _write

import featurestore
from featurestore.core.storage import chunk_cache
from featurestore.errors import SplitChanged

pytest.importorskip("obstore")


# ---------------------------------------------------------------------- the server
def test_the_server_reads_an_object_store_through_the_cache(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from featurestore.format import wire
    from server.app import create_app
    from server.settings import Settings

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    settings = Settings(storage_options={**options, "cache_dir": str(tmp_path / "cache")})
    index = [150, 3, 77, 3]
    with TestClient(create_app(seaweed_url, settings)) as client:
        response = client.post(wire.route(wire.BATCH, dataset="ds", encoder="enc", split="train"),
                               json={"indices": index})
        assert response.status_code == 200, response.text
    got = np.frombuffer(response.content, np.float16).reshape(len(index), *SHAPE)
    assert np.array_equal(got, values[index])
    assert len([p for p in _chunk_files(tmp_path / "cache") if f"{os.sep}features{os.sep}" in p]) == 3


def test_the_server_serves_bags_through_the_cache(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    options = seaweed.storage_options
    bags = _write_bags(seaweed_url, options)
    settings = Settings(storage_options={**options, "cache_dir": str(tmp_path / "cache")})
    with TestClient(create_app(seaweed_url, settings)) as client:
        response = client.get("/v1/bags/ds/enc/bags/slide-07")
        assert response.status_code == 200, response.text
    rows = len(bags["slide-07"]) * BAG_DIM * 2
    np.testing.assert_array_equal(np.frombuffer(response.content[:rows], np.float16).reshape(-1, BAG_DIM),
                                  bags["slide-07"])
    cached = {os.path.basename(os.path.dirname(p)) for p in _chunk_files(tmp_path / "cache")}
    assert {"features", "coords"} <= cached


def test_cache_flags_join_the_storage_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from featurestore.commands.storeargs import add_cache_options, add_storage_options, options_from_args

    parser = argparse.ArgumentParser()
    add_storage_options(parser)
    add_cache_options(parser)
    monkeypatch.setenv("FEATURESTORE_STORAGE_OPTIONS", '{"endpoint_url": "http://127.0.0.1:1"}')
    args = parser.parse_args(["--cache-dir", "/c", "--cache-bytes", "5G"])
    url = "s3://bucket/store"
    expected = {"endpoint_url": "http://127.0.0.1:1", "cache_dir": "/c", "cache_bytes": "5G"}
    assert options_from_args(args, url) == expected
    assert options_from_args(parser.parse_args([]), url) == {"endpoint_url": "http://127.0.0.1:1"}


def test_forked_workers_read_through_the_cache(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """A DataLoader worker forked after the parent used the cache (obstore is not fork-safe: the
    child fetches through fsspec) gets the right rows and fills the same cache."""
    import torch

    from client import FeatureDataset

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    ds = FeatureDataset(seaweed_url, "ds", "enc", "train", storage_options={**options, "cache_dir": str(tmp_path)})
    ds.array.read_numpy([0])  # the parent used obstore and the cache before the fork
    loader = torch.utils.data.DataLoader(ds, batch_size=25, shuffle=False, num_workers=2,
                                         multiprocessing_context="fork")
    got = torch.cat([features for features, _ in loader]).numpy()
    assert np.array_equal(got, values)
    assert len([p for p in _chunk_files(tmp_path) if f"{os.sep}features{os.sep}" in p]) == -(-N // CHUNK_ROWS)


# ---------------------------------------------------------------------- bag splits
BAG_DIM, BAG_CHUNK_ROWS = 24, 16


def _write_bags(url: str, options: dict[str, Any], seed: int = 0, overwrite: bool = False) -> dict[str, np.ndarray]:
    """20 bags of 0-60 patches (some empty, several spanning chunks of 16 rows)."""
    rng = np.random.default_rng(seed)
    writer = featurestore.open_store(url, mode="a", **options).create_bag_split(
        "ds", "enc", "bags", dim=BAG_DIM, dtype="float16", label_dtype="int64", overwrite=overwrite,
        chunk_bytes=BAG_CHUNK_ROWS * BAG_DIM * 2)
    data = {}
    for i in range(20):
        n = 0 if i in (3, 11) else int(rng.integers(1, 60))
        data[f"slide-{i:02d}"] = rng.standard_normal((n, BAG_DIM)).astype(np.float16)
        writer.add_bag(f"slide-{i:02d}", data[f"slide-{i:02d}"], coords=rng.integers(0, 9999, (n, 2)), label=i)
    writer.commit()
    return data


def _epoch(loader: Any, epoch: int) -> list[tuple[np.ndarray, ...]]:
    import warnings

    loader.set_epoch(epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the empty bags left out
        return [tuple(t.numpy().copy() for t in batch) for batch in loader]


def test_bag_loader_reads_ahead_through_the_cache_and_matches(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """A BagLoader over a bag split in object storage with a cache: the same batches as without
    one, every features and coords chunk downloaded once (read ahead by the epoch's plan), and
    the next epoch downloads nothing."""
    from client import BagDataset, BagLoader

    options = dict(seaweed.storage_options)
    _write_bags(seaweed_url, options)
    kwargs = dict(batch_size=2, shuffle=True, seed=4, device="cpu", dtype=None, max_patches=40, prefetch=1)
    plain = BagLoader(BagDataset(seaweed_url, "ds", "enc", "bags", storage_options=options), **kwargs)
    ds = BagDataset(seaweed_url, "ds", "enc", "bags", storage_options={**options, "cache_dir": str(tmp_path)})
    assert ds.read_path == "cached"
    cached = BagLoader(ds, **kwargs)
    chunks = -(-int(ds.lengths.sum()) // BAG_CHUNK_ROWS)
    cache = ds.bags.features.chunk_cache.cache
    readahead = []
    batches = []
    cached.set_epoch(0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in cached:
            readahead.append(cached._readahead is not None)
            batches.append(tuple(t.numpy().copy() for t in batch))
            if len(batches) == 1:  # the plan's read-ahead fetches chunks of batches not asked for yet
                deadline = time.monotonic() + 30
                while len(_chunk_files(tmp_path)) < 2 * chunks + 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert len(_chunk_files(tmp_path)) == 2 * chunks + 2
    assert all(readahead) and cached._readahead is None  # running for the epoch, stopped at its end
    for got, want in zip(batches, _epoch(plain, 0), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    files = _chunk_files(tmp_path)
    for array in ("features", "coords"):  # every chunk of each, downloaded once
        assert len([f for f in files if os.path.basename(os.path.dirname(f)) == array]) == chunks
    seal_files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                  if f.isdigit() and "chunk_seals" in d.split(os.sep)]
    assert len(files) == 2 * chunks + 2  # and the one chunk of offsets and of labels
    assert cache.stats["fetched"] == len(files) + len(seal_files)  # each once (the seal table if it was asked for)
    storage = ds.bags.features._storage
    before, fetched = storage.bytes_read, cache.stats["fetched"]
    for got, want in zip(_epoch(cached, 1), _epoch(plain, 1), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    assert cache.stats["fetched"] == fetched and storage.bytes_read == before  # all local now
    cached.close()
    plain.close()


def test_bag_dataset_in_forked_workers_reads_through_the_cache(seaweed_url: str, seaweed: Any,
                                                               tmp_path: Any) -> None:
    """CLAM-style: a BagDataset in a DataLoader with forked workers, the parent having used the
    cache (and its shared generation check) first: every bag right, every chunk cached once."""
    import torch

    from client import BagDataset

    options = dict(seaweed.storage_options)
    bags = _write_bags(seaweed_url, options)
    ds = BagDataset(seaweed_url, "ds", "enc", "bags", storage_options={**options, "cache_dir": str(tmp_path)})
    np.testing.assert_array_equal(ds[0][0].numpy(), bags["slide-00"])  # used before the fork
    loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=2,
                                         multiprocessing_context="fork")
    for bag_id, (features, coords, label) in zip(ds.ids, loader, strict=True):
        np.testing.assert_array_equal(features.numpy(), bags[bag_id])
        assert len(coords) == len(bags[bag_id]) and int(label) == int(bag_id[-2:])
    chunks = -(-int(ds.lengths.sum()) // BAG_CHUNK_ROWS)
    files = _chunk_files(tmp_path)
    for array in ("features", "coords"):
        assert len([f for f in files if os.path.basename(os.path.dirname(f)) == array]) == chunks


def test_a_cached_bag_reader_of_an_overwritten_split_is_refused(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """Bag splits keep the cache's generation rule: a reader that opened the old split and meets
    a chunk not cached yet gets ``SplitChanged``; a reader opened after gets the new bags."""
    options = dict(seaweed.storage_options)
    old = _write_bags(seaweed_url, options, seed=0)
    early = featurestore.open_store(seaweed_url, cache_dir=str(tmp_path), **options).open_bags("ds", "enc", "bags")
    np.testing.assert_array_equal(early.read_numpy("slide-00")[0], old["slide-00"])
    new = _write_bags(seaweed_url, options, seed=1, overwrite=True)
    fresh = featurestore.open_store(seaweed_url, cache_dir=str(tmp_path), **options).open_bags("ds", "enc", "bags")
    for bag_id, values in new.items():
        np.testing.assert_array_equal(fresh.read_numpy(bag_id)[0], values)
    with pytest.raises(SplitChanged, match="another generation"):
        early.read_numpy("slide-19")


def test_caches_of_one_process_share_its_fetch_threads(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """A pool per cache directory left FETCH_THREADS idle threads behind for every directory a
    process ever opened (one per repeat in ``bench s3``)."""
    import threading

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    for i in range(3):
        cached = _open(seaweed_url, options, tmp_path / f"cache{i}")
        assert np.array_equal(cached.read_numpy(np.arange(N)), values)
    names = [t.name for t in threading.enumerate()]
    fetchers = [n for n in names if n.startswith("featurestore-cache_")]
    assert 0 < len(fetchers) <= chunk_cache.FETCH_THREADS, names
