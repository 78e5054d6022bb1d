"""The local chunk cache of object-storage stores (core.storage.chunk_cache), against the
session's SeaweedFS server: same bytes as without it, shared by processes, safe against kills,
other generations and damaged files. Room, eviction and a server that dies are in
test_chunk_cache_eviction.py; the server, forked workers and bag splits in test_chunk_cache_served.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from _chunk_cache_helpers import CHUNK_ROWS, N, _chunk_files, _env, _open, _write
from reader_contract import ReaderContract

import featurestore
from featurestore.core.storage.options import parse_bytes, translate
from featurestore.errors import InvalidStorageOptions, SplitChanged

pytest.importorskip("obstore")


class TestSeaweedCachedReader(ReaderContract):
    """The reader contract through a chunk cache on the real S3 server."""

    dtypes = ("float16", "float32")

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        return request.getfixturevalue("seaweed_url"), dict(request.getfixturevalue("seaweed").storage_options)

    def open_reader(self, url: str, options: dict[str, Any], dataset: str, encoder: str, split: str,
                    request: pytest.FixtureRequest) -> Any:
        cache = request.getfixturevalue("tmp_path") / "cache"
        reader = featurestore.open_store(url, cache_dir=str(cache), **options).open(dataset, encoder, split)
        assert reader.path == "cached"
        return reader


# ---------------------------------------------------------------------- options (no server)
def test_cache_options_and_environment() -> None:
    settings = translate("s3://b", {"cache_dir": "/x", "cache_bytes": "2G"}, environ={})
    assert settings.cache_dir == "/x" and settings.cache_bytes == 2 << 30
    env = translate("s3://b", {}, environ={"FEATURESTORE_CACHE_DIR": "/y", "FEATURESTORE_CACHE_BYTES": "512M"})
    assert env.cache_dir == "/y" and env.cache_bytes == 512 << 20
    assert translate("s3://b", {}, environ={}).cache_dir is None  # no cache unless asked
    assert translate("s3://b", {"cache_dir": "/o"}, environ={"FEATURESTORE_CACHE_DIR": "/e"}).cache_dir == "/o"
    with pytest.raises(InvalidStorageOptions) as info:
        translate("s3://b", {}, environ={"FEATURESTORE_CACHE_BYTES": "lots"})
    assert "FEATURESTORE_CACHE_BYTES='lots'" in str(info.value) and "\n" not in str(info.value)
    assert parse_bytes(1000, "x") == 1000 and parse_bytes("1.5k", "x") == 1536
    with pytest.raises(InvalidStorageOptions, match=r"cache_bytes='12M' without a cache directory: give cache_dir"):
        translate("s3://b", {"cache_bytes": "12M"}, environ={})  # was a limit of no cache, silently


# ---------------------------------------------------------------------- same bytes
def test_cached_reads_are_the_uncached_bytes_in_any_order(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    plain = featurestore.open_store(seaweed_url, **options).open("ds", "enc", "train")
    cached = _open(seaweed_url, options, tmp_path / "cache")
    assert plain.path == "ranges" and cached.path == "cached" and cached.labels.path == "cached"
    rng = np.random.default_rng(3)
    orders = [rng.permutation(N)[:50], np.arange(N), np.array([5, 5, 199, 0, 5, 17]), rng.integers(0, N, 70)]
    for index in orders:
        got = cached.read_numpy(index)
        assert np.array_equal(got, plain.read_numpy(index)) and np.array_equal(got, values[index])
        assert np.array_equal(cached.labels.read_numpy(index), index)
    stats = cached._storage.cache.stats
    chunks = -(-N // CHUNK_ROWS)
    assert stats["fetched"] == 2 * chunks  # features and labels, each chunk once
    assert len(_chunk_files(tmp_path / "cache")) == 2 * chunks


def test_loader_reads_ahead_by_plan_and_matches(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    from client import FeatureDataset, FeatureLoader

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    ds = FeatureDataset(seaweed_url, "ds", "enc", "train", storage_options={**options, "cache_dir": str(tmp_path)})
    assert ds.read_path == "cached"
    loader = FeatureLoader(ds, batch_size=32, device="cpu", dtype=None, seed=5)
    for epoch in range(2):
        loader.set_epoch(epoch)
        plan = loader.plan()
        for k, (features, labels) in enumerate(loader):
            index = plan.batch(k)
            assert np.array_equal(features.numpy(), values[index]) and np.array_equal(labels.numpy(), index)
    assert ds.array._storage.cache.stats["fetched"] == 2 * -(-N // CHUNK_ROWS)  # epoch 2: all local


# ---------------------------------------------------------------------- processes
_FILL = """
import json, sys, zlib
import numpy as np
import featurestore
url, options, cache, seed = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
array = featurestore.open_store(url, cache_dir=cache, **options).open("ds", "enc", "train")
order = np.random.default_rng(seed).permutation(len(array))
digest = 0
for start in range(0, len(order), 8):
    index = np.sort(order[start:start + 8])
    rows = array.read_numpy(index)
    digest ^= zlib.crc32(rows.tobytes() + index.tobytes())
