"""Shuffled rows read through descriptors (core.descriptor_reads): the right bytes in the right
rows whether one thread or several read them, an error in any thread raised after all stopped,
and the gather of a split that takes this path (rows read, nothing left mapped in)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import featurestore
from featurestore.core import chunk_maps, descriptor_reads, pread
from featurestore.core.mapped_file import Descriptor
from featurestore.errors import CorruptChunk

WIDTH = 512
ROWS_PER_FILE = 32


def _files(tmp_path: Path, count: int) -> list[tuple[Descriptor, str]]:
    """``count`` files of ``ROWS_PER_FILE`` rows; every byte of row r of file f is (f * 7 + r) % 251."""
    files = []
    for f in range(count):
        path = str(tmp_path / f"chunk-{f}")
        rows = (f * 7 + np.arange(ROWS_PER_FILE)) % 251
        np.repeat(rows.astype(np.uint8), WIDTH).tofile(path)
        files.append((Descriptor(os.open(path, os.O_RDONLY)), path))
    return files


def _split(tmp_path: Path, n: int, shape: tuple[int, ...], chunk_bytes: int) -> tuple[str, np.ndarray]:
    """A float16 split of ``n`` random samples in chunks of ``chunk_bytes``: its root and values."""
    root = str(tmp_path / "store")
    values = np.random.default_rng(n).standard_normal((n, *shape), dtype=np.float32).astype(np.float16)
    writer = featurestore.open_store(root, mode="a").create_split("ds", "enc", "s", num_samples=n,
                                                                  sample_shape=shape, chunk_bytes=chunk_bytes)
    writer.write(0, values)
    writer.commit()
    return root, values


def _sharing(monkeypatch: pytest.MonkeyPatch, *, resident: int, piece: int, cores: int) -> None:
    """A fresh process-wide map cache of ``resident`` mapped bytes; helpers from ``piece`` bytes."""
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(64, 1 << 40, resident))
    monkeypatch.setattr(descriptor_reads, "PIECE_BYTES", piece)
    monkeypatch.setattr(descriptor_reads, "cores", lambda: cores)


def _refuse_short(path: str, size: int) -> None:
    if size != ROWS_PER_FILE * WIDTH:
        raise CorruptChunk(f"chunk file {path} has {size} bytes")


@pytest.mark.parametrize("threads", [1, 4])
def test_rows_land_in_their_targets_on_one_thread_or_several(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             threads: int) -> None:
    monkeypatch.setattr(descriptor_reads, "PIECE_BYTES", WIDTH)  # a helper from two rows on
    monkeypatch.setattr(descriptor_reads, "cores", lambda: threads)
    files = _files(tmp_path, 5)
    rng = np.random.default_rng(0)
    n = 120
    file_of, row = rng.integers(0, 5, n), rng.integers(0, ROWS_PER_FILE, n)  # duplicates too
    targets = rng.permutation(n)
    rows = np.full((n, WIDTH), 255, np.uint8)
    pool = pread.ReadPool(threads)
    descriptor_reads.read_rows(rows, targets, files, file_of, row * WIDTH, _refuse_short, pool)
    expected = ((file_of * 7 + row) % 251).astype(np.uint8)
    assert np.array_equal(rows[targets], np.repeat(expected[:, None], WIDTH, axis=1))
    pool.shutdown()


def test_a_file_shorter_than_its_rows_is_refused_by_name_from_any_thread(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(descriptor_reads, "PIECE_BYTES", WIDTH)
    monkeypatch.setattr(descriptor_reads, "cores", lambda: 4)
    files = _files(tmp_path, 3)
    os.truncate(files[2][1], WIDTH * 4)  # truncated in place: its rows past 4 are gone
    n = 90
    file_of = np.arange(n) % 3
    row = np.full(n, 10)
    pool = pread.ReadPool(4)
    with pytest.raises(CorruptChunk, match="chunk-2 has 2048 bytes"):
        descriptor_reads.read_rows(np.zeros((n, WIDTH), np.uint8), np.arange(n), files, file_of, row * WIDTH,
                                   _refuse_short, pool)
    pool.shutdown()


def test_a_shuffled_gather_over_helpers_reads_each_row_and_maps_nothing_in(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A split far larger than the (tiny) mapped budget, 16 KiB rows shuffled: the gather goes
    through the descriptors in one pass, shared with a helper thread, and every row is its own."""
    n = 512
    root, values = _split(tmp_path, n, (16, 512), 256 << 10)
    _sharing(monkeypatch, resident=1 << 20, piece=64 << 10, cores=2)
    calls: list[int] = []
    real = chunk_maps.read_rows
    monkeypatch.setattr(chunk_maps, "read_rows",
                        lambda rows, targets, *a: calls.append(len(targets)) or real(rows, targets, *a))
    array = featurestore.open_store(root).open("ds", "enc", "s")
    array.local_read = "mmap"
    order = np.random.default_rng(5).permutation(n)
    for start in range(0, n, 64):
        assert np.array_equal(array.read_numpy(order[start : start + 64]), values[order[start : start + 64]])
    assert sum(calls) == n  # every row through the descriptors
    assert chunk_maps.shared().resident_bytes == 0  # nothing mapped in, nothing counted
    chunk_maps.shared().clear()


