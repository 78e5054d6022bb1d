"""Deprecated import path: the chunk cache lives in :mod:`featurestore.core.storage.chunk_cache`
(a backend wrapped in it: :mod:`featurestore.core.storage.cached`; ``parse_bytes`` and the
environment variables' names: :mod:`featurestore.core.storage.options`)."""

from featurestore.core.storage.chunk_cache import FETCH_THREADS, LOCK_SUFFIX, PART_BYTES, ChunkCache, shared
from featurestore.core.storage.options import ENV_BYTES, ENV_DIR, parse_bytes

__all__ = ["ENV_BYTES", "ENV_DIR", "FETCH_THREADS", "LOCK_SUFFIX", "PART_BYTES", "ChunkCache", "parse_bytes", "shared"]
