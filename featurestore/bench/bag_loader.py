"""``featurestore bench bag-loader``: BagLoader against the bare bag reader and CLAM's pattern, warm
and cold, padded batches, RSS over B and 4B bags; int8 beside float16. Method: docs/BENCHMARKS.md,
"What each bench measures"."""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from featurestore.bench import harness
from featurestore.bench.harness import Method, interleaved
from featurestore.demo.synthetic_bags import bag_lengths, write_io_cohort
from featurestore.errors import InvalidOption
from featurestore.testing import memory
from featurestore.testing.cgroup import evict, unmap

DATASET, ENCODER = "bench", "bags"


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "bag-loader", "BagLoader vs the bare bag reader and CLAM's torch.load per slide: "
                      "epoch warm and cold, padded batches, RSS over B vs 4B bags", {
        "--bags": (48, "B, bags in the cohort (the RSS run also uses 4B)"),
        "--patches": (2500, "median patches per bag (log-normal, sigma 0.6)"), "--dim": (1024, None),
        "--dtype": ("float16,int8", "float16, or float16,int8: int8 measured beside float16 (docs/BENCHMARKS.md)"),
        "--workers": (4, "CLAM DataLoader workers (CLAM's default: 4)", {"type": harness.number(int, inclusive=True)}),
        "--batch-size": (8, "padded run's batch size"),
        "--max-patches": (4096, "padded run's max_patches"), "--skip-cold": (False, "warm figures only"),
        "--skip-rss": (False, "skip the B vs 4B subprocesses")}, repeats=5, keep="best")


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtypes = harness.parse_dtypes(args.dtype)
    if not set(dtypes) <= {"float16", "int8"}:
        raise InvalidOption(f"--dtype {args.dtype!r}: the cohort is float16, int8 measured beside it; give "
                            "--dtype float16,int8 or float16")
    lengths = bag_lengths(args.patches, count=args.bags)
    with harness.scratch(args, "bag-loader") as work:
        stores = {d: os.path.join(work, d, "store") for d in dtypes}
        pt_dir = os.path.join(work, "pt_files")
        write_io_cohort(stores["float16"], (DATASET, ENCODER, "b"), lengths, args.dim, "float16",
                        each=clam_files(pt_dir))
        result = {"benchmark": "bag-loader", "bags": args.bags, "dim": args.dim, "dtype": "float16",
                  "workers": args.workers, "patches": int(lengths.sum()),
                  **epoch_figures(_spec(stores["float16"], pt_dir=pt_dir, workers=args.workers), args)}
        if not args.skip_rss:
            write_io_cohort(stores["float16"], (DATASET, ENCODER, "b4"), np.tile(lengths, 4), args.dim, "float16")
            result["rss"] = rss_figures(stores["float16"], ("b", "b4"), prefetch=2, runs=min(3, args.repeats))
        if "int8" in dtypes:
            write_io_cohort(stores["int8"], (DATASET, ENCODER, "b"), lengths, args.dim, "int8")
            result["int8"] = int8_figures(stores, args)
    return result


def _spec(store: str, split: str = "b", **more: Any) -> dict[str, Any]:
    """What :func:`_runs` (here, or in a cold child) needs: the bag split, CLAM's files, the seed."""
    return {"store": store, "split": split, "pt_dir": None, "workers": 0, "seed": 0, **more}


