"""Local reads built for cold data: every path gives the same bytes, warm and cold, in
the loader and in DataLoader workers; a chunk deleted or truncated mid-epoch fails with its name;
a failing read thread never leaves the loader waiting; the loader's read threads stop with it.

The read paths are forced with ``FEATURESTORE_LOCAL_READ`` / ``FEATURESTORE_READ_CACHE`` (what a
user sets) and the page cache is emptied with ``posix_fadvise(DONTNEED)`` for the cold cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from _loader_fixtures import DATASET, ENCODER, NUM_SAMPLES, SAMPLE_SHAPE, reference, write_reference_store

from client import FeatureDataset, FeatureLoader
from featurestore.core import pread
from featurestore.errors import CorruptChunk, IndexOutOfRange, InvalidIndices, MissingChunks
from featurestore.testing.cgroup import evict

PATHS = [("auto", "auto"), ("mmap", "keep"), ("pread", "keep"), ("pread", "drop"), ("pread", "direct")]


@pytest.fixture
def store(tmp_path: Any) -> str:
    root = str(tmp_path / "store")
    write_reference_store(root)
    return root


def _read_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("featurestore-read") and t.is_alive()]


def _chunk_files(store: str, split: str = "f32") -> list[str]:
    base = os.path.join(store, DATASET, ENCODER, split, "features", "c")
    return sorted((os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs),
                  key=lambda p: int(os.path.relpath(p, base).split(os.sep)[0]))


@pytest.mark.parametrize("local_read,cache", PATHS)
@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_loader_epoch_same_bytes_on_every_path(store: str, monkeypatch: pytest.MonkeyPatch,
                                               local_read: str, cache: str, cold: bool) -> None:
    monkeypatch.setenv("FEATURESTORE_LOCAL_READ", local_read)
    monkeypatch.setenv("FEATURESTORE_READ_CACHE", cache)
    if cold:  # the first-read crc check would read (and cache) whole chunks first
        monkeypatch.setenv("FEATURESTORE_VERIFY_READS", "off")
    ref_x, ref_y = (torch.from_numpy(a) for a in reference())
    ds = FeatureDataset(store, DATASET, ENCODER, "f32")
    for order in ("shuffle", "sequential"):
        if cold:
            evict(store)
        loader = FeatureLoader(ds, batch_size=16, device="cpu", order=order, seed=2)
        got = [(f.clone(), y.clone()) for f, y in loader]
        index = loader.plan().indices
        assert torch.equal(torch.cat([f for f, _ in got]), ref_x[index])
        assert torch.equal(torch.cat([y for _, y in got]), ref_y[index])
        loader.close()
    counts = ds.array.read_counts
    if local_read == "mmap":
        assert counts["mmap"] > 0 and counts["pool"] + counts["inline"] == 0
    elif local_read == "pread":
        assert counts["mmap"] == 0 and (counts["pool"] > 0 or not cold)


def test_dataloader_workers_read_with_their_own_pools(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEATURESTORE_VERIFY_READS", "off")
    monkeypatch.setenv("FEATURESTORE_LOCAL_READ", "pread")
    ref_x = torch.from_numpy(reference()[0])
    ds = FeatureDataset(store, DATASET, ENCODER, "f32")
    ds[0]  # the parent's reader and read pool exist before the fork
    evict(store)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                                         multiprocessing_context="fork")
    features = torch.cat([f for f, _ in loader])
    where = {float(v): i for i, v in enumerate(ref_x[:, 0, 0])}
    index = [where[float(v)] for v in features[:, 0, 0]]
    assert sorted(index) == list(range(NUM_SAMPLES)) and torch.equal(features, ref_x[index])


def test_pool_is_per_process_after_fork() -> None:
    pool = pread.ReadPool(2)
    parent = pool.executor()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a fresh executor, not the parent's copy (which has no threads)
        ok = pool.executor() is not parent and pool.executor().submit(lambda: 7).result(timeout=10) == 7
        os.write(write_end, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read_end, 1) == b"1"
    pool.shutdown()


def test_a_dropped_stager_stops_its_read_threads_without_joining_them() -> None:
    # Its finalizer may run inside the garbage collector at any point, even inside threading's own
    # locks (a CI worker deadlocked there): it tells the threads to stop and never waits for them.
    from client.stager import DeviceStager

    before = set(_read_threads())
    stager = DeviceStager(torch.device("cpu"), torch.float32, False, None, 1, prefetch=1)
    release = threading.Event()
    busy = stager.read_pool.executor().submit(release.wait, 30)
    threads = set(_read_threads()) - before
    assert threads
    holder = [stager]
    del stager
    dropper = threading.Thread(target=holder.clear, daemon=True)  # the last reference goes there
    dropper.start()
    dropper.join(timeout=10)
    assert not dropper.is_alive(), "the stager's finalizer waited for a busy read thread"
    release.set()
    assert busy.result(timeout=10) is True
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


@pytest.mark.parametrize("local_read", ["auto", "pread"])
@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_chunk_damaged_mid_epoch_fails_with_its_name(store: str, monkeypatch: pytest.MonkeyPatch,
                                                     local_read: str, damage: str) -> None:
    monkeypatch.setenv("FEATURESTORE_LOCAL_READ", local_read)
    ds = FeatureDataset(store, DATASET, ENCODER, "f32")
    victim = _chunk_files(store)[-1]  # the last chunk: rows 96..100, read by the last batch
    loader = FeatureLoader(ds, batch_size=16, device="cpu", order="sequential", prefetch=1, num_threads=1)
    received = []
    start = time.monotonic()
    expected_error = MissingChunks if damage == "delete" else CorruptChunk
    with pytest.raises(expected_error) as info:
        for k, (features, _) in enumerate(loader):
            received.append(features.clone())
            if k == 0:
                if damage == "delete":
                    os.unlink(victim)
                else:
                    os.truncate(victim, 100)
    assert victim in str(info.value) and "--resume" in str(info.value)
    assert time.monotonic() - start < 60  # no hang
    assert all(f.shape == (16, *SAMPLE_SHAPE) for f in received) and len(received) == NUM_SAMPLES // 16
    assert not [t for t in threading.enumerate() if t.name.startswith("featurestore-prefetch")]


def test_failed_read_thread_never_leaves_the_loader_waiting(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEATURESTORE_VERIFY_READS", "off")
    monkeypatch.setenv("FEATURESTORE_LOCAL_READ", "pread")
    real = pread._read_blocking
    calls = {"n": 0}

    def failing(fd: int, read: Any, path_of: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(5, "Input/output error")
        real(fd, read, path_of)

    monkeypatch.setattr(pread, "_read_blocking", failing)
    ds = FeatureDataset(store, DATASET, ENCODER, "f32")
    evict(store)  # cold: reads go to the threads
    start = time.monotonic()
    with pytest.raises(OSError, match="Input/output error"):
        for _ in FeatureLoader(ds, batch_size=8, device="cpu", order="shuffle"):
            evict(store)
    assert time.monotonic() - start < 60


def test_loader_close_stops_its_read_threads(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEATURESTORE_VERIFY_READS", "off")
    monkeypatch.setenv("FEATURESTORE_LOCAL_READ", "pread")
    ds = FeatureDataset(store, DATASET, ENCODER, "f32")
    before = set(_read_threads())
    with FeatureLoader(ds, batch_size=8, device="cpu") as loader:
        evict(store)
        for _ in loader:
            pass
        mine = set(_read_threads()) - before  # the loader's own read threads
        assert mine
    assert not [t for t in mine if t.is_alive()]


def test_plan_reads_coalesces_adjacent_rows_and_handles_duplicates() -> None:
    rows = np.zeros((6, 8), np.uint8)
    reads, dup_src, dup_dst = pread.plan_reads(np.array([9, 3, 4, 5, 4, 10]), rows, chunk_rows=8)
    # 3,4,5 are adjacent in chunk 0: one read; 9,10 adjacent in chunk 1: one read.
    assert [(r.chunk, r.offset // 8, r.nbytes // 8) for r in reads] == [(0, 3, 3), (1, 1, 2)]
    assert dup_dst.tolist() == [4] and dup_src.tolist() == [2]


def test_auto_cache_is_direct_only_for_arrays_larger_than_half_the_memory() -> None:
    assert pread.resolve_cache("auto", 1 << 20) == "keep"
    assert pread.resolve_cache("auto", pread.memory_limit()) == "direct"
    assert pread.resolve_cache("drop", 1) == "drop"


def test_dataset_rejects_non_integer_indices(store: str) -> None:
    ds = FeatureDataset(store, DATASET, ENCODER, "f32")
    for bad in (1.9, "3", None, True):
        with pytest.raises(InvalidIndices):
            ds[bad]  # type: ignore[index]
    with pytest.raises(InvalidIndices):
        ds.__getitems__([1.5, 2])  # type: ignore[list-item]
    with pytest.raises(IndexOutOfRange, match=str(NUM_SAMPLES)):
        ds[NUM_SAMPLES]
    with pytest.raises(IndexOutOfRange):
        ds[-NUM_SAMPLES - 1]
    assert torch.equal(ds[np.int64(3)][0], ds[-NUM_SAMPLES + 3][0])
    assert torch.equal(ds[torch.tensor(3)][0], ds[3][0])


def test_partial_state_dict_is_a_clear_error(store: str) -> None:
    ds = FeatureDataset(store, DATASET, ENCODER, "f32")
    loader = FeatureLoader(ds, batch_size=8, device="cpu")
    with pytest.raises(ValueError, match="lacks 'batch'"):
        loader.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="non-negative integer"):
        loader.load_state_dict({"epoch": 1, "batch": -2})
    with pytest.raises(TypeError):
        loader.load_state_dict([1, 2])  # type: ignore[arg-type]
    loader.load_state_dict({"epoch": 1, "batch": 2})
    assert loader.epoch == 1 and len(list(loader)) == len(loader) - 2


def test_check_buffers_go_once_every_chunk_is_checked(store: str) -> None:
    """The first read of each chunk checks it whole in buffers of one process-wide pool; once all
    chunks of the array are checked, no check is left to come and the idle buffers go."""
    from featurestore.core import checked

    ds = FeatureDataset(store, DATASET, ENCODER, "f32")
    array = ds.array
    assert array.num_chunks > 2
    checked.release_buffers()
    array.read_numpy(np.arange(array.chunk_rows + 1))  # two chunks checked, the rest still to come
    assert checked._pool().free_bytes > 0
    array.read_numpy(np.arange(len(array)))
    assert checked._pool().free_bytes == 0
    assert np.array_equal(array.read_numpy(np.arange(len(array))), reference()[0])


def test_the_reader_imports_numpy_ma_before_any_read_thread_needs_it() -> None:
    # np.unique imports numpy.ma on first use; several read threads doing that at once (seen in a
    # forked S3 reader: RecursionError in numpy's lazy __getattr__) must not be the first import.
    code = "import sys, featurestore.core.reader; print('numpy.ma' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_a_read_converted_to_float32_holds_no_copy_of_the_whole_read(tmp_path: Any, dtype: str) -> None:
    """read_numpy(dtype="float32") made a whole stored copy and a whole float32 one per read (a
    server converting ?dtype= held 1.5x each response, kept by malloc after); now the stored rows
    pass through one buffer of at most CONVERT_PIECE_BYTES (a map of its own), piece by piece."""
    import tracemalloc

    from featurestore import open_store
    from featurestore.core.reader import CONVERT_PIECE_BYTES

    x = np.random.default_rng(0).standard_normal((600, 32, 384)).astype(np.float32)  # 28 MiB as float32
    writer = open_store(str(tmp_path), mode="a").create_split("d", "e", "s", num_samples=600,
                                                              sample_shape=(32, 384), dtype=dtype)
    writer.write(0, x)
    writer.commit()
    arr = open_store(str(tmp_path)).open("d", "e", "s")
    index = np.random.default_rng(1).permutation(600)
    whole = np.empty((600, 32, 384), np.float32)
    expected = np.concatenate([arr.read_numpy(index[i : i + 7], dtype="float32") for i in range(0, 600, 7)])
    tracemalloc.start()
    arr.read_numpy(index, out=whole, dtype="float32")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert whole.tobytes() == expected.tobytes()
    # int8 gathers each piece's rows' scales: float32, 4x the bytes of an int8 piece
    assert peak <= (5 if dtype == "int8" else 2) * CONVERT_PIECE_BYTES, peak