stats = array._storage.cache.stats
print(json.dumps({"fetched": stats["fetched"], "waited": stats["waited"], "digest": digest}))
"""


def test_two_processes_fill_one_cache_without_duplicates(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    import zlib

    options = seaweed.storage_options
    values = _write(seaweed_url, options, n=640, chunk_rows=32)
    script = tmp_path / "fill.py"
    script.write_text(_FILL)
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, str(script), seaweed_url, json.dumps(options), str(cache), str(s)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in (1, 2)]
    results = []
    for proc, seed in zip(procs, (1, 2)):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
        order, digest = np.random.default_rng(seed).permutation(640), 0
        for start in range(0, 640, 8):
            index = np.sort(order[start : start + 8])
            digest ^= zlib.crc32(values[index].tobytes() + index.tobytes())
        assert results[-1]["digest"] == digest  # the right bytes in each process
    # Every chunk downloaded once between them: a process that found one downloading waited for it.
    assert sum(r["fetched"] for r in results) == 640 // 32 == len(_chunk_files(cache))


_FILL_FOREVER = """
import json, sys
import numpy as np
import featurestore
url, options, cache = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
array = featurestore.open_store(url, cache_dir=cache, **options).open("ds", "enc", "train")
print("ready", flush=True)
for chunk in range(len(array) // array.chunk_rows):
    array.read_numpy([chunk * array.chunk_rows])
"""


def test_sigkill_during_a_download_leaves_nothing_that_is_read(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """Kill a filling process when a temporary file is in the cache (a chunk half written); the
    lock dies with it, a new reader gets every row right and the dead writer's file is removed."""
    options = seaweed.storage_options
    n, shape, rows = 48 * 8, (64, 128), 8  # 48 chunks of 128 KiB
    values = _write(seaweed_url, options, n=n, shape=shape, chunk_rows=rows)
    cache = tmp_path / "cache"
    script = tmp_path / "fill.py"
    script.write_text(_FILL_FOREVER)
    seen_tmp = False
    for _ in range(5):  # a kill has to land while a file is being written: usually the first try
        proc = subprocess.Popen([sys.executable, str(script), seaweed_url, json.dumps(options), str(cache)],
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            if any(f.endswith(".tmp") for _, _, fs in os.walk(cache) for f in fs):
                seen_tmp = True
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if seen_tmp:
            break
        for path in _chunk_files(cache):  # start over from an empty cache
            os.unlink(path)
    assert seen_tmp, "never caught a download in progress"
    array = _open(seaweed_url, options, cache)
    index = np.random.default_rng(0).permutation(n)
    assert np.array_equal(array.read_numpy(index), values[index])
    assert not [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".tmp")]  # swept: its writer is dead


# ---------------------------------------------------------------------- generations and damage
def test_entries_of_an_overwritten_split_are_never_used(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    options = seaweed.storage_options
    old = _write(seaweed_url, options, seed=0)
    early = _open(seaweed_url, options, tmp_path)
    assert np.array_equal(early.read_numpy(np.arange(CHUNK_ROWS)), old[:CHUNK_ROWS])  # chunk 0 cached
    new = _write(seaweed_url, options, seed=1, overwrite=True)
    fresh = _open(seaweed_url, options, tmp_path)
    index = np.arange(N)
    assert np.array_equal(fresh.read_numpy(index), new[index])  # not one row of the old cache entries
    assert np.array_equal(fresh.labels.read_numpy(index), index + 1)
    # A reader that opened the old generation and now meets a chunk of the new one: refused.
    with pytest.raises(SplitChanged) as info:
        early.read_numpy([N - 1])
    message = str(info.value)
    assert "another generation" in message and "open it again" in message and "\n" not in message


def test_chunks_answered_before_a_generation_check_share_it(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """One GET of the split's group document covers every chunk whose GET was answered before it
    was requested: fetch threads finishing together wait on one check, a later chunk asks again."""
    import threading

    from featurestore.format import layout

    options = seaweed.storage_options
    _write(seaweed_url, options)
    front = _open(seaweed_url, options, tmp_path).chunk_cache
    documents = []
    real_read = front.storage.read
    front.storage.read = lambda key: (documents.append(key) if key.endswith(layout.ZARR_JSON) else None) or real_read(key)
    answered = time.monotonic()
    errors: list[BaseException] = []

    def finish() -> None:
        try:
            front._generation.after(answered)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=finish) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and len(documents) == 1
    front._generation.after(answered)  # covered by the check that passed: no request
    assert len(documents) == 1
    front._generation.after(time.monotonic())  # answered after it: a new check
    assert len(documents) == 2
    _write(seaweed_url, options, seed=1, overwrite=True)
    with pytest.raises(SplitChanged, match="another generation"):
        front._generation.after(time.monotonic())


def test_a_splits_arrays_share_one_generation_check(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """Features and labels (or a bag split's features and coords) are checked against one split
    document: their chunks, fetched together, cost one request of it, not one per array."""
    from featurestore.format import layout

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    array = _open(seaweed_url, options, tmp_path)
    assert array.chunk_cache._generation is array.labels.chunk_cache._generation
    storage = array.chunk_cache.storage
    documents = []
    real_read = storage.read
    storage.read = lambda key: (documents.append(key) if key.endswith(layout.ZARR_JSON) else None) or real_read(key)
    answered = time.monotonic()  # a features chunk and a labels chunk answered before it
    array.chunk_cache._generation.after(answered)
    array.labels.chunk_cache._generation.after(answered)  # covered by the features chunk's check
    assert len(documents) == 1
    index = np.arange(3 * CHUNK_ROWS)
    assert np.array_equal(array.read_numpy(index), values[index])
    assert np.array_equal(array.labels.read_numpy(index), index)


def test_a_forked_child_does_not_wait_on_its_parents_generation_check(seaweed_url: str, seaweed: Any,
                                                                       tmp_path: Any) -> None:
    """A DataLoader worker forked while a check was in flight (its future never completes in the
    child, whose threads did not come along, and its lock may be held) makes its own check."""
    import multiprocessing
    from concurrent.futures import Future

    options = seaweed.storage_options
    _write(seaweed_url, options)
    front = _open(seaweed_url, options, tmp_path).chunk_cache
    check = front._generation
    check._pending = (time.monotonic(), Future())  # in flight at the fork, answered after it
    answered = check._pending[0] - 1.0
    check._lock.acquire()  # held by a parent's thread at the fork
    try:
        context = multiprocessing.get_context("fork")
        child = context.Process(target=check.after, args=(answered,))
        child.start()
        child.join(60)
        hung = child.is_alive()
        if hung:
            child.kill()
    finally:
        check._lock.release()
    assert not hung and child.exitcode == 0


def test_a_damaged_cache_file_is_found_and_fetched_again(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    script = tmp_path / "fill.py"
    script.write_text(_FILL)
    subprocess.run([sys.executable, str(script), seaweed_url, json.dumps(options), str(tmp_path), "0"], env=_env(),
                   check=True, capture_output=True, timeout=120)  # another process filled the cache
    files = [p for p in _chunk_files(tmp_path) if f"{os.sep}features{os.sep}" in p]
    victim = next(p for p in files if p.endswith(f"{os.sep}3"))
    with open(victim, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    array = _open(seaweed_url, options, tmp_path)  # this process checks each cached file on its first read
    before = array._storage.cache.stats["fetched"]
    assert np.array_equal(array.read_numpy(np.arange(N)), values)
    assert array._storage.cache.stats["fetched"] == before + 1  # that one chunk, again
