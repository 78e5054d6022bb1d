"""Data requests answered on the event loop (``server/on_loop.py``) and the reader's test that
decides it (``FeatureArray.in_memory``): only reads that cannot wait skip the thread pool, and
they answer the same bytes."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import featurestore  # noqa: E402
from featurestore.core.mapped_file import mincore_truthful  # noqa: E402
from featurestore.format import wire  # noqa: E402
from featurestore.testing.cgroup import evict  # noqa: E402
from server import Settings, create_app  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import expected, make_store  # noqa: E402

BASE = "/v1/features/pannuke/tiny"
COUNTER = "featurestore_data_requests_on_event_loop_total"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_store(str(tmp_path_factory.mktemp("on_loop") / "store"))


def on_loop(client: TestClient) -> int:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(COUNTER + " "):
            return int(float(line.split()[1]))
    raise AssertionError(f"{COUNTER} is not in /metrics")


def rows_of(response: Any) -> np.ndarray:
    assert response.status_code == 200, response.text
    shape = wire.parse_shape(response.headers[wire.SHAPE_HEADER])
    return np.frombuffer(response.content, wire.storage_dtype(response.headers[wire.DTYPE_HEADER])).reshape(shape)


def test_page_cached_checked_rows_are_answered_on_the_loop_with_the_same_bytes(store_path: str) -> None:
    # train: float16 [40, 4, 8], 5-row chunks; every request is answered twice, the second time
    # with everything it needs already checked and in memory
    with TestClient(create_app(store_path)) as client:
        first = client.get(f"{BASE}/train/items/7")
        assert on_loop(client) == 0  # the split was not open yet: opened in the pool
        again = client.get(f"{BASE}/train/items/7")
        assert on_loop(client) == 1
        assert np.array_equal(rows_of(first), expected(store_path, "train", [7])[0])
        assert rows_of(again).tobytes() == rows_of(first).tobytes()

        client.get(f"{BASE}/train/items/31")  # chunk 6, never read by this worker: checked in the pool
        assert on_loop(client) == 1
        assert np.array_equal(rows_of(client.get(f"{BASE}/train/items/31")), expected(store_path, "train", [31])[0])
        assert on_loop(client) == 2

        got = rows_of(client.get(f"{BASE}/train/batch", params={"start": 5, "stop": 10}))  # chunk 1: read above
        assert on_loop(client) == 3
        assert np.array_equal(got, expected(store_path, "train", range(5, 10)))
        body = wire.encode_indices(np.array([31, 7, 7], dtype=np.int64))
        got = rows_of(client.post(f"{BASE}/train/batch", content=body, headers={"content-type": wire.INDICES}))
        assert on_loop(client) == 4
        assert np.array_equal(got, expected(store_path, "train", [31, 7, 7]))

        labels = client.get(f"{BASE}/train/items/7", params={"labels": "true"})  # labels: another array
        assert on_loop(client) == 4
        assert rows_of(labels).tolist() == [70]
        client.get(f"{BASE}/train/items/7", params={"labels": "true"})
        assert on_loop(client) == 5

        assert client.get(f"{BASE}/train/items/40").status_code == 416  # errors are answered as before
        assert client.get(f"{BASE}/nope/items/0").status_code == 404


def test_inline_reads_can_be_turned_off_and_large_reads_go_to_the_pool(store_path: str) -> None:
    with TestClient(create_app(store_path, Settings(inline_read_bytes=0))) as client:
        for _ in range(3):
            assert np.array_equal(rows_of(client.get(f"{BASE}/train/items/3")), expected(store_path, "train", [3])[0])
        assert on_loop(client) == 0
    row = 4 * 8 * 2  # one float16 [4, 8] sample
    with TestClient(create_app(store_path, Settings(inline_read_bytes=row))) as client:
        for _ in range(2):
            client.get(f"{BASE}/train/batch", params={"start": 0, "stop": 2})
        assert on_loop(client) == 0  # 2 rows > the cap, however warm
        client.get(f"{BASE}/train/items/1")
        assert on_loop(client) == 1


def test_a_full_in_flight_budget_sends_the_request_to_the_pool_not_to_a_wait_on_the_loop(store_path: str) -> None:
    row = 4 * 8 * 2
    app = create_app(store_path, Settings(max_inflight_bytes=row, inflight_wait_s=0.05))
    state = app.state.featurestore
    with TestClient(app) as client:
        client.get(f"{BASE}/train/items/2")
        client.get(f"{BASE}/train/items/2")
        assert on_loop(client) == 1
        state.reserve(row)  # another response holds the whole budget
        try:
            busy = client.get(f"{BASE}/train/items/2")
        finally:
            state.release(row)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert on_loop(client) == 1
        assert client.get(f"{BASE}/train/items/2").status_code == 200
        assert on_loop(client) == 2


def test_an_int8_split_is_answered_on_the_loop_only_as_stored_codes(tmp_path: Any) -> None:
    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    w = store.create_split("d", "e", "q", num_samples=8, sample_shape=(16,), dtype="int8", chunk_rows=4)
    w.write(0, np.random.default_rng(0).standard_normal((8, 16), dtype=np.float32))
    w.commit()
    with TestClient(create_app(str(tmp_path / "s"))) as client:
        for _ in range(3):  # values: dequantized, a conversion kept off the loop
            assert client.get("/v1/features/d/e/q/items/1").headers[wire.DTYPE_HEADER] == "float32"
        assert on_loop(client) == 0
        codes = client.get("/v1/features/d/e/q/items/1", params={"dtype": "int8"})
        assert codes.status_code == 200 and codes.headers[wire.DTYPE_HEADER] == "int8"
        assert on_loop(client) == 1


# ---------------------------------------------------------------------- FeatureArray.in_memory
def _split(path: str, verify_chunks: bool = True) -> Any:
    store = featurestore.open_store(path, mode="a")
    w = store.create_split("d", "e", "s", num_samples=64, sample_shape=(1024,), dtype="float16", chunk_rows=16)
    w.write(0, np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024) % 251)
    w.commit()
    return featurestore.open_store(path).open("d", "e", "s")


def test_in_memory_needs_the_chunks_mapped_and_checked(tmp_path: Any) -> None:
    arr = _split(str(tmp_path / "s"))
    rows = np.array([3], dtype=np.int64)
    assert not arr.in_memory(rows)  # nothing mapped or checked yet (the pages are cached: just written)
    arr.read_numpy(rows)
    assert arr.in_memory(rows)
    assert arr.in_memory(np.array([0, 15, 3, 3], dtype=np.int64))  # the same chunk
    assert not arr.in_memory(np.array([3, 16], dtype=np.int64))  # chunk 1: not checked yet
    assert not arr.in_memory(np.array([64], dtype=np.int64))  # out of range: the read raises, not this
    arr.read_numpy(np.arange(64))
    assert arr.in_memory(np.array([63, 0, 40], dtype=np.int64))


def test_in_memory_is_false_for_rows_evicted_from_the_page_cache(tmp_path: Any) -> None:
    path = str(tmp_path / "s")
    arr = _split(path)
    every = np.arange(64, dtype=np.int64)
    arr.read_numpy(every)
    assert arr.in_memory(every)
    for entry in list(arr._maps._seen.values()):  # this process's page-table entries go first
        entry.release()
    evict(path)
    assert not arr.in_memory(every)
    arr.read_numpy(every)
    assert arr.in_memory(every)


def test_in_memory_is_false_off_the_local_mmap_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _split(str(tmp_path / "s"))
    monkeypatch.setenv("FEATURESTORE_LOCAL_READ", "pread")
    arr = featurestore.open_store(str(tmp_path / "s")).open("d", "e", "s")
    arr.read_numpy(np.arange(64))
    assert not arr.in_memory(np.array([1], dtype=np.int64))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to act as another user")
def test_mincore_is_trusted_only_for_files_the_process_could_write() -> None:
    # Linux >= 5.2 reports every page of a file it may not write as resident: those maps never
    # count as in memory. Checked as an unprivileged user against root's files (in a directory
    # that user may search: pytest's own are root's alone).
    top = Path(tempfile.mkdtemp(prefix="featurestore-mincore-"))
    top.chmod(0o755)
    shared, writable = top / "shared", top / "writable"
    for name, mode in ((shared, 0o644), (writable, 0o666)):
        name.write_bytes(b"x")
        os.chmod(name, mode)
    os.seteuid(65534)
    try:
        seen = [mincore_truthful(str(shared), 0), mincore_truthful(str(writable), 0),
                mincore_truthful(str(shared), 65534)]  # fmt: skip
    finally:
        os.seteuid(0)
        shutil.rmtree(top)
    assert seen == [False, True, True]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to act as another user")
def test_in_memory_of_a_store_this_process_may_only_read_asks_a_read_that_refuses_to_wait() -> None:
    # A store made by another user (a shared project directory; a host store mounted read-only into
    # the server's container): mincore cannot tell there, a RWF_NOWAIT read of the rows can.
    top = Path(tempfile.mkdtemp(prefix="featurestore-not-owner-"))
    top.chmod(0o755)
    path = str(top / "s")
    _split(path)
    every = np.arange(64, dtype=np.int64)
    os.seteuid(65534)
    try:
        arr = featurestore.open_store(path).open("d", "e", "s")
        arr.read_numpy(every)
        assert not any(entry.mincore_truthful for entry in arr._maps._seen.values())
        warm = arr.in_memory(every)
        for entry in list(arr._maps._seen.values()):
            entry.release()
        os.seteuid(0)
        evict(path)
        os.seteuid(65534)
        cold = arr.in_memory(every)
        arr.read_numpy(every)
        again = arr.in_memory(np.array([5, 40, 3, 3, 1], dtype=np.int64))  # runs of one chunk, a duplicate
        for entry in list(arr._maps._seen.values()):
            entry.release()
        # Only the page of rows 0 and 1 (2 KiB each) cached: the whole chunk dropped, then that page
        # read back without read-ahead. (Dropping the page of rows 2 and 3 alone fails where the
        # page cache holds the file in large folios: a part of one is not dropped.)
        fd = os.open(os.path.join(path, "d", "e", "s", "features", "c", "0", "0"), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 4096, 0)
        os.close(fd)
        partly = (arr.in_memory(np.array([1], dtype=np.int64)), arr.in_memory(np.array([1, 3], dtype=np.int64)))
    finally:
        os.seteuid(0)
        shutil.rmtree(top)
    assert (warm, cold, again, partly) == (True, False, True, (True, False))
