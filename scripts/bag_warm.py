"""Warm ``BagLoader`` epochs (batch 1, shuffled, CPU, stored dtype) against the bare bag reader
reading the same bags in the same order, and against the limits of any loader that reads ahead,
all interleaved over ``--repeats`` rounds in one process (the ``bench bag-loader`` warm figure
without its cold, CLAM and RSS parts). Prints each method's median epoch and its time over the
reader's (the median of the per-round ratios, and their spread):

* ``reader``: ``read_numpy`` of each bag in the consumer's thread, into the reader's own reused
  output (one buffer, cache-hot);
* ``reader, 4 outputs``: the same into 4 outputs in turn, as a loader must (the consumer holds a
  batch while the next ones are read): what the rotation alone costs;
* ``read-ahead limit``: the reader on one plain thread into 4 outputs in turn, handed over through a
  ``queue.Queue(2)``: no featurestore loader code, the floor of a thread hand-over per bag;
* ``BagLoader, N threads``: the loader as users build it (default 2 threads) and with 1.
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--bags", type=int, default=48)
    parser.add_argument("--patches", type=int, default=2500)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    from client import BagDataset, BagLoader
    from featurestore.bench import harness
    from featurestore.bench.bag_loader import DATASET, ENCODER
    from featurestore.core.buffers import aligned_empty
    from featurestore.demo.synthetic_bags import bag_lengths, write_io_cohort

    work = args.workdir or tempfile.mkdtemp(prefix="fs-bagwarm-")
    store = os.path.join(work, "store")
    if not os.path.isdir(os.path.join(store, DATASET, ENCODER, "b")):
        write_io_cohort(store, (DATASET, ENCODER, "b"), bag_lengths(args.patches, count=args.bags), args.dim, "float16")
    harness.warm(os.path.join(store, DATASET, ENCODER, "b"))
    ds = BagDataset(store, DATASET, ENCODER, "b")
    order = [int(b[0]) for b in BagLoader(ds, batch_size=1, seed=0, device="cpu").plan()]
    outputs = [aligned_empty((int(ds.lengths.max()), ds.dim), ds.numpy_dtype) for _ in range(4)]

    def into(k: int, i: int) -> None:
        ds.bags.read_numpy(i, out=outputs[k % 4][: int(ds.lengths[i])])

    def read_ahead() -> None:
        handed: queue.Queue[int | None] = queue.Queue(2)

        def produce() -> None:
            for k, i in enumerate(order):
                into(k, i)
                handed.put(k)
            handed.put(None)

        thread = threading.Thread(target=produce)
        thread.start()
        while handed.get(timeout=60) is not None:
            pass
        thread.join()

    loaders = {t: BagLoader(ds, batch_size=1, seed=0, device="cpu", dtype=None, num_threads=t) for t in (2, 1)}
    methods: dict[str, Callable[[], object]] = {
        "reader": lambda: harness.drain(ds.bags.read_numpy(i) for i in order),  # each dropped at once
        "reader, 4 outputs": lambda: harness.drain(into(k, i) for k, i in enumerate(order)),
        "read-ahead limit": read_ahead,
        **{f"BagLoader, {t} thread{'s' * (t > 1)}": (lambda loader=loader: harness.drain(loader))
           for t, loader in loaders.items()}}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(-1, args.repeats):  # one untimed round: maps, buffers, threads
        for name in (list(methods) if r % 2 == 0 else list(methods)[::-1]):
            start = time.perf_counter()
            methods[name]()
            if r >= 0:
                seconds[name].append(time.perf_counter() - start)
    nbytes = int(ds.lengths.sum()) * ds.row_nbytes
    for name, times in seconds.items():
        ratios = [a / b for a, b in zip(seconds["reader"], times)]
        print(f"{name:<22} {nbytes / np.median(times) / 1e9:6.2f} GB/s  reader / it {np.median(ratios):.3f}x "
              f"median (rounds {min(ratios):.2f}-{max(ratios):.2f})")
    for loader in loaders.values():
        loader.close()


if __name__ == "__main__":
    main()
