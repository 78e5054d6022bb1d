"""The contract every reader of a bag split passes (the bag twin of tests/reader_contract.py).

Subclass :class:`BagContract` in a ``test_*.py`` module and implement :meth:`location` (a store
URL and its storage options); override :meth:`open_bags` for a reader that is not the store's
own (HTTP: serve the store, open it through ``FeatureClient``) and :meth:`prepare` to force a
read path. Every test writes a bag split with the real writer (bags added out of id order, one
empty, one spanning several chunks, ids that look like paths or markup) and compares what is
read with values computed by numpy/torch alone.

The ``rows`` tests pin the one bag-selection rule (``featurestore.format.bags.select_rows``), so
every bag reader takes and refuses the same selections with the same errors, as the dense readers
do in tests/reader_contract.py.

Subclasses: tests/test_bags_contract.py (local mmap and pread, ``memory://``, S3 on moto and on
SeaweedFS), tests/test_bags_contract_http.py (``RemoteBagArray``, with and without a byte cap).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from reader_contract import expected_bits

import featurestore
from featurestore.core.protocol import BagReader
from featurestore.errors import BagNotFound, IndexOutOfRange, InvalidIndices, ShapeMismatch

DIM = 6
CHUNK_ROWS = 8
# id -> rows; "../x" spans 5 chunks, "empty" has none; written in this (non-id) order
LENGTHS = {"zeta": 3, "../x": 37, "empty": 0, "a/b": 8, "<script>alert(1)</script>": 5, "ünï-切片": 12, "1": 1}


class BagContract:
    dtypes = ("float16", "bfloat16", "float32")

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def open_bags(self, url: str, options: dict[str, Any], request: pytest.FixtureRequest) -> Any:
        return featurestore.open_store(url, **options).open_bags("ds", "enc", "bags")

    def prepare(self, bags: Any) -> None:
        """Called before every read."""

    @pytest.fixture(params=["float16", "bfloat16", "float32"])
    def written(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[Any, dict[str, Any], str]:
        dtype = request.param
        if dtype not in self.dtypes:
            pytest.skip(f"{type(self).__name__} does not read {dtype}")
        url, options = self.location(request, tmp_path)
        rng = np.random.default_rng(11)
        data = {}
        store = featurestore.open_store(url, mode="a", **options)
        itemsize = 4 if dtype == "float32" else 2
        writer = store.create_bag_split("ds", "enc", "bags", dim=DIM, dtype=dtype, label_dtype="int64",
                                        patch_size_level0=256, chunk_bytes=CHUNK_ROWS * DIM * itemsize)
        for i, (bag_id, n) in enumerate(LENGTHS.items()):
            values = rng.standard_normal((n, DIM)).astype(np.float32)
            coords = rng.integers(0, 200_000, (n, 2)).astype(np.int64)
            writer.add_bag(bag_id, values, coords=coords, label=i, attrs={"index": i, "id": bag_id})
            data[bag_id] = (expected_bits(values, dtype), coords, i)
        writer.commit()
        return self.open_bags(url, options, request), data, dtype

    def _read(self, bags: Any, which: Any, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
        self.prepare(bags)
        return bags.read_numpy(which, **kw)

    # ------------------------------------------------------------------ the contract
    def test_index(self, written: Any) -> None:
        bags, data, dtype = written
        assert isinstance(bags, BagReader)
        assert len(bags) == len(LENGTHS) and list(bags.ids) == sorted(LENGTHS)
        assert list(bags.lengths) == [LENGTHS[b] for b in sorted(LENGTHS)]
        assert list(bags.labels) == [data[b][2] for b in sorted(LENGTHS)]
        assert bags.dim == DIM and bags.dtype == dtype
        assert bags.metadata["bags"]["count"] == len(LENGTHS) and bags.metadata["kind"] == "bags"

    def test_every_bag_by_id_and_position(self, written: Any) -> None:
        bags, data, _ = written
        for position, bag_id in enumerate(bags.ids):
            bits, coords, _ = data[bag_id]
            for which in (bag_id, position):
                features, got_coords = self._read(bags, which)
                assert features.shape == (len(bits), DIM)
                assert np.array_equal(features.view(bits.dtype), bits), bag_id
                assert np.array_equal(got_coords, coords), bag_id

    def test_rows_subset_into_out(self, written: Any) -> None:
        bags, data, _ = written
        bits, coords, _ = data["../x"]
        rows = np.array([0, 7, 8, 20, 36])
        storage_dtype = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}[bags.dtype]
        out = np.empty((len(rows), DIM), storage_dtype)
        features, got_coords = self._read(bags, "../x", rows=rows, out=out)
        assert features is out
        assert np.array_equal(out.view(bits.dtype), bits[rows]) and np.array_equal(got_coords, coords[rows])

    def test_empty_bag(self, written: Any) -> None:
        bags, _, _ = written
        features, coords = self._read(bags, "empty")
        assert features.shape == (0, DIM) and coords.shape == (0, 2)

    def test_torch_dtypes(self, written: Any) -> None:
        bags, data, dtype = written
        self.prepare(bags)
        features, coords = bags.read("ünï-切片")
        want = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        assert features.dtype == want and tuple(features.shape) == (12, DIM)
        assert coords.dtype == torch.int64 and tuple(coords.shape) == (12, 2)

    def test_unknown_id_and_position(self, written: Any) -> None:
        bags, _, _ = written
        with pytest.raises(BagNotFound, match="no-such"):
            self._read(bags, "no-such")
        with pytest.raises(IndexOutOfRange):
            self._read(bags, len(LENGTHS))

    def test_attrs(self, written: Any) -> None:
        bags, data, _ = written
        assert bags.attrs("a/b") == {"index": data["a/b"][2], "id": "a/b"}

    def test_patch_size_of(self, written: Any) -> None:
        bags, _, _ = written  # the split's patch size, which a bag's own attribute only stands in for
        assert bags.patch_size_level0 == 256 and bags.patch_size_of("a/b") == bags.patch_size_of(0) == 256

    # ------------------------------------------------------------------ rows: the one selection rule
    def test_rows_in_every_order(self, written: Any) -> None:
        bags, data, _ = written
        bits, coords, _ = data["../x"]
        rng = np.random.default_rng(5)
        orders: dict[str, Any] = {
            "sequential": np.arange(37),
            "reversed": np.arange(37)[::-1].copy(),
            "shuffled": rng.permutation(37),
            "duplicates": np.array([5, 5, 0, 36, 5, 17, 0, 36, 36]),
            "chunk edges": np.array([7, 8, 35, 36, 15, 16]),
            "single": [36],
            "scalar": 12,
        }
        for order, rows in orders.items():
            features, got_coords = self._read(bags, "../x", rows=rows)
            flat = np.atleast_1d(np.asarray(rows))
            assert features.shape == (len(flat), DIM), order
            assert np.array_equal(features.view(bits.dtype), bits[flat]), order
            assert np.array_equal(got_coords, coords[flat]), order

    def test_rows_index_types(self, written: Any) -> None:
        bags, data, _ = written
        bits, coords, _ = data["ünï-切片"]
        rows = [9, 2, 11]
        for given in (rows, tuple(rows), np.array(rows, np.int32), np.array(rows, np.uint64), torch.tensor(rows)):
            features, got_coords = self._read(bags, "ünï-切片", rows=given)
            assert np.array_equal(features.view(bits.dtype), bits[rows]), type(given)
            assert np.array_equal(got_coords, coords[rows]), type(given)

    def test_rows_slices_and_ranges_select_as_python_does(self, written: Any) -> None:
        bags, data, _ = written
        bits, coords, _ = data["../x"]
        everything = np.arange(37)
        for rows in (slice(None), slice(3, 30), slice(0, 1000), slice(-5, None), slice(30, 3),
                     slice(1, 36, 4), slice(None, None, -3), range(2, 20), range(20, 2, -2)):
            want = everything[rows] if isinstance(rows, slice) else np.asarray(rows, np.int64)
            features, got_coords = self._read(bags, "../x", rows=rows)
            assert features.shape == (len(want), DIM), rows
            assert np.array_equal(features.view(bits.dtype), bits[want]), rows
            assert np.array_equal(got_coords, coords[want]), rows

    def test_rows_empty(self, written: Any) -> None:
        bags, _, _ = written
        for which, rows in (("../x", []), ("../x", np.array([], np.int64)), ("empty", []), ("empty", slice(0, 5))):
            features, coords = self._read(bags, which, rows=rows)
            assert features.shape == (0, DIM) and coords.shape == (0, 2), (which, rows)

    def test_rows_out_of_range_name_the_position(self, written: Any) -> None:
        bags, _, _ = written
        for bad in (37, 137, -1):
            with pytest.raises(IndexOutOfRange, match=str(bad)):
                self._read(bags, "../x", rows=[0, bad])
        with pytest.raises(IndexOutOfRange, match="0"):
            self._read(bags, "empty", rows=[0])

    def test_rows_that_are_not_positions_are_refused(self, written: Any) -> None:
        bags, _, _ = written
        for bad in ([1.9], [[0, 1]], ["3"], np.array([True, False])):
            with pytest.raises(InvalidIndices):
                self._read(bags, "../x", rows=bad)

    def test_wrong_out_is_refused(self, written: Any) -> None:
        bags, _, _ = written
        rows = np.array([3, 1, 3])
        storage_dtype = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}[bags.dtype]
        for out in (np.empty((2, DIM), storage_dtype), np.empty((3, DIM + 1), storage_dtype),
                    np.empty((3, DIM), np.float64), np.empty((DIM, 3), storage_dtype).T):
            with pytest.raises(ShapeMismatch):
                self._read(bags, "../x", rows=rows, out=out)
        with pytest.raises(ShapeMismatch):
            self._read(bags, "zeta", out=np.empty((2, DIM), storage_dtype))
