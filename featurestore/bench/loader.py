"""``featurestore bench loader``: FeatureLoader against the bare reader, its stall, its memory bound,
and an epoch under a memory cgroup (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import time
from typing import Any

import numpy as np

from featurestore.bench import harness
from featurestore.bench.harness import Method, gbps, interleaved
from featurestore.core import checked
from featurestore.demo.synthetic_splits import write_split
from featurestore.testing import memory
from featurestore.testing.cgroup import CgroupUnavailable, MemoryCgroup, evict

DATASET, ENCODER = "bench", "loader"


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "loader", "FeatureLoader vs bare reader: throughput, stall, RSS N vs 4N, epoch under "
                      "a memory cgroup", {
        "--shape": ("256x384", "sample shape TxD"),
        "--dtype": ("float16", None, {"choices": ("float16", "bfloat16", "float32")}),
        "--num-samples": (1024, "N (the RSS run also uses 4N)"), "--batch-size": (64, None), "--prefetch": (2, None),
        "--cgroup-limit-mib": (512, "memory limit of the cgroup run"),
        "--skip-rss": (False, "skip the N vs 4N subprocesses"), "--skip-cgroup": (False, "skip the memory cgroup run")},
        repeats=7, keep="best")


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = harness.parse_shapes(args.shape)[0]
    n = int(args.num_samples)
    results: dict[str, Any] = {"benchmark": "loader", "sample_shape": list(shape), "dtype": args.dtype,
                               "batch_size": args.batch_size, "prefetch": args.prefetch, "num_samples": n}
    with harness.scratch(args, "loader") as work:
        store = os.path.join(work, "store")
        for split, rows in (("n", n), ("n4", 4 * n)):
            write_split(store, rows, shape, dtype=args.dtype, names=(DATASET, ENCODER, split))
        results["throughput"] = _throughput(store, args)
        # Over 4N: more batches per epoch, so the unavoidable wait for the first one weighs less.
        results["stall"] = _stall(store, "n4", args)
        if not args.skip_rss:
            results["rss"] = _rss(store, shape, args)
        results["cgroup"] = _cgroup_epoch(store, shape, args) if not args.skip_cgroup else {"skipped": "--skip-cgroup"}
    return results


def _split_dir(store: str, split: str) -> str:
    return os.path.join(store, DATASET, ENCODER, split)


def _throughput(store: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from client import FeatureDataset, FeatureLoader

    ds = FeatureDataset(store, DATASET, ENCODER, "n4")
    batches = list(FeatureLoader(ds, batch_size=args.batch_size, device="cpu", order="shuffle", seed=1).plan())
    nbytes = sum(len(b) for b in batches) * ds.sample_nbytes
    harness.warm(_split_dir(store, "n4"))
    # One loader per dtype, reused across epochs as a training loop does: its recycled buffers
    # and threads are set up by the warm-up epoch, like the reader's maps are by its first pass.
    loaders = {dtype: FeatureLoader(ds, batch_sampler=batches, device="cpu", dtype=dtype, prefetch=args.prefetch)
               for dtype in (None, torch.float32)}
    methods = {"reader": lambda: harness.drain(ds.array.read(index) for index in batches),
               "loader": functools.partial(harness.drain, loaders[None]),
               "reader_f32": lambda: harness.drain(ds.array.read(index).to(torch.float32) for index in batches),
               "loader_f32": functools.partial(harness.drain, loaders[torch.float32])}
    # Interleaved, so drift hits all four alike; the warm-up sets up the loaders' buffers and threads.
    times = interleaved([Method(name, fn) for name, fn in methods.items()], max(1, args.repeats), warmup=1)
    best = times.bests()
    return {"batches": len(batches), "bytes": nbytes, "reader_s_per_batch": best["reader"] / len(batches),
            **{f"{key.replace('_f32', '_float32')}_gbps": gbps(nbytes, seconds) for key, seconds in best.items()},
            "loader_vs_reader": best["reader"] / best["loader"],
            "loader_vs_reader_float32": best["reader_f32"] / best["loader_f32"], "times_s": dict(times)}


def _stall(store: str, split: str, args: argparse.Namespace) -> dict[str, Any]:
    from client import FeatureDataset, FeatureLoader

    ds = FeatureDataset(store, DATASET, ENCODER, split)
    harness.warm(_split_dir(store, split))
    loader = FeatureLoader(ds, batch_size=args.batch_size, device="cpu", dtype=None, order="shuffle", seed=2,
                           prefetch=args.prefetch)
    harness.drain(loader)  # warm-up epoch (page tables of the maps, recycled buffers)
    runs = []
    for repeat in range(max(1, args.repeats)):  # one epoch's stall is one noisy number: the median of several
        # The consumer's step: the mean time of one bare read of this epoch's batches, measured just
        # before, so that reads and steps run at the same rate (the hardest case for a prefetcher).
        batches = list(loader.plan(epoch=100 + repeat))
        step_s = harness.timed(lambda: harness.drain(ds.array.read(index) for index in batches)) / len(batches)
        loader.set_epoch(1 + repeat)
        epoch = harness.timed(lambda: harness.drain(time.sleep(step_s) for _ in loader))  # a "GPU step" per batch
        # The first batch is always waited for (nothing to overlap it with); it is counted.
        runs.append((float(loader.stats["stall_s"]) / epoch, step_s, epoch))
    fraction, step_s, epoch = sorted(runs)[len(runs) // 2]
    return {"split_samples": ds.num_samples, "consumer_step_s": step_s, "epoch_s": epoch, "stall_s": fraction * epoch,
            "stall_fraction": fraction, "stall_fractions": [r[0] for r in runs],
            "batches": int(loader.stats["batches"])}


def _rss(store: str, shape: tuple[int, ...], args: argparse.Namespace) -> dict[str, Any]:
    out = harness.rss_runs("loader:epoch", {"N": _spec(store, "n", args), "4N": _spec(store, "n4", args)},
                           runs=min(3, args.repeats))
    elements = int(np.prod(shape))
    stored_itemsize = 4 if args.dtype == "float32" else 2
    # docs/LOADER.md: (prefetch + 3) float32 batches handed out or idle in the pool, plus one
    # staging batch per prefetch thread at the stored width for the CPU upcast, plus the buffers
    # in which each thread checks chunks whole on their first read (checked reads: CHECK_BYTES at
    # a time; idle ones go once every chunk is checked), plus a constant (thread stacks, intra-op
    # thread arenas).
    threads = int(out["N"]["num_threads"])
    bound = (args.prefetch + 3) * args.batch_size * elements * 4 + threads * (
        args.batch_size * elements * stored_itemsize + checked.CHECK_BYTES)
    # "Does not grow with N": both runs stay under the same N-independent bound (figure rss_vs_bound).
    return {**out, "growth_bytes": out["4N"]["peak_anon"] - out["N"]["peak_anon"], "bound_bytes": bound,
            "limit_bytes": bound + (32 << 20), "rss_growth_bytes": out["4N"]["peak_rss"] - out["N"]["peak_rss"]}


def _spec(store: str, split: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"store": store, "split": split, "batch_size": args.batch_size, "prefetch": args.prefetch}


def epoch(spec: dict[str, Any]) -> dict[str, Any]:
    """(A child.) One epoch to a CPU consumer in float32, anonymous RSS sampled every 5 ms."""
    import torch

    from client import FeatureDataset, FeatureLoader

    ds = FeatureDataset(spec["store"], DATASET, ENCODER, spec["split"])
    loader = FeatureLoader(ds, batch_size=spec["batch_size"], device="cpu", dtype=torch.float32,
                           prefetch=spec["prefetch"])
    rss = memory.rss_epoch(float(features[:, 0, 0].sum()) for features, _ in loader)  # touched, as a consumer would
    return {"num_samples": ds.num_samples, "store_bytes": ds.num_samples * ds.sample_nbytes,
            "num_threads": loader.num_threads, **rss}


def ram_tensor(spec: dict[str, Any]) -> dict[str, Any]:
    """(A child.) The baseline the loader replaces: the whole split as one float32 tensor in RAM."""
    import torch

    from client import FeatureDataset

    ds = FeatureDataset(spec["store"], DATASET, ENCODER, spec["split"])
    ram = torch.empty((ds.num_samples, *ds.sample_shape), dtype=torch.float32)
    for start in range(0, ds.num_samples, 256):
        stop = min(ds.num_samples, start + 256)
        ram[start:stop] = ds.array.read(np.arange(start, stop)).to(torch.float32)
    return {"loaded_bytes": ram.numel() * 4}


def _cgroup_epoch(store: str, shape: tuple[int, ...], args: argparse.Namespace) -> dict[str, Any]:
    limit = args.cgroup_limit_mib << 20
    sample_bytes = int(np.prod(shape)) * (4 if args.dtype == "float32" else 2)
    rows = -(-int(2.2 * limit) // sample_bytes)  # >= 2x the limit, with margin
    write_split(store, rows, shape, dtype=args.dtype, names=(DATASET, ENCODER, "big"))
    out: dict[str, Any] = {"limit_bytes": limit, "store_bytes": rows * sample_bytes, "num_samples": rows}
    try:
        with MemoryCgroup(limit) as group:
            evict(_split_dir(store, "big"))  # the child must fault every page in, under the limit
            start = time.perf_counter()
            loader = harness.child_process("loader:epoch", _spec(store, "big", args), cgroup=group)
            out["loader_s"] = time.perf_counter() - start
            out["loader_returncode"] = loader.returncode
            if loader.returncode == 0:
                out["loader_peak_anon"] = harness.child_result(loader)["peak_anon"]
            else:
                out["loader_stderr"] = loader.stderr[-2000:]
            ram = harness.child_process("loader:ram_tensor", _spec(store, "big", args), cgroup=group)
            out["ram_returncode"] = ram.returncode
            out["ram_killed"] = ram.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
            out["oom_kills"] = group.oom_kills()
    except CgroupUnavailable as error:  # the notes print it
        return {"skipped": str(error)}
    out["ok"] = out["loader_returncode"] == 0 and out["ram_killed"]
    return out
