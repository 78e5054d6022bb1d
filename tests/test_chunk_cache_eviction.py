"""The local chunk cache when room runs out (a full disk, an unwritable or too small cache
directory, eviction under a limit), damaged objects, and a server that goes away mid-epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np
import pytest
from _moto_helpers import own_moto_bucket
from _chunk_cache_helpers import CHUNK_ROWS, N, SHAPE, _chunk_files, _env, _open, _write

from featurestore.core.storage.cached import chunk_cache_of
from featurestore.errors import StorageUnavailable

pytest.importorskip("obstore")


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


def _state(front: Any) -> str:
    """What the cache holds and why it may have refused, for a failed assertion's message."""
    cache, now = front.cache, time.monotonic()
    ages = {c: round(time.time() - os.stat(front.path(c)).st_mtime, 1) for c in range(13) if front.present(c)}
    return (f"stats {cache.stats}, used {cache.used_bytes()} of {cache.max_bytes}, last use age (s) by chunk {ages}, "
            f"full for {max(0.0, cache._full_until - now):.1f} s more, no room for "
            f"{max(0.0, cache._no_room_until - now):.1f} s more")


def test_eviction_keeps_the_limit_and_what_the_plan_needs(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    chunk = CHUNK_ROWS * int(np.prod(SHAPE)) * 2 + 4
    array = _open(seaweed_url, options, tmp_path / "c", cache_bytes=4 * chunk + 200)
    front = array.chunk_cache
    cache = front.cache
    assert np.array_equal(array.read_numpy(np.arange(3 * CHUNK_ROWS)), values[: 3 * CHUNK_ROWS])  # chunks 0-2
    assert all(front.present(c) for c in range(3)), _state(front)
    # Chunks used in the last minute stay (a shuffle touches all of them): 3 and 4 cannot both come in.
    # Their last use is set to now first: a wall clock stepped forward meanwhile (a VM's first NTP
    # sync) would age them past the minute, and this is about the rule, not about the clock.
    for c in range(3):
        os.utime(front.path(c))
    array.read_numpy(np.arange(3 * CHUNK_ROWS, 5 * CHUNK_ROWS))
    assert cache.stats["not_admitted"] >= 1 and cache.used_bytes() <= cache.max_bytes, _state(front)
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


def test_two_fetch_threads_never_both_take_the_last_room(tmp_path: Any) -> None:
    """Room for one more chunk, two fetch threads asking at once: one is admitted, the other reads
    by ranges. The shared count is read slowly here (as on a loaded host, where a thread is
    preempted between seeing room and counting its reservation) so both look before either counts."""
    import threading

    from featurestore.core.storage.chunk_cache import ChunkCache

    cache = ChunkCache(str(tmp_path / "c"), max_bytes=1000)
    read_count = cache._shared_used

    def slow_count(**kwargs: Any) -> Any:
        value = read_count(**kwargs)
        time.sleep(0.2)
        return value

    cache._shared_used = slow_count  # type: ignore[method-assign]
    start = threading.Barrier(2)
    admitted: list[bool] = []

    def ask() -> None:
        start.wait()
        admitted.append(cache.reserve(600))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(admitted) == [False, True] and cache.stats["not_admitted"] == 1
    assert cache._pending == 600  # the one admitted holds its room until its chunk is written


def test_a_chunk_stored_while_the_eviction_scan_runs_still_counts(tmp_path: Any) -> None:
    """A fetch thread's chunk is renamed into place after the eviction scan listed the directory,
    and its reservation is released before the scan ends: the chunk counted nowhere, and one chunk
    more than the limit was admitted (a CI run held 5 chunks under a 4-chunk limit)."""
    from featurestore.core.storage.chunk_cache import ChunkCache

    cache = ChunkCache(str(tmp_path / "c"), max_bytes=4 * 1000 + 200)
    folder = tmp_path / "c" / "v1" / "store" / "array"
    folder.mkdir(parents=True)

    def put(i: int) -> bool:
        return cache.store(str(folder / str(i)), lambda write: write(b"\0" * 1000), 1000)

    for i in range(3):
        assert cache.reserve(1000) and put(i)
    assert cache.reserve(1000)  # chunk 3: the last room, its download in flight
    scan = cache._scan

    def scan_then_chunk_3_lands() -> Any:
        listed = scan()  # chunk 3 not there yet
        assert put(3)  # renamed in, counted, its reservation released
        return listed

    cache._scan = scan_then_chunk_3_lands  # type: ignore[method-assign]
    assert not cache.reserve(1000)  # chunk 4: no room (chunks 0-3 are recent, so kept)
    cache._scan = scan  # type: ignore[method-assign]
    assert cache.used_bytes() == 4000 <= cache.max_bytes and cache.stats["not_admitted"] == 1


def test_a_child_forked_while_the_cache_makes_room_makes_room_itself(tmp_path: Any) -> None:
    """A fork (a DataLoader worker starting) while a fetch thread makes room, holding the cache's
    reservation lock and its eviction flock: the child inherited both as held, by a thread it does
    not have, and its own first eviction waited forever (and its copy of the flock would have kept
    the host's evictions waiting until it exited). Now it waits only for the parent's eviction."""
    import threading
    import warnings

    from featurestore.core.storage.chunk_cache import shared

    cache = shared(str(tmp_path / "c"), 1000)
    assert cache is not None
    parent, inside, go = os.getpid(), threading.Event(), threading.Event()
    scan = cache._scan

    def held_scan() -> Any:
        if os.getpid() == parent and not go.is_set():
            inside.set()
            go.wait(30)
        return scan()

    cache._scan = held_scan  # type: ignore[method-assign]
    maker = threading.Thread(target=cache.reserve, args=(5000,))  # no room: the slow path, both locks held
    maker.start()
    assert inside.wait(30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running (Python 3.12+)
        pid = os.fork()
    if pid == 0:  # the child makes room itself, within a bound
        try:
            child = threading.Thread(target=cache.reserve, args=(5000,), daemon=True)
            child.start()
            child.join(20)
            os._exit(3 if child.is_alive() else 0)
        finally:
            os._exit(4)
    time.sleep(0.3)  # the child waits for the parent's eviction by now
    go.set()
    maker.join(30)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child waited for locks of a thread it does not have"


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


# ---------------------------------------------------------------------- one limit for the host
def test_two_views_of_one_cache_directory_keep_one_limit(tmp_path: Any) -> None:
    """Each process counted only its own stores: N processes sharing a cache_dir filled N times
    cache_bytes (a DataLoader's workers, DDP ranks). Two views of one directory are two processes."""
    from featurestore.core.storage.chunk_cache import ChunkCache

    views = ChunkCache(str(tmp_path), 4000), ChunkCache(str(tmp_path), 4000)
    folder = tmp_path / "v1" / "store" / "array"
    folder.mkdir(parents=True)
    for i in range(10):
        view = views[i % 2]
        if view.reserve(1000):  # chunks just stored are recent: kept, so the rest is not admitted
            assert view.store(str(folder / str(i)), lambda write: write(b"\0" * 1000), 1000)
    assert len(list(folder.iterdir())) == 4 and views[0].used_bytes() == 4000
    assert sum(v.stats["not_admitted"] for v in views) == 6


_SHARED_READER = """
import json, sys
import numpy as np
import featurestore
url, options, cache, limit, seed, rows = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
array = featurestore.open_store(url, cache_dir=cache, cache_bytes=limit, **options).open("ds", "enc", "train")
for chunk in np.random.default_rng(seed).permutation(-(-len(array) // rows)):
    array.read_numpy(np.arange(chunk * rows, min(len(array), (chunk + 1) * rows)))
"""


def test_processes_sharing_a_cache_directory_keep_one_limit(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    options = seaweed.storage_options
    _write(seaweed_url, options)
    chunk = CHUNK_ROWS * int(np.prod(SHAPE)) * 2 + 4
    limit = 4 * chunk + 200
    readers = [subprocess.Popen([sys.executable, "-c", _SHARED_READER, seaweed_url, json.dumps(options),
                                 str(tmp_path / "c"), str(limit), str(seed), str(CHUNK_ROWS)], env=_env())
               for seed in range(4)]
    assert [r.wait(timeout=120) for r in readers] == [0] * 4
    held = sum(os.path.getsize(f) for f in _chunk_files(tmp_path / "c") if os.sep + "features" + os.sep in f)
    # One chunk at a time per reader: the others' downloads in flight may pass the limit by one each.
    assert held <= limit + 3 * chunk, (held, limit)


def test_a_download_lock_held_too_long_is_given_up_for_ranged_reads(seaweed_url: str, seaweed: Any, tmp_path: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that stopped (Ctrl-Z, a suspended job) holding a chunk's download lock hung every
    other process that needed the chunk, uninterruptibly (a blocking flock in a fetch thread)."""
    import fcntl

    from featurestore.core import cached_array

    monkeypatch.setattr(cached_array, "LOCK_WAIT_S", 0.3)
    options = seaweed.storage_options
    values = _write(seaweed_url, options)
    array = _open(seaweed_url, options, tmp_path / "c")
    front = array.chunk_cache
    os.makedirs(os.path.dirname(front.path(0)), exist_ok=True)
    with open(front.path(0) + ".lock", "w") as held:  # another process's download, stopped
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        assert np.array_equal(array.read_numpy([0, 1, CHUNK_ROWS]), values[[0, 1, CHUNK_ROWS]])
        assert time.monotonic() - started < 20
        # the next reads of that chunk (a shuffled epoch's) go by ranges without waiting again
        for row in range(4):
            assert np.array_equal(array.read_numpy([row]), values[[row]])
    assert front.cache.stats["waited"] == 1 and not front.present(0) and front.present(1)
