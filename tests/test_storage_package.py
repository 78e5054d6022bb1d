"""The storage package's composition: ``open_storage`` picks a backend and wraps an object store
opened with ``cache_dir`` in the chunk cache; the backend itself knows nothing of the cache.

No server is contacted: building an obstore client sends no request.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from featurestore.core.storage import LocalStorage, open_storage
from featurestore.core.storage.cached import CachedStorage, chunk_cache_of
from featurestore.core.storage.chunk_cache import shared

pytest.importorskip("obstore")

URL = "s3://bucket/store"
OPTIONS = {"endpoint_url": "http://127.0.0.1:1", "key": "k", "secret": "s", "max_retries": 0}


@pytest.fixture(autouse=True)
def _no_cache_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEATURESTORE_CACHE_DIR", raising=False)
    monkeypatch.delenv("FEATURESTORE_CACHE_BYTES", raising=False)
    monkeypatch.delenv("FEATURESTORE_OBJECT_BACKEND", raising=False)


def test_an_object_store_without_cache_dir_is_the_bare_backend() -> None:
    from featurestore.core.storage.obstore import ObjectStorage

    storage = open_storage(URL, OPTIONS)
    assert type(storage) is ObjectStorage and chunk_cache_of(storage) is None
    assert not hasattr(storage, "chunk_cache") and not hasattr(storage, "cache")


def test_cache_dir_wraps_the_backend_in_the_process_cache(tmp_path: Path) -> None:
    from featurestore.core.storage.obstore import ObjectStorage

    storage = open_storage(URL, {**OPTIONS, "cache_dir": str(tmp_path), "cache_bytes": "1G"})
    assert isinstance(storage, CachedStorage) and type(storage.backend) is ObjectStorage
    assert chunk_cache_of(storage) is shared(str(tmp_path), 1 << 30)  # one cache per directory and process
    assert not hasattr(storage.backend, "chunk_cache") and chunk_cache_of(storage.backend) is None
    # the interface goes to the backend; its extras are read through the wrapper
    assert storage.url == storage.backend.url and storage.local_path("k") is None
    assert storage.settings is storage.backend.settings and storage.put_threads == ObjectStorage.put_threads
    assert storage.bytes_read == 0


def test_a_pickled_cached_storage_opens_the_same_cache(tmp_path: Path) -> None:
    storage: Any = open_storage(URL, {**OPTIONS, "cache_dir": str(tmp_path)})
    copy = pickle.loads(pickle.dumps(storage))  # as a spawned DataLoader worker receives it
    assert isinstance(copy, CachedStorage) and copy.backend is not storage.backend
    assert copy.url == storage.url and chunk_cache_of(copy) is chunk_cache_of(storage)
    assert copy.cache.max_bytes == storage.cache.max_bytes


def test_a_local_store_has_no_cache(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "root"))
    assert type(storage) is LocalStorage and chunk_cache_of(storage) is None


def test_the_wrapper_passes_every_interface_method_to_its_backend() -> None:
    """A method added to the interface must be passed on by the wrapper too: inherited, it would
    run the interface's default instead of the backend's own (an object store's atomic copy, say)."""
    from featurestore.core.storage.base import Storage

    interface = [n for n, v in vars(Storage).items() if callable(v) and not n.startswith("_")]
    assert "write_sealed" in interface and "read_whole_into" in interface
    missing = [n for n in interface if n not in vars(CachedStorage)]
    assert not missing, f"CachedStorage does not pass on {missing}: add them to featurestore/core/storage/cached.py"
