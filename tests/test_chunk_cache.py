"""The local chunk cache of object-storage stores (core.storage.chunk_cache), against the
session's SeaweedFS server (moto for a server that dies): same bytes as without it, shared by
processes, safe against kills, other generations, damaged files and a full disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np
import pytest
from _moto_helpers import own_moto_bucket
from reader_contract import ReaderContract

import featurestore
from featurestore.core.storage import chunk_cache
from featurestore.core.storage.cached import chunk_cache_of
from featurestore.core.storage.options import parse_bytes, translate
from featurestore.errors import InvalidStorageOptions, SplitChanged, StorageUnavailable

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


# ---------------------------------------------------------------------- room
_FULL_DISK = """
import json, resource, sys
import numpy as np
import featurestore
url, options, cache, limit = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
array = featurestore.open_store(url, cache_dir=cache, **options).open("ds", "enc", "train")
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # no file may grow past a few KiB: EFBIG
rows = array.read_numpy(np.arange(len(array)))
print(json.dumps({"sum": float(rows.astype(np.float64).sum()), "stats": array._storage.cache.stats}))
"""


def test_a_full_cache_disk_warns_once_and_reads_by_ranges(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """The kernel refuses the cache's writes (RLIMIT_FSIZE: EFBIG, as ENOSPC on a full disk): one
    warning naming the directory, and every row still arrives, by ranged GETs."""
    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    script = tmp_path / "full.py"
    script.write_text(_FULL_DISK)
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, str(script), seaweed_url, json.dumps(options), str(cache), "4096"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sum"] == pytest.approx(float(values.astype(np.float64).sum()))
    assert result["stats"]["fetched"] == 0 and not _chunk_files(cache)
    warnings = [line for line in proc.stderr.splitlines() if "is full" in line]
    assert len(warnings) == 1 and str(cache) in warnings[0] and "ranged GETs" in warnings[0]


@pytest.fixture(params=["new", "used before"])
def unwritable_cache(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """An existing cache directory this process cannot create files in ("used before": its
    layout directory is there too, from a run that could write). Permission bits do not stop
    root, so as root the directories get the immutable attribute (``chattr +i``: EPERM even for
    root); where that is refused (tmpfs, no CAP_LINUX_IMMUTABLE) a new cache falls back to /sys,
    where the kernel refuses root's mkdir too (EPERM, or EROFS when mounted read-only)."""
    from pathlib import Path

    used = request.param == "used before"
    cache = tmp_path / "cache"
    (cache / "v1" if used else cache).mkdir(parents=True)
    locked = [cache / "v1", cache] if used else [cache]
    if os.geteuid() != 0:
        for path in locked:
            path.chmod(0o555)

        def undo() -> None:
            for path in locked:
                path.chmod(0o755)
    else:
        def attr(flag: str) -> bool:
            try:
                return all(subprocess.run(["chattr", flag, str(p)], capture_output=True).returncode == 0
                           for p in locked)
            except FileNotFoundError:
                return False

        def undo() -> None:
            attr("-i")

        if not attr("+i"):
            undo()
            if used:
                pytest.skip("cannot make a directory unwritable for root here (chattr +i refused)")
            cache = Path("/sys")
    try:
        with pytest.raises(OSError):  # the premise: this process really cannot write there
            (cache / "v1" / "probe" if used else cache / "v1").mkdir()
        yield cache
    finally:
        undo()


def test_an_unwritable_cache_dir_warns_once_and_reads_by_ranges(seaweed_url: str, seaweed: Any,
                                                                 unwritable_cache: Any) -> None:
    """A cache directory that exists but cannot be written (read-only mount, no permission) is one
    warning naming it, and the store reads by ranged GETs as without a cache; it used to be a raw
    OSError out of open_store (which the CLI took for a wrong URL)."""
    import warnings

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays = [_open(seaweed_url, options, unwritable_cache) for _ in range(2)]
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1, said  # the second store of the process opens the same (no) cache
    assert f"chunk cache {unwritable_cache} cannot be written" in said[0] and "ranged GETs" in said[0]
    for array in arrays:
        assert array.path == "ranges" and chunk_cache_of(array._storage) is None
        assert np.array_equal(array.read_numpy(np.arange(N)[::-1]), values[::-1])


