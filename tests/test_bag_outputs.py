"""Whole-bag reads land in memory recycled from bags the caller dropped, never in a kept one's."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import numpy as np

import featurestore
from featurestore.core.bag_array import BagArray


def _bags(tmp_path: Path) -> BagArray:
    store = featurestore.open_store(str(tmp_path), mode="a")
    writer = store.create_bag_split("ds", "enc", "bags", dim=1536, dtype="float16")
    rng = np.random.default_rng(0)
    # 35 MiB bags: above the 32 MiB up to which malloc recycles freed memory itself (its dynamic
    # mmap threshold), so every fresh array would be a new map, faulted in page by page.
    for i, n in enumerate((12000, 11000, 12000)):
        writer.add_bag(f"s{i}", rng.standard_normal((n, 1536), dtype=np.float32), np.zeros((n, 2), np.int64))
    writer.commit()
    return store.open_bags("ds", "enc", "bags")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_dropped_bags_memory_serves_the_next_read_and_a_kept_one_is_never_overwritten(tmp_path: Path) -> None:
    bags = _bags(tmp_path)
    expected = bags.read_numpy(0)[0].copy()  # first reads: the chunk maps and the pool fill
    for i in (0, 1, 2):
        bags.read_numpy(i)
    before = _faults()
    features, _ = bags.read_numpy(0)  # into the buffer a dropped read of the same size held
    faults = _faults() - before
    # A fresh 35 MiB map is faulted in as it is written (~370 faults here, in folios of 64 KiB and
    # more); the recycled buffer only maps the chunk's pages back (~60).
    assert faults < 200, faults
    np.testing.assert_array_equal(features, expected)
    kept = [bags.read_numpy(i)[0] for i in range(3)]  # all held: three distinct buffers
    assert len({a.__array_interface__["data"][0] for a in kept + [features]}) == 4
    np.testing.assert_array_equal(kept[0], expected)
    np.testing.assert_array_equal(features, expected)


def test_a_forked_reader_reads_with_its_own_pool(tmp_path: Path) -> None:
    # The parent holds the pool's lock while it forks (as a thread of it might): the child (a
    # DataLoader worker) must not wait for a lock no thread of its own will release.
    from featurestore.core import bag_array

    bags = _bags(tmp_path)
    expected = bags.read_numpy(1)[0].copy()
    with bag_array._OUTPUTS._lock:
        pid = os.fork()
        if pid == 0:  # the child: read, compare, and leave without running the parent's cleanup
            signal.alarm(60)
            ok = np.array_equal(bags.read_numpy(1)[0], expected)
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
