"""The contract every reader of a bag split passes (the bag twin of tests/reader_contract.py).

Subclass :class:`BagContract` in a ``test_*.py`` module and implement :meth:`location` (a store
URL and its storage options); override :meth:`open_bags` for a reader that is not the store's
own (HTTP: serve the store, open it through ``FeatureClient``) and :meth:`prepare` to force a
read path. Every test writes a bag split with the real writer (bags added out of id order, one
empty, one spanning several chunks, ids that look like paths or markup) and compares what is
read with values computed by numpy/torch alone.

Subclasses: tests/test_bags_contract.py (local mmap and pread, ``memory://``, S3 on moto and on
SeaweedFS).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import featurestore
from featurestore.core.protocol import BagReader
from featurestore.errors import BagNotFound, IndexOutOfRange

DIM = 6
CHUNK_ROWS = 8
# id -> rows; "../x" spans 5 chunks, "empty" has none; written in this (non-id) order
LENGTHS = {"zeta": 3, "../x": 37, "empty": 0, "a/b": 8, "<script>alert(1)</script>": 5, "ünï-切片": 12, "1": 1}


def expected_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return values.view(np.uint32)
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    return torch.from_numpy(values).bfloat16().view(torch.int16).numpy().view(np.uint16)


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
