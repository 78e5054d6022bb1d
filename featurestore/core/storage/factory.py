"""``open_storage``: the backend for a store URL, wrapped in the chunk cache when asked for.

Above the backends: a local path or ``file://`` URL gets :mod:`.local`, ``s3://``/``gs://``/
``az://`` get :mod:`.obstore` (imported on first use), any other fsspec URL :mod:`.fsspec`. An
object store opened with ``cache_dir`` (storage option or ``FEATURESTORE_CACHE_DIR``) comes
wrapped in :class:`.cached.CachedStorage`.
"""

from __future__ import annotations

import os
from typing import Any

from featurestore.core.storage.base import Storage
from featurestore.core.storage.fsspec import FsspecStorage
from featurestore.core.storage.local import LocalStorage
from featurestore.errors import StoreNotFound


def check_url(url: Any) -> None:
    """Refuse a store URL that is empty (or not a path at all) in the one message every caller gives."""
    if not isinstance(url, (str, os.PathLike)) or not str(url):
        raise StoreNotFound(f"store URL {url!r} is empty: pass a directory path or an fsspec URL such as s3://bucket/prefix")


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """A local path or ``file://`` URL gets :class:`LocalStorage` (memory-mappable); ``s3://``,
    ``gs://`` and ``az://`` get the obstore backend (:class:`.obstore.ObjectStorage`; set
    ``FEATURESTORE_OBJECT_BACKEND=fsspec`` to go through fsspec instead), wrapped in the chunk
    cache (:func:`.cached.with_chunk_cache`) when its settings name a ``cache_dir``; any other
    fsspec URL gets :class:`FsspecStorage`."""
    check_url(url)
    url = os.fspath(url)
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" not in url:
        return LocalStorage(url, fsync=os.environ.get("FEATURESTORE_FSYNC") == "1",
                            writeback=os.environ.get("FEATURESTORE_WRITEBACK", "1") != "0")
    scheme = url.split("://", 1)[0].lower()
    check_protocols(url, scheme)
    if scheme in OBJECT_SCHEMES and os.environ.get("FEATURESTORE_OBJECT_BACKEND", "obstore") != "fsspec":
        # Imported here: asyncio and the obstore backend would cost every local command ~0.1 s.
        from featurestore.core.storage.obstore import ObjectStorage

        backend = ObjectStorage(url, storage_options)
        if backend.settings.cache_dir is None:
            return backend
        from featurestore.core.storage.cached import with_chunk_cache

        return with_chunk_cache(backend, backend.settings.cache_dir, backend.settings.cache_bytes)
    return FsspecStorage(url, storage_options)


#: URL schemes read and written through obstore (see :data:`.options.SCHEMES`).
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
