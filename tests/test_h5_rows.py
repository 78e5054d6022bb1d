"""featurestore.extract.h5_rows: a row-chunked h5 dataset read with positional reads gives exactly
what h5py gives, and every other layout is left to h5py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from featurestore.extract.h5_rows import _chunk_runs, read_rows  # noqa: E402


def test_every_layout_reads_as_h5py(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    rng = np.random.default_rng(0)
    trident = rng.standard_normal((1000, 24)).astype(np.float16)
    with h5py.File(path, "w") as f:
        f.create_dataset("trident", data=trident, chunks=(1, 24), maxshape=(None, 24))  # TRIDENT's save_h5
        f.create_dataset("coords", data=np.arange(2000, dtype=np.int64).reshape(1000, 2), chunks=(1, 2),
                         maxshape=(None, 2))
        f.create_dataset("partial", data=np.arange(30, dtype="<f4").reshape(10, 3), chunks=(4, 3))
        f.create_dataset("gzip", data=np.arange(30, dtype="<f4").reshape(10, 3), chunks=(4, 3), compression="gzip")
        f.create_dataset("contiguous", data=np.arange(30, dtype="<f4").reshape(10, 3))
        f.create_dataset("big_endian", data=np.arange(30, dtype=">f4").reshape(10, 3), chunks=(2, 3))
        f.create_dataset("columns", data=np.arange(30, dtype="<f4").reshape(10, 3), chunks=(10, 1))
        f.create_dataset("unwritten", shape=(10, 3), dtype="<f4", chunks=(4, 3), fillvalue=7)
        f["unwritten"][:4] = 1
        f.create_dataset("empty", data=np.zeros((0, 24), np.float16), chunks=(1, 24), maxshape=(None, 24))
    fast = {"trident", "coords", "partial"}
    with h5py.File(path, "r") as f:
        for name, dataset in f.items():
            got = read_rows(dataset)
            assert got.dtype == dataset.dtype and got.shape == dataset.shape, name
            np.testing.assert_array_equal(got, dataset[()], err_msg=name)
            assert (_chunk_runs(dataset) is not None) == (name in fast), name
        np.testing.assert_array_equal(read_rows(f["trident"]).view(np.uint16), trident.view(np.uint16))


def test_truncated_file_is_an_error_not_zeros(tmp_path: Path) -> None:
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("features", data=np.ones((4000, 64), np.float16), chunks=(1, 64), maxshape=(None, 64))
    with h5py.File(path, "r") as f:
        dataset = f["features"]
        runs, _ = _chunk_runs(dataset)  # the layout, read before the file loses its tail
        with open(path, "r+b") as raw:
            raw.truncate(runs[-1][0])  # the last run's rows are gone
        with pytest.raises(OSError, match="truncated"):
            read_rows(dataset)
