"""``featurestore bench bag-loader``: BagLoader against the bare bag reader and CLAM's pattern.

On a synthetic cohort (a bag split with log-normal bag lengths, and the same slides as CLAM
writes them: one float32 ``pt_files/<id>.pt`` per slide), side by side in one run:

1. one epoch, batch 1, shuffled, to a CPU consumer, **warm** (page cache filled first) and **cold**
   (every file evicted with ``posix_fadvise(DONTNEED)`` before each timed epoch): BagLoader
   against the bare reader (``bags.read_numpy(i)`` in the same order) at the stored dtype, and
   BagLoader to float32 against CLAM's loop (``torch.load`` of the ``.pt`` per ``__getitem__`` in
   a ``torch.utils.data.DataLoader`` with ``--workers`` workers, batch 1, CLAM's default 4); the
   loader with its defaults (2 read-ahead threads). Targets: cold >= 0.9x the reader and >= 1.5x CLAM,
   warm >= 0.95x the reader. Best of ``--repeats`` interleaved epochs;
2. padded batches (``--batch-size`` 8, ``--max-patches`` 4096, warm): BagLoader against the bare
   reader reading the same seeded subsets and padding them into one array (target >= 0.9x);
3. peak anonymous RSS of a float32 epoch over B and over 4B bags (the same length mix repeated),
   each in a fresh subprocess: the loader's memory must not grow with the number of bags.

:func:`epoch_figures` measures 1-2 on any existing bag split (and ``.pt`` directory of
``<bag id>.pt`` files), so the ``bench bags`` verb can add these rows to its report without
building its own cohort; :func:`throughput_rows` turns either result into report panels.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from featurestore.bench.cgroup import evict
from featurestore.bench.common import drop_into, save_json

DATASET, ENCODER = "bench", "bags"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bag-loader", help="BagLoader vs the bare bag reader and CLAM's torch.load per slide: epoch warm and cold, "
        "padded batches, RSS over B vs 4B bags")
    parser.add_argument("--bags", type=int, default=48, help="B, bags in the cohort (the RSS run also uses 4B)")
    parser.add_argument("--patches", type=int, default=2500, help="median patches per bag (log-normal, sigma 0.6)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--workers", type=int, default=4, help="CLAM DataLoader workers (CLAM's default: 4)")
    parser.add_argument("--batch-size", type=int, default=8, help="padded run's batch size")
    parser.add_argument("--max-patches", type=int, default=4096, help="padded run's max_patches")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved epochs per figure; best kept")
    parser.add_argument("--skip-cold", action="store_true", help="warm figures only")
    parser.add_argument("--skip-rss", action="store_true", help="skip the B vs 4B subprocesses")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    parser.set_defaults(func=lambda args: _print_and_save(run(args), args.json_out))


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = args.workdir or tempfile.mkdtemp(prefix="fs-bench-bags-")
    os.makedirs(work, exist_ok=True)
    store, pt_dir = os.path.join(work, "store"), os.path.join(work, "pt_files")
    results: dict[str, Any] = {"benchmark": "bag-loader", "bags": args.bags, "dim": args.dim, "dtype": args.dtype,
                               "workers": args.workers}
    try:
        lengths = cohort_lengths(args.bags, args.patches)
        make_cohort(store, "b", lengths, args.dim, args.dtype, pt_dir=pt_dir)
        results["patches"] = int(lengths.sum())
        results.update(epoch_figures(store, DATASET, ENCODER, "b", pt_dir=pt_dir, workers=args.workers,
                                     repeats=args.repeats, cold=not args.skip_cold, batch_size=args.batch_size,
                                     max_patches=args.max_patches))
        if not args.skip_rss:
            make_cohort(store, "b4", np.tile(lengths, 4), args.dim, args.dtype)
            results["rss"] = rss_figures(store, ("b", "b4"), prefetch=2)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return results


# ---------------------------------------------------------------------- data
def cohort_lengths(bags: int, median: int, seed: int = 0) -> np.ndarray:
    """Patches per slide: log-normal around ``median`` (sigma 0.6: a long tail, as real cohorts)."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(median * np.exp(0.6 * rng.standard_normal(bags))), 16, 8 * median).astype(np.int64)


