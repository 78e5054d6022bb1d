"""``featurestore bench bags``: reading whole slide bags, featurestore against the files MIL users keep
(TRIDENT h5, CLAM .pt, parallel pread), cold and warm, and ``featurestore import``.

Method: docs/BENCHMARKS.md, "What each bench measures".
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import featurestore
from featurestore.bench import bag_loader, harness
from featurestore.bench.harness import Method, interleaved
from featurestore.demo.synthetic_bags import bag_lengths, write_io_cohort
from featurestore.testing.cgroup import evict

METHODS = ("featurestore", "TRIDENT h5", "CLAM .pt", "parallel pread")
WHERE = {"featurestore": "store", "TRIDENT h5": "h5", "CLAM .pt": "pt", "parallel pread": "raw"}
NAMES = ("bench", "enc", "bags")


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "bags", "whole-bag reads: featurestore bag split vs TRIDENT h5, CLAM .pt, parallel "
                      "pread; import", {
        "--gib": (2.0, "float16 features of the cohort in GiB (the .pt copy is twice that)"),
        "--dim": (1536, "features per patch"), "--median": (5000, "median patches per slide (log-normal, sigma 0.8)"),
        "--min": (100, "fewest patches per slide", {"dest": "min_patches"}),
        "--max": (60000, "most patches per slide; one slide always has this many", {"dest": "max_patches"}),
        "--threads": (8, "threads of the parallel-pread reference")},
        repeats=1, description=__doc__)


def build(work: str, lengths: np.ndarray, dim: int) -> dict[str, Any]:
    """Write the four copies; returns their paths, the bag ids and the raw file's bag offsets."""
    import h5py

    paths = {"store": os.path.join(work, "store"), "h5": os.path.join(work, "h5"),
             "pt": os.path.join(work, "pt_files"), "raw": os.path.join(work, "raw.bin")}
    os.makedirs(paths["h5"])
    offsets, ids, clam = [0], [], bag_loader.clam_files(paths["pt"])
    with open(paths["raw"], "wb") as raw:
        def copies(bag_id: str, features: np.ndarray, coords: np.ndarray) -> None:
            ids.append(bag_id)
            offsets.append(offsets[-1] + features.nbytes + coords.nbytes)
            raw.write(features.tobytes() + coords.tobytes())
            with h5py.File(os.path.join(paths["h5"], f"{bag_id}.h5"), "w") as h5:
                # TRIDENT's save_h5: chunks of one row, maxshape (None, ...), no compression.
                h5.create_dataset("features", data=features, chunks=(1, dim), maxshape=(None, dim))
                dset = h5.create_dataset("coords", data=coords, chunks=(1, 2), maxshape=(None, 2))
                dset.attrs.update({"patch_size": 256, "patch_size_level0": 256, "level0_magnification": 20,
                                   "target_magnification": 20, "overlap": 0})
            clam(bag_id, features, coords)
        write_io_cohort(paths["store"], NAMES, lengths, dim, "float16", each=copies)
    return {"paths": paths, "ids": ids, "raw_offsets": offsets}


def one_pass(config: dict[str, Any]) -> dict[str, Any]:
    """(A child.) One method's pass over every bag in ``order``; warm: one untimed pass first. In a
    fresh process, since a reader that held maps of the files would make a "cold" pass warm."""
    import h5py
    import torch

    paths, ids, offsets, name = config["paths"], config["ids"], config["raw_offsets"], config["method"]
    pool, fd = ThreadPoolExecutor(config["threads"]), -1
    if name == "featurestore":
        bags = featurestore.open_store(paths["store"]).open_bags(*NAMES)

        def read(i: int) -> int:
            return sum(tensor.nbytes for tensor in bags.read(i))  # features and coords
    elif name == "TRIDENT h5":
        def read(i: int) -> int:
            with h5py.File(os.path.join(paths["h5"], f"{ids[i]}.h5"), "r") as f:
                return int(f["features"][:].nbytes + f["coords"][:].nbytes)
    elif name == "CLAM .pt":
        def read(i: int) -> int:
            return int(torch.load(os.path.join(paths["pt"], f"{ids[i]}.pt")).nbytes)
    else:
        fd, piece = os.open(paths["raw"], os.O_RDONLY), 1 << 20
        buffer = memoryview(bytearray(int(np.diff(offsets).max())))  # one reused buffer, as the reader's

        def read(i: int) -> int:
            start, size = offsets[i], offsets[i + 1] - offsets[i]
            return sum(pool.map(lambda lo: os.preadv(fd, [buffer[lo: min(size, lo + piece)]], start + lo),
                                range(0, size, piece)))
    try:
        for _ in range(2 if config["temperature"] == "warm" else 1):
            start = time.perf_counter()
            total = sum(read(int(i)) for i in config["order"])
        return {"seconds": time.perf_counter() - start, "bytes": total}
    finally:
        pool.shutdown()
        if fd >= 0:
            os.close(fd)


