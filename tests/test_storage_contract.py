"""The storage primitives' contract (featurestore.core.storage.Storage), on every backend.

What the writer and the readers rely on, and nothing more: ``write`` is atomic and replaces,
``read``/``read_many``/``read_ranges`` return exactly the bytes written (a missing key is a
``FileNotFoundError``), ``size``/``exists``/``listdir`` describe what is there, and
``delete_tree`` removes a prefix. Subclass :class:`StorageContract` for a new backend (the object
storage backend does) and implement :meth:`open`.
"""

from __future__ import annotations

from typing import Any

import pytest

from featurestore.core.storage import Storage, open_storage


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

    def test_listdir_exists_delete_tree(self, storage: Storage) -> None:
        storage.write("t/x/1", b"1")
        storage.write("t/x/2", b"2")
        storage.write("t/y", b"3")
        assert sorted(storage.listdir("t")) == ["x", "y"] and sorted(storage.listdir("t/x")) == ["1", "2"]
        assert storage.exists("t/x/1")
        storage.delete_tree("t/x")
        assert not storage.exists("t/x/1") and storage.listdir("t") == ["y"]

    def test_no_temporary_left_behind(self, storage: Storage) -> None:
        for i in range(3):
            storage.write("w/v", bytes([i]) * 100)
        assert storage.listdir("w") == ["v"]


class TestLocalStorage(StorageContract):
    def open(self, request: pytest.FixtureRequest, tmp_path: Any) -> Storage:
        storage = open_storage(str(tmp_path / "root"))
        assert storage.local_path("a") is not None
        return storage


class TestMemoryStorage(StorageContract):
    def open(self, request: pytest.FixtureRequest, tmp_path: Any) -> Storage:
        return open_storage(request.getfixturevalue("memory_url"))


class TestS3MotoStorage(StorageContract):
    def open(self, request: pytest.FixtureRequest, tmp_path: Any) -> Storage:
        bucket = request.getfixturevalue("s3_bucket")
        return open_storage(f"s3://{bucket}/root", dict(request.getfixturevalue("s3_storage_options")))