def make_cohort(store: str, split: str, lengths: np.ndarray, dim: int, dtype: str, *, pt_dir: str | None = None) -> None:
    """The bag split (and, with ``pt_dir``, CLAM's float32 ``.pt`` per slide) of random bags."""
    import torch

    import featurestore

    fs = featurestore.open_store(store, mode="a")
    writer = fs.create_bag_split(DATASET, ENCODER, split, dim=dim, dtype=dtype, overwrite=True, label_dtype="int64")
    rng = np.random.default_rng(1)
    # Content does not matter to I/O: one random block, shifted per bag, is cut to each length.
    block = rng.standard_normal((int(lengths.max()), dim), dtype=np.float32)
    if pt_dir:
        os.makedirs(pt_dir, exist_ok=True)
    for i, n in enumerate(lengths):
        features = block[: int(n)] + np.float32(i % 7)
        coords = np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.int64) * 256
        writer.add_bag(f"slide-{i:05d}", features, coords=coords, label=i % 2)
        if pt_dir:
            torch.save(torch.from_numpy(features), os.path.join(pt_dir, f"slide-{i:05d}.pt"))
    writer.commit()


class ClamDataset:
    """CLAM's ``Generic_MIL_Dataset.__getitem__`` for ``pt_files``: ``torch.load`` one slide."""

    def __init__(self, paths: list[str], labels: np.ndarray) -> None:
        self.paths, self.labels = paths, labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        return torch.load(self.paths[i], weights_only=True), int(self.labels[i])


def _collate_mil(batch: list[tuple[Any, int]]) -> tuple[Any, Any]:
    import torch  # CLAM's collate_MIL: features concatenated, labels as a LongTensor

    return torch.cat([item[0] for item in batch], dim=0), torch.LongTensor([item[1] for item in batch])


