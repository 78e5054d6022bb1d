"""The one contract suite every reader of a stored array runs (zarr's ``StoreTests`` pattern).

Subclass :class:`ReaderContract` in a ``test_*.py`` module and implement :meth:`location` (where
to write the store: a URL and its storage options); override :meth:`open_reader` when the reader
is not the store's own (HTTP: serve the store and open it through ``FeatureClient``), and
:meth:`prepare` to force a read path or evict the page cache before each read. Every test writes
a small split of known values with the real writer and checks the bytes read against values
computed independently of featurestore (numpy / torch casts).

Subclasses: tests/test_reader_contract.py (local mmap, local pread warm/cold/direct, auto, zarr
compressed, ``memory://``, moto S3); the HTTP and SeaweedFS suites subclass it in their modules.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import featurestore
from featurestore.core.protocol import ArrayReader
from featurestore.errors import IndexOutOfRange, InvalidIndices, ShapeMismatch

N = 37  # 10 chunks of 4 rows, the last one partial


def expected_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """The stored bits the SPEC promises for float32 ``values`` written as ``dtype``."""
    if dtype == "float32":
        return values.view(np.uint32)
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    return torch.from_numpy(values).bfloat16().view(torch.int16).numpy().view(np.uint16)


class ReaderContract:
    """Read tests every :class:`~featurestore.core.protocol.ArrayReader` passes."""

    sample_shape: tuple[int, ...] = (3, 8)
    chunk_rows = 4
    compressor: str | None = None
    dtypes = ("float16", "bfloat16", "float32")

    # ------------------------------------------------------------------ hooks for subclasses
    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        """(store URL, storage options) of an empty store for this test."""
        raise NotImplementedError

    def open_reader(self, url: str, options: dict[str, Any], dataset: str, encoder: str, split: str,
                    request: pytest.FixtureRequest) -> ArrayReader:
        return featurestore.open_store(url, **options).open(dataset, encoder, split)

    def prepare(self, reader: ArrayReader) -> None:
        """Called before every read (force a read path, evict the page cache...)."""

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(params=["float16", "bfloat16", "float32"])
    def written(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[ArrayReader, np.ndarray, np.ndarray]:
        dtype = request.param
        if dtype not in self.dtypes:
            pytest.skip(f"{type(self).__name__} does not read {dtype}")
        url, options = self.location(request, tmp_path)
        rng = np.random.default_rng(7)
        values = rng.standard_normal((N, *self.sample_shape)).astype(np.float32)
        labels = rng.integers(0, 5, N).astype(np.int64)
        itemsize = 4 if dtype == "float32" else 2
        store = featurestore.open_store(url, mode="a", **options)
        writer = store.create_split("ds", "enc", "s", num_samples=N, sample_shape=self.sample_shape, dtype=dtype,
                                    label_dtype="int64", compressor=self.compressor,
                                    chunk_bytes=self.chunk_rows * int(np.prod(self.sample_shape)) * itemsize)
        for start in (8, 0, 20, 4, 12, 16, 24, 28, 32, 36):  # out of order, as ranks write
            stop = min(N, start + 4)
            writer.write(start, values[start:stop], labels=labels[start:stop])
        writer.commit()
        reader = self.open_reader(url, options, "ds", "enc", "s", request)
        return reader, expected_bits(values, dtype), labels

    def _read(self, reader: ArrayReader, index: Any, out: np.ndarray | None = None) -> np.ndarray:
        self.prepare(reader)
        return reader.read_numpy(index, out=out)

    # ------------------------------------------------------------------ the contract
    def test_conforms_to_protocol(self, written: Any) -> None:
        reader, expected, _ = written
        assert isinstance(reader, ArrayReader)
        assert reader.shape == (N, *self.sample_shape) and len(reader) == N
        assert tuple(reader.sample_shape) == self.sample_shape
        assert reader.sample_nbytes == int(np.prod(self.sample_shape)) * reader.numpy_dtype.itemsize
        assert reader.nbytes == N * reader.sample_nbytes
        assert reader.labels is not None and reader.labels.shape == (N,)
        assert reader.metadata["num_samples"] == N

    def test_every_order_returns_the_written_bytes(self, written: Any) -> None:
        reader, expected, _ = written
        rng = np.random.default_rng(3)
        orders: dict[str, Any] = {
            "sequential": np.arange(N),
            "reversed": np.arange(N)[::-1].copy(),
            "shuffled": rng.permutation(N),
            "duplicates": np.array([5, 5, 0, 36, 5, 17, 0, 36, 36]),
            "one chunk": np.array([6, 4, 7, 5]),
            "chunk edges": np.array([3, 4, 35, 36, 7, 8]),
            "single": [36],
            "scalar": 12,
        }
        for order, index in orders.items():
            got = self._read(reader, index)
            flat = np.atleast_1d(np.asarray(index))
            assert got.shape == (len(flat), *self.sample_shape) and got.dtype == reader.numpy_dtype, order
            assert np.array_equal(got.view(expected.dtype), expected[flat]), order

    def test_index_types(self, written: Any) -> None:
        reader, expected, _ = written
        idx = [9, 2, 30]
        for index in (idx, tuple(idx), np.array(idx, np.int32), torch.tensor(idx)):
            assert np.array_equal(self._read(reader, index).view(expected.dtype), expected[idx]), type(index)

    def test_empty(self, written: Any) -> None:
        reader, _, _ = written
        for empty in ([], np.array([], np.int64)):
            got = self._read(reader, empty)
            assert got.shape == (0, *self.sample_shape)

    def test_into_out_and_wrong_out(self, written: Any) -> None:
        reader, expected, _ = written
        index = np.array([33, 1, 18, 1])
        out = np.empty((4, *self.sample_shape), reader.numpy_dtype)
        assert self._read(reader, index, out=out) is out
        assert np.array_equal(out.view(expected.dtype), expected[index])
        with pytest.raises(ShapeMismatch):
            self._read(reader, index, out=np.empty((3, *self.sample_shape), reader.numpy_dtype))
        with pytest.raises(ShapeMismatch):
            self._read(reader, index, out=np.empty((4, *self.sample_shape), np.float64))

    def test_out_of_range_names_the_index(self, written: Any) -> None:
        reader, _, _ = written
        for bad in (N, N + 100, -1, 2**64, -(10**30)):  # beyond int64 too: out of range, not "not integers"
            with pytest.raises(IndexOutOfRange, match=str(bad)):
                self._read(reader, [0, bad])
        with pytest.raises(IndexOutOfRange):
            reader.read_range(0, N + 1)

    def test_non_integer_indices_are_refused(self, written: Any) -> None:
        reader, _, _ = written
        for bad in ([1.9], [[0, 1]], ["3"], np.array([True, False])):
            with pytest.raises(InvalidIndices):
                self._read(reader, bad)

    def test_labels(self, written: Any) -> None:
        reader, _, labels = written
        index = np.array([36, 0, 11, 11, 25])
        assert reader.labels is not None
        self.prepare(reader.labels)
        assert np.array_equal(reader.labels.read_numpy(index), labels[index])

    def test_read_is_a_torch_tensor_of_the_logical_dtype(self, written: Any) -> None:
        reader, expected, _ = written
        self.prepare(reader)
        tensor = reader.read([4, 2])
        want = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[reader.dtype]
        assert tensor.dtype == want and tuple(tensor.shape) == (2, *self.sample_shape)
        bits = tensor.view(torch.int32 if want == torch.float32 else torch.int16).numpy().view(expected.dtype)
        assert np.array_equal(bits, expected[[4, 2]])

    def test_read_range(self, written: Any) -> None:
        reader, expected, _ = written
        self.prepare(reader)
        assert np.array_equal(reader.read_range(3, 14).view(expected.dtype), expected[3:14])
        assert reader.read_range(5, 5).shape == (0, *self.sample_shape)
