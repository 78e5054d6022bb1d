"""Process RSS (VmRSS: anonymous + mapped file pages, what `top`, SLURM and Kubernetes count) and
speed of one loader epoch, over a split and a 4x larger split of the same bags, each epoch in a
fresh child process; optionally for several source trees side by side (before vs after a change),
interleaved.

    PYTHONPATH=$PWD python scripts/rss_epoch.py --workdir /tmp/fs-rss \
        --tree after=$PWD --tree before=/tmp/fs-before --repeats 3

Per child: ``warm`` reads the split's files into the page cache, runs one untimed epoch, then
times a second one (what epoch 2+ of a training run sees); ``cold`` evicts the files
(``posix_fadvise(DONTNEED)``) and times the process's first epoch. The peak is ``VmHWM`` after
``clear_refs`` reset it at the baseline (taken after the loader is built), so nothing between two
samples is missed. ``--kind dense`` runs ``FeatureLoader`` (shuffled 64-row batches) over dense
splits of the same bytes instead of ``BagLoader`` (batch 1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

DATASET, ENCODER = "bench", "bags"


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _cpu() -> float:
    """CPU seconds of the whole process (all threads): on a loaded machine a steadier figure of a
    warm epoch's work than its wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _files(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def _evict(path: str) -> None:
    for name in _files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(path: str) -> None:
    buffer = bytearray(8 << 20)
    for name in _files(path):
        with open(name, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def child(config: dict[str, Any]) -> dict[str, Any]:
    import torch

    split_dir = os.path.join(config["store"], DATASET, ENCODER, config["split"])
    if config["kind"] == "bags":  # else dense[-TxD]
        from client import BagDataset, BagLoader

        ds: Any = BagDataset(config["store"], DATASET, ENCODER, config["split"])
        loader: Any = BagLoader(ds, batch_size=1, device="cpu", dtype=torch.float32, prefetch=2)
        nbytes = int(ds.lengths.sum()) * ds.row_nbytes
    else:
        from client import FeatureDataset, FeatureLoader

        ds = FeatureDataset(config["store"], DATASET, ENCODER, config["split"])
        loader = FeatureLoader(ds, batch_size=64, device="cpu", dtype=torch.float32, prefetch=2)
        nbytes = len(ds) * ds.sample_nbytes

    def epoch() -> tuple[float, float]:
        start, cpu = time.perf_counter(), _cpu()
        for batch in loader:
            float(batch[0].reshape(-1)[0])  # touch the batch, as a consumer would
        return time.perf_counter() - start, _cpu() - cpu

    if config["mode"] == "cold":
        _evict(split_dir)
    else:
        _warm(split_dir)
    base = _status()
    exact = _reset_peak()
    if config["mode"] == "warm":
        epoch()
        loader.set_epoch(1)
    seconds, cpu = epoch()
    end = _status()
    return {"bytes": nbytes, "seconds": seconds, "cpu_s": cpu, "gbps": nbytes / seconds / 1e9,
            "base_rss": base["VmRSS"], "peak_rss": end["VmHWM"] if exact else max(base["VmHWM"], end["VmHWM"]),
            "end_rss": end["VmRSS"], "end_file": end["RssFile"], "end_anon": end["RssAnon"], "exact_peak": exact}


def make(store: str, kind: str, bags: int, patches: int, dim: int) -> dict[str, int]:
    import numpy as np

    from featurestore.demo.synthetic_bags import bag_lengths, write_io_cohort

    lengths = bag_lengths(patches, count=bags)
    sizes = {}
    if kind != "bags" and not kind.startswith("dense"):
        sys.exit(f"--kind {kind!r}: use bags, dense or dense-TxD")
    for split, tile in (("s", 1), ("s4", 4)):
        rows = int(lengths.sum()) * tile
        sizes[split] = rows * dim * 2
        if os.path.exists(os.path.join(store, DATASET, ENCODER, f"{kind}-{split}", "zarr.json")):
            continue
        if kind == "bags":
            write_io_cohort(store, (DATASET, ENCODER, f"{kind}-{split}"), np.tile(lengths, tile), dim, "float16")
        else:
            from featurestore.demo.synthetic_splits import write_split

            shape = tuple(int(v) for v in kind.split("-")[1].split("x")) if "-" in kind else (dim,)
            rows = rows * dim * 2 // (int(np.prod(shape)) * 2)
            write_split(store, rows, shape, names=(DATASET, ENCODER, f"{kind}-{split}"), rows=max(1, (8 << 20) // (
                int(np.prod(shape)) * 2)))
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/fs-rss")
    parser.add_argument("--kind", default="bags", help="bags, dense (rows of --dim) or dense-TxD (rows of that "
                        "shape, e.g. dense-256x384)")
    parser.add_argument("--bags", type=int, default=48)
    parser.add_argument("--patches", type=int, default=2500)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree (repeatable); "
                        "default: this process's PYTHONPATH as 'this'")
    parser.add_argument("--modes", default="warm,cold")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the children (repeatable)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    store = os.path.join(args.workdir, "store")
    sizes = make(store, args.kind, args.bags, args.patches, args.dim)
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": os.environ.get("PYTHONPATH", os.getcwd())}
    extra = dict(e.split("=", 1) for e in args.env)
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            for split in ("s", "s4"):
                for name, tree in trees.items():
                    config = {"store": store, "split": f"{args.kind}-{split}", "kind": args.kind, "mode": mode}
                    env = {**os.environ, **extra, "PYTHONPATH": os.path.abspath(tree)}
                    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(config)],
                                          capture_output=True, text=True, env=env, cwd=os.path.abspath(tree), check=False)
                    if done.returncode != 0:
                        sys.exit(f"child {name} {mode} {split} failed: {done.stderr[-3000:]}")
                    results.setdefault((name, mode, split), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    mib = 2**20
    print(f"{args.kind}: split s {sizes['s'] / 1e6:.0f} MB, s4 {sizes['s4'] / 1e6:.0f} MB; {args.repeats} interleaved "
          "repeats, each epoch a fresh child; growth = VmHWM - VmRSS before the epoch(s)")
    print(f"{'tree':<8} {'mode':<5} {'split':<5} {'growth MiB (max)':>17} {'end RssFile MiB':>16} "
          f"{'GB/s median [min-max]':>24}")
    table = []
    for (name, mode, split), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        growth = max(r["peak_rss"] - r["base_rss"] for r in rows) / mib
        speeds = [r["gbps"] for r in rows]
        table.append({"tree": name, "mode": mode, "split": split, "growth_mib": growth, "runs": rows})
        print(f"{name:<8} {mode:<5} {split:<5} {growth:>17.0f} {max(r['end_file'] for r in rows) / mib:>16.0f} "
              f"{statistics.median(speeds):>10.2f} [{min(speeds):.2f}-{max(speeds):.2f}]")
    if len(trees) == 2:
        (a, _), (b, _) = list(trees.items())
        for mode in args.modes.split(","):
            for split in ("s", "s4"):
                for what in ("seconds", "cpu_s"):
                    ratios = sorted(y[what] / x[what] for x, y in zip(results[(a, mode, split)], results[(b, mode, split)]))
                    print(f"speed {a} / {b} by {'wall' if what == 'seconds' else 'CPU'} time, {mode} {split}: median "
                          f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}] (paired by repeat)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
