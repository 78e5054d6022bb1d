"""``featurestore bench bags``: reading whole slide bags, featurestore against the files MIL users keep.

A synthetic cohort of slides (issue 23): patches per slide log-normal (median ``--median``, sigma
``--sigma``, one slide at ``--max`` so the long tail is always there, clipped to ``[--min, --max]``),
``--dim`` features per patch, about ``--gib`` GiB of float16 features in all (the slide count
follows from it: a TCGA cohort holds ~11k slides and 0.1-0.3 TB per encoder, far beyond a shared
machine; the per-slide figures do not depend on the count). Stored four ways:

* **featurestore**: one bag split, float16 features + int64 level-0 coordinates;
* **TRIDENT-style h5**: one ``.h5`` per slide as TRIDENT writes it, ``features`` float16 in h5
  chunks of one row ``(1, D)``, ``coords`` int64 ``(N, 2)``;
* **CLAM-style .pt**: one ``torch.save`` file per slide of the float32 features (CLAM's
  ``pt_files/``: features only, no coordinates), i.e. **twice the bytes** of float16;
* **raw**: the featurestore bytes (features, then coordinates, of each slide) in one file, for
  the parallel-pread reference.

Each method reads every bag whole (features and coordinates where the format has them) in one
shuffled pass (the same permutation for all), **cold** (every file of the method evicted from the
page cache first: ``fdatasync`` + ``POSIX_FADV_DONTNEED``) and **warm** (read once before the
timed pass). Methods: ``featurestore`` (``store.open_bags(...).read(i)``, one bag after another),
``TRIDENT h5`` (``h5py``: ``features[:]``, ``coords[:]``), ``CLAM .pt`` (``torch.load``), and the
``parallel pread`` reference (``--threads`` threads, each bag's bytes in 1 MiB ``preadv`` pieces
into a reused buffer: what the device gives). Rates are bags/s and GB/s of stored bytes; the
ratios featurestore / baseline compare pass times, so CLAM's ratio is per bag, not per byte.

Then ``featurestore import`` of the h5 directory (cold h5 files, in this process, through
``featurestore.extract.importer``, to ``os.sync``) against the cold h5 read pass alone (the write
must not dominate), and against the import's own reading of the files alone (``SlideFiles.read``,
which reads TRIDENT's one-row chunks with ``preadv``, not h5py's chunk-at-a-time read). Targets: >= 1.5x TRIDENT h5 cold and warm; >= 1.5x CLAM .pt cold, >= 1.0x warm;
>= 0.85x the parallel-pread reference cold; import >= 0.7x the h5 read time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from featurestore.bench.cgroup import evict
from featurestore.bench.common import drop_into, gbps, save_json

TARGETS = {"TRIDENT h5 cold": 1.5, "TRIDENT h5 warm": 1.5, "CLAM .pt cold": 1.5, "CLAM .pt warm": 1.0,
           "parallel pread cold": 0.85, "import vs h5 read": 0.7}
METHODS = ("featurestore", "TRIDENT h5", "CLAM .pt", "parallel pread")
NAMES = ("bench", "enc", "bags")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bags", help="whole-bag reads: featurestore bag split vs TRIDENT h5, CLAM .pt, parallel pread; import",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--gib", type=float, default=2.0,
                        help="float16 features of the cohort in GiB (default 2; the .pt copy is twice that)")
    parser.add_argument("--dim", type=int, default=1536, help="features per patch (default 1536)")
    parser.add_argument("--median", type=int, default=5000, help="median patches per slide (default 5000)")
    parser.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of patches per slide (default 0.8)")
    parser.add_argument("--min", dest="min_patches", type=int, default=100, help="fewest patches per slide")
    parser.add_argument("--max", dest="max_patches", type=int, default=60000,
                        help="most patches per slide; one slide always has this many (default 60000)")
    parser.add_argument("--threads", type=int, default=8, help="threads of the parallel-pread reference")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats; the median is kept")
    parser.add_argument("--skip-import", action="store_true", help="skip the import row")
    parser.add_argument("--skip-loader", action="store_true",
                        help="skip the BagLoader rows (bench bag-loader's epochs on this cohort)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    parser.set_defaults(func=lambda args: _print_and_save(run(args), args.json_out))


# ---------------------------------------------------------------------- the cohort
def cohort_lengths(gib: float, dim: int, median: int, sigma: float, low: int, high: int, seed: int = 0) -> np.ndarray:
    """Patches per slide: log-normal around ``median``, one slide at ``high``, ~``gib`` GiB float16."""
    rng = np.random.default_rng(seed)
    budget = int(gib * (1 << 30)) // (dim * 2)
    lengths = [high]
    while sum(lengths) < budget:
        lengths.append(int(np.clip(rng.lognormal(np.log(median), sigma), low, high)))
    order = rng.permutation(len(lengths))  # the long slide anywhere in the cohort
    return np.asarray(lengths, dtype=np.int64)[order]


def slide(i: int, n: int, dim: int, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slide ``i``'s features (float16, distinct per slide, cheap to make) and level-0 coords."""
    rows = np.arange(n) % len(base)
    features = base[rows] + np.float16(i % 97)
    side = int(np.ceil(np.sqrt(max(n, 1))))
    k = np.arange(n, dtype=np.int64)
    coords = np.stack([(k % side) * 256, (k // side) * 256], axis=1)
    return features, coords


def build(work: str, lengths: np.ndarray, dim: int) -> dict[str, Any]:
    """Write the four copies; returns paths and byte counts."""
    import h5py
    import torch

    import featurestore

    paths = {"store": os.path.join(work, "store"), "h5": os.path.join(work, "h5"),
             "pt": os.path.join(work, "pt_files"), "raw": os.path.join(work, "raw.bin")}
    os.makedirs(paths["h5"])
    os.makedirs(paths["pt"])
    base = np.random.default_rng(1).standard_normal((4096, dim), dtype=np.float32).astype(np.float16)
    ids = [f"TCGA-{i:04d}-slide" for i in range(len(lengths))]
    store = featurestore.open_store(paths["store"], mode="a")
    writer = store.create_bag_split(*NAMES, dim=dim, dtype="float16", coords_unit="px", coords_dtype="int64",
                                    patch_size_level0=256)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    with open(paths["raw"], "wb") as raw:
        for i, (bag_id, n) in enumerate(zip(ids, lengths)):
            features, coords = slide(i, int(n), dim, base)
            writer.add_bag(bag_id, features, coords=coords, attrs={"patch_size_level0": 256})
            offsets[i + 1] = offsets[i] + features.nbytes + coords.nbytes
            raw.write(features.tobytes())
            raw.write(coords.tobytes())
            with h5py.File(os.path.join(paths["h5"], f"{bag_id}.h5"), "w") as h5:
                # TRIDENT's save_h5: chunks of one row, maxshape (None, ...), no compression.
                h5.create_dataset("features", data=features, chunks=(1, dim), maxshape=(None, dim))
                dset = h5.create_dataset("coords", data=coords, chunks=(1, 2), maxshape=(None, 2))
                dset.attrs.update({"patch_size": 256, "patch_size_level0": 256, "level0_magnification": 20,
                                   "target_magnification": 20, "overlap": 0})
            torch.save(torch.from_numpy(features.astype(np.float32)), os.path.join(paths["pt"], f"{bag_id}.pt"))
    writer.commit()
    return {"paths": paths, "ids": ids, "raw_offsets": offsets}


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# ---------------------------------------------------------------------- the readers
def readers(built: dict[str, Any], threads: int, only: str | None = None) -> dict[str, tuple[str, Callable[[int], int]]]:
    """Per method: (the path to evict/warm, read(bag position) -> bytes read); ``only``: set up
    that method alone (the others' entries have no reader)."""
    import h5py
    import torch

    import featurestore

    paths, ids, offsets = built["paths"], built["ids"], built["raw_offsets"]
    where = {"featurestore": paths["store"], "TRIDENT h5": paths["h5"], "CLAM .pt": paths["pt"],
             "parallel pread": paths["raw"]}
    if only is None:
        return {name: (path, _no_reader) for name, path in where.items()}
    bags = featurestore.open_store(paths["store"]).open_bags(*NAMES) if only == "featurestore" else None

    def fs(i: int) -> int:
        features, coords = bags.read(i)
        return features.numel() * features.element_size() + coords.numel() * coords.element_size()

    def h5(i: int) -> int:
        with h5py.File(os.path.join(paths["h5"], f"{ids[i]}.h5"), "r") as f:
            features, coords = f["features"][:], f["coords"][:]
        return features.nbytes + coords.nbytes

    def pt(i: int) -> int:
        features = torch.load(os.path.join(paths["pt"], f"{ids[i]}.pt"))
        return features.numel() * features.element_size()

    def pread(i: int) -> int:
        start, stop = int(offsets[i]), int(offsets[i + 1])
        return sum(pool.map(lambda lo: os.preadv(fd, [buffer[lo : min(stop - start, lo + piece)]], start + lo),
                            range(0, stop - start, piece)))

    if only == "parallel pread":
        fd = os.open(paths["raw"], os.O_RDONLY)
        pool = ThreadPoolExecutor(threads)
        piece = 1 << 20
        buffer = memoryview(bytearray(int(np.diff(offsets).max())))  # one reused buffer, as the reader's
        pread.close = lambda: (pool.shutdown(), os.close(fd))  # type: ignore[attr-defined]
    fns = {"featurestore": fs, "TRIDENT h5": h5, "CLAM .pt": pt, "parallel pread": pread}
    return {name: (path, fns[name]) for name, path in where.items()}


def _no_reader(i: int) -> int:
    raise RuntimeError("readers(only=None) sets up no reader: pass only=<method>")


def one_pass(read: Callable[[int], int], order: np.ndarray) -> tuple[float, int]:
    start, total = time.perf_counter(), 0
    for i in order:
        total += read(int(i))
    return time.perf_counter() - start, total


def _child(config: dict[str, Any]) -> dict[str, Any]:
    """One method's timed pass in a fresh process: a reader that held maps of the files, or had
    checked their crc32c, in an earlier pass would make a "cold" pass warm. Warm: one untimed
    pass first (the files are page-cached by the parent)."""
    built = {"paths": config["paths"], "ids": config["ids"], "raw_offsets": np.asarray(config["raw_offsets"])}
    name, order = config["method"], np.asarray(config["order"])
    methods = readers(built, config["threads"], only=name)
    _, read = methods[name]
    try:
        if config["temperature"] == "warm":
            one_pass(read, order)
        seconds, total = one_pass(read, order)
    finally:
        if hasattr(read, "close"):
            read.close()
    return {"seconds": seconds, "bytes": total}


def run_child(config: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "featurestore.bench.bags", "_child", json.dumps(config)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench bags: the {config['method']} {config['temperature']} pass failed "
                           f"(rc {done.returncode}): {done.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def time_import_read(built: dict[str, Any]) -> float:
    """Seconds of the import's own reading alone: every h5 file read (cold) as ``import`` reads it
    (``SlideFiles.read``: features, coords and attributes), nothing written."""
    from featurestore.extract.slide_files import SlideFiles, find_slides

    found = find_slides(built["paths"]["h5"])
    assert found is not None
    files = SlideFiles(*found)
    evict(built["paths"]["h5"])
    start = time.perf_counter()
    for slide in files.slides:
        files.read(slide)
    return time.perf_counter() - start


def time_import(built: dict[str, Any], work: str) -> float:
    """Seconds of ``featurestore import`` of the h5 directory (cold), to its return and ``os.sync``."""
    from featurestore.extract.importer import ImportOptions, import_cache

    target = os.path.join(work, "imported")
    shutil.rmtree(target, ignore_errors=True)
    evict(built["paths"]["h5"])
    os.sync()
    start = time.perf_counter()
    import_cache(ImportOptions(source=built["paths"]["h5"], store=target, dataset=NAMES[0], encoder_name=NAMES[1],
                               split=NAMES[2], progress=False))
    os.sync()
    seconds = time.perf_counter() - start
    shutil.rmtree(target, ignore_errors=True)
    return seconds


# ---------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    work = args.workdir or tempfile.mkdtemp(prefix="fs-bench-bags-", dir=os.environ.get("FEATURESTORE_BENCH_DIR"))
    os.makedirs(work, exist_ok=True)
    lengths = cohort_lengths(args.gib, args.dim, args.median, args.sigma, args.min_patches, args.max_patches)
    print(f"\n[bags] {len(lengths)} slides, patches per slide median {int(np.median(lengths))}, max "
          f"{int(lengths.max())}, {int(lengths.sum())} patches x {args.dim} float16 "
          f"({lengths.sum() * args.dim * 2 / 2**30:.2f} GiB; scaled down from a TCGA cohort's ~11k slides)")
    try:
        start = time.perf_counter()
        built = build(os.path.join(work, "cohort"), lengths, args.dim)
        sizes = {k: _size(v) for k, v in built["paths"].items()}
        print(f"  built in {time.perf_counter() - start:.0f} s: featurestore {sizes['store'] / 2**30:.2f} GiB, "
              f"h5 {sizes['h5'] / 2**30:.2f} GiB, pt {sizes['pt'] / 2**30:.2f} GiB (float32), raw {sizes['raw'] / 2**30:.2f} GiB")
        results = measure(built, lengths, args)
        results["sizes"] = sizes
        if not args.skip_import:
            reads, imports = [], []
            for _ in range(args.repeats):
                reads.append(time_import_read(built))
                imports.append(time_import(built, work))
            results["import_seconds"] = statistics.median(imports)
            results["import_read_seconds"] = statistics.median(reads)
            results["all_import_seconds"], results["all_import_read_seconds"] = imports, reads
            # The target's base: the h5 files read whole with h5py (the TRIDENT h5 cold pass).
            results["ratios"]["import vs h5 read"] = results["seconds"]["TRIDENT h5 cold"] / results["import_seconds"]
            results["ratios"]["import vs its own read"] = results["import_read_seconds"] / results["import_seconds"]
        _print_rows(results)
        if not args.skip_loader:
            results["loader"] = loader_figures(built, lengths, args)
        return results
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def loader_figures(built: dict[str, Any], lengths: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """Issue 25's loader targets on this cohort: BagLoader epochs (batch 1, warm and cold) against
    the bare bag reader and CLAM's ``torch.load`` loop over the ``.pt`` copy, and padded batches."""
    from featurestore.bench import bag_loader

    figures = bag_loader.epoch_figures(built["paths"]["store"], *NAMES, pt_dir=built["paths"]["pt"],
                                       workers=4, repeats=max(1, args.repeats))
    figures.update(patches=int(lengths.sum()), dim=args.dim, dtype="float16", workers=4)
    bag_loader.print_figures(figures)
    return figures


def measure(built: dict[str, Any], lengths: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """Every method cold and warm, each pass in a fresh child process, repeats interleaved."""
    methods = readers(built, args.threads)
    order = np.random.default_rng(2).permutation(len(lengths))
    config = {"paths": built["paths"], "ids": built["ids"], "raw_offsets": built["raw_offsets"].tolist(),
              "order": order.tolist(), "threads": args.threads}
    times: dict[str, list[float]] = {}
    nbytes: dict[str, int] = {}
    for repeat in range(args.repeats):
        # featurestore and the pread reference back to back, in turn first (the disk's state, and
        # on a VM the host's cache, drift during a run), then the two file-per-slide formats.
        pair = ["featurestore", "parallel pread"][:: 1 if repeat % 2 == 0 else -1]
        for temperature in ("cold", "warm"):
            for name in [*pair, "TRIDENT h5", "CLAM .pt"]:
                for path, _ in methods.values():  # only this method's files may be cached
                    evict(path)
                if temperature == "warm":
                    drop_into(methods[name][0])
                result = run_child({**config, "method": name, "temperature": temperature})
                times.setdefault(f"{name} {temperature}", []).append(result["seconds"])
                nbytes[name] = result["bytes"]
    for path, _ in methods.values():
        evict(path)
    seconds = {key: statistics.median(values) for key, values in times.items()}
    rows = {key: {"seconds": s, "bags_per_s": len(lengths) / s, "gb_per_s": gbps(nbytes[key.rsplit(' ', 1)[0]], s),
                  "all_seconds": times[key]} for key, s in seconds.items()}
    ratios = {f"{name} {t}": seconds[f"{name} {t}"] / seconds[f"featurestore {t}"]
              for name in METHODS[1:] for t in ("cold", "warm")}
    return {"benchmark": "bags", "slides": len(lengths), "dim": args.dim, "patches": int(lengths.sum()),
            "median_patches": int(np.median(lengths)), "max_patches": int(lengths.max()), "repeats": args.repeats,
            "bytes_read": nbytes, "seconds": seconds, "rows": rows, "ratios": ratios, "targets": TARGETS}


def _print_rows(results: dict[str, Any]) -> None:
    print(f"  one shuffled pass reading every bag whole, median of {results['repeats']} interleaved repeat(s); "
          "cold = evicted (posix_fadvise DONTNEED) before each pass")
    for key, row in results["rows"].items():
        print(f"  {key:<22} {row['seconds']:7.2f} s  {row['bags_per_s']:7.1f} bags/s  {row['gb_per_s']:6.2f} GB/s")
    if "import_seconds" in results:
        print(f"  import of the h5 directory (cold, to os.sync) {results['import_seconds']:.2f} s; its own reading "
              f"of the files alone (cold, extract.h5_rows: preadv per run of chunks) {results['import_read_seconds']:.2f} s")
    print("  featurestore / baseline (pass time; CLAM .pt reads float32, twice the bytes, and no coordinates):")
    for key, value in results["ratios"].items():
        target = TARGETS.get(key)
        verdict = "" if target is None else f"  (target >= {target}x: {'met' if value >= target else 'MISSED'})"
        print(f"    {key:<22} {value:5.2f}x{verdict}")


def _print_and_save(results: dict[str, Any], path: str | None) -> int:
    save_json(results, path)
    return 0


__all__ = ["cohort_lengths", "register", "run"]

if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "_child":
    print(json.dumps(_child(json.loads(sys.argv[2]))))
