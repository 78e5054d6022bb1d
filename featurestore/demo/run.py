"""``featurestore demo``: the whole pipeline end to end on built-in data, in minutes on a CPU.

1. a synthetic PanNuke-style fold (train + val) in the real PanNuke file format
   (:func:`featurestore.demo.synthetic.make_synthetic_pannuke`);
2. ``builtin:tiny-vit`` features extracted three times, stored as float32 (``tiny-vit-fp32``), as
   float16 (``tiny-vit-fp16``) and as int8 (``tiny-vit-int8``), with their quantization reports;
3. the store served by a real ``featurestore serve`` subprocess on a free loopback port;
4. loader throughput from local disk and over HTTP, and the loader's RSS growth over an epoch
   against the in-RAM float32 cache it replaces (both measured);
5. the segmentation probe under K seeds per dtype from local disk (``compare_probes``, the same
   check as ``featurestore probe --compare``: float16 and int8, each against float32), plus seed 0
   of the float16 side streamed over HTTP, which must give the same Jaccard as from disk;
6. slide bags (:mod:`featurestore.demo.bag_section`): a synthetic cohort as float32, float16 and
   int8 bag splits, a ``BagLoader`` epoch from disk and over HTTP, and the ABMIL probe under K seeds
   per dtype (float16 and int8 against float32), with seed 0 from the float32 store checked against
   the same bags held in RAM; a
   clinical table's second task under ABMIL with one slide's attention map drawn to a PNG in the
   workdir, and mean slide embeddings under the linear probe beside ABMIL.

:func:`run_demo` returns every figure as a dict; ``featurestore/commands/demo.py`` prints the table.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from featurestore.demo.bag_section import bag_section, make_bags
from featurestore.errors import FeatureStoreError

DATASET = "pannuke"
ENCODERS = {"float32": "tiny-vit-fp32", "float16": "tiny-vit-fp16", "int8": "tiny-vit-int8"}


@dataclass(frozen=True)
class DemoSize:
    """How much work the demo does. Probe cost dominates: it grows with train images x epochs x seeds."""

    image_size: int
    train: int
    val: int
    epochs: int
    batch_size: int  # small batches: enough optimizer steps for the head to learn from few images
    seeds: int


# small: CI (< 60 s on 2 CPU cores); default: the README's demo (< 5 min on 2 CPU cores).
# 128 px images (8x8 token grid) instead of PanNuke's 256 px: the probe's per-pixel loss is 4x
# cheaper and the nuclei are still several pixels wide.
SIZES = {
    "small": DemoSize(image_size=128, train=32, val=16, epochs=3, batch_size=4, seeds=2),
    "default": DemoSize(image_size=128, train=96, val=48, epochs=4, batch_size=8, seeds=3),
}


def run_demo(
    workdir: str | None = None,
    *,
    size: str = "default",
    keep: bool = False,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the demo; return its figures. ``workdir``: where data and store go (default: a temp
    dir); the data and store are removed at the end unless ``keep`` (the clinical table and the
    attention picture stay; a failed run removes a workdir it created)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, but got: {size!r}")
    plan = SIZES[size]
    created = workdir is None or not os.path.exists(workdir)
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix="featurestore-demo-")
    elif os.path.exists(workdir) and not os.path.isdir(workdir):
        raise FeatureStoreError(f"--workdir {workdir!r} exists and is not a directory: pass a directory")
    data, store = os.path.join(workdir, "data"), os.path.join(workdir, "store")
    for path in (data, store):
        if os.path.exists(path):
            raise FeatureStoreError(f"{path} already exists (a kept demo?): remove it or pass another --workdir")
    os.makedirs(workdir, exist_ok=True)
    import torch

    threads_before = torch.get_num_threads()  # restored at the end: run_demo may run inside a caller
    started = time.perf_counter()
    result: dict[str, Any] = {"size": size, "plan": asdict(plan), "workdir": workdir, "store": store}
    finished = False
    try:
        result["threads"] = _set_threads(threads)
        total = 8
        log(f"[1/{total}] synthetic PanNuke fold: {plan.train} train + {plan.val} val images, "
            f"{plan.image_size} px, in {data}; synthetic slide bags in the store")
        result["data"] = _make_data(data, plan)
        result["bags_data"] = make_bags(store, size)
        for step, dtypes in ((2, ("float32",)), (3, ("float16", "int8"))):
            log(f"[{step}/{total}] extract builtin:tiny-vit as {' and '.join(dtypes)} -> "
                + ", ".join(f"{DATASET}/{ENCODERS[d]}" for d in dtypes))
            for dtype in dtypes:
                result.setdefault("extract", {})[dtype] = _extract(data, store, dtype)
                log(f"      {dtype}: {_extract_line(result['extract'][dtype])}")
        log(f"[4/{total}] serve the store: featurestore serve on a free 127.0.0.1 port")
        with _served(store) as url:
            result["server_url"] = url
            log(f"      serving {url}")
            log(f"[5/{total}] loader: one epoch from local disk and over HTTP; RSS vs the in-RAM cache")
            result["loader"] = {"local": _loader_rate(store), "http": _loader_rate(url)}
            result["memory"] = _memory(store)
            log(f"      local {result['loader']['local']['gb_per_s']:.3f} GB/s, HTTP "
                f"{result['loader']['http']['gb_per_s']:.3f} GB/s; loader RSS growth "
                f"{_mib(result['memory']['stream_rss_growth'])}, float32 in-RAM cache {_mib(result['memory']['ram_cache_bytes'])}")
            log(f"[6/{total}] seg probe from local disk: {plan.seeds} seeds x float16 and float32, then int8 "
                f"and float32, {plan.epochs} epochs, batch {plan.batch_size}")
            result["compare"] = _compare(store, plan, log)
            result["compare_int8"] = _compare(store, plan, log, "int8")
            log(f"[7/{total}] seg probe streamed over HTTP: float16, seed 0")
            result["http_probe"] = _http_probe(url, plan, result["compare"], log)
            bag_plan = result["bags_data"]["plan"]
            log(f"[8/{total}] slide bags: BagLoader from disk and over HTTP; ABMIL probe, {plan.seeds} seeds x "
                f"float16, int8 and float32, {bag_plan['train']} train + {bag_plan['val']} val slides; a clinical table's "
                "task with one attention map; mean embeddings + linear probe")
            result["bags"] = bag_section(store, url, size, plan.seeds, log, workdir)
        result["baseline_jaccard"] = constant_baseline(store)
        result["memory"]["process_peak_rss"] = _peak_rss()  # after the probes, the heaviest step
        result["seconds"] = time.perf_counter() - started
        finished = True
    finally:
        torch.set_num_threads(threads_before)
        if not keep:
            # A finished demo leaves its outputs (the clinical table, the attention picture) in
            # workdir and removes the data and store; a failed one removes a workdir it created.
            if created and not finished:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                for path in (data, store):
                    shutil.rmtree(path, ignore_errors=True)
    result["kept"] = keep
    return result


# ------------------------------------------------------------------------------- the steps


def _set_threads(threads: int | None) -> int:
    """Intra-op threads for extraction and probes. Auto: all cores, but 1 when the machine is
    already oversubscribed: OpenMP threads spin-wait for each other, and on a loaded 2-core host
    two threads ran the probe step 5x slower than one (measured on the shared CI machine)."""
    import torch

    if threads is None:
        cores = os.cpu_count() or 1
        try:
            busy = os.getloadavg()[0] > cores
        except OSError:
            busy = False
        threads = 1 if busy else cores
    if threads < 1:
        raise ValueError(f"threads must be a positive integer, but got: {threads}")
    torch.set_num_threads(threads)
    return threads


def _make_data(data: str, plan: DemoSize) -> dict[str, Any]:
    from featurestore.demo.synthetic import make_synthetic_pannuke

    began = time.perf_counter()
    for split, n, seed in (("train", plan.train, 0), ("val", plan.val, 1)):
        make_synthetic_pannuke(os.path.join(data, split), n, size=plan.image_size, seed=seed)
    return {"seconds": time.perf_counter() - began, "bytes": _tree_bytes(data)}


def _extract(data: str, store: str, dtype: str) -> dict[str, Any]:
    from featurestore.extract.run import ExtractOptions, extract

    out: dict[str, Any] = {"encoder": ENCODERS[dtype], "images": 0, "seconds": 0.0}
    for split in ("train", "val"):
        res = extract(ExtractOptions(
            images=f"pannuke:{os.path.join(data, split)}", encoder="builtin:tiny-vit", store=store,
            dataset=DATASET, split=split, encoder_name=ENCODERS[dtype], dtype=dtype, progress=False))
        out["images"] += res.encoded
        out["seconds"] += res.seconds
        out["sample_shape"] = res.metadata.get("sample_shape")
        if split == "train":
            out["quantization"] = res.metadata.get("quantization") or {}
    out["images_per_s"] = out["images"] / max(out["seconds"], 1e-9)
    out["store_bytes"] = _tree_bytes(os.path.join(store, DATASET, ENCODERS[dtype]))
    return out


def _extract_line(e: dict[str, Any]) -> str:
    q = e["quantization"]
    return (f"{e['images']} images in {e['seconds']:.1f} s ({e['images_per_s']:.1f} img/s), "
            f"{_mib(e['store_bytes'])} on disk; max rel error {q.get('max_rel_error', 0):.2g}, rel RMS error "
            f"{q.get('rel_rms_error') or 0:.2g}, overflow {q.get('overflow_count', 0)}"
            + (f", saturation {q['saturation_count']}" if "saturation_count" in q else ""))


@contextlib.contextmanager
def _served(store: str) -> Iterator[str]:
    """``featurestore serve STORE`` as a subprocess on a free loopback port; the bench helper
    stops it (TERM, then KILL) in its ``finally``, whatever happens in the block."""
    from featurestore.testing.serving import serve_subprocess

    server = serve_subprocess(store, args=("--host", "127.0.0.1"))  # loopback only, explicitly
    try:
        url, _proc = server.__enter__()
    except RuntimeError as error:  # one clear line from the CLI, not a traceback
        raise FeatureStoreError(f"the demo server did not start: {error}") from error
    try:
        yield str(url)
    except BaseException:
        if not server.__exit__(*sys.exc_info()):
            raise
    else:
        server.__exit__(None, None, None)


def _loader_rate(source: str, min_seconds: float = 0.5) -> dict[str, Any]:
    """Epochs of the float16 train split to a CPU consumer as float32 batches of 64, repeated
    until ``min_seconds`` have passed (a tiny split would otherwise time a handful of calls)."""
    import torch

    from client import FeatureDataset, FeatureLoader

    ds = FeatureDataset(source, DATASET, ENCODERS["float16"], "train")
    loader = FeatureLoader(ds, batch_size=64, shuffle=True, seed=0, device="cpu", dtype=torch.float32)
    for _ in loader:  # warm-up: connections, page cache, recycled buffers
        pass
    samples, epochs, began = 0, 0, time.perf_counter()
    while time.perf_counter() - began < min_seconds:
        loader.set_epoch(epochs + 1)
        for features, _ in loader:
            samples += len(features)
        epochs += 1
    seconds = time.perf_counter() - began
    return {"epochs": epochs, "seconds": seconds, "bytes": samples * ds.sample_nbytes,
            "gb_per_s": samples * ds.sample_nbytes / seconds / 1e9}


def _memory(store: str) -> dict[str, Any]:
    """Anonymous RSS growth of one streamed epoch (sampled every 2 ms by a thread) against the
    growth from reading train + val into float32 tensors, the cache featurestore replaces."""
    import torch

    from client import FeatureDataset, FeatureLoader
    from featurestore.testing.memory import anon_peak, rss_anon_bytes

    dsets = [FeatureDataset(store, DATASET, ENCODERS["float16"], s) for s in ("train", "val")]
    before = rss_anon_bytes()
    with anon_peak(every=0.002) as peak:
        for ds in dsets:
            for _ in FeatureLoader(ds, batch_size=64, shuffle=True, seed=0, device="cpu", dtype=torch.float32):
                pass
    stream = max(0, peak[0] - before)
    before = rss_anon_bytes()
    cache = [torch.empty((len(ds), *ds.sample_shape), dtype=torch.float32) for ds in dsets]
    for ds, tensor in zip(dsets, cache):
        for lo in range(0, len(ds), 256):
            hi = min(lo + 256, len(ds))
            tensor[lo:hi] = ds.array.read(list(range(lo, hi))).to(torch.float32)
    ram = max(0, rss_anon_bytes() - before)
    nbytes = sum(t.numel() * 4 for t in cache)
    del cache
    return {"stream_rss_growth": stream, "ram_cache_rss_growth": ram, "ram_cache_bytes": nbytes,
            "process_peak_rss": _peak_rss()}


def _peak_rss() -> int:
    """This process's peak resident set size so far (ru_maxrss, KiB on Linux)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _compare(store: str, plan: DemoSize, log: Callable[[str], None], dtype: str = "float16") -> dict[str, Any]:
    """``dtype``'s split (A) against the float32 one (B), as ``featurestore probe --compare`` does."""
    from featurestore.probes.run import compare_probes

    return compare_probes(store, DATASET, ENCODERS[dtype], ENCODERS["float32"], train_split="train",
                          eval_split="val", task="seg", seeds=plan.seeds, epochs=plan.epochs,
                          batch_size=plan.batch_size, device="auto", log=lambda line: log(f"      {line}"))