# ---------------------------------------------------------------------- 1-2. epochs
def epoch_figures(store: str, dataset: str, encoder: str, split: str, *, pt_dir: str | None = None,
                  workers: int = 4, repeats: int = 3, cold: bool = True, batch_size: int = 8,
                  max_patches: int = 4096, seed: int = 0) -> dict[str, Any]:
    """Epoch times of BagLoader, the bare reader and (with ``pt_dir``) CLAM's loop on one bag split.

    Returns ``{"warm": {...}, "cold": {...}, "padded": {...}}``: per run the best seconds, GB/s
    of stored bytes, and the ratios the targets name (``loader_vs_reader``, ``loader_vs_clam``,
    ``padded_vs_reader``). ``pt_dir`` holds ``<bag id>.pt`` per bag (float32 features). Warm runs
    share this process (page cache filled first); each cold run is a fresh subprocess that evicts
    the files first (a process that has mapped them keeps their pages resident)."""
    from client import BagDataset

    ds = BagDataset(store, dataset, encoder, split)
    spec = {"store": store, "dataset": dataset, "encoder": encoder, "split": split, "pt_dir": pt_dir,
            "workers": workers, "seed": seed}
    runs, order, paths = _runs(spec)
    nbytes = int(ds.lengths.sum()) * ds.row_nbytes
    split_dir = os.path.join(store, dataset, encoder, split)
    out: dict[str, Any] = {"epoch_bytes": nbytes, "bags": len(order)}
    for mode in ("warm", "cold") if cold else ("warm",):
        if mode == "cold":
            # This process's maps of the chunk files (its warm epochs made them) keep their pages
            # resident: the children's eviction would leave them, and main's mmap reads "cold"
            # at page-cache speed (2.9 GB/s where a truly cold pass gives ~1.1).
            from featurestore.core import chunk_maps

            chunk_maps.shared().clear()
        if mode == "warm":
            drop_into(split_dir)
            for path in paths:
                drop_into(path)
            for name in runs:  # warm-up: maps, buffers, worker imports
                runs[name]()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(max(1, repeats)):  # interleaved, so drift hits every run alike
            for name in runs:
                times[name].append(_timed(runs[name]) if mode == "warm" else _cold_child(spec, name))
        best = {name: min(values) for name, values in times.items()}
        figures: dict[str, Any] = {f"{name}_s": best[name] for name in runs}
        figures.update({f"{name}_gbps": nbytes / best[name] / 1e9 for name in runs})
        figures["loader_vs_reader"] = best["reader"] / best["loader"]
        # Medians too: on a shared host the loader's threads spread its epochs wider than the
        # single-threaded reader's, and the best of a few repeats hides that.
        figures["loader_vs_reader_median"] = float(np.median(times["reader"]) / np.median(times["loader"]))
        figures["times_s"] = times
        if "clam" in best:
            figures["loader_vs_clam"] = best["clam"] / best["loader_f32"]
        out[mode] = figures
    out["padded"] = _padded(ds, batch_size=batch_size, max_patches=max_patches, seed=seed, repeats=repeats,
                            threads=min(workers, 2))
    return out


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _runs(spec: dict[str, Any]) -> tuple[dict[str, Any], list[int], list[str]]:
    """The epochs compared, as callables, the shuffled bag order and CLAM's ``.pt`` paths."""
    import warnings

    import torch

    from client import BagDataset, BagLoader

    ds = BagDataset(spec["store"], spec["dataset"], spec["encoder"], spec["split"])
    bags, workers, seed = ds.bags, spec["workers"], spec["seed"]
    order = [int(b[0]) for b in BagLoader(ds, batch_size=1, seed=seed, device="cpu").plan()]
    # The loader as a user builds it (its default read-ahead: 2 threads, 2 batches); CLAM's loop
    # with its own default, `workers` DataLoader processes. More loader threads than cores only
    # add hand-over latency when the data is page-cached (measured on 2 cores: 4 threads 0.65x
    # the reader where 2 threads gave 0.95-1.2x).
    loader_stored = BagLoader(ds, batch_size=1, seed=seed, device="cpu", dtype=None)
    loader_f32 = BagLoader(ds, batch_size=1, seed=seed, device="cpu", dtype=torch.float32)

    def reader() -> None:
        for i in order:
            bags.read_numpy(i)

    def loader(instance: Any) -> Any:
        def epoch() -> None:
            for _ in instance:
                pass
        return epoch

    runs: dict[str, Any] = {"reader": reader, "loader": loader(loader_stored), "loader_f32": loader(loader_f32)}
    paths: list[str] = []
    if spec["pt_dir"]:
        paths = [os.path.join(spec["pt_dir"], f"{bag_id}.pt") for bag_id in ds.ids]
        clam_ds = ClamDataset([paths[i] for i in order], np.zeros(len(order), np.int64))

        def clam() -> None:
            with warnings.catch_warnings():  # "more workers than cores" on small hosts: CLAM's default
                warnings.simplefilter("ignore")
                for _ in torch.utils.data.DataLoader(clam_ds, batch_size=1, num_workers=workers, shuffle=False,
                                                     collate_fn=_collate_mil):
                    pass
        runs["clam"] = clam
    return runs, order, paths


