"""The local backend: a store root on a local (or mounted) file system; keys are files.

Every put is a temporary file beside its target, written in pieces (:mod:`.files`), then
``os.replace``d over it: a reader sees the whole value or none.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Sequence
from typing import Any

from featurestore.core.storage import conditional, files
from featurestore.core.storage.base import Storage
from featurestore.format.names import TMP_SUFFIX


class LocalStorage(Storage):
    def __init__(self, root: str, *, fsync: bool = False, writeback: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        # fsync makes each chunk durable across an OS crash; a process crash (SIGKILL) never loses
        # a completed rename without it, so it is off by default for speed.
        self.fsync = fsync
        # Start the writeback of each large value once written (files.start_writeback); off:
        # FEATURESTORE_WRITEBACK=0.
        self.writeback = writeback

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def local_path(self, key: str) -> str | None:
        return self._path(key)

    def read(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        out = []
        for key, start, end in zip(keys, starts, ends):
            with open(self._path(key), "rb") as f:
                out.append(os.pread(f.fileno(), end - start, start))
        return out

    def write(self, key: str, *parts: bytes | memoryview) -> None:
        self._write(key, parts, seal=False)

    def write_sealed(self, key: str, payload: bytes | memoryview) -> None:
        self._write(key, [payload], seal=True)

    def _write(self, key: str, parts: Sequence[bytes | memoryview], *, seal: bool) -> None:
        """Atomically: a temp file in the same directory, then ``os.replace``."""
        path = self._path(key)
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = files.temp_path(path)
        nbytes = sum(memoryview(p).nbytes for p in parts)
        try:
            with open(tmp, "wb") as f:
                # several parts (the chunk and its crc) without a joined copy
                files.stream_parts(f, parts, seal=seal,
                                   writeback=self.writeback and not self.fsync and nbytes >= files.WRITEBACK_MIN_BYTES)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            files.unlink_quietly(tmp)
            raise

    def copy(self, source: str, target: str) -> None:
        # A hard link under a temporary name, then the atomic rename over the target: the file is
        # never modified in place afterwards (every write is temp + rename), so sharing it is safe.
        path, source_path = self._path(target), self._path(source)
        if not os.path.exists(source_path):  # before the target's directories are made: none left behind
            raise FileNotFoundError(errno.ENOENT, "no such key", source_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = files.temp_path(path)
        try:
            os.link(source_path, tmp)
        except OSError as error:
            if isinstance(error, FileNotFoundError):
                raise
            shutil.copyfile(source_path, tmp)  # no hard links here (EXDEV, EPERM, some FUSE mounts)
        try:
            os.replace(tmp, path)
        finally:
            # Also after a rename that succeeded: when the target already is a link to the source
            # (a commit redone after its chunks were linked), rename() between two names of one
            # inode does nothing (POSIX) and leaves the temporary name in place.
            files.unlink_quietly(tmp)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            return None

    def listdir(self, prefix: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self._path(prefix)) if not n.endswith(TMP_SUFFIX))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete_tree(self, prefix: str) -> None:
        path = self._path(prefix)
        if os.path.isfile(path):  # one key: removed, as an object store's delete of it and fsspec's rm do
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        shutil.rmtree(path, ignore_errors=True)

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        return conditional.local_put_if_absent(self._path(key), data)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        return conditional.local_read_versioned(self._path(key))

    def replace_if(self, key: str, data: bytes, token: str) -> str | None:
        return conditional.local_replace_if(self._path(key), data, token)

    def zarr_store(self, read_only: bool = True) -> Any:
        from zarr.storage import LocalStore

        return LocalStore(self.root, read_only=read_only)
