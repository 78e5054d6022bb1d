"""``featurestore bench cold``: shuffled epochs over a store larger than a memory cgroup, page cache cold.

What it measures: docs/BENCHMARKS.md, "What each bench measures".
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import featurestore
from featurestore.bench import harness
from featurestore.bench.harness import Method, gbps, interleaved, parse_shapes
from featurestore.bench.reading import label
from featurestore.core.buffers import aligned_empty
from featurestore.demo.synthetic_splits import write_split
from featurestore.errors import InvalidOption
from featurestore.format import int8 as int8_format
from featurestore.testing.cgroup import CgroupUnavailable, MemoryCgroup, evict, files_under, resident_bytes, unmap
from featurestore.testing.memory import peak_reset, peak_rss

BASE_METHODS = ("device limit", "pread reference", "np.memmap gather", "FeatureArray.read", "FeatureLoader")
# Loader epochs to float32 values on the float16 split and on the int8 one (whose loader
# dequantizes), interleaved in the same child: int8's samples/s over float16's, per repeat.
INT8_PAIRS = {"cpu": ("FeatureLoader -> float32", "FeatureLoader [int8]"),
              "cuda": ("FeatureLoader -> cuda float32", "FeatureLoader -> cuda [int8]")}


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "cold", "cold-cache epochs over a store larger than a memory cgroup", {
        "--shapes": ("1024x3072,256x384", "sample shapes TxD, comma separated"),
        "--batch-sizes": ("16,64", "batch size per shape (one value: all shapes)"),
        "--dtype": ("float16,int8", "stored dtypes, comma separated, every shape in each; int8 is measured beside "
                                    "float16 (docs/BENCHMARKS.md) and needs it in the list"),
        "--chunk-rows": (64, "rows per chunk of the store"), "--limit-mib": (512, "memory cgroup limit in MiB"),
        "--store-ratio": (3.0, "store size / cgroup limit"), "--prefetch": (4, "FeatureLoader prefetch"),
        "--no-variants": (False, "(no effect: the forced reader rows are gone; kept so older command lines run)"),
        "--slow-seconds": (20.0, "time budget of the page-fault-bound np.memmap row: GB/s over the batches read in "
                                 "that time"),
        "--cuda": ("auto", "CUDA rows (the loader's epoch to the GPU); auto: when a GPU is present",
                   {"choices": ("auto", "on", "off")})}, repeats=3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    shapes = parse_shapes(args.shapes)
    sizes = harness.parse_numbers("--batch-sizes", args.batch_sizes, int, "16,64")
    sizes = sizes * len(shapes) if len(sizes) == 1 else sizes
    if len(sizes) != len(shapes) or min(sizes) < 1:
        raise InvalidOption(f"--batch-sizes {args.batch_sizes!r}: give one positive size, or one per shape "
                            f"({len(shapes)})")
    dtypes = harness.parse_dtypes(args.dtype, numpy_only=True)
    paired = "int8" in dtypes
    limit = args.limit_mib << 20
    with harness.scratch(args, "cold") as work:
        return {"benchmark": "cold", "limit_bytes": limit,
                "shapes": [_bench_shape(work, shape, size, dtype, limit, args, int8=paired and dtype == "float16")
                           for dtype in dtypes if dtype != "int8" for shape, size in zip(shapes, sizes)]}


def _bench_shape(work: str, shape: tuple[int, ...], batch_size: int, dtype: str, limit: int,
                 args: argparse.Namespace, *, int8: bool = False) -> dict[str, Any]:
    sample_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    # The loader's bound on CPU (docs/LOADER.md, "Memory bound"): prefetch + 3 float32 batches, a
    # staging batch of the stored width and 64 MiB of check buffers per read thread (up to 3 locally:
    # an int8 split's), plus the child's interpreter with torch and numba (~300 MiB anonymous). Less
    # OOM-kills the child instead of measuring the epoch.
    values = batch_size * int(np.prod(shape))
    needed = (args.prefetch + 3) * values * 4 + 3 * (values * np.dtype(dtype).itemsize + (64 << 20)) + (384 << 20)
    if limit < needed:
        print(f"[cold] [{label(shape)}]: the memory limit is raised to {needed >> 20} MiB, what a "
              f"FeatureLoader of {batch_size}-sample float32 batches may hold (the store stays {args.store_ratio}x it)")
        limit = needed
    n = max(2 * batch_size, int(args.store_ratio * limit) // sample_bytes)
    if int8:  # whole int8 chunks: a padded last chunk would weigh on the bytes figure, not a real split's
        rows = int8_format.chunk_rows("int8", args.chunk_rows, n)
        n = max(rows, n // rows * rows)
    base = harness.fresh(os.path.join(work, f"{label(shape)}-{dtype}"))
    print(f"\n[cold] samples [{label(shape)}] {dtype}, N={n} ({n * sample_bytes / 2**30:.2f} GiB, "
          f"{args.chunk_rows}-row chunks), batches of {batch_size}, memory limit {limit >> 20} MiB")
    with open(os.path.join(base, "raw"), "wb") as raw:  # the store and a raw file of the same bytes
        write_split(os.path.join(base, "store"), n, shape, dtype=dtype, rows=args.chunk_rows,
                    chunk_bytes=args.chunk_rows * sample_bytes, slabs=lambda _, values: values.tofile(raw))
    import torch  # the child measures with it too

    cuda = args.cuda == "on" or (args.cuda == "auto" and torch.cuda.is_available())
    methods = [*BASE_METHODS, *(["FeatureLoader -> cuda"] if cuda else [])]
    out: dict[str, Any] = {"sample_shape": list(shape), "dtype": dtype, "num_samples": n, "batch_size": batch_size,
                           "chunk_rows": args.chunk_rows, "store_bytes": n * sample_bytes, "limit_bytes": limit}
    if int8:  # the same samples as int8 (the writer quantizes them), chunks of as many rows where the format allows
        write_split(os.path.join(base, "store-int8"), n, shape, dtype="int8", rows=args.chunk_rows,
                    chunk_bytes=args.chunk_rows * int(np.prod(shape)))
        methods += [*INT8_PAIRS["cpu"], *(INT8_PAIRS["cuda"] if cuda else ())]
        out["split_bytes"] = {name: harness.feature_bytes(os.path.join(base, folder, "bench", "enc", "train"))
                              for name, folder in ((dtype, "store"), ("int8", "store-int8"))}
    config = {"base": base, "shape": list(shape), "dtype": dtype, "n": n, "batch_size": batch_size,
              "methods": methods, "repeats": args.repeats, "prefetch": args.prefetch, "slow_seconds": args.slow_seconds}
    try:
        with MemoryCgroup(limit) as group:
            done = harness.child_process("cold:measure", config, cgroup=group)
            out["cgroup"] = f"v{group.version}" if group.version else "systemd-run scope"
            out["oom_kills"] = group.oom_kills()
    except CgroupUnavailable as error:  # the notes print it
        out["cgroup"] = f"none ({error}); evicted with posix_fadvise(DONTNEED) before each method"
        done = harness.child_process("cold:measure", config)
    shutil.rmtree(base, ignore_errors=True)
    out["returncode"] = done.returncode
    if done.returncode != 0:  # the notes print its stderr
        out["stderr"] = done.stderr[-3000:]
        return out
    out.update(harness.child_result(done))
    if int8:  # the paired loader epochs, on the CPU and on CUDA where measured
        rows = out["rows"]
        out["int8"] = harness.int8_figures(out["split_bytes"], dtype, {
            device: {dtype: rows[ref]["all_seconds"], "int8": rows[q]["all_seconds"]}
            for device, (ref, q) in INT8_PAIRS.items() if ref in rows and q in rows}, n, "samples")
    return out


# ---------------------------------------------------------------------- the child (in the cgroup)
def measure(config: dict[str, Any]) -> dict[str, Any]:
    """(The child, in the cgroup.) Every method, interleaved, each after an eviction."""
    import torch

    from client import FeatureDataset, FeatureLoader

    base, shape, n, b = config["base"], tuple(config["shape"]), config["n"], config["batch_size"]
    dtype = np.dtype(config["dtype"])
    sample_bytes = int(np.prod(shape)) * dtype.itemsize
    store_dir, raw_path, int8_dir = (os.path.join(base, name) for name in ("store", "raw", "store-int8"))
    order = np.random.default_rng(1).permutation(n)
    batches = [order[i : i + b] for i in range(0, n, b)]
    chunk_files = files_under(os.path.join(store_dir, "bench", "enc", "train", "features"))
    chunk_bytes = harness.size(*chunk_files)

    def device_limit() -> int:  # every chunk file read whole, 4 at a time
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(harness.warm, chunk_files))
        return chunk_bytes

    def pread_reference() -> int:
        fd = os.open(raw_path, os.O_RDONLY)
        local = threading.local()  # one preallocated sample buffer per thread
        try:
            def one(k: int) -> int:
                if not hasattr(local, "out"):
                    local.out = memoryview(aligned_empty((sample_bytes,), np.uint8))
                return os.preadv(fd, [local.out], int(order[k]) * sample_bytes)

            with ThreadPoolExecutor(8) as pool:
                return sum(pool.map(one, range(n), chunksize=b))
        finally:
            os.close(fd)

    def memmap() -> np.memmap:  # made per epoch: a map kept open would keep its pages past the next eviction
        return np.memmap(raw_path, dtype=dtype, mode="r", shape=(n, *shape))

    def reader() -> int:
        array = featurestore.open_store(store_dir).open("bench", "enc", "train")
        return sum(array.read(idx).nbytes for idx in batches)

    def memmap_gather() -> int:
        """Bytes gathered until the time budget runs out: this row is page-fault bound, and GB/s is
        per byte, so a prefix of the same shuffled epoch measures the same rate."""
        raw, total, start = memmap(), 0, time.perf_counter()
        for idx in batches:
            total += raw[idx].nbytes  # fancy indexing copies: only raw holds the map, which closes on return
            if time.perf_counter() - start > config["slow_seconds"]:
                break
        return total

    def loader(device: str, store: str = store_dir, out: Any = None) -> Any:
        def epoch() -> int:
            ds = FeatureDataset(store, "bench", "enc", "train")
            it = FeatureLoader(ds, batch_size=b, shuffle=True, device=device, dtype=out, prefetch=config["prefetch"])
            total = sum(features.nbytes for features, _ in it)
            it.close()
            if device == "cuda":
                torch.cuda.synchronize()
            return total
        return epoch

    fns = {"device limit": device_limit, "pread reference": pread_reference, "np.memmap gather": memmap_gather,
           "FeatureArray.read": reader, "FeatureLoader": loader("cpu"), "FeatureLoader -> cuda": loader("cuda")}
    for device, pair in INT8_PAIRS.items():  # float32 out of the float16 split, then of the int8 one
        fns.update({name: loader(device, store, torch.float32) for name, store in zip(pair, (store_dir, int8_dir))})
    peaks: dict[str, int] = {}
    errors: dict[str, str] = {}
    seconds: dict[str, list[float]] = {}
    left: dict[str, int] = {}  # bytes still cached after each method's eviction, the most over the repeats

    def method(name: str) -> Method:
        def rate() -> float:
            start = time.perf_counter()
            try:
                nbytes = fns[name]()
            except Exception as error:  # one broken row (a CUDA setup, say) must not hide the others
                errors[name] = f"{type(error).__name__}: {error}"
                return float("nan")
            elapsed = time.perf_counter() - start
            seconds.setdefault(name, []).append(elapsed)
            return gbps(nbytes, elapsed)

        def setup() -> None:
            unmap()  # the readers' maps of chunk files: a mapped page outlives the eviction
            evict(store_dir, raw_path, int8_dir)  # int8_dir: absent unless int8 is measured
            left[name] = max(left.get(name, 0), resident_bytes(store_dir, raw_path, int8_dir))
            peak_reset()
        return Method(name, rate, setup, lambda: peaks.__setitem__(name, max(peaks.get(name, 0), peak_rss())),
                      own=True)

    times = interleaved([method(name) for name in config["methods"]], config["repeats"])
    rates = {name: [r for r in values if r == r] for name, values in times.items()}
    # Same bytes: the reader's and the loader's first batch against the raw file.
    array = featurestore.open_store(store_dir).open("bench", "enc", "train")
    same = array.read_numpy(batches[0]).tobytes() == memmap()[batches[0]].tobytes()
    rows = {name: {"gb_per_s": float(np.median(r)), "all_gb_per_s": r, "all_seconds": seconds[name],
                   "peak_rss": peaks[name], "cached_after_evict": left[name]} for name, r in rates.items() if r}
    return {"rows": rows, "repeats": config["repeats"], "same_bytes": same, "errors": errors}


def failed(results: dict[str, Any]) -> str | None:
    bad = [f"[{label(s['sample_shape'])}] {s.get('dtype', 'float16')}" for s in results.get("shapes", [])
           if s.get("returncode") != 0 or s.get("errors")]
    return f"a child or a method failed for {', '.join(bad)}" if bad else None
