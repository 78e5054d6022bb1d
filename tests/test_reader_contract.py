"""The reader contract (tests/reader_contract.py) on every store-side read path.

Local uncompressed arrays are read by the mmap gather or by concurrent positional reads (warm,
cold after eviction, O_DIRECT, DONTNEED, and "auto", which picks per read): each path is forced
here explicitly so each one is covered. Then zarr-decoded compressed arrays, ``memory://`` and
S3 (moto) ranged reads.
"""

from __future__ import annotations

from typing import Any

import pytest
from reader_contract import ReaderContract

from featurestore.core.protocol import ArrayReader
from featurestore.testing.cgroup import evict


class _Local(ReaderContract):
    local_read = "auto"
    cache = "keep"
    cold = False

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        self._root = str(tmp_path / "store")
        return self._root, {}

    def prepare(self, reader: ArrayReader) -> None:
        reader.local_read, reader.cache = self.local_read, self.cache  # type: ignore[attr-defined]
        if self.cold:
            # The first-read crc check reads whole chunks through the cache (tests/test_faults_read.py
            # covers it); off here, so the rows really come off the device.
            reader.verify_reads = "off"  # type: ignore[attr-defined]
            evict(self._root)


class TestLocalMmap(_Local):
    local_read = "mmap"

    def test_path_taken(self, written: Any) -> None:
        reader = written[0]
        self._read(reader, [1, 30])
        assert reader.read_counts["mmap"] >= 1 and reader.read_counts["pool"] == 0


class TestLocalPreadWarm(_Local):
    local_read = "pread"

    def test_path_taken(self, written: Any) -> None:
        reader = written[0]
        self._read(reader, [1, 30])  # warm: served inline (RWF_NOWAIT), no thread hand-off
        assert reader.read_counts["mmap"] == 0 and reader.read_counts["inline"] + reader.read_counts["pool"] == 2


class TestLocalPreadCold(_Local):
    local_read = "pread"
    cold = True

    def test_path_taken(self, written: Any) -> None:
        reader = written[0]
        self._read(reader, [1, 30])  # evicted first: the read threads wait for the disk
        assert reader.read_counts["mmap"] == 0 and reader.read_counts["pool"] >= 1


class TestLocalPreadDrop(_Local):
    local_read = "pread"
    cache = "drop"


class TestLocalPreadDirect(_Local):
    """O_DIRECT needs rows that are a multiple of 4 KiB: 2 x 1024 float16 / 2 x 2048 bytes."""

    local_read = "pread"
    cache = "direct"
    sample_shape = (2, 2048)


class TestLocalAutoCold(_Local):
    cold = True

    def test_path_taken(self, written: Any) -> None:
        reader = written[0]
        self._read(reader, [1, 30])
        assert reader.read_counts["mmap"] == 0 and reader.read_counts["pool"] >= 1
        reader.read_numpy([1, 30])  # now cached: mincore says so, the mmap gather serves it
        assert reader.read_counts["mmap"] == 1


class TestZarrCompressed(_Local):
    compressor = "zstd"

    def prepare(self, reader: ArrayReader) -> None:
        if reader.name == "features":  # labels are stored uncompressed
            assert reader.path == "zarr"  # type: ignore[attr-defined]


class TestMemory(ReaderContract):
    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        return request.getfixturevalue("memory_url"), {}


class TestS3Moto(ReaderContract):
    dtypes = ("float16", "bfloat16")  # float32 adds nothing the ranges path does not already cover

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        bucket = request.getfixturevalue("s3_bucket")
        return f"s3://{bucket}/store", dict(request.getfixturevalue("s3_storage_options"))
