"""Where a warm loader epoch's stall goes: ``bench loader``'s stall figure (a consumer that sleeps
one bare read per batch), with the first ``next()`` timed apart from the other waits, and
``FeatureLoader`` with 1 read-ahead thread against 2, interleaved over ``--repeats`` epochs in one
process. Per thread count: the median stall (its spread), the first wait, the other waits summed,
and warm throughput over the bare reader (a drained epoch, no consumer work). The split is the
bench's: ``--samples`` rows of ``[256, 384]`` float16, 64-row shuffled batches, page cache warm.

    PYTHONPATH=. python scripts/loader_stall.py [--samples 4096] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from client import FeatureDataset, FeatureLoader
from featurestore.bench import harness
from featurestore.demo.synthetic_splits import write_split


def epoch(loader: FeatureLoader, step: float) -> tuple[float, float, float]:
    """(stall share, first wait s, other waits s) of one epoch whose consumer sleeps ``step`` a batch."""
    waits, it = [], iter(loader)
    start = time.perf_counter()
    while True:
        before = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - before)
        time.sleep(step)
    return loader.stats["stall_s"] / (time.perf_counter() - start), waits[0], sum(waits[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="loader-stall-")
    try:
        write_split(os.path.join(work, "store"), args.samples, (256, 384), dtype="float16",
                    names=("bench", "loader", "n4"))
        ds = FeatureDataset(os.path.join(work, "store"), "bench", "loader", "n4")
        harness.warm(work)
        loaders = {t: FeatureLoader(ds, batch_size=64, device="cpu", dtype=None, order="shuffle", seed=2, prefetch=2,
                                    num_threads=t) for t in (1, 2)}
        for loader in loaders.values():
            harness.drain(loader)  # the pool's threads, the maps' page tables, the recycled buffers
        rows: dict[int, list[tuple[float, ...]]] = {1: [], 2: []}
        for r in range(args.repeats):
            for threads in ((1, 2) if r % 2 else (2, 1)):
                loader = loaders[threads]
                batches = list(loader.plan(epoch=100 + r))
                read_s = harness.timed(lambda: harness.drain(ds.array.read(i) for i in batches))  # noqa: B023
                loader.set_epoch(1 + r)
                stall, first, rest = epoch(loader, read_s / len(batches))
                loader.set_epoch(1000 + r)
                rows[threads].append((stall, first, rest, read_s / harness.timed(lambda: harness.drain(loader))))  # noqa: B023
        for threads, runs in rows.items():
            stall, first, rest, speed = ([run[k] for run in runs] for k in range(4))
            print(f"{threads} read-ahead thread(s): stall median {statistics.median(stall):.1%} "
                  f"({min(stall):.1%}-{max(stall):.1%}); first wait {statistics.median(first) * 1e3:.2f} ms, the "
                  f"others {statistics.median(rest) * 1e3:.2f} ms; warm throughput / bare reader "
                  f"{statistics.median(speed):.3f}x ({min(speed):.2f}-{max(speed):.2f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
