"""``featurestore bench write``: the writer (float16 and float32 input) against numpy ``tofile`` of the
same bytes, both timed to ``os.sync()`` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
from typing import Any

import numpy as np

from featurestore.bench import harness
from featurestore.bench.harness import Method, gbps, interleaved, parse_shapes
from featurestore.extract.plan import chunk_rows_for


def register(subparsers: Any) -> None:
    parser = harness.add_bench(subparsers, "write", "writer (float16 and float32 input) vs numpy tofile, with os.sync")
    parser.add_argument("--shapes", default="256x384,1024x3072", help="sample shapes (default 256x384,1024x3072)")
    parser.add_argument("--mb", type=float, default=384.0,
                        help="stored float16 MB per shape and method (default 384; at least --min-batches batches)")
    parser.add_argument("--min-batches", type=int, default=5,
                        help="at least this many batches per shape, so the writer's pipeline runs (default 5: "
                             "320 samples of [1024, 3072], 2 GB: the seed workload's shape)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunk-mb", type=float, default=8.0, help="writer chunk size in MiB (default 8)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved repeats, each in another order of the three methods (6 covers every "
                             "order once); the median is kept")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")


def _bench_shape(work: str, shape: tuple[int, ...], args: argparse.Namespace) -> dict[str, Any]:
    sample_bytes = int(np.prod(shape)) * 2
    n = max(args.min_batches * args.batch_size, int(args.mb * 1e6) // sample_bytes)
    nbytes = n * sample_bytes
    source32 = np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32)
    source16 = source32.astype(np.float16)
    written: list[str] = []

    def method(name: str) -> Method:
        def run() -> float:
            path = os.path.join(work, f"{name}-{len(written)}")
            written.append(path)
            if name == "tofile":
                return harness.tofile_synced(path, source16)
            return harness.write_synced(path, source16 if name == "float16" else source32, args.batch_size,
                                        chunk_rows=chunk_rows_for(shape, "float16", args.chunk_mb, args.batch_size))
        # Untimed: the written (clean) pages leave the page cache, so the next method does not pay
        # for reclaiming them (the last of a round measured up to 3.5x slower).
        return Method(name, run, teardown=lambda: harness.evict(written[-1]), own=True)

    def order(repeat: int, methods: list[Method]) -> tuple[Method, ...]:
        # Deleted between rounds, not between methods: a method that followed a 2 GB delete
        # measured up to 2.4x slower (the file system reclaiming the freed blocks), whichever it was.
        _remove(written)
        # Every order of the three in turn, not rotations of one: a rotation keeps who follows whom,
        # and the method right after tofile's 2 GB measured 1.4-1.6x slower, whichever it was.
        return list(itertools.permutations(methods))[repeat % 6]

    times = interleaved([method(name) for name in ("tofile", "float16", "float32")], args.repeats,
                        warmup=args.warmup, order=order)
    _remove(written)
    median = {m: statistics.median(t) for m, t in times.items()}
    out = {
        "sample_shape": list(shape), "num_samples": n, "bytes": nbytes,
        "tofile_gb_per_s": gbps(nbytes, median["tofile"]),
        "repeats_s": dict(times),
    }
    for source in ("float16", "float32"):
        out[f"writer_{source}_gb_per_s"] = gbps(nbytes, median[source])
        out[f"writer_{source}_ratio"] = median["tofile"] / median[source]
    return out


def _remove(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
    paths.clear()
    os.sync()  # the deletes' writeback stays out of the next round


def run(args: argparse.Namespace) -> dict[str, Any]:
    with harness.scratch(args, "write") as work:
        shapes = [_bench_shape(work, shape, args) for shape in parse_shapes(args.shapes)]
    from featurestore.core import fused_stats

    return {"benchmark": "write", "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
            "fused_stats": fused_stats.available(), "stats_threads": fused_stats.threads(),
            "page_cache": "source in RAM; every file new, evicted after its timing; both sides timed to os.sync()",
            "shapes": shapes}


__all__ = ["register", "run"]