def test_helpers_that_never_start_leave_every_row_to_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool whose threads are all busy (another array's cold reads, a loader's): the caller reads
    every row itself and returns without waiting for its queued helpers, which are cancelled."""
    import threading

    monkeypatch.setattr(descriptor_reads, "PIECE_BYTES", WIDTH)
    monkeypatch.setattr(descriptor_reads, "cores", lambda: 2)
    files = _files(tmp_path, 2)
    pool = pread.ReadPool(2)
    release = threading.Event()
    busy = [pool.executor().submit(release.wait, 30) for _ in range(2)]  # both threads held
    n = 40
    file_of, row = np.arange(n) % 2, np.arange(n) % ROWS_PER_FILE
    rows = np.zeros((n, WIDTH), np.uint8)
    descriptor_reads.read_rows(rows, np.arange(n), files, file_of, row * WIDTH, _refuse_short, pool)
    assert not any(b.done() for b in busy)  # returned while the pool was still busy: nothing waited for the helper
    assert np.array_equal(rows[:, 0], ((file_of * 7 + row) % 251).astype(np.uint8))
    release.set()
    pool.shutdown()


def test_a_pool_that_does_not_share_gathers_lends_no_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader's read pool (its producers already read concurrently): the caller reads alone."""
    monkeypatch.setattr(descriptor_reads, "PIECE_BYTES", WIDTH)
    monkeypatch.setattr(descriptor_reads, "cores", lambda: 4)
    files = _files(tmp_path, 2)
    pool = pread.ReadPool(4, share_gathers=False)
    n = 40
    file_of, row = np.arange(n) % 2, np.arange(n) % ROWS_PER_FILE
    rows = np.zeros((n, WIDTH), np.uint8)
    descriptor_reads.read_rows(rows, np.arange(n), files, file_of, row * WIDTH, _refuse_short, pool)
    assert pool._executor is None  # no thread was started for it
    assert np.array_equal(rows[:, 0], ((file_of * 7 + row) % 251).astype(np.uint8))


def test_copies_out_of_the_maps_over_helpers_are_right_and_counted(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Row ranges, shuffled wide rows and duplicates of a split within the mapped budget (copied
    out of the maps, not read through descriptors), a chunk's runs per helper: every row its own,
    and what was mapped in is counted within the budget."""
    n = 300
    root, values = _split(tmp_path, n, (8, 256), 64 << 10)
    _sharing(monkeypatch, resident=256 << 10, piece=8 << 10, cores=3)
    helped: list[int] = []
    real = descriptor_reads.share
    monkeypatch.setattr(descriptor_reads, "share", lambda work, count, *a: helped.append(count) or real(work, count, *a))
    array = featurestore.open_store(root).open("ds", "enc", "s")
    array.local_read = "mmap"
    rng = np.random.default_rng(1)
    for index in (np.arange(n), np.arange(17, 251), rng.permutation(n)[:120], rng.integers(0, n, 90),
                  np.arange(n)[::-1].copy()):
        assert np.array_equal(array.read_numpy(index), values[index])
        assert chunk_maps.shared().resident_bytes <= chunk_maps.shared().max_resident
    assert helped and max(helped) > 2  # shared, a chunk's runs an item
    chunk_maps.shared().clear()


@pytest.mark.parametrize("helpers", [False, True])
def test_threads_reading_across_many_chunks_hold_a_bounded_number_of_files(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            helpers: bool) -> None:
    """Four threads, each batch over ~100 chunks, maps and descriptors bounded at 8: the files held
    open stay near that bound. Each read held every touched chunk's descriptor until its end, so
    the threads together held hundreds (a walk: `Too many open files` under ulimit -n 1024); with
    helpers, the cancelled ones left queued in the busy pool held their reads' descriptors (150)."""
    import threading

    if helpers:
        monkeypatch.setattr(descriptor_reads, "PIECE_BYTES", 4096)
        monkeypatch.setattr(descriptor_reads, "cores", lambda: 3)

    root, values = _split(tmp_path, 2400, (4, 256), 16 << 10)  # 150 chunks of 8 rows
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(8, 1 << 40, 64 << 10, max_descriptors=8))
    opened: list[int] = []
    real = chunk_maps.read_rows
    monkeypatch.setattr(chunk_maps, "read_rows",
                        lambda *a: opened.append(len(os.listdir("/proc/self/fd"))) or real(*a))
    array = featurestore.open_store(root).open("ds", "enc", "s")
    array.local_read = "mmap"
    array.verify_reads = "off"  # the first-read checks open files of their own, for a moment
    baseline = len(os.listdir("/proc/self/fd"))
    wrong: list[int] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(15):
            index = rng.choice(2400, 128, replace=False)
            if not np.array_equal(array.read_numpy(index), values[index]):
                wrong.append(seed)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and opened
    # the shared bound (8) plus a group of 4 chunks a thread, and a few the threads open meanwhile
    assert max(opened) - baseline <= 8 + 4 * 4 + 8, (baseline, max(opened))
    chunk_maps.shared().clear()


