"""``featurestore bench write``: the writer (float16 and float32 input) against numpy ``tofile`` of the
same bytes, both timed to ``os.sync()``, each timing in a fresh process: what a user's first write sees.

Method: docs/BENCHMARKS.md, "What each bench measures".
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
from typing import Any

import numpy as np

from featurestore.bench import harness
from featurestore.bench.harness import Method, gbps, interleaved, parse_shapes
from featurestore.bench.reading import label
from featurestore.extract.plan import chunk_rows_for
from featurestore.testing.cgroup import evict

METHODS = ("tofile", "float16", "float32", "float16 second")


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "write", "writer (float16 and float32 input) vs numpy tofile, with os.sync, each "
                      "timed in a fresh process", {
        "--shapes": ("256x384,1024x3072", "sample shapes TxD, comma separated"),
        "--mb": ("250,384", "stored float16 MB per shape and method, one size or several (at least --min-batches "
                            "batches; a size that --min-batches raises to another's is run once)"),
        "--min-batches": (5, "at least this many batches per shape, so the writer's pipeline runs (5: 320 samples of "
                             "[1024, 3072], 2 GB: the seed workload's shape)"),
        "--batch-size": (64, None), "--chunk-mb": (8.0, "writer chunk size in MiB"),
        "--repeats": (3, "interleaved repeats, each in another order of the four methods; the median is kept")})


def first_write(config: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process (:func:`harness.child`): make the source, then time one write of it (the
    second one with ``second``, after an untimed first, removed). Seconds to ``os.sync()``."""
    import featurestore  # noqa: F401 - imported before the clock, as a user's script has it

    shape, n, path = tuple(config["shape"]), config["n"], config["path"]
    draft = np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32)
    # Every child frees its float32 draft before the clock, so every method's buffers and page
    # cache come from memory just freed: a VM that hands idle memory back to its host makes the
    # first touch of other memory ~25x slower (scripts/fresh_memory.py).
    source = draft.copy() if config["source"] == "float32" else draft.astype(np.float16)
    del draft

    def write(where: str) -> float:
        if config["source"] == "tofile":
            return harness.tofile_synced(where, source)
        return harness.write_synced(where, source, config["batch_size"], chunk_rows=config["chunk_rows"])

    if config["second"]:
        write(path + "-first")
        evict(path + "-first")
        shutil.rmtree(path + "-first")
        os.sync()
    seconds = write(path)
    evict(path)
    return {"seconds": seconds, "pid": os.getpid()}


def _sizes(shape: tuple[int, ...], args: argparse.Namespace) -> list[tuple[int, str]]:
    """``(samples, figure label)`` per size of ``--mb`` for ``shape``: the largest is labelled by the
    shape alone (``256x384``), a smaller one by its MB too (``256x384 250MB``)."""
    sample_bytes = int(np.prod(shape)) * 2
    ns = sorted({max(args.min_batches * args.batch_size, int(mb * 1e6) // sample_bytes)
                 for mb in harness.parse_numbers("--mb", args.mb, float, "250,384")})
    return [(n, label(shape) if n == ns[-1] else f"{label(shape)} {n * sample_bytes / 1e6:.3g}MB") for n in ns]


def _bench_shape(work: str, shape: tuple[int, ...], n: int, tag: str, args: argparse.Namespace) -> dict[str, Any]:
    nbytes = n * int(np.prod(shape)) * 2
    chunk_rows = chunk_rows_for(shape, "float16", args.chunk_mb, args.batch_size)
    written: list[str] = []
    pids: list[int] = []  # the process of every timing: each a new one

    def method(name: str) -> Method:
        def run() -> float:
            path = os.path.join(work, f"{name.replace(' ', '-')}-{len(written)}")
            written.append(path)
            config = {"shape": list(shape), "n": n, "path": path, "source": name.split()[0],
                      "second": name.endswith("second"), "batch_size": args.batch_size, "chunk_rows": chunk_rows}
            got = harness.child("write:first_write", config)
            pids.append(got["pid"])
            return float(got["seconds"])
        # Untimed: the written (clean) pages leave the page cache, so the next method does not pay
        # for reclaiming them (the last of a round measured up to 3.5x slower).
        return Method(name, run, teardown=lambda: evict(written[-1]), own=True)

    orders = list(itertools.permutations(range(len(METHODS))))

    def order(repeat: int, methods: list[Method]) -> list[Method]:
        # Deleted between rounds, not between methods: a method that followed a 2 GB delete
        # measured up to 2.4x slower (the file system reclaiming the freed blocks), whichever it was.
        _remove(written)
        # Orders spread over the permutations, not rotations of one: a rotation keeps who follows
        # whom, and the method right after tofile's 2 GB measured 1.4-1.6x slower, whichever it was.
        return [methods[i] for i in orders[(repeat * 7) % len(orders)]]

    # No warm-up round: each timing is a new process, and its first write is the figure.
    times = interleaved([method(name) for name in METHODS], args.repeats, order=order)
    _remove(written)
    median = times.medians()
    return {"sample_shape": list(shape), "label": tag, "num_samples": n, "bytes": nbytes,
            "tofile_gb_per_s": gbps(nbytes, median["tofile"]), "repeats_s": dict(times),
            "processes": len(set(pids) - {os.getpid()}),
            **{f"writer_{source.replace(' ', '_')}_{what}": value for source in METHODS[1:] for what, value in (
                ("gb_per_s", gbps(nbytes, median[source])), ("ratio", median["tofile"] / median[source]))}}


def _remove(paths: list[str]) -> None:
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)
    paths.clear()
    os.sync()  # the deletes' writeback stays out of the next round


def run(args: argparse.Namespace) -> dict[str, Any]:
    with harness.scratch(args, "write") as work:
        shapes = [_bench_shape(work, shape, n, tag, args) for shape in parse_shapes(args.shapes)
                  for n, tag in _sizes(shape, args)]
    from featurestore.core import fused_stats

    return {"benchmark": "write", "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
            "fused_stats": fused_stats.available(), "stats_threads": fused_stats.threads(),
            "page_cache": "source in RAM; every file new, evicted after its timing; both sides timed to os.sync()",
            "process": "each timing a fresh process (featurestore imported, source made, then the clock): "
                       "the first write; 'float16 second' is a process's second write",
            "shapes": shapes}
