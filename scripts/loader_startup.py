"""Side-by-side figures of the loader's start-up and the single-item path over HTTP.

Run with PYTHONPATH pointing at the code to measure (a checkout), in one process, methods
interleaved over ``--repeats`` rounds; prints medians and the per-round spread:

* ``http16``: a 16-batch epoch over HTTP with start-up counted. ``loader``: a fresh
  ``FeatureDataset`` + ``FeatureLoader`` per epoch (as a user's short epoch or a fresh fold sees
  it), iterated; ``client``: a fresh ``FeatureClient`` opening the split and reading the same 16
  batches (features + labels) one after another. Ratio = client time / loader time. With
  ``--client-reused`` the client is made and opened once, before the rounds (a harness that
  keeps its client and builds a dataset and loader per epoch).
* ``item``: ``FeatureClient.item`` of one 192 KiB sample, p50 / p99 in ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="keeps the store between runs")
    parser.add_argument("--client-reused", action="store_true", help="one FeatureClient for every round")
    args = parser.parse_args()
    from featurestore.testing.serving import build_store, serve_subprocess

    work = args.workdir or tempfile.mkdtemp(prefix="fs-startup-")
    path = os.path.join(work, "store")
    if not os.path.isdir(os.path.join(path, "bench", "enc", "train")):
        build_store(path, 1024)
    key = ("bench", "enc", "train")
    with serve_subprocess(path) as (url, _):
        http16(url, key, args)
        item(url, key, args)


def http16(url: str, key: tuple[str, str, str], args: argparse.Namespace) -> None:
    from client import FeatureClient, FeatureDataset, FeatureLoader

    batch, threads = 64, args.threads

    def loader_epoch(epoch: int) -> float:
        start = time.perf_counter()
        ds = FeatureDataset(url, *key)
        loader = FeatureLoader(ds, batch_size=batch, order="shuffle", device="cpu", dtype=None,
                               num_threads=threads, prefetch=threads + 1, drop_last=True)
        loader.set_epoch(epoch)
        count = sum(1 for _ in loader)
        assert count == 16, count
        return time.perf_counter() - start

    kept = FeatureClient(url) if args.client_reused else None
    if kept is not None:
        kept.open(*key)

    def client_epoch(epoch: int) -> float:
        start = time.perf_counter()
        fc = kept or FeatureClient(url)
        remote = fc.open(*key)
        n = len(remote)
        features = np.empty((batch, *remote.sample_shape), remote.numpy_dtype)
        labels = np.empty((batch, *remote.labels.sample_shape), remote.labels.numpy_dtype)
        order = np.random.default_rng(epoch).permutation(n)
        for k in range(n // batch):
            remote.read_into(order[k * batch:(k + 1) * batch], features, labels)
        took = time.perf_counter() - start
        if kept is None:
            fc.close()
        return took

    loader_epoch(0), client_epoch(0)  # imports, the server's first requests
    ratios, lt, ct = [], [], []
    for r in range(args.repeats):
        if r % 2:
            c, l = client_epoch(r + 1), loader_epoch(r + 1)
        else:
            l, c = loader_epoch(r + 1), client_epoch(r + 1)
        lt.append(l), ct.append(c), ratios.append(c / l)
    what = "client reused" if args.client_reused else "fresh client"
    print(f"http16 ({what}) loader/client {np.median(ratios):.3f}x median, rounds {min(ratios):.2f}-{max(ratios):.2f}; "
          f"loader {np.median(lt) * 1e3:.1f} ms, client {np.median(ct) * 1e3:.1f} ms (median)")


def item(url: str, key: tuple[str, str, str], args: argparse.Namespace) -> None:
    from client import FeatureClient

    fc = FeatureClient(url)
    n = len(fc.open(*key))
    rng = np.random.default_rng(99)
    lat = []
    for i in rng.integers(0, n, size=args.items + 20):
        start = time.perf_counter()
        fc.item(*key, int(i))
        lat.append(time.perf_counter() - start)
    ms = np.array(lat[20:]) * 1e3
    print(f"item p50 {np.percentile(ms, 50):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms ({len(ms)} requests)")
    fc.close()


if __name__ == "__main__":
    sys.exit(main())
