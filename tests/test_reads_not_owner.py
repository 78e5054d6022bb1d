"""A store this process may read but not write (a labmate's store on a shared file system).

``mincore`` reports every page of such a file as page-cached (Linux >= 5.2), so the reader's
``auto`` choice between the mmap gather (cached rows) and concurrent preads (rows on the disk)
asks sampled ``RWF_NOWAIT`` reads instead: a cold chunk must go to pread, whose cold reads are
many times the mmap gather's page faults, and a cached one to the maps."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.core import pread
from featurestore.testing.cgroup import evict

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="needs root to write a store and read it as another user")  # fmt: skip

NOBODY = 65534


@pytest.fixture
def shared_store() -> Iterator[str]:
    """A store root wrote (files 0644), in a directory any user may search."""
    pread.resident(0, 0)  # ctypes imported as root: this interpreter's own files are root's alone
    top = Path(tempfile.mkdtemp(prefix="featurestore-shared-"))
    top.chmod(0o755)
    path = str(top / "store")
    store = featurestore.open_store(path, mode="a")
    w = store.create_split("d", "e", "s", num_samples=64, sample_shape=(1024,), dtype="float16", chunk_rows=16)
    w.write(0, np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024) % 251)
    w.commit()
    for root, dirs, files in os.walk(top):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    try:
        yield path
    finally:
        shutil.rmtree(top)


def as_nobody(call: Any) -> Any:
    os.seteuid(NOBODY)
    try:
        return call()
    finally:
        os.seteuid(0)


def test_cold_chunks_of_a_store_read_only_to_this_process_go_to_pread(shared_store: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("FEATURESTORE_VERIFY_READS", "off")  # the first read's crc check would cache the chunk
    monkeypatch.setenv("FEATURESTORE_READ_CACHE", "keep")
    evict(shared_store)
    arr = as_nobody(lambda: featurestore.open_store(shared_store).open("d", "e", "s"))
    rows = np.array([1, 5, 9], dtype=np.int64)
    first = as_nobody(lambda: arr.read_numpy(rows))
    assert arr.read_counts["mmap"] == 0, "a cold chunk went to the mmap gather: mincore's answer was trusted"
    assert arr.read_counts["inline"] + arr.read_counts["pool"] > 0
    for root, _, files in os.walk(shared_store):  # every file page-cached now
        for name in files:
            Path(root, name).read_bytes()
    arr._warm = None  # forget what was found, as every 2 s
    again = as_nobody(lambda: arr.read_numpy(rows))
    assert arr.read_counts["mmap"] == 1, "a cached chunk was not read through its map"
    assert np.array_equal(first, again)
    assert np.array_equal(first, (np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024) % 251)[rows])


def test_sampled_probe_tells_cached_from_evicted(tmp_path: Any) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    os.sync()
    with open(path, "rb") as f:
        f.read()
    assert pread.sampled_cached(str(path), 1 << 20) is True
    evict(str(path))
    assert pread.sampled_cached(str(path), 1 << 20) is False
