"""The storage primitives' contract (featurestore.core.storage.Storage), on every backend.

What the writer and the readers rely on, and nothing more: ``write`` is atomic and replaces,
``read``/``read_many``/``read_ranges`` return exactly the bytes written (a missing key is a
``FileNotFoundError``; ``None`` in ``read_present``), ``size``/``exists``/``listdir`` describe what is there,
``delete_tree`` removes a prefix and ``copy`` stores a key's value under another key. Subclass
:class:`StorageContract` for a new backend (the object
storage backend does) and implement :meth:`open`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import crc32c
import pytest

from featurestore.core.storage import files as storage_files
from featurestore.core.storage import LocalStorage, Storage, open_storage
from featurestore.format import chunks


class StorageContract:
    def open(self, request: pytest.FixtureRequest, tmp_path: Any) -> Storage:
        raise NotImplementedError

    @pytest.fixture
    def storage(self, request: pytest.FixtureRequest, tmp_path: Any) -> Storage:
        return self.open(request, tmp_path)

    def test_write_read_replace(self, storage: Storage) -> None:
        storage.write("a/b/c", b"hello ", memoryview(b"world"))  # parts are concatenated
        assert storage.read("a/b/c") == b"hello world"
        storage.write("a/b/c", b"new")  # replaces, whole
        assert storage.read("a/b/c") == b"new" and storage.size("a/b/c") == 3

    def test_missing_key(self, storage: Storage) -> None:
        assert not storage.exists("nope/x") and storage.size("nope/x") is None
        with pytest.raises(FileNotFoundError):
            storage.read("nope/x")
        with pytest.raises(FileNotFoundError):
            storage.read_many(["nope/x"])
        assert storage.listdir("nope") == []

    def test_read_ranges_and_many(self, storage: Storage) -> None:
        data = bytes(range(256)) * 4
        storage.write("k/0", data)
        storage.write("k/1", data[::-1])
        got = storage.read_ranges(["k/0", "k/1", "k/0"], [0, 10, 1000], [4, 20, 1024])
        assert [bytes(g) for g in got] == [data[0:4], data[::-1][10:20], data[1000:1024]]
        assert [bytes(g) for g in storage.read_many(["k/1", "k/0"])] == [data[::-1], data]
        # a key deleted meanwhile (a claim, a segment a commit removed) reads as None among the others
        got = storage.read_present(["k/1", "gone/x", "k/0"])
        assert [None if g is None else bytes(g) for g in got] == [data[::-1], None, data]

    def test_copy_replaces_and_leaves_the_source(self, storage: Storage) -> None:
        storage.write("s/a", b"first")
        storage.write("t/b", b"old")
        storage.copy("s/a", "t/b")  # a bag split's commit moves chunks in place this way
        storage.write("s/a", b"second")  # the source rewritten afterwards: the copy keeps its bytes
        assert storage.read("t/b") == b"first" and storage.read("s/a") == b"second"
        storage.copy("s/a", "u/new/c")
        assert storage.read("u/new/c") == b"second"
        with pytest.raises(FileNotFoundError):
            storage.copy("s/missing", "v/w/c")
        assert storage.listdir("v") == []  # no directory made for a copy that cannot happen

    def test_listdir_exists_delete_tree(self, storage: Storage) -> None:
        storage.write("t/x/1", b"1")
        storage.write("t/x/2", b"2")
        storage.write("t/y", b"3")
        assert sorted(storage.listdir("t")) == ["x", "y"] and sorted(storage.listdir("t/x")) == ["1", "2"]
        assert storage.exists("t/x/1")
        storage.delete_tree("t/x")
        assert not storage.exists("t/x/1") and storage.listdir("t") == ["y"]
        storage.delete_tree("t/y")  # one key (a claim record withdrawn)
        assert not storage.exists("t/y") and storage.listdir("t") == []

    def test_write_sealed_appends_the_crc32c_trailer(self, storage: Storage) -> None:
        payload = os.urandom(3000)
        storage.write_sealed("c/0", memoryview(payload))
        assert storage.read("c/0") == payload + crc32c.crc32c(payload).to_bytes(4, "little")
        assert chunks.check(storage.read("c/0"), len(payload)) is None

    def test_no_temporary_left_behind(self, storage: Storage) -> None:
        for i in range(3):
            storage.write("w/v", bytes([i]) * 100)
        assert storage.listdir("w") == ["v"]


class TestLocalStorage(StorageContract):
    def open(self, request: pytest.FixtureRequest, tmp_path: Any) -> Storage:
        storage = open_storage(str(tmp_path / "root"))
        assert storage.local_path("a") is not None
        return storage


# --------------------------------------------------------------------------- local writeback
def _record_writeback(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Record each ``sync_file_range`` call (offset, length, flags), still making the real one."""
    calls: list[tuple[int, int, int]] = []
    real = storage_files._sync_file_range

    def record(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((offset, length, flags))
        return real(fd, offset, length, flags) if real is not None else 0

    monkeypatch.setattr(storage_files, "_sync_file_range", record)
    return calls


def test_a_large_value_starts_its_writeback_slice_by_slice(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_files, "WRITEBACK_MIN_BYTES", 1000)
    monkeypatch.setattr(storage_files, "WRITEBACK_SLICE_BYTES", 4096)
    monkeypatch.setattr(storage_files, "PIECE_BYTES", 4096)  # every write goes in pieces (2 MiB ones cost ~12x)
    calls = _record_writeback(monkeypatch)
    payload, crc = os.urandom(3 * 4096 + 100), b"crc!"
    storage = LocalStorage(str(tmp_path))
    storage.write("s/features/c/0", memoryview(payload), crc)
    assert storage.read("s/features/c/0") == payload + crc
    # every byte's writeback started once, in file order, as each slice was written
    assert calls == [(0, 4096, 2), (4096, 4096, 2), (8192, 4096, 2), (12288, 104, 2)]
    storage.write("s/labels/c/0", b"x" * 999)  # below the threshold: the kernel's own writeback
    assert len(calls) == 4 and storage.read("s/labels/c/0") == b"x" * 999


def test_a_sealed_value_is_checksummed_piece_by_piece_as_it_is_written(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_files, "WRITEBACK_MIN_BYTES", 1000)
    monkeypatch.setattr(storage_files, "WRITEBACK_SLICE_BYTES", 4096)
    monkeypatch.setattr(storage_files, "PIECE_BYTES", 1000)  # pieces that do not divide the slices
    calls = _record_writeback(monkeypatch)
    payload = os.urandom(2 * 4096 + 7)
    storage = LocalStorage(str(tmp_path))
    storage.write_sealed("s/features/c/0", payload)
    assert storage.read("s/features/c/0") == payload + crc32c.crc32c(payload).to_bytes(4, "little")
    assert calls == [(0, 5000, 2), (5000, 3203, 2)]  # once 4096 bytes wait, then the rest and the crc
    storage.write_sealed("small", b"abc")  # below the threshold: sealed all the same
    assert storage.read("small") == b"abc" + crc32c.crc32c(b"abc").to_bytes(4, "little") and len(calls) == 2


@pytest.mark.parametrize("how", ["FEATURESTORE_WRITEBACK=0", "FEATURESTORE_FSYNC=1"])
def test_writeback_stays_off_when_switched_off_or_fsync_waits_anyway(
        how: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_files, "WRITEBACK_MIN_BYTES", 1000)
    name, value = how.split("=")
    monkeypatch.setenv(name, value)
    calls = _record_writeback(monkeypatch)
    storage = open_storage(str(tmp_path / "root"))
    storage.write("k", b"y" * 5000)
    assert calls == [] and storage.read("k") == b"y" * 5000


def test_writes_work_where_there_is_no_sync_file_range(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_files, "WRITEBACK_MIN_BYTES", 1000)
    monkeypatch.setattr(storage_files, "_sync_file_range", None)  # macOS, Windows
    storage = LocalStorage(str(tmp_path))
    storage.write("k", b"z" * 5000, b"tail")
    assert storage.read("k") == b"z" * 5000 + b"tail"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_kernel_accepts_the_writeback_request(tmp_path: Any) -> None:
    assert storage_files._sync_file_range is not None
    with open(tmp_path / "f", "wb") as f:
        f.write(b"w" * 65536)
        f.flush()
        assert storage_files.start_writeback(f.fileno(), 0, 65536)
        assert not storage_files.start_writeback(-1)  # a bad descriptor: False, not an exception


class TestMemoryStorage(StorageContract):
    def open(self, request: pytest.FixtureRequest, tmp_path: Any) -> Storage:
        return open_storage(request.getfixturevalue("memory_url"))


class TestS3MotoStorage(StorageContract):
    def open(self, request: pytest.FixtureRequest, tmp_path: Any) -> Storage:
        bucket = request.getfixturevalue("s3_bucket")
        return open_storage(f"s3://{bucket}/root", dict(request.getfixturevalue("s3_storage_options")))