def time_import(built: dict[str, Any], work: str) -> float:
    """Seconds of ``featurestore import`` of the h5 directory (cold), to its return and ``os.sync``."""
    from featurestore.extract.importer import ImportOptions, import_cache

    target = os.path.join(work, "imported")
    shutil.rmtree(target, ignore_errors=True)
    evict(built["paths"]["h5"])
    os.sync()
    options = ImportOptions(source=built["paths"]["h5"], store=target, dataset=NAMES[0], encoder_name=NAMES[1],
                            split=NAMES[2], progress=False)
    seconds = harness.timed(lambda: (import_cache(options), os.sync()))
    shutil.rmtree(target, ignore_errors=True)
    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = bag_lengths(args.median, gib=args.gib, dim=args.dim, sigma=0.8, low=args.min_patches,
                          high=args.max_patches)
    print(f"\n[bags] {len(lengths)} slides, patches per slide median {int(np.median(lengths))}, max "
          f"{int(lengths.max())}, {int(lengths.sum())} patches x {args.dim} float16 "
          f"({lengths.sum() * args.dim * 2 / 2**30:.2f} GiB; scaled down from a TCGA cohort's ~11k slides)")
    with harness.scratch(args, "bags") as work:
        built = build(os.path.join(work, "cohort"), lengths, args.dim)
        results = measure(built, lengths, args)
        results["sizes"] = {k: harness.size(v) for k, v in built["paths"].items()}
        times = [time_import(built, work) for _ in range(max(1, args.repeats))]
        results["import_seconds"], results["all_import_seconds"] = float(np.median(times)), times
        # The target's base: the h5 files read whole with h5py (the TRIDENT h5 cold pass).
        results["ratios"]["import vs h5 read"] = results["seconds"]["TRIDENT h5 cold"] / results["import_seconds"]
        return results


def measure(built: dict[str, Any], lengths: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """Every method cold and warm, each pass in a fresh child process, repeats interleaved."""
    paths = built["paths"]
    config = {**built, "order": np.random.default_rng(2).permutation(len(lengths)).tolist(), "threads": args.threads}
    nbytes: dict[str, int] = {}

    def method(name: str, temperature: str) -> Method:
        def run() -> float:
            result = harness.child("bag_reads:one_pass", {**config, "method": name, "temperature": temperature})
            nbytes[name] = result["bytes"]
            return float(result["seconds"])

        def setup() -> None:  # only this method's files may be cached
            evict(*paths.values())
            if temperature == "warm":
                harness.warm(paths[WHERE[name]])
        return Method(f"{name} {temperature}", run, setup, own=True)

    def order(repeat: int, methods: list[Method]) -> list[Method]:
        # featurestore and the pread reference back to back, in turn first (the disk's state, and
        # on a VM the host's cache, drift during a run), then the two file-per-slide formats.
        pair = ["featurestore", "parallel pread"][:: 1 if repeat % 2 == 0 else -1]
        by_name = {m.name: m for m in methods}
        return [by_name[f"{n} {t}"] for t in ("cold", "warm") for n in [*pair, "TRIDENT h5", "CLAM .pt"]]

    times = interleaved([method(n, t) for t in ("cold", "warm") for n in METHODS], args.repeats, order=order)
    evict(*paths.values())
    seconds = times.medians()
    rows = {key: {"seconds": s, "bags_per_s": len(lengths) / s, "all_seconds": times[key],
                  "gb_per_s": harness.gbps(nbytes[key.rsplit(" ", 1)[0]], s)} for key, s in seconds.items()}
    ratios = {f"{name} {t}": seconds[f"{name} {t}"] / seconds[f"featurestore {t}"]
              for name in METHODS[1:] for t in ("cold", "warm")}
    return {"benchmark": "bags", "slides": len(lengths), "dim": args.dim, "patches": int(lengths.sum()),
            "median_patches": int(np.median(lengths)), "max_patches": int(lengths.max()), "repeats": args.repeats,
            "bytes_read": nbytes, "seconds": seconds, "rows": rows, "ratios": ratios}