def int8_figures(stores: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """The same cohort stored float16 and int8 (``stores``): one BagLoader epoch (batch 1, float32
    out, the same order) of each, interleaved repeat by repeat, warm and cold (each cold epoch an
    evicted fresh process): bags/s, int8 / float16 per repeat and its median; bytes on storage."""
    sizes = {d: harness.feature_bytes(os.path.join(store, DATASET, ENCODER, "b")) for d, store in stores.items()}
    specs = {d: _spec(store, method="loader_f32") for d, store in stores.items()}
    epochs = {d: _runs(spec)[0]["loader_f32"] for d, spec in specs.items()}  # the same loader as the float16 figures'
    modes = dict(_warm_and_cold(epochs, specs, args, *map(_split_dir, specs.values())))
    return harness.int8_figures(sizes, "float16", modes, args.bags, "bags")


def clam_files(pt_dir: str) -> Any:
    """For :func:`~featurestore.demo.synthetic_bags.write_io_cohort`'s ``each``: CLAM's
    ``pt_files/<slide>.pt``, float32 features only."""
    import torch

    os.makedirs(pt_dir, exist_ok=True)
    return lambda bag_id, features, _coords: torch.save(torch.from_numpy(features.astype(np.float32)),
                                                        os.path.join(pt_dir, f"{bag_id}.pt"))


class ClamDataset:
    """CLAM's ``Generic_MIL_Dataset.__getitem__`` for ``pt_files``: ``torch.load`` one slide."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        return torch.load(self.paths[i], weights_only=True), 0


def _collate_mil(batch: list[tuple[Any, int]]) -> tuple[Any, Any]:
    import torch  # CLAM's collate_MIL: features concatenated, labels as a LongTensor

    return torch.cat([item[0] for item in batch], dim=0), torch.LongTensor([item[1] for item in batch])


# ---------------------------------------------------------------------- 1-2. epochs
def epoch_figures(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``{"warm", "cold", "padded"}`` epoch figures of BagLoader, the bare reader and (with
    ``pt_dir`` of ``<bag id>.pt`` files) CLAM's loop on one bag split: best seconds, GB/s of the
    stored bytes, and the ratios the targets name."""
    from client import BagDataset

    ds = BagDataset(spec["store"], DATASET, ENCODER, spec["split"])
    runs, paths = _runs(spec)
    nbytes = int(ds.lengths.sum()) * ds.row_nbytes
    out: dict[str, Any] = {"epoch_bytes": nbytes, "bags": len(ds)}
    specs = {name: {**spec, "method": name} for name in runs}
    for mode, times in _warm_and_cold(runs, specs, args, _split_dir(spec), *paths):
        best = times.bests()
        out[mode] = {**{f"{name}_s": s for name, s in best.items()},
                     **{f"{name}_gbps": nbytes / s / 1e9 for name, s in best.items()},
                     "loader_vs_reader": best["reader"] / best["loader"],
                     # Medians too: the loader's threads spread its epochs wider than the reader's on a shared host.
                     "loader_vs_reader_median": times.median("reader") / times.median("loader"),
                     "times_s": dict(times),
                     **({"loader_vs_clam": best["clam"] / best["loader_f32"]} if "clam" in best else {})}
    out["padded"] = _padded(ds, args, seed=spec["seed"], threads=min(args.workers, 2))
    return out


def _warm_and_cold(runs: dict[str, Any], specs: dict[str, dict[str, Any]], args: argparse.Namespace,
                   *paths: str) -> Iterator[tuple[str, harness.Times]]:
    """``("warm", times)``: ``runs`` interleaved here, ``paths`` read first, after an untimed round
    (maps, buffers, worker imports); then unless ``--skip-cold``, ``("cold", times)``: each epoch
    :func:`cold_epoch` of ``specs[name]`` in a fresh process that evicts first (this one's maps
    would keep the pages resident)."""
    harness.warm(*paths)
    yield "warm", interleaved([Method(name, fn) for name, fn in runs.items()], args.repeats, warmup=1)
    if not args.skip_cold:
        unmap()
        child = functools.partial(harness.child, "bag_loader:cold_epoch")
        yield "cold", interleaved([Method(name, functools.partial(child, spec), own=True)
                                   for name, spec in specs.items()], args.repeats)


def _split_dir(spec: dict[str, Any]) -> str:
    return os.path.join(spec["store"], DATASET, ENCODER, spec["split"])


def _runs(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The epochs compared, as callables, and CLAM's ``.pt`` paths."""
    import warnings

    import torch

    from client import BagDataset, BagLoader

    ds = BagDataset(spec["store"], DATASET, ENCODER, spec["split"])
    seed = spec["seed"]
    order = [int(b[0]) for b in BagLoader(ds, batch_size=1, seed=seed, device="cpu").plan()]
    runs: dict[str, Any] = {"reader": lambda: harness.drain(ds.bags.read_numpy(i) for i in order)}
    # The loader as a user builds it: its default read-ahead threads (docs/LOADER.md: more than the
    # cores only add hand-over latency on page-cached data).
    for name, dtype in (("loader", None), ("loader_f32", torch.float32)):
        runs[name] = functools.partial(harness.drain, BagLoader(ds, batch_size=1, seed=seed, device="cpu", dtype=dtype))
    paths: list[str] = []
    if spec["pt_dir"]:
        paths = [os.path.join(spec["pt_dir"], f"{bag_id}.pt") for bag_id in ds.ids]
        clam_ds = ClamDataset([paths[i] for i in order])

        def clam() -> None:
            with warnings.catch_warnings():  # "more workers than cores" on small hosts: CLAM's default
                warnings.simplefilter("ignore")
                harness.drain(torch.utils.data.DataLoader(clam_ds, batch_size=1, num_workers=spec["workers"],
                                                          collate_fn=_collate_mil))
        runs["clam"] = clam
    return runs, paths


def cold_epoch(spec: dict[str, Any]) -> float:
    """(A child.) Seconds of one epoch of ``spec["method"]``, the split and CLAM's files evicted first."""
    runs, paths = _runs(spec)
    evict(_split_dir(spec), *paths)
    return harness.timed(runs[spec["method"]])


def _padded(ds: Any, args: argparse.Namespace, *, seed: int, threads: int) -> dict[str, Any]:
    from client import BagLoader

    max_patches = args.max_patches
    loader = BagLoader(ds, batch_size=args.batch_size, max_patches=max_patches, seed=seed, device="cpu", dtype=None,
                       bucket=True, prefetch=threads, num_threads=threads)
    plan = loader.plan()

    def reader() -> None:  # the same subsets, read and padded by hand
        for batch in plan:
            picked = [ds.bags.read_numpy(int(i), rows=ds.rows(int(i), max_patches=max_patches, seed=seed, epoch=0))[0]
                      for i in batch]
            out = np.zeros((len(batch), max(len(p) for p in picked), ds.dim), ds.numpy_dtype)
            for b, rows in enumerate(picked):
                out[b, : len(rows)] = rows

    times = interleaved([Method("reader", reader), Method("loader", lambda: harness.drain(loader))], args.repeats,
                        warmup=1)
    rows = sum(min(int(ds.lengths[i]), max_patches) for batch in plan for i in batch)
    best = times.bests()
    return {"batch_size": args.batch_size, "max_patches": max_patches, "batches": len(plan), "rows": rows,
            "reader_s": best["reader"], "loader_s": best["loader"], "padded_vs_reader": best["reader"] / best["loader"],
            "loader_gbps": rows * ds.row_nbytes / best["loader"] / 1e9, "times_s": dict(times)}


# ---------------------------------------------------------------------- 3. RSS
def rss_figures(store: str, splits: tuple[str, str], prefetch: int = 2, runs: int = 3) -> dict[str, Any]:
    out = harness.rss_runs("bag_loader:rss_epoch", {label: {"store": store, "split": split, "prefetch": prefetch}
                                                    for label, split in zip(("B", "4B"), splits)}, runs)
    largest, stored, threads = (max(out["B"][key], out["4B"][key])
                                for key in ("largest_bag_f32_bytes", "largest_bag_stored_bytes", "num_threads"))
    # docs/LOADER.md, "Memory bound of BagLoader": (prefetch + 4) float32 batches, each rounded up
    # at most 25 %, + a staging piece per read-ahead thread and the consumer, + a constant.
    bound = int((prefetch + 4) * 1.25 * largest + (threads + 1) * min(64 << 20, 1.25 * stored)) + (32 << 20)
    return {**out, "growth_bytes": out["loader_bytes"]["4B"] - out["loader_bytes"]["B"],
            # What top shows (file pages of the maps included): the 4x larger split's peak over the other's.
            "rss_growth_bytes": out["4B"]["peak_rss"] - out["B"]["peak_rss"], "bound_bytes": bound}


def rss_epoch(config: dict[str, Any]) -> dict[str, Any]:
    """(A child.) One float32 epoch (batch 1) to a CPU consumer, anonymous RSS sampled."""
    import torch

    from client import BagDataset, BagLoader

    ds = BagDataset(config["store"], DATASET, ENCODER, config["split"])
    loader = BagLoader(ds, batch_size=1, device="cpu", dtype=torch.float32, prefetch=config["prefetch"])
    rss = memory.rss_epoch(float(batch[0][0, 0, 0]) for batch in loader)  # each batch touched, as a consumer would
    return {"bags": len(ds), "store_bytes": int(ds.lengths.sum()) * ds.row_nbytes, **rss,
            "num_threads": loader.num_threads, "largest_bag_f32_bytes": int(ds.lengths.max()) * ds.dim * 4,
            "largest_bag_stored_bytes": int(ds.lengths.max()) * ds.row_nbytes}
