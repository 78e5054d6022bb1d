"""The bag contract (tests/bag_contract.py) on every store-side read path: local mmap and pread,
``memory://`` (fsspec) and S3 (moto through fsspec, SeaweedFS through obstore, with and without a
chunk cache), and the promise
that one bag costs one ranged read per chunk it spans, in one call, on object storage."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from bag_contract import CHUNK_ROWS, BagContract


class TestLocalMmap(BagContract):
    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        return str(tmp_path / "store"), {}

    def prepare(self, bags: Any) -> None:
        bags.features.local_read = bags.coords.local_read = "mmap"


class TestLocalPread(TestLocalMmap):
    def prepare(self, bags: Any) -> None:
        bags.features.local_read = bags.coords.local_read = "pread"


class TestMemory(BagContract):
    dtypes = ("bfloat16",)

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        return request.getfixturevalue("memory_url"), {}


class TestS3Moto(BagContract):
    dtypes = ("float16",)

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        bucket = request.getfixturevalue("s3_bucket")
        return f"s3://{bucket}/store", dict(request.getfixturevalue("s3_storage_options"))


class TestSeaweedFS(BagContract):
    dtypes = ("float16", "float32")

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        seaweed = request.getfixturevalue("seaweed")
        return request.getfixturevalue("seaweed_url"), dict(seaweed.storage_options)

    def test_one_ranged_read_per_chunk_a_bag_spans(self, written: Any) -> None:
        bags, data, _ = written
        assert bags.features.path == "ranges"
        calls: list[tuple[str, int]] = []
        storage = bags.features._storage
        whole, ranged = storage.read_many, storage.read_ranges_into

        def counting_whole(keys: Any) -> Any:
            calls.append(("whole", len(keys)))
            return whole(keys)

        def counting_ranged(keys: Any, starts: Any, ends: Any, sink: Any) -> Any:
            calls.append(("ranges", len(keys)))
            return ranged(keys, starts, ends, sink)

        storage.read_many, storage.read_ranges_into = counting_whole, counting_ranged
        start = int(bags.offsets[bags.index("../x")])
        spanned = (start + 37 - 1) // CHUNK_ROWS - start // CHUNK_ROWS + 1
        # First read of those chunks in this process: each fetched whole once (its crc32c is
        # checked) and the bag's rows taken from it; one call for features, one for coords.
        bags.read_numpy("../x")  # 37 rows from row offsets["../x"]: 5 or 6 chunks
        assert calls == [("whole", spanned), ("whole", spanned)]
        calls.clear()
        bags.read_numpy("../x")  # checked already: one ranged read per chunk, one call per array
        assert calls == [("ranges", spanned), ("ranges", spanned)]
        calls.clear()
        bags.read_numpy("empty")
        assert calls == []
        np.testing.assert_array_equal(bags.read_numpy("1")[0].view(data["1"][0].dtype), data["1"][0])


class TestSeaweedFSCached(BagContract):
    """Through a local chunk cache: whole chunks fetched, checked, read locally."""

    dtypes = ("float16", "float32")

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        seaweed = request.getfixturevalue("seaweed")
        return request.getfixturevalue("seaweed_url"), dict(seaweed.storage_options)

    def open_bags(self, url: str, options: dict[str, Any], request: pytest.FixtureRequest) -> Any:
        import featurestore

        cache = request.getfixturevalue("tmp_path") / "cache"
        bags = featurestore.open_store(url, cache_dir=str(cache), **options).open_bags("ds", "enc", "bags")
        assert bags.features.path == bags.coords.path == "cached"
        return bags


def test_seaweedfs_commit_copies_chunks_in_place_server_side(seaweed: Any, seaweed_url: str) -> None:
    """Bags added in id order by one writer: the commit copies each chunk object (CopyObject)."""
    import featurestore

    options = dict(seaweed.storage_options)
    store = featurestore.open_store(seaweed_url, mode="a", **options)
    writer = store.create_bag_split("ds", "enc", "s", dim=4, chunk_bytes=8 * 4 * 2)
    rng = np.random.default_rng(0)
    data = {f"b{i}": rng.standard_normal((n, 4)).astype(np.float16) for i, n in enumerate((8, 16, 3))}
    for bag_id, values in data.items():
        writer.add_bag(bag_id, values)
    copied: list[str] = []
    original = store.storage.copy
    store.storage.copy = lambda a, b: (copied.append(b), original(a, b))  # type: ignore[method-assign]
    asked: list[str] = []  # a HEAD each: the commit copies rows without asking first
    exists = store.storage.exists
    store.storage.exists = lambda key: (asked.append(key), exists(key))[1]  # type: ignore[method-assign]
    writer.commit()
    assert not [key for key in asked if "block_seals" in key]
    # features, coords and the features' block seals row of the 4 chunks, none rewritten
    assert sorted(copied) == sorted(f"ds/enc/s/{name}/c/{c}/0" for c in range(4)
                                    for name in ("features", "coords", "block_seals"))
    bags = featurestore.open_store(seaweed_url, **options).open_bags("ds", "enc", "s")
    for bag_id, values in data.items():
        np.testing.assert_array_equal(bags.read_numpy(bag_id)[0], values)
