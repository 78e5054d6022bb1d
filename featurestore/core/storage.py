"""Key-value access to a store root: one small interface, a local and an fsspec backend.

Keys are ``/``-separated paths relative to the store root (``ds/enc/split/features/c/0/0/0``).
The writer needs exactly three guarantees from a backend, and both give them:

* ``write`` is atomic: a reader (or a resumed writer) sees the whole value or no value, never a
  torn one. Locally that is write-to-temp + ``os.replace`` in the same directory (POSIX rename is
  atomic); on object stores a single PUT is atomic by design. ``write_sealed`` is ``write`` of a
  chunk plus its crc32c trailer; the local backend checksums each piece as it writes it and
  starts the file's writeback as it goes (``start_writeback``).
* ``read_ranges`` fetches many byte ranges in one call, concurrently where the backend can (the
  obstore backend for s3/gs/az in ``storage_obstore``, fsspec's async filesystems otherwise).
* ``local_path`` tells the reader when a key is a plain file it may memory-map.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from featurestore.core import storage_conditional
from featurestore.errors import ConditionalWritesUnsupported, StoreNotFound
from featurestore.format import chunks, layout
from featurestore.format.names import TMP_SUFFIX, tmp_name


class Storage:
    """Abstract key-value view of a store root."""

    url: str
    #: The local chunk cache readers of this storage use (object storage with ``cache_dir``).
    chunk_cache: Any = None

    def read(self, key: str) -> bytes:  # raises FileNotFoundError
        raise NotImplementedError

    # Conditional writes, the primitive of --worker claims (core.claims); a token names one version
    # of a key and changes with every write. Backends: core.storage_conditional.
    def put_if_absent(self, key: str, data: bytes) -> str | None:
        """Create ``key`` holding ``data`` unless it exists: the new version's token, or None."""
        raise ConditionalWritesUnsupported(f"{self.url}: this backend has no create-if-absent write; "
                                           "use a local/NFS path or s3://, gs://, az:// (obstore)")

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """``key``'s bytes and its version's token (FileNotFoundError when absent)."""
        raise ConditionalWritesUnsupported(f"{self.url}: this backend has no versioned read")

    def replace_if(self, key: str, data: bytes, token: str) -> str | None:
        """Overwrite ``key`` only while its version is ``token``: the new token, else None."""
        raise ConditionalWritesUnsupported(f"{self.url}: this backend has no conditional replace")

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        raise NotImplementedError

    def read_ranges_into(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int],
                         sink: Callable[[int, Any], None]) -> None:
        """``sink(i, data)`` for each range ``i`` of :meth:`read_ranges`; a backend that fetches
        concurrently calls it as each range arrives, so the caller's copy overlaps the wait for
        the others."""
        for i, data in enumerate(self.read_ranges(keys, starts, ends)):
            sink(i, data)

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """Whole values of many keys (concurrently where the backend can)."""
        return [self.read(k) for k in keys]

    def read_whole_into(self, key: str, size: int, part_bytes: int, sink: Callable[[Any], None],
                        answered: Callable[[], None] | None = None) -> None:
        """The value of ``key``, expected to hold ``size`` bytes, handed to ``sink`` as consecutive
        buffers (a backend may fetch parts of ``part_bytes`` concurrently, or stream pieces as they
        arrive and hold no buffer of the whole value). A longer value comes longer than ``size``
        (by at least a byte), a shorter one shorter: the caller checks the size. ``answered()``
        is called once every request for the value has been answered (a backend that streams calls
        it before the body has arrived): whatever is read after that call was stored no earlier
        than the value that comes back."""
        data = self.read(key)
        if answered is not None:
            answered()
        sink(data)

    def write(self, key: str, *parts: bytes | memoryview) -> None:
        """Store the concatenation of ``parts`` under ``key``, atomically."""
        raise NotImplementedError

    def write_sealed(self, key: str, payload: bytes | memoryview) -> None:
        """Store ``payload`` and its crc32c trailer (a chunk, as zarr's ``crc32c`` codec seals
        it) under ``key``, atomically. A backend that streams may compute the crc as it writes."""
        self.write(key, payload, chunks.crc_bytes(payload))

    def copy(self, source: str, target: str) -> None:
        """Store the value of ``source`` under ``target`` too, atomically (a bag split's commit
        moves chunks already in place this way). Locally a hard link: no bytes are copied."""
        self.write(target, self.read(source))

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def size(self, key: str) -> int | None:
        """Size in bytes, or None if the key does not exist."""
        raise NotImplementedError

    def listdir(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (files and sub-directories), [] if none."""
        raise NotImplementedError

    def delete_tree(self, prefix: str) -> None:
        raise NotImplementedError

    def local_path(self, key: str) -> str | None:
        return None

    def zarr_store(self, read_only: bool = True) -> Any:
        """A zarr-python store on the same root (for the compressed read path and ``ids``)."""
        raise NotImplementedError


# Values at least this large start their writeback as soon as they are written (below).
WRITEBACK_MIN_BYTES = 1 << 20
WRITEBACK_SLICE_BYTES = 32 << 20  # a 400 MB chunk starts its writeback 32 MiB at a time
# Values are written this much at a time. A sealed value is checksummed piece by piece: the piece
# the crc32c just read is still in the core's L2 cache when write() copies it into the page cache,
# so the payload crosses memory once, not twice. And a write() of 2 MiB or more lets ext4 (large
# folios, Linux 6.16+) take whole 2 MiB folios for the page cache, which cost ~12x the CPU of
# smaller ones here (200 MB into a new file: 0.43-0.54 s in 2-8 MiB writes, 0.033-0.046 s in
# 256 KiB-1 MiB writes, this 6.18 VM, repeated with fresh files kept and deleted).
PIECE_BYTES = 1 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the dirty pages, do not wait


def _load_libc(name: str, argtypes: list[Any]) -> Any:
    """libc's ``name`` (Linux), or None where there is none (macOS, Windows)."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
# The raw fallocate(2), not posix_fallocate(3), which writes zeros where a file system has none.
_fallocate = _load_libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
_NO_ROOM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def temp_path(path: str) -> str:
    """The temporary name beside ``path`` under which it is written before its atomic rename:
    unique per process and call, so concurrent writers never share one; the pid in it tells a
    resume whether its writer still runs (core.leftovers)."""
    return os.path.join(os.path.dirname(path), tmp_name(os.path.basename(path), os.getpid(), uuid.uuid4().hex[:8]))


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it is there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def preallocate(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` of disk for the new file ``fd`` (its size becomes ``nbytes``) before it
    is written: the writes then skip ext4's delayed-allocation bookkeeping (200 MB of new files
    in 1 MiB writes: 34 vs 50 ms of CPU, this VM) and a full disk shows before any byte is
    fetched. Raises ``OSError`` for a full disk or quota; a file system without ``fallocate``
    (or a system without the call) is written as it is."""
    if _fallocate is None or _fallocate(fd, 0, 0, nbytes) == 0:
        return
    code = ctypes.get_errno()
    if code in _NO_ROOM_ERRNOS:
        raise OSError(code, os.strerror(code))


def stream_parts(f: Any, parts: Sequence[bytes | memoryview], *, seal: bool = False, writeback: bool = False) -> None:
    """Write ``parts`` to the file ``f`` in pieces of :data:`PIECE_BYTES`, then (``seal``) their
    crc32c trailer.

    ``writeback``: start the writeback of every ``WRITEBACK_SLICE_BYTES`` as soon as they are
    written (start_writeback), and of the rest at the end."""
    crc = 0
    offset = started = 0  # bytes written; the first byte whose writeback is not started yet
    for part in parts:
        view = memoryview(part).cast("B")
        for lo in range(0, len(view), PIECE_BYTES):
            piece = view[lo : lo + PIECE_BYTES]
            if seal:
                crc = chunks.crc32c(piece, crc)
            f.write(piece)
            offset += len(piece)
            if writeback and offset - started >= WRITEBACK_SLICE_BYTES:
                f.flush()
                start_writeback(f.fileno(), started, offset - started)
                started = offset
    if seal:
        f.write(chunks.crc_trailer(crc))
        offset += layout.CRC_BYTES
    if writeback and offset > started:
        f.flush()
        start_writeback(f.fileno(), started, offset - started)


def start_writeback(fd: int, offset: int = 0, length: int = 0) -> bool:
    """Ask the kernel to start writing ``fd``'s dirty pages in ``[offset, offset + length)``
    (``length`` 0: to the end) to the device now, without waiting.

    Left alone, the kernel writes a new file back only after ~30 s or once dirty pages pass
    ``dirty_background_ratio``, so the disk idles while a split is written and the final
    ``os.sync()`` (or the OS, later) waits for all of it; past ``dirty_ratio`` every writer stalls.
    Starting each chunk's writeback as it lands keeps the disk busy alongside the writer and the
    dirty pages few (RocksDB's ``bytes_per_sync`` and PostgreSQL's ``*_flush_after`` do the same).
    The pages stay cached, now clean, for readers. Returns False where it could not (no Linux call,
    or a filesystem that refuses it): nothing else changes then.
    """
    if _sync_file_range is None:
        return False
    return _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0


class LocalStorage(Storage):
    def __init__(self, root: str, *, fsync: bool = False, writeback: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        # fsync makes each chunk durable across an OS crash; a process crash (SIGKILL) never loses
        # a completed rename without it, so it is off by default for speed.
        self.fsync = fsync
        # Start the writeback of each large value once written (start_writeback); off:
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
        tmp = temp_path(path)
        nbytes = sum(memoryview(p).nbytes for p in parts)
        try:
            with open(tmp, "wb") as f:
                # several parts (the chunk and its crc) without a joined copy
                stream_parts(f, parts, seal=seal,
                             writeback=self.writeback and not self.fsync and nbytes >= WRITEBACK_MIN_BYTES)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise

    def copy(self, source: str, target: str) -> None:
        # A hard link under a temporary name, then the atomic rename over the target: the file is
        # never modified in place afterwards (every write is temp + rename), so sharing it is safe.
        path = self._path(target)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = temp_path(path)
        try:
            os.link(self._path(source), tmp)
        except OSError as error:
            if isinstance(error, FileNotFoundError):
                raise
            shutil.copyfile(self._path(source), tmp)  # no hard links here (EXDEV, EPERM, some FUSE mounts)
        try:
            os.replace(tmp, path)
        finally:
            # Also after a rename that succeeded: when the target already is a link to the source
            # (a commit redone after its chunks were linked), rename() between two names of one
            # inode does nothing (POSIX) and leaves the temporary name in place.
            unlink_quietly(tmp)

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
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        return storage_conditional.local_put_if_absent(self._path(key), data)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        return storage_conditional.local_read_versioned(self._path(key))

    def replace_if(self, key: str, data: bytes, token: str) -> str | None:
        return storage_conditional.local_replace_if(self._path(key), data, token)

    def zarr_store(self, read_only: bool = True) -> Any:
        from zarr.storage import LocalStore

        return LocalStore(self.root, read_only=read_only)


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


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """A local path or ``file://`` URL gets :class:`LocalStorage` (memory-mappable); ``s3://``,
    ``gs://`` and ``az://`` get the obstore backend (``storage_obstore.ObjectStorage``; set
    ``FEATURESTORE_OBJECT_BACKEND=fsspec`` to go through fsspec instead); any other fsspec URL gets
    :class:`FsspecStorage`."""
    if not isinstance(url, (str, os.PathLike)) or not str(url):
        raise StoreNotFound(f"store URL {url!r} is empty: pass a directory path or an fsspec URL such as s3://bucket/prefix")
    url = os.fspath(url)
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" not in url:
        return LocalStorage(url, fsync=os.environ.get("FEATURESTORE_FSYNC") == "1",
                            writeback=os.environ.get("FEATURESTORE_WRITEBACK", "1") != "0")
    scheme = url.split("://", 1)[0].lower()
    check_protocols(url, scheme)
    if scheme in OBJECT_SCHEMES and os.environ.get("FEATURESTORE_OBJECT_BACKEND", "obstore") != "fsspec":
        from featurestore.core.storage_obstore import ObjectStorage

        return ObjectStorage(url, storage_options)
    return FsspecStorage(url, storage_options)


#: URL schemes read and written through obstore (see featurestore.core.storage_options.SCHEMES).
OBJECT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")
#: The schemes an unknown one's message suggests (any other fsspec protocol works too).
COMMON_SCHEMES = ("file", "s3", "gs", "az", "abfs", "memory", "http", "https")


def check_protocols(url: str, scheme: str) -> None:
    """One line listing the supported schemes when ``url`` names a protocol fsspec does not know
    (fsspec's own ``ValueError: Protocol not known`` would be a traceback). ``scheme`` may chain
    protocols (``simplecache::s3``): each must be known."""
    import fsspec

    known = set(fsspec.available_protocols()) | set(OBJECT_SCHEMES)
    unknown = [p for p in scheme.split("::") if p and p not in known]
    if unknown:
        from featurestore.format.redact import redact_url

        raise StoreNotFound(
            f"store URL {redact_url(url)!r}: unknown protocol {unknown[0]!r}: use a local path or a URL "
            f"starting with {', '.join(s + '://' for s in COMMON_SCHEMES)} (or another fsspec protocol)"
        )


