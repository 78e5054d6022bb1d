"""Fixtures for the Dataset/loader suite: one reference split set, served from three sources.

The same bytes are written to a local directory, to a bucket on the moto S3 server (from
``conftest.s3_endpoint``), to the session's SeaweedFS (``conftest.seaweed``), and served over HTTP by a real uvicorn subprocess running the
featurestore server on the local copy. Every suite test then runs once per source and compares
against in-RAM tensors built from the same numpy arrays.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import featurestore

NUM_SAMPLES = 101  # odd on purpose: partial last batch, padding for world_size 2 and 3
SAMPLE_SHAPE = (3, 8)
DATASET, ENCODER = "ds", "enc"
NUM_CLASSES = 7
# 8 rows per chunk for the float32 split (sample = 96 bytes): 13 chunks, so shuffles and block
# orders cross many chunk boundaries. Small on purpose: every random row is one request on S3.
CHUNK_BYTES = 8 * 3 * 8 * 4


def reference() -> tuple[np.ndarray, np.ndarray]:
    """The float32 features and int64 labels every split is written from."""
    rng = np.random.default_rng(1234)
    features = (rng.standard_normal((NUM_SAMPLES, *SAMPLE_SHAPE)) * 3 + 0.5).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, size=NUM_SAMPLES).astype(np.int64)
    return features, labels


def write_reference_store(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Splits ``f32`` (float32 + int64 labels), ``f16`` (float16 + uint8 labels), ``nolabels``."""
    store = featurestore.open_store(url, mode="a", **(storage_options or {}))
    features, labels = reference()
    specs = (("f32", "float32", "int64", labels), ("f16", "float16", "uint8", labels.astype(np.uint8)),
             ("nolabels", "float32", None, None))
    for split, dtype, label_dtype, split_labels in specs:
        writer = store.create_split(DATASET, ENCODER, split, num_samples=NUM_SAMPLES, sample_shape=SAMPLE_SHAPE,
                                    dtype=dtype, label_dtype=label_dtype, chunk_bytes=CHUNK_BYTES)
        for start in range(0, NUM_SAMPLES, 40):  # several writes, like an extraction run
            stop = min(NUM_SAMPLES, start + 40)
            writer.write(start, features[start:stop], labels=None if split_labels is None else split_labels[start:stop])
        writer.commit()


@dataclass
class Source:
    """Where the reference store lives: ``FeatureDataset(url, ..., **kwargs)`` opens it."""

    kind: str
    url: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def local_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("loader") / "store")
    write_reference_store(path)
    return path


@pytest.fixture(scope="module")
def http_url(local_store: str) -> Iterator[str]:
    """A live ``featurestore serve`` (uvicorn subprocess on a free loopback port) over ``local_store``."""
    from featurestore.testing.serving import serve_subprocess

    with serve_subprocess(local_store) as (url, _):
        yield url


@pytest.fixture(scope="module")
def s3_store(request: pytest.FixtureRequest, local_store: str) -> tuple[str, dict[str, Any]]:
    """The reference store in its own bucket on the session's moto server (conftest).

    Uploaded from the local copy in one concurrent ``put`` (the writer's own S3 path is tested by
    the store suite); a store is just its keys, so the bytes are identical.
    """
    pytest.importorskip("s3fs")
    import s3fs

    options = dict(request.getfixturevalue("s3_storage_options"))
    bucket = f"fs-loader-{uuid.uuid4().hex[:10]}"
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(bucket)
    fs.put(local_store, f"{bucket}/store", recursive=True)
    fs.invalidate_cache()
    return f"s3://{bucket}/store", options


@pytest.fixture(scope="module")
def seaweed_store(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    """The reference store written by the writer itself to the session's SeaweedFS (conftest)."""
    from conftest import SEAWEED_BUCKET

    from featurestore.core.storage.obstore import ObjectStorage

    options = dict(request.getfixturevalue("seaweed").storage_options)
    url = f"s3://{SEAWEED_BUCKET}/loader-{uuid.uuid4().hex[:10]}"
    write_reference_store(url, options)
    yield url, options
    ObjectStorage(url, options).delete_tree("")


@pytest.fixture(scope="module", params=["local", "s3", "seaweedfs", "http"])
def source(request: pytest.FixtureRequest) -> Source:
    if request.param == "local":
        return Source("local", request.getfixturevalue("local_store"))
    if request.param in ("s3", "seaweedfs"):
        url, options = request.getfixturevalue("s3_store" if request.param == "s3" else "seaweed_store")
        return Source(request.param, url, {"storage_options": options})
    return Source("http", request.getfixturevalue("http_url"))


def fresh_maps_per_epoch(loader: Any, monkeypatch: pytest.MonkeyPatch, epochs: int = 3,
                         dropped: list[int] | None = None) -> list[int]:
    """How many fresh batch buffers (anonymous maps) each of ``epochs`` epochs of ``loader`` mapped:
    those of its own batch pool only, not of another pool that maps meanwhile in this process (the
    threads of a loader an earlier test left mid-epoch, say). ``dropped``, if given, gets per epoch
    how many buffers came back to that pool and were unmapped instead of kept."""
    from featurestore.core import buffers

    mapped: list[Any] = []  # the pool behind each map
    drops: list[Any] = []  # the pool that dropped each returning buffer
    real, real_file = buffers.anonymous, buffers.BufferPool._file

    def counted(nbytes: int) -> Any:
        mapped.append(sys._getframe(1).f_locals.get("self"))  # BufferPool.lease's self
        return real(nbytes)

    def filed(pool: Any, buffer: Any) -> None:
        kept = len(pool._free)
        real_file(pool, buffer)
        if not any(b is buffer for b in pool._free) and len(pool._free) <= kept:
            drops.append(pool)

    monkeypatch.setattr(buffers, "anonymous", counted)
    monkeypatch.setattr(buffers.BufferPool, "_file", filed)
    counts = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        before, dropped_before = len(mapped), len(drops)
        for _ in loader:
            pass
        pool = loader._producer.pool
        counts.append(sum(1 for p in mapped[before:] if p is pool))
        if dropped is not None:
            dropped.append(sum(1 for p in drops[dropped_before:] if p is pool))
    return counts
