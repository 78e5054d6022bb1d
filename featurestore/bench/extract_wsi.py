"""``featurestore bench extract --wsi``: slide extraction against OpenSlide alone reading the same
patches (and against encoding alone with a real encoder); docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Any

import numpy as np

from featurestore.bench import harness
from featurestore.bench.harness import Method, interleaved

ZERO = "python:featurestore.bench.extract:zero_encoder"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--wsi (whole-slide extraction)")
    group.add_argument("--wsi", action="store_true", help="bench slide extraction instead (see bench/extract_wsi.py)")
    group.add_argument("--slides", type=int, default=3, help="synthetic slides (default 3)")
    group.add_argument("--slide-size", type=int, nargs=2, default=(12288, 9216), metavar=("W", "H"),
                       help="level-0 size (default 12288 9216 at 0.5 um/px, levels 1/4/16: ~700 tissue "
                       "patches of 224 px a slide)")
    group.add_argument("--patch-size", type=int, default=224, help="patch side at 20x (default 224)")
    group.add_argument("--tissue", default="otsu", choices=("otsu", "all"), help="tissue filter (default otsu)")
    group.add_argument("--max-patches", type=int, default=None,
                       help="--limit slides so about this many patches are encoded (a real encoder on a CPU)")
    group.add_argument("--cold", action="store_true", help="evict the slides from the page cache before each pass")


def _openslide_only(keys_batches: list[list[Any]], workers: int) -> float:
    """Seconds to read every patch with OpenSlide alone (RGB arrays, stacked per batch)."""
    import torch

    from featurestore.extract.encode_loop import worker_init as _worker_init
    from featurestore.extract.workers import DieWithParent

    # The default collate: stacked into shared memory in the worker, as extraction's own collate does.
    loader = torch.utils.data.DataLoader(_RawReader(), batch_sampler=keys_batches, num_workers=workers,
                                         worker_init_fn=DieWithParent(_worker_init) if workers else None)
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


class _RawReader:
    """``read_region`` -> RGB ``uint8 [s, s, 3]``, one handle per slide per worker."""

    def __init__(self) -> None:
        self.open: dict[str, Any] = {}

    def __getitem__(self, key: Any) -> np.ndarray:
        import openslide

        slide = self.open.get(key.path)
        if slide is None:
            slide = self.open[key.path] = openslide.OpenSlide(key.path)
        region = slide.read_region((key.x, key.y), key.level, (key.read_size, key.read_size))
        return np.asarray(region)[..., :3].copy()


def encode_pass(opts: Any, dataset: Any, plan: list[Any], workers: int, collate: Any,
                call: Any) -> tuple[float, Any]:
    """Extraction's loader over ``dataset(encoder)``, its batches and encoder (``call(encoder, batch, device)``), the device
    synchronised per batch, the features dropped: seconds, and the first batch's features."""
    import torch

    from featurestore.core.device import resolve_device
    from featurestore.extract.encode_loop import autocast, resolve_precision, worker_init
    from featurestore.extract.encoders import load_encoder
    from featurestore.extract.workers import DieWithParent

    start = time.perf_counter()
    encoder = load_encoder(opts.encoder)
    device = resolve_device(opts.device)
    encoder.to(device)
    precision = resolve_precision(opts.precision, device)
    loader = torch.utils.data.DataLoader(dataset(encoder), batch_sampler=plan,
                                         num_workers=workers, collate_fn=collate, pin_memory=device.type == "cuda",
                                         worker_init_fn=DieWithParent(worker_init) if workers else None)
    first = None
    with torch.inference_mode():
        for batch in loader:
            with autocast(device, precision):
                out = call(encoder, batch, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first = out if first is None else first
    return time.perf_counter() - start, first


def _encode_only(opts: Any, keys_batches: list[list[Any]], workers: int) -> float:
    from featurestore.extract.sources import Preprocessing
    from featurestore.extract.wsi_patches import PatchReader, collate_patches, to_encoder

    size, prep = opts.patch_size, list[Any]()

    def call(encoder: Any, batch: Any, device: Any) -> Any:
        import torch

        images = batch.images
        if len(images) < opts.batch_size:
            images = torch.cat([images, images.new_zeros((opts.batch_size - len(images), *images.shape[1:]))])
        if not prep:  # once: the encoder's normalisation
            prep.append(Preprocessing(resize=(size, size), mean=encoder.mean, std=encoder.std))
        encoder(to_encoder(images, prep[0], device), vectors=True)

    return encode_pass(opts, lambda _: PatchReader(size), keys_batches, workers, collate_patches, call)[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from featurestore.demo.slides import write_slide
    from featurestore.extract.encode_loop import default_num_workers
    from featurestore.extract.wsi import Target, list_slides
    from featurestore.extract.wsi_patches import PatchBatches, Patching, SlidePlanner
    from featurestore.extract.wsi_run import SlideOptions, extract_slides

    encoder = {"zero": ZERO}.get(args.encoder, args.encoder)
    if args.encoder == "trivial":
        encoder = ZERO  # the dense bench's default; here the zero-cost encoder is the ceiling
    workers = args.num_workers if args.num_workers is not None else default_num_workers()
    with harness.scratch(args, "wsi") as work:
        slides_dir = os.path.join(work, "slides")
        os.makedirs(slides_dir, exist_ok=True)
        width, height = args.slide_size
        for i in range(args.slides):
            write_slide(os.path.join(slides_dir, f"slide-{i:03d}.tiff"), width=width, height=height, seed=i, blobs=8)
        patching = Patching(Target(args.patch_size, magnification=20.0), args.tissue, 0.5)
        refs = list_slides(slides_dir)
        planner = SlidePlanner(refs, patching)
        plans = [planner[i] for i in range(len(refs))]
        limit = len(refs)
        if args.max_patches:
            total, limit = 0, 0
            while limit < len(plans) and total < args.max_patches:
                total += len(plans[limit])  # type: ignore[arg-type]
                limit += 1
        plans = plans[:limit]
        batches = list(PatchBatches(plans, args.batch_size, lambda _: None))
        patches = sum(len(b) for b in batches)
        files = [r.path for r in refs[:limit]]

        def cold() -> None:  # --cold: the slides leave the page cache before each pass
            if args.cold:
                harness.evict(*files)

        real = encoder != ZERO
        opts = SlideOptions(images=f"wsi:{slides_dir}", encoder=encoder, store=os.path.join(work, "store"),
                            dataset="bench", split="s", patch_size=args.patch_size, tissue=args.tissue,
                            batch_size=args.batch_size, num_workers=workers, progress=False, limit=limit,
                            device=args.device, precision=args.precision, chunk_mb=args.chunk_mb)
        loop: list[float] = []

        def extract() -> None:
            result = extract_slides(opts)
            os.sync()
            loop.append(result.seconds)  # plans, reads, encoder, bags: no start-up or commit
            assert result.patches == patches, (result.patches, patches)

        methods = [Method("openslide_only_s", lambda: _openslide_only(batches, workers), cold, own=True)]
        if real:
            methods.append(Method("encode_only_s", lambda: _encode_only(opts, batches, workers), cold, own=True))
        methods.append(Method("extract_s", extract, cold,
                              lambda: shutil.rmtree(os.path.join(work, "store"), ignore_errors=True)))
        times = interleaved(methods, args.repeats)
        times["extract_loop_s"] = loop
        best = {name: min(values) for name, values in times.items() if values}
        results: dict[str, Any] = {
            "benchmark": "extract-wsi", "encoder": encoder, "device": args.device, "slides": limit,
            "slide_size": [width, height], "patch_size": args.patch_size, "tissue": args.tissue,
            "patches": patches, "batch_size": args.batch_size, "num_workers": workers, "cold": bool(args.cold),
            "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0], "repeats": times, **best,
            "openslide_only_patches_s": patches / best["openslide_only_s"],
            "extract_patches_s": patches / best["extract_s"],
            "extract_vs_openslide": best["openslide_only_s"] / best["extract_s"],
            # Each repeat's own pair (measured back to back): the spread shows the machine's noise.
            "pair_ratios": [a / b for a, b in zip(times["openslide_only_s"], times["extract_s"])],
            "extract_loop_vs_openslide": best["openslide_only_s"] / best["extract_loop_s"],
        }
        if real:
            results.update(encode_only_patches_s=patches / best["encode_only_s"],
                           ratio=best["extract_s"] / best["encode_only_s"])
    return results


__all__ = ["add_arguments", "run"]
