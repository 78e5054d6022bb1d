"""``featurestore bench read``: shuffled-batch gather speed against the usual baselines (np.memmap,
zarr-python, HDF5 and torch files per sample) and the reader's RSS over N and 4N samples.

Method: docs/BENCHMARKS.md, "What each bench measures".
"""

from __future__ import annotations

import argparse
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import featurestore
from featurestore.bench import harness
from featurestore.bench.harness import Method, interleaved
from featurestore.bench.reading import label
from featurestore.core import descriptor_reads
from featurestore.core.buffers import aligned_empty
from featurestore.demo.synthetic_splits import write_split
from featurestore.testing import memory

PREAD = "preadv per row, no map (limit)"
CHUNK_PREAD = "preadv per row from the chunk files (limit)"


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "read", "reader GB/s vs memmap, zarr, HDF5, torch.save; RSS", {
        "--shapes": ("256x384,1024x1536", "sample shapes TxD, comma separated"),
        "--gib": (0.75, "size of each test array in GiB"), "--batch-size": (64, None),
        "--batches": (200, "timed batches per method and repeat (fewer do not settle)"),
        "--skip-rss": (False, "skip the N vs 4N RSS subprocesses")}, repeats=3, keep="best")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with harness.scratch(args, "read") as work:
        out = {"benchmark": "read", "batch_size": args.batch_size,
               "shapes": [_bench_shape(work, shape, args) for shape in harness.parse_shapes(args.shapes)]}
        if not args.skip_rss:  # N and 4N samples of [256x384] float16, each in a fresh process
            n = max(256, int(args.gib * (1 << 30)) // (256 * 384 * 2) // 4)
            paths = {key: os.path.join(work, f"rss-{key}") for key in ("N", "4N")}
            for key, rows in (("N", n), ("4N", 4 * n)):
                write_split(harness.fresh(paths[key]), rows, (256, 384))
            out["rss"] = harness.rss_runs("read:rss_epoch", paths, runs=min(3, args.repeats))
    return out


def _bench_shape(work: str, shape: tuple[int, ...], args: argparse.Namespace) -> dict[str, Any]:
    import h5py
    import torch
    import zarr

    sample_bytes = int(np.prod(shape)) * 2
    n = max(args.batch_size * 4, int(args.gib * (1 << 30)) // sample_bytes)
    print(f"\n[read] samples [{label(shape)}] float16, N={n} ({n * sample_bytes / 2**30:.2f} GiB), batches of "
          f"{args.batch_size}")
    base = harness.fresh(os.path.join(work, label(shape)))
    os.makedirs(os.path.join(base, "pt"))
    raw_path, h5_path = os.path.join(base, "raw.f16"), os.path.join(base, "per-sample.h5")
    with open(raw_path, "wb") as raw, h5py.File(h5_path, "w") as h5:
        def copies(start: int, values: np.ndarray) -> None:
            values.tofile(raw)
            for j, sample in enumerate(values):
                h5.create_dataset(str(start + j), data=sample)
                torch.save(torch.from_numpy(sample.copy()), os.path.join(base, "pt", f"{start + j}.pt"))
        write_split(os.path.join(base, "store"), n, shape, rows=max(1, (64 << 20) // sample_bytes), slabs=copies)

    array = featurestore.open_store(os.path.join(base, "store")).open("bench", "enc", "train")
    memmap = np.memmap(raw_path, dtype=np.float16, mode="r", shape=(n, *shape))
    zarray = zarr.open_group(os.path.join(base, "store"), mode="r")["bench/enc/train/features"]
    h5 = h5py.File(h5_path, "r")
    out = aligned_empty((args.batch_size, *shape), np.float16)  # what the loader and server use
    raw_fd, cores = os.open(raw_path, os.O_RDONLY), descriptor_reads.cores()  # as many as the reader's helpers
    pool, slots = ThreadPoolExecutor(cores), out.reshape(len(out), -1).view(np.uint8)
    # The same rows out of the store's own chunk files, the limit for the very pages the reader copies:
    # the page cache holds each file's pages its own way (docs/BENCHMARKS.md, "What each bench measures").
    chunk_fds = [os.open(array.storage.local_path(key), os.O_RDONLY) for key in array.chunk_keys()]

    def pread_rows(idx: np.ndarray, lo: int, hi: int, chunked: bool = False) -> None:
        for j in range(lo, hi):
            chunk, row = divmod(int(idx[j]), array.chunk_rows) if chunked else (0, int(idx[j]))
            os.preadv(chunk_fds[chunk] if chunked else raw_fd, [slots[j]], row * sample_bytes)

    def pread_limit(idx: np.ndarray, chunked: bool = False) -> None:
        # The limit of a read that maps nothing in (the reader's way past its mapped-bytes bound,
        # docs/READS.md "Resident bytes"): each row preadv'd into its slot, a share per core.
        step = -(-len(idx) // cores)
        list(pool.map(lambda lo: pread_rows(idx, lo, min(len(idx), lo + step), chunked), range(0, len(idx), step)))

    fns = {
        "featurestore": lambda idx: array.read_numpy(idx, out=out),
        "np.memmap gather": lambda idx: memmap[idx],
        PREAD: pread_limit,
        CHUNK_PREAD: lambda idx: pread_limit(idx, chunked=True),
        "zarr orthogonal": lambda idx: zarray.get_orthogonal_selection((idx,)),
        "hdf5 per sample": lambda idx: np.stack([h5[str(i)][()] for i in idx]),
        "torch.save per sample": lambda idx: torch.stack([torch.load(os.path.join(base, "pt", f"{i}.pt"))
                                                          for i in idx]),
    }
    harness.warm(os.path.join(base, "store"), os.path.join(base, "pt"), raw_path, h5_path)  # every method from memory
    # The slow baselines get fewer batches; GB/s is per byte, so the counts need not match.
    counts = {"zarr orthogonal": max(3, args.batches // 10), "hdf5 per sample": max(5, args.batches // 4),
              "torch.save per sample": max(5, args.batches // 4)}
    orders: list[np.ndarray] = []

    def draw(repeat: int, methods: list[Method]) -> list[Method]:  # the same shuffled batches for every method
        rng = np.random.default_rng(repeat)
        orders[:] = [rng.choice(n, size=args.batch_size, replace=False) for _ in range(args.batches + 1)]
        return methods

    def method(name: str) -> Method:  # one untimed batch first; GB/s of the timed ones
        batches = counts.get(name, args.batches)
        gb_per_s = harness.rate(lambda: harness.drain(fns[name](order) for order in orders[1:batches + 1]),
                                batches * args.batch_size * sample_bytes)
        return Method(name, gb_per_s, lambda: fns[name](orders[0]), own=True)

    rates = interleaved([method(name) for name in fns], args.repeats, order=draw)
    h5.close()
    pool.shutdown()
    for fd in (raw_fd, *chunk_fds):
        os.close(fd)
    best = {name: max(values) for name, values in rates.items()}
    rows = {name: {"gb_per_s": rate, "vs_memmap": rate / best["np.memmap gather"]} for name, rate in best.items()}
    shutil.rmtree(base, ignore_errors=True)
    result = {"sample_shape": list(shape), "num_samples": n, "read": rows}
    for key, other in (("memmap", "np.memmap gather"), ("pread", PREAD), ("chunk_pread", CHUNK_PREAD)):
        pairs = result[f"paired_vs_{key}"] = rates.pairs("featurestore", other)  # back to back in each repeat
        result[f"median_paired_vs_{key}"] = float(np.median(pairs))
    return result


def rss_epoch(path: str) -> dict[str, Any]:
    """(A child.) The reader's peak anonymous RSS over one shuffled epoch of batches of 64."""
    arr = featurestore.open_store(path).open("bench", "enc", "train")
    out = aligned_empty((64, *arr.sample_shape), arr.numpy_dtype)
    order = np.random.default_rng(0).permutation(len(arr))
    return {"n": len(arr), **memory.rss_epoch(arr.read_numpy(order[s:s + 64], out=out)
                                              for s in range(0, len(order) - 63, 64))}
