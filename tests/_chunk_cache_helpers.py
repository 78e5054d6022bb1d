"""What the chunk-cache tests share: a small float16 split written to an object store, opened
through a cache directory, and the cache files it leaves."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import featurestore

N, SHAPE, CHUNK_ROWS = 200, (16, 24), 16  # 13 chunks of 12 KiB (+ labels, + statistics rows)


def _write(url: str, options: dict[str, Any], seed: int = 0, overwrite: bool = False, n: int = N,
           shape: tuple[int, ...] = SHAPE, chunk_rows: int = CHUNK_ROWS) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float16)
    store = featurestore.open_store(url, mode="a", **options)
    writer = store.create_split("ds", "enc", "train", num_samples=n, sample_shape=shape, dtype="float16",
                                chunk_rows=chunk_rows, label_shape=(), label_dtype="int64", overwrite=overwrite)
    writer.write(0, values, labels=np.arange(n) + seed)
    writer.commit()
    return values


def _open(url: str, options: dict[str, Any], cache: Any, **extra: Any) -> Any:
    return featurestore.open_store(url, cache_dir=str(cache), **options, **extra).open("ds", "enc", "train")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}


def _chunk_files(root: Any) -> list[str]:
    """The cached chunk files under ``root`` (the seal table, read when a cached file is first
    checked against it, is not a chunk of the split's data)."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                  if f.isdigit() and "chunk_seals" not in d.split(os.sep))