def test_a_chunk_truncated_then_repaired_reads_again_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk file truncated in place is refused by name; once a good copy replaces it (written
    beside it and renamed, as rsync does), the next read of the same array returns its rows."""
    root, values = _split(tmp_path, 640, (4, 256), 16 << 10)
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(64, 1 << 40, 64 << 10))
    array = featurestore.open_store(root).open("ds", "enc", "s")
    array.local_read = "mmap"
    index = np.array([3 * 8 + 1, 500, 7], np.int64)  # a row of chunk 3 among others
    assert np.array_equal(array.read_numpy(index), values[index])  # chunk 3 mapped, its descriptor open
    path = os.path.join(root, "ds", "enc", "s", "features", "c", "3", "0", "0")
    good = open(path, "rb").read()
    os.truncate(path, 100)
    with pytest.raises(CorruptChunk, match="c/3/0/0 has 100 bytes"):
        array.read_numpy(index)
    with open(path + ".tmp", "wb") as f:
        f.write(good)
    os.replace(path + ".tmp", path)
    assert np.array_equal(array.read_numpy(index), values[index])
    chunk_maps.shared().clear()


def test_descriptor_reads_check_each_chunk_size_once_a_window_not_per_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shuffled batches through descriptors fstat a chunk's map at most once per SIZE_RECHECK_S (a
    batch touches dozens of chunks: their per-read fstats were a tenth of a warm batch); once the
    window has passed, a file grown in place (no short read to tell) is refused by name again."""
    from featurestore.core.mapped_file import MappedFile

    root, values = _split(tmp_path, 640, (4, 256), 16 << 10)  # 80 chunks of 8 rows
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(128, 1 << 40, 64 << 10, 512))  # all kept
    array = featurestore.open_store(root).open("ds", "enc", "s")
    array.local_read = "mmap"
    rng = np.random.default_rng(1)
    batches = [rng.choice(640, 16, replace=False) for _ in range(30)]
    for index in batches[:3]:
        array.read_numpy(index)  # maps, descriptors, first-read checks
    checks = []
    original = MappedFile.checked_rows
    monkeypatch.setattr(MappedFile, "checked_rows", lambda self: checks.append(1) or original(self))
    now = [1e9]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    touched = set()
    for index in batches:
        assert np.array_equal(array.read_numpy(index), values[index])
        touched.update((index // 8).tolist())
    assert 0 < len(checks) <= len(touched) < sum(len(set((b // 8).tolist())) for b in batches)
    path = os.path.join(root, "ds", "enc", "s", "features", "c", str(int(batches[0][0]) // 8), "0", "0")
    with open(path, "ab") as f:
        f.write(b"x" * 64)
    now[0] += chunk_maps.SIZE_RECHECK_S + 1
    with pytest.raises(CorruptChunk, match=f"{path} has {16388 + 64} bytes"):
        array.read_numpy(batches[0])
    chunk_maps.shared().clear()


def test_a_pool_shut_down_under_a_read_leaves_its_rows_to_the_caller(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    files = _files(tmp_path, 2)
    pool = pread.ReadPool(4)
    closed = ThreadPoolExecutor(2)
    closed.shutdown()
    pool.executor = lambda: closed  # type: ignore[method-assign]  # shut down between the lookup and the submit
    n = 40
    file_of, row = np.arange(n) % 2, np.arange(n) % ROWS_PER_FILE
    rows = np.zeros((n, WIDTH), np.uint8)
    original = descriptor_reads.PIECE_BYTES
    try:
        descriptor_reads.PIECE_BYTES = WIDTH
        descriptor_reads.read_rows(rows, np.arange(n), files, file_of, row * WIDTH, _refuse_short, pool)
    finally:
        descriptor_reads.PIECE_BYTES = original
    assert np.array_equal(rows[:, 0], ((file_of * 7 + row) % 251).astype(np.uint8))


_LOW_LIMIT = """
import resource, sys, threading
import numpy as np
import featurestore
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
arr = featurestore.open_store(sys.argv[1]).open("ds", "enc", "s")  # first reads checked (crc32c)
values = np.load(sys.argv[2])
errors = []
def go(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        index = rng.choice(len(values), 64, replace=False)
        try:
            assert np.array_equal(arr.read_numpy(index), values[index])
        except Exception as error:
            errors.append(repr(error)[:200])
threads = [threading.Thread(target=go, args=(seed,)) for seed in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(errors), errors[:2])
"""


def test_threads_reading_many_chunks_first_time_under_a_low_descriptor_limit(tmp_path: Path) -> None:
    """ulimit -n 64, four threads, each batch's first read checking ~60 chunk files: no
    `Too many open files` (the check opened every file of a read at once: 36 of 80 reads failed)."""
    import subprocess
    import sys

    root, values = _split(tmp_path, 4000, (128,), 20 * 128 * 2)  # 200 chunks of 20 rows
    np.save(tmp_path / "values.npy", values)
    done = subprocess.run([sys.executable, "-c", _LOW_LIMIT, root, str(tmp_path / "values.npy")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("0 "), done.stdout
