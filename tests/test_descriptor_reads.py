"""Shuffled rows read through descriptors (core.descriptor_reads): the right bytes in the right
rows whether one thread or several read them, an error in any thread raised after all stopped,
and the gather of a split that takes this path (rows read, nothing left mapped in)."""

from __future__ import annotations

import os
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
    root = str(tmp_path / "store")
    n = 512
    writer = featurestore.open_store(root, mode="a").create_split("ds", "enc", "s", num_samples=n,
                                                                  sample_shape=(16, 512), chunk_bytes=256 << 10)
    values = np.zeros((n, 16, 512), np.float16)
    values[:, 0, 0] = np.arange(n)
    values[:, -1, -1] = -np.arange(n)
    writer.write(0, values)
    writer.commit()
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(64, 1 << 40, 1 << 20))
    monkeypatch.setattr(descriptor_reads, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(descriptor_reads, "cores", lambda: 2)
    calls: list[int] = []
    real = chunk_maps.read_rows
    monkeypatch.setattr(chunk_maps, "read_rows", lambda rows, *a: calls.append(len(rows)) or real(rows, *a))
    array = featurestore.open_store(root).open("ds", "enc", "s")
    array.local_read = "mmap"
    order = np.random.default_rng(5).permutation(n)
    for start in range(0, n, 64):
        got = array.read_numpy(order[start : start + 64])
        assert np.array_equal(got[:, 0, 0].astype(np.int64), order[start : start + 64])
        assert np.array_equal(got[:, -1, -1].astype(np.int64), -order[start : start + 64])
    assert calls == [64] * 8  # every batch through the descriptors
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
    root = str(tmp_path / "store")
    n, shape = 300, (8, 256)
    writer = featurestore.open_store(root, mode="a").create_split("ds", "enc", "s", num_samples=n,
                                                                  sample_shape=shape, chunk_bytes=64 << 10)
    values = np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32).astype(np.float16)
    writer.write(0, values)
    writer.commit()
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(64, 1 << 40, 256 << 10))
    monkeypatch.setattr(descriptor_reads, "PIECE_BYTES", 8 << 10)
    monkeypatch.setattr(descriptor_reads, "cores", lambda: 3)
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
