"""A backend wrapped in the local chunk cache, as zarr v3 wraps one store in another.

:class:`CachedStorage` is the backend's own view of the store root (every read and write of the
interface goes straight to it) plus the :class:`~.chunk_cache.ChunkCache` that the readers of a
complete split fetch whole chunks into (``core.reader_cached``, ``core.cached_array``). The
backend knows nothing of the cache; :func:`chunk_cache_of` is how a reader asks whether its
storage has one. Attributes of the backend beyond the interface (``bytes_read``, ``settings``,
``put_threads``) are read through the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from featurestore.core.storage.base import Storage
from featurestore.core.storage.chunk_cache import ChunkCache, shared


class CachedStorage(Storage):
    """``backend`` with the process's chunk cache ``cache`` of the directory it was opened with."""

    def __init__(self, backend: Storage, cache: ChunkCache, max_bytes: int | None = None) -> None:
        self.backend = backend
        self.cache = cache
        self.url = backend.url
        self._max_bytes = max_bytes  # as asked for (None: the default share), for the unpickled copy

    def __reduce__(self) -> tuple[Any, ...]:
        # A DataLoader worker (spawned) opens the same directory's cache in its process; a
        # directory it cannot write leaves it the bare backend, as ``open_storage`` would.
        return with_chunk_cache, (self.backend, self.cache.directory, self._max_bytes)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks: the backend's own extras.
        if name.startswith("__") or name in ("backend", "cache", "_max_bytes"):
            raise AttributeError(name)
        return getattr(self.backend, name)

    def __repr__(self) -> str:
        return f"CachedStorage({self.backend!r}, {self.cache!r})"

    def read(self, key: str) -> bytes:
        return self.backend.read(key)

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[Any]:
        return self.backend.read_ranges(keys, starts, ends)

    def read_ranges_into(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int],
                         sink: Callable[[int, Any], None]) -> None:
        self.backend.read_ranges_into(keys, starts, ends, sink)

    def read_many(self, keys: Sequence[str]) -> list[Any]:
        return self.backend.read_many(keys)

    def read_present(self, keys: Sequence[str]) -> list[Any]:
        return self.backend.read_present(keys)

    def read_whole_into(self, key: str, size: int, part_bytes: int, sink: Callable[[Any], None],
                        answered: Callable[[], None] | None = None) -> None:
        self.backend.read_whole_into(key, size, part_bytes, sink, answered)

    def write(self, key: str, *parts: bytes | memoryview) -> None:
        self.backend.write(key, *parts)

    def write_sealed(self, key: str, payload: bytes | memoryview) -> None:
        self.backend.write_sealed(key, payload)

    def copy(self, source: str, target: str) -> None:
        self.backend.copy(source, target)

    def exists(self, key: str) -> bool:
        return self.backend.exists(key)

    def size(self, key: str) -> int | None:
        return self.backend.size(key)

    def listdir(self, prefix: str) -> list[str]:
        return self.backend.listdir(prefix)

    def delete_tree(self, prefix: str) -> None:
        self.backend.delete_tree(prefix)

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        return self.backend.put_if_absent(key, data)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        return self.backend.read_versioned(key)

    def replace_if(self, key: str, data: bytes, token: str) -> str | None:
        return self.backend.replace_if(key, data, token)

    def local_path(self, key: str) -> str | None:
        return self.backend.local_path(key)

    def zarr_store(self, read_only: bool = True) -> Any:
        return self.backend.zarr_store(read_only)


def with_chunk_cache(backend: Storage, directory: str, max_bytes: int | None) -> Storage:
    """``backend`` wrapped in the process's cache of ``directory`` (at most ``max_bytes``, None: the
    default share of its disk); ``backend`` itself when that directory cannot be written (warned
    once by :func:`.chunk_cache.shared`: reads then go by ranged GETs, as without a cache)."""
    cache = shared(directory, max_bytes)
    return backend if cache is None else CachedStorage(backend, cache, max_bytes)


def chunk_cache_of(storage: Storage) -> ChunkCache | None:
    """The chunk cache readers of ``storage`` fetch whole chunks into, or None (no ``cache_dir``)."""
    return storage.cache if isinstance(storage, CachedStorage) else None
