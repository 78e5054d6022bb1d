"""Warm loader epochs (CPU, stored dtype) against the bare reader reading the same batches, and
against the limits of any loader that reads ahead, interleaved over ``--repeats`` rounds in one
process: ``FeatureLoader`` over shuffled 64-row batches (``bench loader``'s ``loader_vs_reader``),
or with ``--bags`` ``BagLoader`` over shuffled bags, batch 1 (``bench bag-loader``'s warm figure).
Prints each method's median epoch and its time over the reader's (the median of the per-round
ratios, and their spread):

* ``reader``: the bare reader in the consumer's thread (``FeatureArray.read`` of each batch, or
  ``read_numpy`` of each bag into the reader's own reused output), as the bench's;
* ``reader, 4 outputs``: ``read_numpy`` into 4 outputs in turn, as a loader must (the consumer
  holds a batch while the next ones are read): what the rotation alone costs;
* ``read-ahead limit``: that on one plain thread, each batch handed over through a
  ``queue.Queue(2)``: no loader code, the floor of a thread hand-over per batch;
* ``<Loader>, N threads``: the loader as users build it (default 2 threads) and with 1.

    PYTHONPATH=. python scripts/loader_warm.py --workdir /tmp/loaderwarm [--bags]
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np


def dense(args: argparse.Namespace, work: str) -> tuple[Any, list[Any], Callable[[Any], Any], Any, int]:
    """The dense split: its loader class, batches, the bench's bare read, an output maker, bytes."""
    from client import FeatureDataset, FeatureLoader
    from featurestore.bench import harness
    from featurestore.core.buffers import aligned_empty
    from featurestore.demo.synthetic_splits import write_split

    shape = harness.parse_shapes(args.shape)[0]
    if not os.path.isdir(os.path.join(work, "store", "bench", "enc", "train")):
        write_split(os.path.join(work, "store"), args.num_samples, shape)
    ds = FeatureDataset(os.path.join(work, "store"), "bench", "enc", "train")
    batches = list(FeatureLoader(ds, batch_size=64, device="cpu", order="shuffle", seed=1).plan())
    outputs = [aligned_empty((64, *shape), ds.array.numpy_dtype) for _ in range(4)]

    def into(k: int, index: Any) -> None:
        ds.array.read_numpy(index, out=outputs[k % 4][: len(index)])
    loader = (lambda threads: FeatureLoader(ds, batch_sampler=batches, device="cpu", dtype=None, num_threads=threads))
    return loader, batches, ds.array.read, into, sum(len(b) for b in batches) * ds.sample_nbytes


def bags(args: argparse.Namespace, work: str) -> tuple[Any, list[Any], Callable[[Any], Any], Any, int]:
    """The bag split, as :func:`dense` (each batch one bag's position)."""
    from client import BagDataset, BagLoader
    from featurestore.bench.bag_loader import DATASET, ENCODER
    from featurestore.core.buffers import aligned_empty
    from featurestore.demo.synthetic_bags import bag_lengths, write_io_cohort

    store = os.path.join(work, "store")
    if not os.path.isdir(os.path.join(store, DATASET, ENCODER, "b")):
        write_io_cohort(store, (DATASET, ENCODER, "b"), bag_lengths(args.patches, count=args.bags), args.dim, "float16")
    ds = BagDataset(store, DATASET, ENCODER, "b")
    order = [int(b[0]) for b in BagLoader(ds, batch_size=1, seed=0, device="cpu").plan()]
    outputs = [aligned_empty((int(ds.lengths.max()), ds.dim), ds.numpy_dtype) for _ in range(4)]

    def into(k: int, i: int) -> None:
        ds.bags.read_numpy(i, out=outputs[k % 4][: int(ds.lengths[i])])
    loader = (lambda threads: BagLoader(ds, batch_size=1, seed=0, device="cpu", dtype=None, num_threads=threads))
    return loader, order, ds.bags.read_numpy, into, int(ds.lengths.sum()) * ds.row_nbytes


def read_ahead(batches: Iterable[Any], into: Callable[[int, Any], None]) -> None:
    handed: queue.Queue[int | None] = queue.Queue(2)

    def produce() -> None:
        for k, batch in enumerate(batches):
            into(k, batch)
            handed.put(k)
        handed.put(None)

    thread = threading.Thread(target=produce)
    thread.start()
    while handed.get(timeout=60) is not None:
        pass
    thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bags", type=int, nargs="?", const=48, default=None,
                        help="bags instead of a dense split: this many (default 48)")
    parser.add_argument("--patches", type=int, default=2500, help="--bags: median patches per bag")
    parser.add_argument("--dim", type=int, default=1024, help="--bags: feature width")
    parser.add_argument("--num-samples", type=int, default=4096, help="dense: samples")
    parser.add_argument("--shape", default="256x384", help="dense: sample shape TxD")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--workdir", default=None, help="kept, reused by a later run (default: a temp dir)")
    args = parser.parse_args()
    from featurestore.bench import harness

    work = args.workdir or tempfile.mkdtemp(prefix="fs-loaderwarm-")
    make, batches, read, into, nbytes = (bags if args.bags else dense)(args, work)
    harness.warm(os.path.join(work, "store"))
    loaders = {threads: make(threads) for threads in (2, 1)}
    kind = type(loaders[1]).__name__
    methods: dict[str, Callable[[], object]] = {
        "reader": lambda: harness.drain(read(batch) for batch in batches),  # each dropped at once
        "reader, 4 outputs": lambda: harness.drain(into(k, batch) for k, batch in enumerate(batches)),
        "read-ahead limit": lambda: read_ahead(batches, into),
        **{f"{kind}, {t} thread{'s' * (t > 1)}": (lambda loader=loader: harness.drain(loader))
           for t, loader in loaders.items()}}
    # One untimed round (maps, buffers, threads), then rounds in turn forward and backward.
    seconds = harness.interleaved([harness.Method(name, fn) for name, fn in methods.items()], args.repeats, warmup=1,
                                  order=lambda r, ms: ms if r % 2 == 0 else ms[::-1])
    for name in seconds:
        ratios = seconds.pairs("reader", name)
        print(f"{name:<24} {nbytes / seconds.median(name) / 1e9:6.2f} GB/s  reader / it {np.median(ratios):.3f}x "
              f"median (rounds {min(ratios):.2f}-{max(ratios):.2f})")
    for loader in loaders.values():
        loader.close()


if __name__ == "__main__":
    main()