def _cold_child(spec: dict[str, Any], name: str) -> float:
    proc = subprocess.run([sys.executable, "-m", "featurestore.bench.bag_loader", "_cold", json.dumps(spec), name],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"cold {name} child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])


def _cold_epoch(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """One epoch of ``name`` in a fresh process, the split (and CLAM's files) evicted first."""
    runs, _, paths = _runs(spec)
    evict(os.path.join(spec["store"], spec["dataset"], spec["encoder"], spec["split"]))
    for path in paths:
        evict(path)
    return {"seconds": _timed(runs[name])}


def _padded(ds: Any, *, batch_size: int, max_patches: int, seed: int, repeats: int, threads: int) -> dict[str, Any]:
    from client import BagLoader

    loader = BagLoader(ds, batch_size=batch_size, max_patches=max_patches, seed=seed, device="cpu", dtype=None,
                       bucket=True, prefetch=threads, num_threads=threads)
    plan = loader.plan()
    bags = ds.bags

    def reader() -> None:  # the same subsets, read and padded by hand
        for batch in plan:
            picked = [bags.read_numpy(int(i), rows=ds.rows(int(i), max_patches=max_patches, seed=seed, epoch=0))[0]
                      for i in batch]
            out = np.zeros((len(batch), max(len(p) for p in picked), ds.dim), ds.numpy_dtype)
            for b, rows in enumerate(picked):
                out[b, : len(rows)] = rows

    def epoch() -> None:
        for _ in loader:
            pass

    reader()
    epoch()
    times: dict[str, list[float]] = {"reader": [], "loader": []}
    for _ in range(max(1, repeats)):
        for name, fn in (("reader", reader), ("loader", epoch)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    rows = sum(min(int(ds.lengths[i]), max_patches) for batch in plan for i in batch)
    best = {k: min(v) for k, v in times.items()}
    return {"batch_size": batch_size, "max_patches": max_patches, "batches": len(plan), "rows": rows,
            "reader_s": best["reader"], "loader_s": best["loader"], "padded_vs_reader": best["reader"] / best["loader"],
            "loader_gbps": rows * ds.row_nbytes / best["loader"] / 1e9, "times_s": times}


# ---------------------------------------------------------------------- 3. RSS
def rss_figures(store: str, splits: tuple[str, str], prefetch: int = 2) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, split in zip(("B", "4B"), splits):
        proc = subprocess.run([sys.executable, "-m", "featurestore.bench.bag_loader", "_epoch", store, split,
                               str(prefetch)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"RSS child for {label} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    largest = max(out[k]["largest_bag_f32_bytes"] for k in ("B", "4B"))
    stored = max(out[k]["largest_bag_stored_bytes"] for k in ("B", "4B"))
    # docs/LOADER.md, "Memory bound of BagLoader": (prefetch + 4) float32 batches (handed out, or
    # idle in the pool), each rounded up at most 25 %, + a staging piece per read-ahead thread and
    # the consumer, plus a constant (thread stacks, allocator arenas).
    threads = min(2, prefetch)
    bound = int((prefetch + 4) * 1.25 * largest + (threads + 1) * min(64 << 20, 1.25 * stored)) + (32 << 20)
    out["loader_bytes"] = {k: out[k]["peak_anon"] - out[k]["baseline_anon"] for k in ("B", "4B")}
    out["growth_bytes"] = out["loader_bytes"]["4B"] - out["loader_bytes"]["B"]
    out["bound_bytes"] = bound
    out["ok"] = all(v <= bound for v in out["loader_bytes"].values())
    return out


def _child_epoch(store: str, split: str, prefetch: int) -> dict[str, Any]:
    """One float32 epoch (batch 1) to a CPU consumer, anonymous RSS sampled every 5 ms."""
    import torch

    from client import BagDataset, BagLoader
    from featurestore.bench.common import rss_anon_bytes

    ds = BagDataset(store, DATASET, ENCODER, split)
    loader = BagLoader(ds, batch_size=1, device="cpu", dtype=torch.float32, prefetch=prefetch)
    peak = [rss_anon_bytes()]
    baseline = peak[0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    for features, _mask, _coords, _labels in loader:
        float(features[0, 0, 0])  # touch the batch, as a consumer would
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    return {"bags": len(ds), "store_bytes": int(ds.lengths.sum()) * ds.row_nbytes, "epoch_s": seconds,
            "baseline_anon": baseline, "peak_anon": peak[0], "largest_bag_f32_bytes": int(ds.lengths.max()) * ds.dim * 4,
            "largest_bag_stored_bytes": int(ds.lengths.max()) * ds.row_nbytes}


# ---------------------------------------------------------------------- report rows
def throughput_rows(results: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Panels for ``bench all``'s report (the shape of ``featurestore.bench.summary``'s rows):
    per title, ``(method, GB/s of stored bytes)`` pairs, featurestore first. Takes the result of
    :func:`run` or the ``{"warm", "cold", "padded"}`` of :func:`epoch_figures`."""
    panels: dict[str, list[tuple[str, float]]] = {}
    for mode in ("warm", "cold"):
        f = results.get(mode)
        if f:
            rows = [("BagLoader", f["loader_gbps"]), ("bare reader", f["reader_gbps"]),
                    ("BagLoader -> f32", f["loader_f32_gbps"])]
            if "clam_gbps" in f:
                rows.append(("CLAM torch.load .pt", f["clam_gbps"]))
            panels[f"bag loader, batch 1, {mode}, GB/s"] = rows
    p = results.get("padded")
    if p:
        nbytes = p["loader_gbps"] * p["loader_s"]
        panels[f"bag loader, batch {p['batch_size']} padded, GB/s"] = [
            ("BagLoader", p["loader_gbps"]), ("reader + pad", nbytes / p["reader_s"])]
    return panels


# ---------------------------------------------------------------------- output
def _print_and_save(results: dict[str, Any], path: str | None) -> int:
    print_figures(results)
    save_json(results, path)
    return 0


def print_figures(results: dict[str, Any]) -> None:
    """The figures and their targets, one line each (``bench bag-loader``, and ``bench bags``'s
    loader rows)."""
    print(f"bag-loader bench: {results['bags']} bags, {results['patches']} patches of dim {results['dim']} "
          f"{results['dtype']}; CLAM DataLoader {results['workers']} workers, BagLoader defaults (2 threads)")
    for mode, target in (("warm", 0.95), ("cold", 0.9)):
        f = results.get(mode)
        if not f:
            continue
        line = (f"  {mode}, batch 1 shuffled: reader {f['reader_gbps']:.2f} GB/s, loader {f['loader_gbps']:.2f} GB/s "
                f"({f['loader_vs_reader']:.2f}x best, {f['loader_vs_reader_median']:.2f}x median; target >= {target}x: "
                f"{'ok' if f['loader_vs_reader'] >= target else 'MISSED'})")
        if "clam_gbps" in f:
            line += (f"; loader -> float32 {f['loader_f32_gbps']:.2f} GB/s vs CLAM torch.load .pt "
                     f"{f['clam_gbps']:.2f} GB/s ({f['loader_vs_clam']:.2f}x, target >= 1.5x: "
                     f"{'ok' if f['loader_vs_clam'] >= 1.5 else 'MISSED'})")
        print(line)
    p = results["padded"]
    print(f"  padded, batch {p['batch_size']}, max_patches {p['max_patches']} (bucketed), warm: reader+pad "
          f"{p['reader_s']:.3f} s, loader {p['loader_s']:.3f} s ({p['padded_vs_reader']:.2f}x, target >= 0.9x: "
          f"{'ok' if p['padded_vs_reader'] >= 0.9 else 'MISSED'})")
    r = results.get("rss")
    if r:
        print(f"  peak loader anon RSS, float32 epoch: B = {r['B']['bags']} bags {r['loader_bytes']['B'] / 2**20:.1f} MiB, "
              f"4B = {r['4B']['bags']} bags {r['loader_bytes']['4B'] / 2**20:.1f} MiB (growth "
              f"{r['growth_bytes'] / 2**20:+.1f} MiB); bound {r['bound_bytes'] / 2**20:.0f} MiB: "
              f"{'ok' if r['ok'] else 'EXCEEDED'}")


def _main(argv: list[str]) -> int:
    """Entry of the subprocesses: ``_epoch STORE SPLIT PREFETCH`` (RSS), ``_cold SPEC METHOD`` (a cold epoch)."""
    if argv[:1] == ["_cold"]:
        print(json.dumps(_cold_epoch(json.loads(argv[1]), argv[2])))
        return 0
    mode, store, split, prefetch = argv[:4]
    if mode != "_epoch":
        raise SystemExit(f"unknown mode {mode!r}: this entry point is for featurestore bench bag-loader's subprocesses")
    print(json.dumps(_child_epoch(store, split, int(prefetch))))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
