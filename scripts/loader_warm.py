"""Warm ``FeatureLoader`` epochs (shuffled 64-row batches, CPU, stored dtype) against the bare reader
reading the same batches, and against the limits of any loader that reads ahead, interleaved over
``--repeats`` rounds in one process (``bench loader``'s ``loader_vs_reader`` without its other
parts; scripts/bag_warm.py is the same for bags). Prints each method's median epoch and its time
over the reader's (the median of the per-round ratios, and their spread):

* ``reader``: ``FeatureArray.read`` of each batch in the consumer's thread (``bench loader``'s);
* ``reader, 4 outputs``: ``read_numpy`` into 4 outputs in turn, as a loader must;
* ``read-ahead limit``: that on one plain thread, each batch handed over through a
  ``queue.Queue(2)``: no loader code, the floor of a thread hand-over per batch;
* ``FeatureLoader, N threads``: the loader as users build it (default 2 threads) and with 1.

    PYTHONPATH=. python scripts/loader_warm.py --workdir /tmp/loaderwarm
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
    parser.add_argument("--num-samples", type=int, default=4096)
    parser.add_argument("--shape", default="256x384")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    from client import FeatureDataset, FeatureLoader
    from featurestore.bench import harness
    from featurestore.core.buffers import aligned_empty
    from featurestore.demo.synthetic_splits import write_split

    shape = harness.parse_shapes(args.shape)[0]
    store = os.path.join(args.workdir or tempfile.mkdtemp(prefix="fs-loaderwarm-"), "store")
    if not os.path.isdir(os.path.join(store, "bench", "enc", "train")):
        write_split(store, args.num_samples, shape)
    harness.warm(os.path.join(store, "bench", "enc", "train"))
    ds = FeatureDataset(store, "bench", "enc", "train")
    batches = list(FeatureLoader(ds, batch_size=args.batch_size, device="cpu", order="shuffle", seed=1).plan())
    outputs = [aligned_empty((args.batch_size, *shape), ds.array.numpy_dtype) for _ in range(4)]

    def into(k: int, index: np.ndarray) -> None:
        ds.array.read_numpy(index, out=outputs[k % 4][: len(index)])

    def read_ahead() -> None:
        handed: queue.Queue[int | None] = queue.Queue(2)

        def produce() -> None:
            for k, index in enumerate(batches):
                into(k, index)
                handed.put(k)
            handed.put(None)

        thread = threading.Thread(target=produce)
        thread.start()
        while handed.get(timeout=60) is not None:
            pass
        thread.join()

    loaders = {t: FeatureLoader(ds, batch_sampler=batches, device="cpu", dtype=None, num_threads=t) for t in (2, 1)}
    methods: dict[str, Callable[[], object]] = {
        "reader": lambda: harness.drain(ds.array.read(index) for index in batches),
        "reader, 4 outputs": lambda: harness.drain(into(k, index) for k, index in enumerate(batches)),
        "read-ahead limit": read_ahead,
        **{f"FeatureLoader, {t} thread{'s' * (t > 1)}": (lambda loader=loader: harness.drain(loader))
           for t, loader in loaders.items()}}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(-1, args.repeats):  # one untimed round: maps, buffers, threads
        for name in (list(methods) if r % 2 == 0 else list(methods)[::-1]):
            start = time.perf_counter()
            methods[name]()
            if r >= 0:
                seconds[name].append(time.perf_counter() - start)
    nbytes = sum(len(index) for index in batches) * ds.sample_nbytes
    for name, times in seconds.items():
        ratios = [a / b for a, b in zip(seconds["reader"], times)]
        print(f"{name:<26} {nbytes / np.median(times) / 1e9:6.2f} GB/s  reader / it {np.median(ratios):.3f}x "
              f"median (rounds {min(ratios):.2f}-{max(ratios):.2f})")
    for loader in loaders.values():
        loader.close()


if __name__ == "__main__":
    main()