def _http_probe(url: str, plan: DemoSize, compare: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    from featurestore.probes.run import run_probe

    run = run_probe(url, DATASET, ENCODERS["float16"], train_split="train", eval_split="val", task="seg",
                    seeds=[0], epochs=plan.epochs, batch_size=plan.batch_size, device="auto",
                    log=lambda line: log(f"      {line} [HTTP]"))
    http, local = run["runs"][0]["jaccard"], compare["a"]["runs"][0]["jaccard"]
    # Same seed, same batch order, same bytes: streaming over HTTP must train the same probe.
    return {"jaccard": http, "local_jaccard": local, "identical": http == local, "seconds": run["seconds"]}


def constant_baseline(store: str) -> dict[str, Any]:
    """Per-image macro Jaccard on val of the best constant predictor (every pixel one class;
    background wins): the score a probe that learned nothing reaches."""
    import torch

    import featurestore
    from featurestore.probes.seg import per_image_jaccard

    labels = featurestore.open_store(store).open(DATASET, ENCODERS["float32"], "val").labels
    if labels is None:  # extraction from a pannuke: source always writes the class maps
        raise FeatureStoreError(f"{store}: {DATASET}/{ENCODERS['float32']}/val has no labels")
    masks = torch.from_numpy(labels.read_range(0, len(labels))).long()
    classes = int(masks.max()) + 1
    scores = {c: float(per_image_jaccard(torch.full_like(masks, c), masks, classes).mean())
              for c in range(classes)}
    best = max(scores, key=lambda c: scores[c])
    return {"class": best, "jaccard": scores[best]}


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


__all__ = ["DATASET", "ENCODERS", "SIZES", "DemoSize", "constant_baseline", "run_demo"]