def test_a_cache_smaller_than_a_chunk_reads_by_ranges(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    array = _open(seaweed_url, options, tmp_path, cache_bytes=1000)
    assert np.array_equal(array.read_numpy(np.arange(N)[::-1]), values[::-1])
    assert array._storage.cache.stats["fetched"] == 0 and not _chunk_files(tmp_path)


def test_eviction_keeps_the_limit_and_what_the_plan_needs(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    chunk = CHUNK_ROWS * int(np.prod(SHAPE)) * 2 + 4
    array = _open(seaweed_url, options, tmp_path / "c", cache_bytes=4 * chunk + 200)
    front = array.chunk_cache
    cache = front.cache
    assert np.array_equal(array.read_numpy(np.arange(3 * CHUNK_ROWS)), values[: 3 * CHUNK_ROWS])  # chunks 0-2
    # Chunks used in the last minute stay (a shuffle touches all of them): 3 and 4 cannot both come in.
    array.read_numpy(np.arange(3 * CHUNK_ROWS, 5 * CHUNK_ROWS))
    assert cache.stats["not_admitted"] >= 1 and cache.used_bytes() <= cache.max_bytes
    # Long unused: 0 oldest, then 1, then 2. A plan that still needs chunk 0 keeps it; 1 goes.
    for c, age in ((0, 3000), (1, 2000), (2, 1000)):
        os.utime(front.path(c), (time.time() - age, time.time() - age))
    last_use = np.full(13, -1)
    last_use[0] = 7
    front.plan(last_use, lambda: 2)
    cache._no_room_until = 0.0
    assert np.array_equal(array.read_numpy(np.arange(5 * CHUNK_ROWS, 6 * CHUNK_ROWS)), values[5 * CHUNK_ROWS : 6 * CHUNK_ROWS])
    # An evicted chunk takes its download lock along; the locks of chunks held stay.
    assert not os.path.exists(front.path(1) + ".lock") and os.path.exists(front.path(0) + ".lock")
    assert front.present(0) and not front.present(1) and front.present(5)
    assert cache.used_bytes() <= cache.max_bytes
    # A lock left without its chunk (a cache of an older version; a download that died) is removed
    # by the next scan unless a download holds it.
    import fcntl

    for c in (11, 12):
        open(front.path(c) + ".lock", "w").close()
    with open(front.path(12) + ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        cache.used_bytes()
        assert not os.path.exists(front.path(11) + ".lock") and os.path.exists(front.path(12) + ".lock")
    assert os.path.exists(os.path.join(cache.directory, "v1", ".evict.lock"))
    # No map of this process keeps an evicted file (its pages and disk blocks) alive.
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as maps:
            assert not [line for line in maps if str(tmp_path / "c") in line and "(deleted)" in line]
    front.plan(None)


@pytest.mark.parametrize("damage", ["flipped byte", "longer", "shorter"])
def test_a_damaged_chunk_object_is_refused_and_nothing_is_kept(seaweed_url: str, seaweed: Any, tmp_path: Any,
                                                               damage: str) -> None:
    """The crc32c trailer and the size are checked as the chunk streams into the cache: a damaged
    object on the server is ``CorruptChunk`` naming it, and no file of it is left to read later."""
    from featurestore.core.storage import open_storage
    from featurestore.errors import CorruptChunk

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    storage = open_storage(seaweed_url, options)
    key = "ds/enc/train/features/c/2/0/0"
    raw = bytearray(storage.read(key))
    if damage == "flipped byte":
        raw[100] ^= 0xFF
    elif damage == "longer":
        raw += os.urandom(3 << 20)  # past one streamed piece: refused before the rest arrives
    else:
        raw = raw[:-10]
    storage.write(key, bytes(raw))
    array = _open(seaweed_url, options, tmp_path)
    with pytest.raises(CorruptChunk) as info:
        array.read_numpy([2 * CHUNK_ROWS + 1])
    assert key in str(info.value) and ("size" in str(info.value)) == (damage != "flipped byte")
    assert not [p for p in _chunk_files(tmp_path) if p.endswith(f"features{os.sep}2")]
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]
    assert np.array_equal(array.read_numpy(np.arange(2 * CHUNK_ROWS)), values[: 2 * CHUNK_ROWS])  # the rest reads


# ---------------------------------------------------------------------- a server that goes away
def test_server_gone_mid_epoch_with_a_cache_is_one_error(tmp_path: Any) -> None:
    with own_moto_bucket("gone-cache") as (options, stop):
        url = f"s3://gone-cache/{uuid.uuid4().hex[:8]}"
        _write(url, options)
        array = _open(url, options, tmp_path)
        assert array.read_numpy([0, 1]).shape == (2, *SHAPE)  # chunk 0 cached
        stop()
        start = time.monotonic()
        assert array.read_numpy([2, 3]).shape == (2, *SHAPE)  # cached: no server needed
        with pytest.raises(StorageUnavailable) as info:
            array.read_numpy([5, 100, 150])
        elapsed = time.monotonic() - start
    message = str(info.value)
    assert "'gone-cache'" in message and "2 retries" in message and "\n" not in message
    assert elapsed < 30


# ---------------------------------------------------------------------- the server
def test_the_server_reads_an_object_store_through_the_cache(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from featurestore.format import wire
    from server.app import create_app
    from server.settings import Settings

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    settings = Settings(storage_options={**options, "cache_dir": str(tmp_path / "cache")})
    index = [150, 3, 77, 3]
    with TestClient(create_app(seaweed_url, settings)) as client:
        response = client.post(wire.route(wire.BATCH, dataset="ds", encoder="enc", split="train"),
                               json={"indices": index})
        assert response.status_code == 200, response.text
    got = np.frombuffer(response.content, np.float16).reshape(len(index), *SHAPE)
    assert np.array_equal(got, values[index])
    assert len([p for p in _chunk_files(tmp_path / "cache") if f"{os.sep}features{os.sep}" in p]) == 3


def test_the_server_serves_bags_through_the_cache(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    options = seaweed.storage_options
    bags = _write_bags(seaweed_url, options)
    settings = Settings(storage_options={**options, "cache_dir": str(tmp_path / "cache")})
    with TestClient(create_app(seaweed_url, settings)) as client:
        response = client.get("/v1/bags/ds/enc/bags/slide-07")
        assert response.status_code == 200, response.text
    rows = len(bags["slide-07"]) * BAG_DIM * 2
    np.testing.assert_array_equal(np.frombuffer(response.content[:rows], np.float16).reshape(-1, BAG_DIM),
                                  bags["slide-07"])
    cached = {os.path.basename(os.path.dirname(p)) for p in _chunk_files(tmp_path / "cache")}
    assert {"features", "coords"} <= cached


def test_cache_flags_join_the_storage_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from featurestore.commands.storeargs import add_cache_options, add_storage_options, options_from_args

    parser = argparse.ArgumentParser()
    add_storage_options(parser)
    add_cache_options(parser)
    monkeypatch.setenv("FEATURESTORE_STORAGE_OPTIONS", '{"endpoint_url": "http://127.0.0.1:1"}')
    args = parser.parse_args(["--cache-dir", "/c", "--cache-bytes", "5G"])
    assert options_from_args(args) == {"endpoint_url": "http://127.0.0.1:1", "cache_dir": "/c", "cache_bytes": "5G"}
    assert options_from_args(parser.parse_args([])) == {"endpoint_url": "http://127.0.0.1:1"}


def test_forked_workers_read_through_the_cache(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """A DataLoader worker forked after the parent used the cache (obstore is not fork-safe: the
    child fetches through fsspec) gets the right rows and fills the same cache."""
    import torch

    from client import FeatureDataset

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    ds = FeatureDataset(seaweed_url, "ds", "enc", "train", storage_options={**options, "cache_dir": str(tmp_path)})
    ds.array.read_numpy([0])  # the parent used obstore and the cache before the fork
    loader = torch.utils.data.DataLoader(ds, batch_size=25, shuffle=False, num_workers=2,
                                         multiprocessing_context="fork")
    got = torch.cat([features for features, _ in loader]).numpy()
    assert np.array_equal(got, values)
    assert len([p for p in _chunk_files(tmp_path) if f"{os.sep}features{os.sep}" in p]) == -(-N // CHUNK_ROWS)


# ---------------------------------------------------------------------- bag splits
BAG_DIM, BAG_CHUNK_ROWS = 24, 16


def _write_bags(url: str, options: dict[str, Any], seed: int = 0, overwrite: bool = False) -> dict[str, np.ndarray]:
    """20 bags of 0-60 patches (some empty, several spanning chunks of 16 rows)."""
    rng = np.random.default_rng(seed)
    writer = featurestore.open_store(url, mode="a", **options).create_bag_split(
        "ds", "enc", "bags", dim=BAG_DIM, dtype="float16", label_dtype="int64", overwrite=overwrite,
        chunk_bytes=BAG_CHUNK_ROWS * BAG_DIM * 2)
    data = {}
    for i in range(20):
        n = 0 if i in (3, 11) else int(rng.integers(1, 60))
        data[f"slide-{i:02d}"] = rng.standard_normal((n, BAG_DIM)).astype(np.float16)
        writer.add_bag(f"slide-{i:02d}", data[f"slide-{i:02d}"], coords=rng.integers(0, 9999, (n, 2)), label=i)
    writer.commit()
    return data


def _epoch(loader: Any, epoch: int) -> list[tuple[np.ndarray, ...]]:
    import warnings

    loader.set_epoch(epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the empty bags left out
        return [tuple(t.numpy().copy() for t in batch) for batch in loader]


def test_bag_loader_reads_ahead_through_the_cache_and_matches(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """A BagLoader over a bag split in object storage with a cache: the same batches as without
    one, every features and coords chunk downloaded once (read ahead by the epoch's plan), and
    the next epoch downloads nothing."""
    from client import BagDataset, BagLoader

    options = dict(seaweed.storage_options)
    _write_bags(seaweed_url, options)
    kwargs = dict(batch_size=2, shuffle=True, seed=4, device="cpu", dtype=None, max_patches=40, prefetch=1)
    plain = BagLoader(BagDataset(seaweed_url, "ds", "enc", "bags", storage_options=options), **kwargs)
    ds = BagDataset(seaweed_url, "ds", "enc", "bags", storage_options={**options, "cache_dir": str(tmp_path)})
    assert ds.read_path == "cached"
    cached = BagLoader(ds, **kwargs)
    chunks = -(-int(ds.lengths.sum()) // BAG_CHUNK_ROWS)
    cache = ds.bags.features.chunk_cache.cache
    readahead = []
    batches = []
    cached.set_epoch(0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in cached:
            readahead.append(cached._readahead is not None)
            batches.append(tuple(t.numpy().copy() for t in batch))
            if len(batches) == 1:  # the plan's read-ahead fetches chunks of batches not asked for yet
                deadline = time.monotonic() + 30
                while len(_chunk_files(tmp_path)) < 2 * chunks + 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert len(_chunk_files(tmp_path)) == 2 * chunks + 2
    assert all(readahead) and cached._readahead is None  # running for the epoch, stopped at its end
    for got, want in zip(batches, _epoch(plain, 0), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    files = _chunk_files(tmp_path)
    for array in ("features", "coords"):  # every chunk of each, downloaded once
        assert len([f for f in files if os.path.basename(os.path.dirname(f)) == array]) == chunks
    seal_files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                  if f.isdigit() and "chunk_seals" in d.split(os.sep)]
    assert len(files) == 2 * chunks + 2  # and the one chunk of offsets and of labels
    assert cache.stats["fetched"] == len(files) + len(seal_files)  # each once (the seal table if it was asked for)
    storage = ds.bags.features._storage
    before, fetched = storage.bytes_read, cache.stats["fetched"]
    for got, want in zip(_epoch(cached, 1), _epoch(plain, 1), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    assert cache.stats["fetched"] == fetched and storage.bytes_read == before  # all local now
    cached.close()
    plain.close()


def test_bag_dataset_in_forked_workers_reads_through_the_cache(seaweed_url: str, seaweed: Any,
                                                               tmp_path: Any) -> None:
    """CLAM-style: a BagDataset in a DataLoader with forked workers, the parent having used the
    cache (and its shared generation check) first: every bag right, every chunk cached once."""
    import torch

    from client import BagDataset

    options = dict(seaweed.storage_options)
    bags = _write_bags(seaweed_url, options)
    ds = BagDataset(seaweed_url, "ds", "enc", "bags", storage_options={**options, "cache_dir": str(tmp_path)})
    np.testing.assert_array_equal(ds[0][0].numpy(), bags["slide-00"])  # used before the fork
    loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=2,
                                         multiprocessing_context="fork")
    for bag_id, (features, coords, label) in zip(ds.ids, loader, strict=True):
        np.testing.assert_array_equal(features.numpy(), bags[bag_id])
        assert len(coords) == len(bags[bag_id]) and int(label) == int(bag_id[-2:])
    chunks = -(-int(ds.lengths.sum()) // BAG_CHUNK_ROWS)
    files = _chunk_files(tmp_path)
    for array in ("features", "coords"):
        assert len([f for f in files if os.path.basename(os.path.dirname(f)) == array]) == chunks


def test_a_cached_bag_reader_of_an_overwritten_split_is_refused(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """Bag splits keep the cache's generation rule: a reader that opened the old split and meets
    a chunk not cached yet gets ``SplitChanged``; a reader opened after gets the new bags."""
    options = dict(seaweed.storage_options)
    old = _write_bags(seaweed_url, options, seed=0)
    early = featurestore.open_store(seaweed_url, cache_dir=str(tmp_path), **options).open_bags("ds", "enc", "bags")
    np.testing.assert_array_equal(early.read_numpy("slide-00")[0], old["slide-00"])
    new = _write_bags(seaweed_url, options, seed=1, overwrite=True)
    fresh = featurestore.open_store(seaweed_url, cache_dir=str(tmp_path), **options).open_bags("ds", "enc", "bags")
    for bag_id, values in new.items():
        np.testing.assert_array_equal(fresh.read_numpy(bag_id)[0], values)
    with pytest.raises(SplitChanged, match="another generation"):
        early.read_numpy("slide-19")


def test_caches_of_one_process_share_its_fetch_threads(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """A pool per cache directory left FETCH_THREADS idle threads behind for every directory a
    process ever opened (one per repeat in ``bench s3``)."""
    import threading

    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    for i in range(3):
        cached = _open(seaweed_url, options, tmp_path / f"cache{i}")
        assert np.array_equal(cached.read_numpy(np.arange(N)), values)
    names = [t.name for t in threading.enumerate()]
    fetchers = [n for n in names if n.startswith("featurestore-cache_")]
    assert 0 < len(fetchers) <= chunk_cache.FETCH_THREADS, names
