"""The fsspec backend: any fsspec URL the obstore backend does not serve (``memory://``,
``http://``...), object storage with ``FEATURESTORE_OBJECT_BACKEND=fsspec``, and the obstore
backend's stand-in in forked children (:mod:`.obstore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from featurestore.core.storage.base import Storage


class FsspecStorage(Storage):
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec.core

        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        if not keys:
            return []
        paths = [self._path(k) for k in keys]
        # One call: async filesystems (s3fs, gcsfs) gather the ranges concurrently.
        return self.fs.cat_ranges(paths, list(starts), list(ends), on_error="raise")

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        if not keys:
            return []
        paths = [self._path(k) for k in keys]
        values = self.fs.cat(paths, on_error="raise")
        return [values[p] for p in paths]

    def write(self, key: str, *parts: bytes | memoryview) -> None:
        # A single PUT is atomic on object stores; memory:// replaces the value in one step.
        self.fs.pipe_file(self._path(key), b"".join(parts))

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def size(self, key: str) -> int | None:
        try:
            info = self.fs.info(self._path(key))
        except (FileNotFoundError, OSError):
            return None
        if info.get("type") == "directory":
            return None
        return int(info["size"])

    def listdir(self, prefix: str) -> list[str]:
        path = self._path(prefix)
        # Object-store listings are cached by fsspec; other processes (ranks) add keys, so
        # always ask the server.
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, OSError):
            return []
        names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries}
        names.discard("")
        return sorted(names)

    def delete_tree(self, prefix: str) -> None:
        path = self._path(prefix)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

    def zarr_store(self, read_only: bool = True) -> Any:
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(self.url, storage_options=self.storage_options, read_only=read_only)
