"""A cold epoch of an int8 split beside its float16 twin: what int8's halved bytes buy a reader.

Both splits hold the same float32 features (written from the same slabs); each epoch is one
shuffled `FeatureLoader` pass, float32 out, on ``--device`` (cpu: dequantized into the host
batch; cuda: int8 codes and scales moved to the GPU and dequantized there). Before every epoch
the split's files are dropped from the page cache (`posix_fadvise(DONTNEED)` after an fdatasync),
so each epoch reads its bytes from the device. The two dtypes alternate, repeat by repeat.

    python scripts/int8_epoch.py /tmp/int8-epoch --samples 256 --device cpu --repeats 3

int8 chunks hold at least 128 rows: a sample count that is not a multiple of 128 stores (and a
cold epoch reads) the last chunk's padding too. ``--keep`` then ``--reuse`` measures again
without writing the twins again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import numpy as np


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def write_twins(root: str, n: int, shape: tuple[int, int], rows: int) -> None:
    """A float16 and an int8 split of the same float32 features (ViT-like: a few outlier channels)."""
    import featurestore

    store = featurestore.open_store(root, mode="a")
    writers = {dtype: store.create_split("bench", "enc", dtype, num_samples=n, sample_shape=shape, dtype=dtype,
                                         overwrite=True) for dtype in ("float16", "int8")}
    rng = np.random.default_rng(0)
    block = rng.standard_normal((min(rows, n), *shape), dtype=np.float32)
    block[:, :, rng.choice(shape[1], 4, replace=False)] *= 40.0  # massive-activation channels
    for k, start in enumerate(range(0, n, rows)):
        values = block[: min(rows, n - start)] + np.float32((k % 64) * 0.01)
        for writer in writers.values():
            writer.write(start, values)
    for writer in writers.values():
        writer.commit()


def epoch(root: str, dtype: str, batch: int, device: str, seed: int, prefetch: int, threads: int | None) -> float:
    """Samples per second of one shuffled epoch, float32 out on ``device``."""
    import torch

    from client import FeatureDataset, FeatureLoader
    from featurestore.testing.cgroup import evict, unmap

    unmap()
    evict(os.path.join(root, "bench", "enc", dtype))
    ds = FeatureDataset(root, "bench", "enc", dtype)
    loader = FeatureLoader(ds, batch_size=batch, shuffle=True, seed=seed, device=device, dtype=torch.float32,
                           prefetch=prefetch, num_threads=threads)
    start = time.perf_counter()
    n = 0
    for features, _ in loader:
        n += int(features.shape[0])
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="scratch store directory (removed at the end unless --keep)")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--shape", default="1024x3072", help="TxD (default: the seed's shape)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefetch", type=int, default=2, help="FeatureLoader prefetch (batches in flight)")
    parser.add_argument("--threads", type=int, default=None, help="FeatureLoader num_threads (default: its own)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--reuse", action="store_true",
                        help="read the twins already in ROOT (written by a run with --keep) instead of writing them")
    args = parser.parse_args()
    t, d = (int(v) for v in args.shape.lower().split("x"))
    start = time.perf_counter()
    if not args.reuse:
        write_twins(args.root, args.samples, (t, d), rows=64)
    sizes = {dtype: _du(os.path.join(args.root, "bench", "enc", dtype)) for dtype in ("float16", "int8")}
    print(f"wrote float16 {sizes['float16'] / 2**30:.2f} GiB and int8 {sizes['int8'] / 2**30:.2f} GiB "
          f"({sizes['int8'] / sizes['float16']:.3f}x) in {time.perf_counter() - start:.0f} s")
    import featurestore

    store = featurestore.open_store(args.root)
    for dtype in ("float16", "int8"):
        # A split's last chunk is stored whole: with int8's 128-row chunks a sample count that is
        # not a multiple of 128 reads padding too (bytes on storage above 0.5x).
        array = store.open("bench", "enc", dtype)
        print(f"{dtype}: {len(array)} samples, {array.chunk_rows} rows a chunk "
              f"({array.chunk_rows * array.sample_nbytes / 2**20:.0f} MiB), {array.num_chunks} chunks")
        if dtype == "int8" and len(array) % array.chunk_rows:
            print(f"  note: {len(array)} samples is not a multiple of {array.chunk_rows}: the last int8 chunk "
                  f"is stored whole, padding included, and read whole by the first-read crc32c check; "
                  f"use --samples {array.chunk_rows * array.num_chunks} to compare the formats' own bytes")
    rates: dict[str, list[float]] = {"float16": [], "int8": []}
    for repeat in range(args.repeats):
        order = ("float16", "int8") if repeat % 2 == 0 else ("int8", "float16")
        for dtype in order:
            rates[dtype].append(epoch(args.root, dtype, args.batch, args.device, seed=repeat,
                                      prefetch=args.prefetch, threads=args.threads))
    pairs = [a / b for a, b in zip(rates["int8"], rates["float16"])]
    for dtype, values in rates.items():
        print(f"{dtype:8s} cold epoch, float32 out on {args.device}: median {statistics.median(values):8.1f} "
              f"samples/s  (repeats {', '.join(f'{v:.1f}' for v in values)})")
    print(f"int8 / float16 samples/s, cold, side by side: median {statistics.median(pairs):.2f}x "
          f"(per repeat {', '.join(f'{p:.2f}' for p in pairs)}); bytes on storage {sizes['int8'] / sizes['float16']:.3f}x")
    if not args.keep:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
