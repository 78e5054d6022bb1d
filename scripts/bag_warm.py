"""Warm ``BagLoader`` epochs (batch 1, shuffled, CPU, stored dtype) against the bare bag reader
reading the same bags in the same order, interleaved over ``--repeats`` rounds, in one process:
prints the median and per-round spread of reader time / loader time (the ``bench bag-loader``
warm figure without its cold, CLAM and RSS parts). Variants: ``--threads``."""

from __future__ import annotations

import argparse
import os
import tempfile
import time

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
    from featurestore.demo.synthetic_bags import bag_lengths, write_io_cohort

    work = args.workdir or tempfile.mkdtemp(prefix="fs-bagwarm-")
    store = os.path.join(work, "store")
    if not os.path.isdir(os.path.join(store, DATASET, ENCODER, "b")):
        write_io_cohort(store, (DATASET, ENCODER, "b"), bag_lengths(args.patches, count=args.bags), args.dim, "float16")
    harness.warm(os.path.join(store, DATASET, ENCODER, "b"))
    ds = BagDataset(store, DATASET, ENCODER, "b")
    order = [int(b[0]) for b in BagLoader(ds, batch_size=1, seed=0, device="cpu").plan()]
    loader = BagLoader(ds, batch_size=1, seed=0, device="cpu", dtype=None)

    def reader() -> float:
        start = time.perf_counter()
        for i in order:
            ds.bags.read_numpy(i)
        return time.perf_counter() - start

    def loaded() -> float:
        start = time.perf_counter()
        for _ in loader:
            pass
        return time.perf_counter() - start

    reader(), loaded()
    ratios, rt, lt = [], [], []
    for r in range(args.repeats):
        a, b = (reader(), loaded()) if r % 2 == 0 else reversed((loaded(), reader()))
        rt.append(a), lt.append(b), ratios.append(a / b)
    print(f"bag warm loader/reader {np.median(ratios):.3f}x median, rounds {min(ratios):.2f}-{max(ratios):.2f}, "
          f"best {min(rt) / min(lt):.3f}x; reader {np.median(rt) * 1e3:.1f} ms, loader {np.median(lt) * 1e3:.1f} ms")
    loader.close()


if __name__ == "__main__":
    main()
