"""One contract suite for the store, run on a local directory, ``memory://`` and S3 (moto).

Every test here runs on all three backends through the ``store_url`` fixture (tests/conftest.py):
the same writer and reader must give the same bytes wherever the store lives.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from _core_helpers import SAMPLE_SHAPE, chunk_keys, float32_source, write_shuffled
from _core_helpers import bits as _bits
from _core_helpers import options as _options

import featurestore
from featurestore.errors import (
    CacheKeyMismatch,
    DatasetNotFound,
    IncompleteSplit,
    IndexOutOfRange,
    InvalidIndices,
    MissingChunks,
    ReadOnlyStore,
    ShapeMismatch,
    SplitExists,
    SplitNotFound,
)
from featurestore.format import layout
from featurestore.format.stats import merge_rows, report

N = 23  # 5 chunks of 5 rows, the last one partial
ROWS = 5
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _tricky_float32() -> np.ndarray:
    """Values where rounding matters: exact ties for float16 and bfloat16, subnormals, -0.0."""
    bits = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F801000, 0x3F803000], np.uint32)
    ties = bits.view(np.float32)
    extra = np.array([1 + 2**-11, 1 + 3 * 2**-11, -0.0, 1e-6, 3e-8, 65504.0, -65504.0, 2**-14],
                     np.float32)
    return np.concatenate([ties, extra])


def _source(case: str) -> Any:
    """The values handed to ``write`` for a round-trip case."""
    x = float32_source(N, seed=1)
    tricky = _tricky_float32()
    x.reshape(-1)[: tricky.size] = tricky
    if case == "bfloat16-from-bfloat16":
        g = torch.Generator().manual_seed(0)
        return (torch.randn((N, *SAMPLE_SHAPE), generator=g) * 100).bfloat16()
    return x


def _expected_bits(case: str, source: Any) -> np.ndarray:
    """The stored bits the SPEC promises, computed by numpy / torch independently of featurestore."""
    if case == "float32":
        return source.view(np.uint32)
    if case == "float16-from-float32":
        return source.astype(np.float16).view(np.uint16)
    if case == "bfloat16-from-bfloat16":
        return source.view(torch.int16).numpy().view(np.uint16)
    assert case == "bfloat16-from-float32"
    return torch.from_numpy(source).bfloat16().view(torch.int16).numpy().view(np.uint16)


class TestStoreContract:
    """The store's behaviour, backend by backend (zarr's ``StoreTests`` pattern)."""

    @pytest.fixture
    def store(self, store_url: str, store_options: dict[str, Any]) -> featurestore.FeatureStore:
        return featurestore.open_store(store_url, mode="a", **store_options)

    def _create(self, store: featurestore.FeatureStore, split: str = "train", dtype: str = "float32",
                **kwargs: Any) -> featurestore.SplitWriter:
        kwargs.setdefault("num_samples", N)
        kwargs.setdefault("chunk_bytes", ROWS * 32 * ITEMSIZE[dtype])
        return store.create_split("pannuke", "tiny-vit", split, sample_shape=SAMPLE_SHAPE,
                                  dtype=dtype, **kwargs)

    def _write_full(self, store: featurestore.FeatureStore, x: np.ndarray, split: str = "train",
                    **kwargs: Any) -> featurestore.FeatureArray:
        w = self._create(store, split, **kwargs)
        write_shuffled(w, x)
        w.commit()
        return store.open("pannuke", "tiny-vit", split)

    # ------------------------------------------------------------------ round trips
    @pytest.mark.parametrize("case", ["float32", "float16-from-float32", "bfloat16-from-bfloat16",
                                      "bfloat16-from-float32"])
    def test_round_trip_per_dtype(self, store: featurestore.FeatureStore, case: str) -> None:
        dtype = case.split("-")[0]
        source = _source(case)
        w = self._create(store, dtype=dtype)
        assert (w.chunk_rows, w.num_chunks) == (ROWS, 5)
        write_shuffled(w, source, seed=3)  # shuffled batches of 1, 2, 3, 7 rows straddling chunks
        w.commit()
        arr = store.open("pannuke", "tiny-vit", "train")
        assert (len(arr), arr.shape, arr.dtype) == (N, (N, *SAMPLE_SHAPE), dtype)
        out = arr.read(torch.arange(N))
        assert out.dtype == {"float32": torch.float32, "float16": torch.float16,
                             "bfloat16": torch.bfloat16}[dtype]
        assert out.shape == (N, *SAMPLE_SHAPE)
        np.testing.assert_array_equal(_bits(out), _expected_bits(case, source))
        # the numpy path returns the storage bits (uint16 for bfloat16) without torch
        raw = arr.read_numpy(np.arange(N))
        assert raw.dtype == arr.numpy_dtype
        np.testing.assert_array_equal(raw.view(_expected_bits(case, source).dtype), _expected_bits(case, source))

    def test_reads_any_order_with_duplicates(self, store: featurestore.FeatureStore) -> None:
        x = float32_source(N, seed=2)
        arr = self._write_full(store, x)
        rng = np.random.default_rng(0)
        cases = [
            np.arange(N)[::-1],
            rng.integers(0, N, 57),                      # duplicates, random order
            np.array([3, 4, 5, 6, 7, 7, 7, 22, 0]),      # a run across a chunk boundary
            np.array([22, 21, 20]),                      # rows of the padded edge chunk
            np.array([9], np.int32),
            torch.tensor([4, 4, 19]),
            [1, 0, 1],
        ]
        for index in cases:
            expected = x[np.asarray(index, np.int64)]
            np.testing.assert_array_equal(arr.read(index).numpy(), expected)
            np.testing.assert_array_equal(arr.read_numpy(index), expected)
        assert arr.read([]).shape == (0, *SAMPLE_SHAPE)
        assert arr.read(np.int64(6)).shape == (1, *SAMPLE_SHAPE)
        out = np.empty((3, *SAMPLE_SHAPE), np.float32)
        assert arr.read_numpy([2, 14, 2], out=out) is out
        np.testing.assert_array_equal(out, x[[2, 14, 2]])
        np.testing.assert_array_equal(arr.read_range(4, 13), x[4:13])
        np.testing.assert_array_equal(arr.read_range(7, 7), x[7:7])

    def test_labels_and_ids_round_trip(self, store: featurestore.FeatureStore) -> None:
        x = float32_source(N, seed=4)
        classes = np.random.default_rng(1).integers(0, 6, N)
        masks = np.random.default_rng(2).integers(0, 255, (N, 3, 3)).astype(np.uint8)
        ids = [f"img-{i:03d}" for i in range(N)]
        w = self._create(store, "cls", label_dtype="int64", ids=ids)
        write_shuffled(w, x, classes, seed=5)
        w.commit()
        w = self._create(store, "seg", label_shape=(3, 3), label_dtype="uint8")
        write_shuffled(w, torch.from_numpy(x), torch.from_numpy(masks), seed=6)
        w.commit()
        index = [7, 0, 22, 7, 13]
        cls = store.open("pannuke", "tiny-vit", "cls")
        assert cls.labels is not None and cls.labels.dtype == "int64"
        assert cls.labels.read(index).dtype == torch.int64
        np.testing.assert_array_equal(cls.labels.read(index).numpy(), classes[index])
        assert cls.ids == ids
        seg = store.open("pannuke", "tiny-vit", "seg")
        assert seg.labels is not None and seg.labels.shape == (N, 3, 3) and seg.ids is None
        np.testing.assert_array_equal(seg.labels.read_numpy(index), masks[index])
        np.testing.assert_array_equal(seg.read_numpy(index), x[index])

    def test_out_of_range_indices(self, store: featurestore.FeatureStore) -> None:
        arr = self._write_full(store, float32_source(N))
        for bad in ([N], [-1], [0, 5, N + 100], np.array([N], np.uint64)):
            with pytest.raises(IndexOutOfRange) as info:
                arr.read(bad)
            assert str(N) in str(info.value)
        with pytest.raises(IndexOutOfRange):
            arr.read_range(0, N + 1)
        with pytest.raises(InvalidIndices):
            arr.read([[0, 1]])
        with pytest.raises(InvalidIndices):
            arr.read([1.9])
        w = self._create(store, "other")
        with pytest.raises(IndexOutOfRange):
            w.write(N - 1, float32_source(2))
        with pytest.raises(IndexOutOfRange):
            w.write(-1, float32_source(1))

    @pytest.mark.parametrize("sample_shape", [(16,), (2, 3, 4)])
    def test_other_sample_ranks(self, store: featurestore.FeatureStore, sample_shape: tuple[int, ...]) -> None:
        x = np.random.default_rng(5).standard_normal((11, *sample_shape)).astype(np.float32)
        w = store.create_split("d", "e", "s", num_samples=11, sample_shape=sample_shape, dtype="float16",
                               chunk_bytes=3 * 2 * int(np.prod(sample_shape)))
        write_shuffled(w, x)
        w.commit()
        arr = store.open("d", "e", "s")
        assert arr.shape == (11, *sample_shape) and arr.chunk_rows == 3
        index = [10, 0, 4, 4, 5, 6, 9]
        np.testing.assert_array_equal(arr.read_numpy(index), x[index].astype(np.float16))
        assert len(arr.metadata["channel_stats"]["mean"]) == sample_shape[-1]

    # ------------------------------------------------------------------ lifecycle
    def test_incomplete_split_is_refused_unless_allowed(self, store: featurestore.FeatureStore) -> None:
        x = float32_source(N)
        w = self._create(store)
        w.write(0, x[:12])  # chunks 0 and 1 complete, chunk 2 partial
        w.close()
        assert store.split_status("pannuke", "tiny-vit", "train") == "writing"
        with pytest.raises(IncompleteSplit):
            store.open("pannuke", "tiny-vit", "train")
        reader = featurestore.open_store(store.url, mode="r", **_options(store))
        with pytest.raises(IncompleteSplit):
            reader.open("pannuke", "tiny-vit", "train")
        arr = store.open("pannuke", "tiny-vit", "train", allow_incomplete=True)
        np.testing.assert_array_equal(arr.read_numpy(range(10)), x[:10])
        assert arr.metadata["status"] == "writing"

    def test_existing_split_needs_resume_or_overwrite(self, store: featurestore.FeatureStore) -> None:
        x = float32_source(N)
        self._write_full(store, x, metadata={"cache_key": "abc"})
        with pytest.raises(SplitExists):
            self._create(store)
        with pytest.raises(CacheKeyMismatch):
            self._create(store, resume=True, metadata={"cache_key": "other"})
        with pytest.raises(ShapeMismatch):
            self._create(store, resume=True, num_samples=N + 1)
        # overwrite replaces it, even with another shape and dtype
        y = float32_source(7, seed=9)
        w = self._create(store, dtype="float16", num_samples=7, overwrite=True)
        assert w.pending_chunks() == [0, 1]
        w.write(0, y)
        w.commit()
        arr = store.open("pannuke", "tiny-vit", "train")
        assert (arr.shape, arr.dtype) == ((7, *SAMPLE_SHAPE), "float16")
        np.testing.assert_array_equal(arr.read_numpy(range(7)), y.astype(np.float16))
        assert arr.metadata["cache_key"] is None
        assert not store.storage.exists(chunk_keys(store, "pannuke", "tiny-vit", "train", "features", 3, 5)[4])

    def test_resume_keeps_valid_chunks(self, store: featurestore.FeatureStore) -> None:
        x = float32_source(N)
        w = self._create(store)
        for start, stop in [(0, 5), (10, 15), (20, 23), (5, 8)]:  # chunks 0, 2, 4 and part of 1
            w.write(start, x[start:stop])
        w.close()  # drops the partial chunk 1
        features = chunk_keys(store, "pannuke", "tiny-vit", "train", "features", 3, 5)
        stats = chunk_keys(store, "pannuke", "tiny-vit", "train", "chunk_stats", 2, 5)
        assert not store.storage.exists(features[1])
        kept = store.storage.read(features[0])
        local = store.storage.local_path(features[0])
        before = os.stat(local) if local else None
        damaged = bytearray(store.storage.read(features[2]))
        damaged[7] ^= 0x01
        store.storage.write(features[2], bytes(damaged))            # flipped byte: crc fails
        store.storage.write(stats[4], store.storage.read(stats[4])[:-9])  # truncated stats row

        w = self._create(store, resume=True)
        assert w.pending_chunks() == [1, 2, 3, 4]
        # Different values for every row: a kept chunk must not be rewritten, so its old
        # values survive, while every pending chunk takes the new ones.
        write_shuffled(w, x + 1, seed=8)
        assert w.pending_chunks() == []
        meta = w.commit()
        assert meta["status"] == "complete"
        assert store.storage.read(features[0]) == kept
        if before is not None:
            after = os.stat(local)
            assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        out = store.open("pannuke", "tiny-vit", "train").read_numpy(range(N))
        np.testing.assert_array_equal(out[:5], x[:5])
        np.testing.assert_array_equal(out[5:], x[5:] + 1)
        # resuming a complete split has nothing left to do
        again = self._create(store, resume=True)
        assert again.pending_chunks() == []
        assert again.commit()["status"] == "complete"

    def test_commit_with_missing_chunks(self, store: featurestore.FeatureStore) -> None:
        x = float32_source(N)
        w = self._create(store)
        w.write(0, x[:15])
        w.write(15, x[15:17])  # chunk 3 partially buffered, chunk 4 never written
        with pytest.raises(MissingChunks):
            w.commit()
        w.write(17, x[17:20])
        with pytest.raises(MissingChunks) as info:
            w.commit()  # chunk 3 is on storage now, chunk 4 is not
        assert "chunk 4" in str(info.value)
        assert store.split_status("pannuke", "tiny-vit", "train") == "writing"
        with pytest.raises(IncompleteSplit):
            store.open("pannuke", "tiny-vit", "train")
        w.write(20, x[20:])
        w.commit()
        np.testing.assert_array_equal(store.open("pannuke", "tiny-vit", "train").read_numpy(range(N)), x)

    def test_listings_and_lookups(self, store: featurestore.FeatureStore) -> None:
        assert store.datasets() == []
        self._write_full(store, float32_source(N), split="val")
        self._create(store, "train").close()
        assert store.datasets() == ["pannuke"]
        assert store.encoders("pannuke") == ["tiny-vit"]
        assert store.splits("pannuke", "tiny-vit") == ["train", "val"]
        assert store.split_status("pannuke", "tiny-vit", "val") == "complete"
        assert store.split_status("pannuke", "tiny-vit", "train") == "writing"
        with pytest.raises(DatasetNotFound):
            store.open("nope", "tiny-vit", "val")
        with pytest.raises(SplitNotFound):
            store.open("pannuke", "tiny-vit", "test")
        reader = featurestore.open_store(store.url, mode="r", **_options(store))
        with pytest.raises(ReadOnlyStore):
            reader.create_split("pannuke", "tiny-vit", "x", num_samples=2, sample_shape=(2,))

    # ------------------------------------------------------------------ read paths
    def test_uncompressed_and_zstd_paths_return_identical_bytes(self, store: featurestore.FeatureStore) -> None:
        for dtype, values in [("float16", float32_source(N, seed=5)),
                              ("bfloat16", torch.from_numpy(float32_source(N, seed=6)).bfloat16())]:
            plain = self._write_full(store, values, split=f"{dtype}-plain", dtype=dtype)
            packed = self._write_full(store, values, split=f"{dtype}-zstd", dtype=dtype, compressor="zstd")
            assert plain.path == ("mmap" if store.storage.local_path("x") else "ranges")
            assert packed.path == "zarr"
            index = np.random.default_rng(3).integers(0, N, 40)
            index[:6] = [21, 22, 3, 4, 5, 6]
            a, b = plain.read(index), packed.read(index)
            assert a.dtype == b.dtype
            assert _bits(a).tobytes() == _bits(b).tobytes()
            assert plain.read_numpy(index).tobytes() == packed.read_numpy(index).tobytes()

    @pytest.mark.parametrize("compressor", [None, "zstd"])
    def test_plain_zarr_reads_every_array(self, store: featurestore.FeatureStore, compressor: str | None) -> None:
        x = float32_source(N, seed=7)
        classes = np.arange(N) % 5
        w = self._create(store, "val", dtype="bfloat16", label_dtype="int64",
                         ids=[str(i) for i in range(N)], compressor=compressor)
        write_shuffled(w, x, classes)
        meta = w.commit()
        arr = store.open("pannuke", "tiny-vit", "val")
        if store.storage.local_path("x") is not None:
            group = zarr.open_group(store.url, mode="r")
        else:
            zstore = zarr.storage.FsspecStore.from_url(store.url, storage_options=_options(store), read_only=True)
            group = zarr.open_group(store=zstore, mode="r")
        assert group.attrs["featurestore"] == {"format": "featurestore", "version": 1}
        split = group["pannuke/tiny-vit/val"]
        assert split.attrs["featurestore"]["status"] == "complete"
        features = split["features"][:]
        assert features.dtype == np.uint16 and features.shape == (N, *SAMPLE_SHAPE)
        np.testing.assert_array_equal(features, arr.read_numpy(np.arange(N)))
        np.testing.assert_array_equal(split["labels"][:], arr.labels.read_numpy(np.arange(N)))
        assert [str(v) for v in split["ids"][:]] == [str(i) for i in range(N)]
        stats = split["chunk_stats"][:]
        raw = [np.frombuffer(store.storage.read(k)[: -layout.CRC_BYTES], np.float64)
               for k in chunk_keys(store, "pannuke", "tiny-vit", "val", "chunk_stats", 2, 5)]
        np.testing.assert_array_equal(stats, np.stack(raw))
        # the metadata's report is exactly the fold of the rows a plain zarr client sees
        # (each row ends with its seal: the split's generation and the chunk's index)
        assert [int(g) for g in stats[:, -2]] == [int(meta["generation"], 16)] * 5
        assert [int(i) for i in stats[:, -1]] == list(range(5))
        folded = report(merge_rows(list(stats[:, :-2]), SAMPLE_SHAPE[-1]), source_dtype="float32",
                        logical_dtype="bfloat16")
        assert folded["quantization"] == meta["quantization"]
        assert folded["channel_stats"] == meta["channel_stats"]


def _local_split(root: str, seed: int, dtype: str, chunk_bytes: int) -> tuple[featurestore.FeatureStore, np.ndarray]:
    """The store at ``root`` with split d/e/s committed: N rows of ``float32_source(N, seed)`` as ``dtype``."""
    store = featurestore.open_store(root, mode="a")
    x = float32_source(N, seed=seed)
    w = store.create_split("d", "e", "s", num_samples=N, sample_shape=SAMPLE_SHAPE, dtype=dtype,
                           chunk_bytes=chunk_bytes)
    write_shuffled(w, x)
    w.commit()
    return store, x


def test_local_mmap_and_ranges_paths_agree(tmp_path: Any) -> None:
    """The same local bytes through the mmap path and the fsspec range path (file://)."""
    from featurestore.core.storage import FsspecStorage

    root = str(tmp_path / "store")
    store, x = _local_split(root, seed=11, dtype="float16", chunk_bytes=ROWS * 64)
    mapped = store.open("d", "e", "s")
    ranged = featurestore.FeatureStore(FsspecStorage(f"file://{root}"), mode="r").open("d", "e", "s")
    assert (mapped.path, ranged.path) == ("mmap", "ranges")
    rng = np.random.default_rng(0)
    for index in [np.arange(N), rng.integers(0, N, 64), np.array([4, 5, 6, 5, 4, 22, 22])]:
        assert mapped.read_numpy(index).tobytes() == ranged.read_numpy(index).tobytes()
        np.testing.assert_array_equal(mapped.read_numpy(index), x[index].astype(np.float16))


def test_reader_survives_pickle_and_fork(tmp_path: Any) -> None:
    """DataLoader workers get the array by pickling or fork: each process maps its own chunks."""
    import pickle

    store, x = _local_split(str(tmp_path / "store"), seed=12, dtype="float32", chunk_bytes=ROWS * 128)
    arr = store.open("d", "e", "s")
    index = np.array([22, 3, 3, 9])
    np.testing.assert_array_equal(arr.read_numpy(index), x[index])  # maps opened in the parent
    clone = pickle.loads(pickle.dumps(arr))
    np.testing.assert_array_equal(clone.read_numpy(index[::-1]), x[index[::-1]])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read through the inherited object, report the bytes, exit
        try:
            os.write(write_end, arr.read_numpy(np.arange(N)[::-1]).tobytes())
        finally:
            os._exit(0)
    os.close(write_end)
    data = b""
    while chunk := os.read(read_end, 1 << 16):
        data += chunk
    os.waitpid(pid, 0)
    assert data == x[::-1].tobytes()
