"""Chunk puts (featurestore.core.chunk_puts): a chunk's early arrays (labels, statistics row,
block seals row) land before its features chunk is started; on object storage they go out
together, on a local disk one after another. A failed early put stops the chunk before its
features chunk, and the writer with that error.

On object storage every put is a round trip: early puts one after another made a chunk cost one
round trip per array on its put thread's path (the block seals row added one). The stores here
are real stores (SeaweedFS, local files) whose puts also record when they start and end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.core.storage import LocalStorage
from featurestore.core.storage.obstore import ObjectStorage
from featurestore.core.verify import verify_split
from featurestore.format import layout
from featurestore.format.block_seals import BLOCK_SEALS

TOP = ("ds", "enc", "s")
SHAPE, CHUNK_ROWS, N = (4, 256), 64, 128  # float16 rows of 2 KiB, two chunks
EARLY = (layout.LABELS, layout.CHUNK_STATS, BLOCK_SEALS)


def _array(key: str) -> str:
    return key.split("/")[len(TOP)]


def _chunk(key: str) -> int:
    return int(key.rsplit("/c/", 1)[1].split("/")[0])


class _Log:
    """Each chunk put's start and end; with ``meet``, chunk 0's early puts wait for each other
    at a barrier, which they pass only if all of them are in flight at the same time."""

    def __init__(self, meet: bool) -> None:
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.meeting = threading.Barrier(len(EARLY), timeout=20) if meet else None

    def put(self, key: str, put: Callable[[], None]) -> None:
        chunk = "/c/" in key
        if chunk:
            with self.lock:
                self.events.append(("start", key))
            if self.meeting is not None and _array(key) in EARLY and _chunk(key) == 0:
                self.meeting.wait()
        put()
        if chunk:
            with self.lock:
                self.events.append(("end", key))


class _LocalLogged(LocalStorage):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.log = _Log(meet=False)

    def _write(self, key: str, parts: Sequence[bytes | memoryview], *, seal: bool) -> None:
        self.log.put(key, lambda: super(_LocalLogged, self)._write(key, parts, seal=seal))


class _S3Logged(ObjectStorage):
    def __init__(self, url: str, options: dict[str, Any]) -> None:
        super().__init__(url, options)
        self.log = _Log(meet=True)

    def write(self, key: str, *parts: bytes | memoryview) -> None:  # every put, sealed or not
        self.log.put(key, lambda: super(_S3Logged, self).write(key, *parts))


def _values() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.standard_normal((N, *SHAPE)).astype(np.float16), np.arange(N) % 3


@pytest.mark.parametrize("backend", ["seaweedfs", "local"])
def test_a_features_chunk_is_put_after_its_early_puts_which_go_together_on_object_storage(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    storage: _S3Logged | _LocalLogged
    if backend == "seaweedfs":
        storage = _S3Logged(request.getfixturevalue("seaweed_url"), request.getfixturevalue("seaweed").storage_options)
    else:
        storage = _LocalLogged(str(tmp_path / "store"))
    store = featurestore.FeatureStore(storage, mode="a")
    values, labels = _values()
    writer = store.create_split(*TOP, num_samples=N, sample_shape=SHAPE, dtype="float16", chunk_rows=CHUNK_ROWS,
                                label_dtype="int64")
    writer.write(0, values, labels=labels)
    writer.commit()  # S3, early puts one after another: the first waits alone, BrokenBarrierError
    for chunk in range(N // CHUNK_ROWS):
        events = [(what, _array(key)) for what, key in storage.log.events if _chunk(key) == chunk]
        early = [event for event in events if event[1] in EARLY]
        features_start = events.index(("start", layout.FEATURES))
        assert len(early) == 2 * len(EARLY) and events.index(early[-1]) < features_start, events
        if backend == "local":  # no round trip to overlap: each put ends before the next starts
            assert [what for what, _ in early] == ["start", "end"] * len(EARLY), events
    assert verify_split(store, *TOP).problems == []
    got = featurestore.FeatureStore(storage, mode="r").open(*TOP)
    assert np.array_equal(got.read_numpy(np.arange(N)), values.astype(np.float32))


class _RoundTrips(LocalStorage):
    """Real local files, put as object storage is (``put_threads``: early puts go together), a
    block seals row taking a while to land."""

    put_threads = 2

    def _write(self, key: str, parts: Sequence[bytes | memoryview], *, seal: bool) -> None:
        if "/c/" in key and _array(key) == BLOCK_SEALS:
            time.sleep(0.5)
        super()._write(key, parts, seal=seal)


def test_a_failed_early_put_stops_the_chunk_before_its_features_once_the_others_settled(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = featurestore.FeatureStore(_RoundTrips(str(root)), mode="a")
    values, _ = _values()
    make = dict(num_samples=N, sample_shape=SHAPE, dtype="float16", chunk_rows=CHUNK_ROWS)
    writer = store.create_split(*TOP, **make)
    split = root.joinpath(*TOP)
    split.joinpath(layout.CHUNK_STATS, "c").write_bytes(b"")  # a file where the rows' directory goes
    with pytest.raises(OSError):
        writer.write(0, values[:CHUNK_ROWS])  # chunk 0: its statistics row fails, its block seals row lands
        writer.flush()
    # the chunk's other early put had landed when the error was raised: nothing of the failed
    # writer lands later, beside what a resume writes
    assert sorted(p.name for p in split.joinpath(BLOCK_SEALS, "c").iterdir()) == ["0"]
    assert not list(split.rglob("*.tmp"))
    assert not split.joinpath(layout.FEATURES, "c").exists()  # no chunk proven done
    with pytest.raises(OSError):
        writer.commit()
    assert store.split_status(*TOP) == "writing"
    split.joinpath(layout.CHUNK_STATS, "c").unlink()
    resumed = store.create_split(*TOP, resume=True, **make)
    assert resumed.pending_chunks() == [0, 1]
    resumed.write(0, values)
    resumed.commit()
    assert verify_split(store, *TOP).problems == []
