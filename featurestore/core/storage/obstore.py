"""Object storage (``s3://``, ``gs://``, ``az://``) through obstore, Rust's ``object_store``.

Why not s3fs: a shuffled batch is dozens of small ranged GETs, and s3fs/botocore spend more per
request (signing in Python, asyncio, copies) than the bytes take to arrive; on a loopback
SeaweedFS it reached 0.08x of what whole-object GETs give. obstore signs and transfers in Rust,
releases the GIL, and hands back its buffers without a copy.

How a batch is read (:meth:`ObjectStorage.read_ranges`): the reader already merged adjacent rows
into one range per run; here ranges of the same object closer than ``coalesce_gap`` bytes (default
1 MiB) are merged into one request too (the bytes between them are fetched and dropped: cheaper
than another request, see :data:`~featurestore.core.storage.options.DEFAULT_COALESCE_GAP`), and
every request of the batch is issued at once on one event loop per process, bounded by
``max_concurrency`` requests in flight per store (settings, see
:mod:`featurestore.core.storage.options`). The loop lives in a daemon thread
(:mod:`featurestore.core.storage.io_loop`, which also keeps an exiting process from aborting while a
Rust thread is still handing it a result); a forked child starts its own.

Writes keep the commit protocol: each key is one PUT, which an object store makes visible
atomically; a value over ``MULTIPART_BYTES`` goes up as a multipart upload (parts in parallel),
which is just as atomic (nothing is visible before CompleteMultipartUpload).

Forked children: obstore's Rust runtime (tokio) does not survive ``fork()`` (a child that calls it
hangs; obstore documents it as not fork-safe). A process forked after obstore was used (the
default ``torch.utils.data.DataLoader`` worker on Linux) therefore reads and writes through
fsspec (s3fs, gcsfs, adlfs) with the same options; a spawned or forkserver worker, and
``FeatureLoader``'s threads, keep obstore.

Errors: a missing key stays ``FileNotFoundError`` (callers ask "is it there?"); a missing
bucket, refused credentials and a server that stays unreachable through the retries become
:class:`BucketNotFound`, :class:`StorageAccessDenied` and :class:`StorageUnavailable`, each one
line naming the URL, the bucket and the fix.

Building the client, planning a batch's requests and translating errors live in
:mod:`.obstore_client`; the chunk cache is not the backend's business (:mod:`.cached` wraps it).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from featurestore.core.storage import conditional
from featurestore.core.storage.base import Storage
from featurestore.core.storage.io_loop import run, settled
from featurestore.core.storage.obstore_client import bucket_and_prefix, build_store, plan_requests, storage_error
from featurestore.core.storage.options import FEATURESTORE_KEYS, ObjectStoreSettings, translate
from featurestore.errors import BucketNotFound
from featurestore.format.redact import redact_url

T = TypeVar("T")

#: Values at least this large go up as multipart uploads, in parts of ``PART_BYTES``.
MULTIPART_BYTES = 32 << 20
PART_BYTES = 8 << 20
#: A streamed GET (:meth:`ObjectStorage.read_whole_into`) hands its body on this much at a time:
#: the size of the page-cache writes that follow (files.PIECE_BYTES).
STREAM_PIECE_BYTES = 1 << 20


class ObjectStorage(Storage):
    """A store root on object storage; keys are object paths below the URL's prefix."""

    #: The writer's chunk-put threads on object storage (``chunk_puts.default_workers``): each
    #: put mostly waits on the network, so more in flight than a disk wants.
    put_threads = 8

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.shown = redact_url(self.url)  # what messages and the repr quote
        self.storage_options = dict(storage_options or {})
        self.settings: ObjectStoreSettings = translate(self.url, self.storage_options)
        self.bucket, self.prefix = bucket_and_prefix(self.url, self.settings)
        self.gap = self.settings.coalesce_gap  # bytes; ranges of one object at most this far apart: one request
        self.multipart_bytes = MULTIPART_BYTES
        self.part_bytes = PART_BYTES
        self._store = build_store(self.bucket, self.prefix, self.settings)
        self._bucket_checked = False
        self._semaphores: dict[int, asyncio.Semaphore] = {}
        self._fallback: Storage | None = None
        self.bytes_read = 0  # bytes of GET responses so far (benches report it per epoch)
        _mark_runtime()

    # ------------------------------------------------------------------ pickling (workers)
    @property
    def obstore(self) -> Any:
        """The obstore client this storage uses (for tools that issue their own requests)."""
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"ObjectStorage({self.shown!r})"

    # ------------------------------------------------------------------ reads
    def read(self, key: str) -> bytes:
        if _forked():
            return self._forked_backend().read(key)
        import obstore

        result = self._call(lambda: obstore.get(self._store, key).bytes(), key, "GET")
        self.bytes_read += len(result)
        return bytes(result)  # small documents: callers json-parse them, which wants bytes

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[Any]:
        """The byte ranges as buffers (obstore ``Bytes``: zero-copy views of the response)."""
        if _forked():
            return self._forked_backend().read_ranges(keys, starts, ends)
        if not keys:
            return []
        return run(self._read_ranges(list(keys), list(starts), list(ends)))

    def read_ranges_into(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int],
                         sink: Callable[[int, Any], None]) -> None:
        if _forked():
            return self._forked_backend().read_ranges_into(keys, starts, ends, sink)
        if keys:
            run(self._read_ranges(list(keys), list(starts), list(ends), sink))

    async def _read_ranges(self, keys: list[str], starts: list[int], ends: list[int],
                           sink: Callable[[int, Any], None] | None = None) -> list[Any]:
        # Merge near ranges of each object, fetch every merged range at once, slice back.
        requests = plan_requests(keys, starts, ends, self.gap)
        semaphore = self._semaphore()
        out: list[Any] = [b""] * len(keys)

        async def fetch(key: str, lo: int, hi: int, group: list[int]) -> None:
            if hi <= lo:
                return
            data = await self._get_range(semaphore, key, lo, hi)
            if len(data) < hi - lo:
                raise FileNotFoundError(f"{self.shown}/{key}: {len(data)} bytes where {hi - lo} were expected")
            for i in group:
                out[i] = data if (starts[i], ends[i]) == (lo, hi) else data[starts[i] - lo : ends[i] - lo]
                if sink is not None:  # on the loop thread, while other requests are in flight
                    sink(i, out[i])
                    out[i] = b""

        tasks = [asyncio.ensure_future(fetch(*request)) for request in requests]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # a failed batch: no request left to write into the caller's buffer
                task.cancel()
            raise
        return out

    def read_whole_into(self, key: str, size: int, part_bytes: int, sink: Callable[[Any], None],
                        answered: Callable[[], None] | None = None) -> None:
        """One plain GET streamed into ``sink`` in pieces of :data:`STREAM_PIECE_BYTES` as they
        arrive, so the chunk cache writes and checks the first bytes while the rest is coming and
        holds no buffer of the whole chunk (measured against that, 18 interleaved cache epochs 1
        each: 0.64x vs 0.58x the whole-object ceiling). A value past ``part_bytes`` comes as
        concurrent ranged parts, the last one asking for a byte past ``size`` (a longer object
        shows it), handed on once all are in."""
        if _forked():
            return self._forked_backend().read_whole_into(key, size, part_bytes, sink, answered)
        if size > part_bytes:
            count = -(-size // part_bytes)
            bounds = [size * i // count for i in range(count)] + [size + 1]
            parts = run(self._read_parts(key, bounds))
            if answered is not None:
                answered()
            for part in parts:
                sink(part)
            return
        import obstore

        result = self._call(lambda: obstore.get(self._store, key), key, "GET")
        if answered is not None:
            answered()
        pieces = iter(result.stream(min_chunk_size=STREAM_PIECE_BYTES))
        while True:
            try:
                piece = next(pieces)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - translated (the sink's own errors pass as they are)
                raise self._error(exc, key, "GET") from None
            self.bytes_read += len(piece)
            sink(piece)

    async def _read_parts(self, key: str, bounds: list[int]) -> list[Any]:
        semaphore = self._semaphore()
        parts = (self._get_range(semaphore, key, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]))
        return list(await asyncio.gather(*parts))

    async def _get_range(self, semaphore: asyncio.Semaphore, key: str, lo: int, hi: int) -> Any:
        """Bytes ``[lo, hi)`` of ``key``: one GET within the store's requests in flight, its error
        translated, its bytes counted (a short answer is the caller's to judge)."""
        import obstore

        async with semaphore:
            try:
                data = await settled(lambda: obstore.get_range_async(self._store, key, start=lo, end=hi))
            except Exception as exc:  # noqa: BLE001 - translated or re-raised as is
                raise self._error(exc, key, "GET") from None
        self.bytes_read += len(data)
        return data

    def read_many(self, keys: Sequence[str]) -> list[Any]:
        if _forked():
            return self._forked_backend().read_many(keys)
        if not keys:
            return []
        return run(self._read_many(list(keys)))

    async def _read_many(self, keys: list[str]) -> list[Any]:
        import obstore

        semaphore = self._semaphore()

        async def fetch(key: str) -> Any:
            async with semaphore:
                try:
                    result = await settled(lambda: obstore.get_async(self._store, key))
                    data = await settled(result.bytes_async)
                except Exception as exc:  # noqa: BLE001
                    raise self._error(exc, key, "GET") from None
            self.bytes_read += len(data)
            return data

        return list(await asyncio.gather(*(fetch(k) for k in keys)))

    # ------------------------------------------------------------------ writes
    def write(self, key: str, *parts: bytes | memoryview) -> None:
        if _forked():
            return self._forked_backend().write(key, *parts)
        import obstore

        size = sum(memoryview(p).nbytes for p in parts)
        payload: Any = parts[0] if len(parts) == 1 else list(parts)
        if size >= self.multipart_bytes:
            # Parts upload in parallel; the object appears only when the upload completes.
            self._call(lambda: obstore.put(self._store, key, payload if len(parts) > 1 else [payload],
                                           use_multipart=True, chunk_size=self.part_bytes, max_concurrency=8),
                       key, "PUT")  # fmt: skip
        else:
            self._call(lambda: obstore.put(self._store, key, payload, use_multipart=False), key, "PUT")

    # ------------------------------------------------------------------ conditional writes
    # (--worker claims; core.storage.conditional: If-None-Match / If-Match PUTs)
    def put_if_absent(self, key: str, data: bytes) -> str | None:
        return conditional.object_put(self._store, key, data, "create", self._error)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        return conditional.object_read_versioned(self._store, key, self._error)

    def replace_if(self, key: str, data: bytes, token: str) -> str | None:
        return conditional.object_put(self._store, key, data, {"e_tag": token}, self._error)

    # ------------------------------------------------------------------ metadata
    def copy(self, source: str, target: str) -> None:
        """A server-side copy (S3 CopyObject): atomic, and no bytes pass through this host."""
        if _forked():
            return self._forked_backend().copy(source, target)
        import obstore

        self._call(lambda: obstore.copy(self._store, source, target), target, "COPY")

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def size(self, key: str) -> int | None:
        if _forked():
            return self._forked_backend().size(key)
        import obstore

        try:
            meta = obstore.head(self._store, key)
        except FileNotFoundError:
            self._check_bucket()
            return None
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, key, "HEAD") from None
        return int(meta["size"])

    def listdir(self, prefix: str) -> list[str]:
        if _forked():
            return self._forked_backend().listdir(prefix)
        import obstore

        path = f"{prefix.rstrip('/')}/" if prefix else None
        try:
            listing = obstore.list_with_delimiter(self._store, path)
        except FileNotFoundError:
            self._check_bucket()
            return []
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, prefix, "LIST") from None
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in listing["common_prefixes"]}
        names |= {o["path"].rsplit("/", 1)[-1] for o in listing["objects"]}
        names.discard("")
        return sorted(names)

    def delete_tree(self, prefix: str) -> None:
        if _forked():
            return self._forked_backend().delete_tree(prefix)
        import obstore

        path = f"{prefix.rstrip('/')}/" if prefix else None
        try:
            for batch in obstore.list(self._store, path, chunk_size=1000):
                obstore.delete(self._store, [o["path"] for o in batch])
            if prefix:  # a plain object at the prefix itself, as fsspec's rm would remove
                try:
                    obstore.delete(self._store, prefix)
                except FileNotFoundError:
                    pass
        except FileNotFoundError:
            return
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, prefix, "DELETE") from None

    def zarr_store(self, read_only: bool = True) -> Any:
        if _forked():
            return self._forked_backend().zarr_store(read_only)
        from zarr.storage import ObjectStore

        return ObjectStore(self._store, read_only=read_only)

    # ------------------------------------------------------------------ helpers
    def _forked_backend(self) -> Storage:
        if self._fallback is None:
            from featurestore.core.storage.fsspec import FsspecStorage

            options = {k: v for k, v in self.storage_options.items() if k not in FEATURESTORE_KEYS}
            self._fallback = FsspecStorage(self.url, options)
        return self._fallback

    def _semaphore(self) -> asyncio.Semaphore:
        # One per event loop (a forked child has a new one): bounds this store's requests in
        # flight across every thread that reads through it.
        loop_id = id(asyncio.get_running_loop())
        semaphore = self._semaphores.get(loop_id)
        if semaphore is None:
            semaphore = self._semaphores[loop_id] = asyncio.Semaphore(self.settings.max_concurrency)
        return semaphore

    def _call(self, fn: Callable[[], T], key: str, op: str) -> T:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, key, op) from None

    def _check_bucket(self) -> None:
        """On the first missing key, tell a missing bucket apart (a HEAD 404 has no body)."""
        if self._bucket_checked:
            return
        self._bucket_checked = True
        import obstore

        try:
            obstore.list_with_delimiter(self._store, None)
        except Exception as exc:  # noqa: BLE001
            error = self._error(exc, "", "LIST")
            if isinstance(error, BucketNotFound):
                raise error from None
            # Anything else (e.g. no ListBucket right): the HEAD's "not found" stands.

    def _error(self, exc: BaseException, key: str, op: str) -> BaseException:
        return storage_error(exc, key, op, shown=self.shown, bucket=self.bucket, settings=self.settings)


# ---------------------------------------------------------------------- fork safety
_runtime_pid: int | None = None


def _mark_runtime() -> None:
    """Remember the process that (may have) started obstore's runtime."""
    global _runtime_pid
    if _runtime_pid is None:
        _runtime_pid = os.getpid()


def _forked() -> bool:
    """True in a child forked after this process used obstore (its runtime is unusable there)."""
    return _runtime_pid is not None and _runtime_pid != os.getpid()
