"""``featurestore bench extract``: extraction wall time against encoding alone and numpy ``tofile``.

With ``--wsi``, slide extraction against OpenSlide alone reading the same patches (and against
encoding alone with a real encoder). What it measures: docs/BENCHMARKS.md, "What each bench measures".
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

import numpy as np

from featurestore.bench import harness
from featurestore.bench.harness import Method, interleaved
from featurestore.testing.cgroup import evict


def trivial_encoder() -> Any:
    """``python:featurestore.bench.extract:trivial_encoder``: patch embedding (16 px, 384 channels)
    + LayerNorm with a mean-pooled CLS token, ``[B, 1 + P, 384]``. torch is imported here, not
    at module import, so ``featurestore --help`` stays light."""
    import torch

    class Trivial(torch.nn.Module):
        num_prefix_tokens = 1
        patch_size = 16

        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Conv2d(3, 384, 16, 16, bias=False)
            torch.nn.init.normal_(self.proj.weight, std=0.05, generator=torch.Generator().manual_seed(0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            grid = self.proj(x).flatten(2).transpose(1, 2)
            tokens = torch.cat([grid.mean(1, keepdim=True), grid], 1)
            return torch.nn.functional.layer_norm(tokens, (384,))

    return Trivial()


def zero_encoder() -> Any:
    """``python:featurestore.bench.extract:zero_encoder``: ``[B, 1 + 256, 384]`` float32 (a CLS
    token and a 16 x 16 grid at any image size) for no work: one precomputed tensor per (batch
    size, grid, device), returned as it is (the writer never modifies its input)."""
    import torch

    class Zero(torch.nn.Module):
        num_prefix_tokens = 1
        patch_size = 16

        def __init__(self) -> None:
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))  # so .to(device) has something to move
            self.cache: dict[tuple[int, int, str], torch.Tensor] = {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # A 16 x 16 grid whatever the image size (the patch follows it): small images keep the
            # image loader out of the ceiling while the features stay [256, 384].
            self.patch_size = max(1, x.shape[-1] // 16)
            tokens = 1 + (x.shape[-2] // self.patch_size) * (x.shape[-1] // self.patch_size)
            key = (len(x), tokens, str(x.device))
            if key not in self.cache:
                generator = torch.Generator().manual_seed(len(x))
                self.cache[key] = torch.randn((len(x), tokens, 384), generator=generator).to(x.device)
            return self.cache[key]

    return Zero()


ENCODERS = {"trivial": "python:featurestore.bench.extract:trivial_encoder",
            "zero": "python:featurestore.bench.extract:zero_encoder"}


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "extract", "extraction wall time vs encoding alone and numpy tofile; --wsi: slide "
                      "extraction vs OpenSlide alone", {
        "--n": (512, "images"), "--image-size": (224, "square image side"), "--batch-size": (64, None),
        "--chunk-mb": (8.0, None), "--num-workers": (int, "DataLoader workers (default: auto)"),
        "--encoder": ("trivial", "trivial (patch embedding + LayerNorm), zero (zero-cost: the pipeline's own ceiling) "
                                 "or any encoder spec, e.g. builtin:vit-s14 (a ViT-S/14's cost, no download) or "
                                 "timm:vit_small_patch14_dinov2,pretrained=false,img_size=224; with --wsi the default "
                                 "is zero"),
        "--device": ("auto", "auto, cpu or cuda"), "--precision": ("auto", "auto, bf16 or fp32 (auto: bf16 on CUDA)"),
        "--wsi": (False, "bench slide extraction instead (synthetic pyramidal TIFFs)"),
        "--slides": (3, "--wsi: synthetic slides"),
        "--slide-size": ((12288, 9216), "--wsi: level-0 size (default 12288 9216 at 0.5 um/px, levels 1/4/16: ~700 "
                                        "tissue patches of 224 px a slide)",
                         {"type": int, "nargs": 2, "metavar": ("W", "H")}),
        "--patch-size": (224, "--wsi: patch side at 20x"),
        "--tissue": ("otsu", "--wsi: tissue filter", {"choices": ("otsu", "all")}),
        "--max-patches": (int, "--wsi: --limit slides so about this many patches are encoded (a real encoder on a "
                               "CPU)"),
        "--cold": (False, "--wsi: evict the slides from the page cache before each pass")}, repeats=3, keep="best")


def _encode_only(opts: Any) -> None:
    """:func:`encode_pass` over the images, in the batches extraction makes of them."""
    from featurestore.extract.sources import Failure, PreparedImages, Preprocessing, collate, open_source

    source = open_source(opts.images)
    n = len(source)
    # New splits hold whole batches per chunk, so extraction's plan is these consecutive batches.
    plan = [list(range(a, min(a + opts.batch_size, n))) for a in range(0, n, opts.batch_size)]

    def call(encoder: Any, batch: Any, device: Any) -> Any:
        assert not isinstance(batch, Failure)
        return encoder(batch[1].to(device, non_blocking=True))

    encode_pass(opts, lambda e: PreparedImages(source, Preprocessing(mean=e.mean, std=e.std)), plan,
                opts.num_workers, collate, call)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.wsi:
        return run_wsi(args)
    from featurestore.extract.run import ExtractOptions, extract

    spec = ENCODERS.get(args.encoder, args.encoder)
    with harness.scratch(args, "extract") as work:
        images_path = os.path.join(work, "images.npy")
        rng = np.random.default_rng(0)
        images = np.lib.format.open_memmap(images_path, mode="w+", dtype=np.uint8,
                                           shape=(args.n, args.image_size, args.image_size, 3))
        for lo in range(0, args.n, 64):
            images[lo : lo + 64] = rng.integers(0, 256, images[lo : lo + 64].shape, dtype=np.uint8)
        del images  # flushed as it goes
        opts = ExtractOptions(images=f"npy:{images_path}", encoder=spec, store=os.path.join(work, "store"),
                              dataset="bench", split="s", batch_size=args.batch_size, chunk_mb=args.chunk_mb,
                              num_workers=args.num_workers, progress=False, device=args.device,
                              precision=args.precision)
        done: list[Any] = []  # each extraction's result

        def run_extract() -> None:
            done.append(extract(opts))
            os.sync()  # the same finish line as tofile's

        def block(rows: int) -> np.ndarray:
            return np.random.default_rng(0).standard_normal((rows, *done[0].metadata["sample_shape"]), dtype=np.float32)

        def clean() -> None:
            for path in ("store", "write"):
                shutil.rmtree(os.path.join(work, path), ignore_errors=True)
            os.sync()

        raw = os.path.join(work, "raw")
        # Interleaved: a slow moment hits every method alike.
        times = interleaved([Method("encode_only_s", lambda: _encode_only(opts)),
                             Method("extract_s", run_extract),
                             # the disk's own write rate, for the same bytes
                             Method("tofile_s", lambda: harness.tofile_synced(raw, block(args.n).astype(np.float16)),
                                    teardown=lambda: os.unlink(raw), own=True),
                             Method("write_only_s", lambda: harness.write_synced(
                                 os.path.join(work, "write"), block(64), 64, n=args.n,
                                 chunk_bytes=int(args.chunk_mb * (1 << 20))), teardown=clean, own=True)], args.repeats)
        shape, best = tuple(done[0].metadata["sample_shape"]), times.bests()
        nbytes, extracted = args.n * int(np.prod(shape)) * 2, best["extract_s"]
        return {"benchmark": "extract", "encoder": spec, "device": args.device, "images": args.n,
                "image_size": args.image_size, "batch_size": args.batch_size, "cpu_count": os.cpu_count(),
                "load_average_1m": os.getloadavg()[0], "sample_shape": list(shape), "stored_dtype": "float16",
                "bytes": nbytes, **best, "ratio": extracted / best["encode_only_s"],
                "extract_vs_tofile": best["tofile_s"] / extracted,
                "writer_wait_s": done[times["extract_s"].index(extracted)].writer_wait_seconds,
                "extract_write_mb_s": nbytes / extracted / 1e6, "write_only_mb_s": nbytes / best["write_only_s"] / 1e6,
                "tofile_mb_s": nbytes / best["tofile_s"] / 1e6, "encode_only_img_s": args.n / best["encode_only_s"],
                "extract_img_s": args.n / extracted, "repeats": dict(times)}


def _data_loader(dataset: Any, batches: list[Any], workers: int | None, **options: Any) -> Any:
    """A DataLoader as extraction's: ``batches`` as its sampler, ``workers`` (None: extraction's
    default) that die with this process."""
    import torch

    from featurestore.extract.encode_loop import default_num_workers, worker_init
    from featurestore.extract.workers import DieWithParent

    workers = default_num_workers() if workers is None else workers
    return torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=workers,
                                       worker_init_fn=DieWithParent(worker_init) if workers else None, **options)


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


def encode_pass(opts: Any, dataset: Any, plan: list[Any], workers: int | None, collate: Any, call: Any) -> None:
    """Extraction's loader over ``dataset(encoder)``, its batches and encoder (``call(encoder,
    batch, device)``), the device synchronised per batch, the features dropped."""
    import torch

    from featurestore.core.device import resolve_device
    from featurestore.extract.encode_loop import autocast, resolve_precision
    from featurestore.extract.encoders import load_encoder

    device = resolve_device(opts.device)
    encoder = load_encoder(opts.encoder).to(device)
    precision = resolve_precision(opts.precision, device)
    loader = _data_loader(dataset(encoder), plan, workers, collate_fn=collate, pin_memory=device.type == "cuda")
    with torch.inference_mode():
        for batch in loader:
            with autocast(device, precision):
                call(encoder, batch, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)


def _encode_patches(opts: Any, keys_batches: list[list[Any]], workers: int) -> None:
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

    encode_pass(opts, lambda _: PatchReader(size), keys_batches, workers, collate_patches, call)


def run_wsi(args: argparse.Namespace) -> dict[str, Any]:
    """``--wsi``: slide extraction against OpenSlide alone reading the same patches (and against
    encoding alone with a real encoder)."""
    from featurestore.demo.slides import write_slide
    from featurestore.extract.encode_loop import default_num_workers
    from featurestore.extract.wsi import Target, list_slides
    from featurestore.extract.wsi_patches import PatchBatches, Patching, SlidePlanner
    from featurestore.extract.wsi_run import SlideOptions, extract_slides

    encoder = ENCODERS["zero"] if args.encoder in ("zero", "trivial") else args.encoder  # zero: the ceiling
    workers = args.num_workers if args.num_workers is not None else default_num_workers()
    with harness.scratch(args, "wsi") as work:
        slides_dir, (width, height) = harness.fresh(os.path.join(work, "slides")), args.slide_size
        for i in range(args.slides):
            write_slide(os.path.join(slides_dir, f"slide-{i:03d}.tiff"), width=width, height=height, seed=i, blobs=8)
        refs = list_slides(slides_dir)
        planner = SlidePlanner(refs, Patching(Target(args.patch_size, magnification=20.0), args.tissue, 0.5))
        plans = [planner[i] for i in range(len(refs))]
        limit = len(refs)  # --max-patches: the first slides that hold that many patches
        if args.max_patches:
            held = np.cumsum([len(plan) for plan in plans])  # type: ignore[arg-type]
            limit = min(limit, int(np.searchsorted(held, args.max_patches)) + 1)
        batches = list(PatchBatches(plans[:limit], args.batch_size, lambda _: None))
        patches = sum(len(b) for b in batches)
        files = [r.path for r in refs[:limit]]
        cold = (lambda: evict(*files)) if args.cold else None  # the slides leave the page cache per pass
        real = encoder != ENCODERS["zero"]
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

        # OpenSlide alone: RGB arrays stacked per batch in the worker by the default collate, as extraction's.
        methods = [Method("openslide_only_s", lambda: harness.drain(_data_loader(_RawReader(), batches, workers)),
                          cold)]
        if real:
            methods.append(Method("encode_only_s", lambda: _encode_patches(opts, batches, workers), cold))
        methods.append(Method("extract_s", extract, cold,
                              lambda: shutil.rmtree(os.path.join(work, "store"), ignore_errors=True)))
        times = interleaved(methods, args.repeats)
        times["extract_loop_s"] = loop
        best = times.bests()
        results: dict[str, Any] = {
            "benchmark": "extract-wsi", "encoder": encoder, "device": args.device, "slides": limit,
            "slide_size": [width, height], "patch_size": args.patch_size, "tissue": args.tissue, "patches": patches,
            "batch_size": args.batch_size, "num_workers": workers, "cold": bool(args.cold), "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0], "repeats": times, **best,
            "openslide_only_patches_s": patches / best["openslide_only_s"],
            "extract_patches_s": patches / best["extract_s"],
            "extract_vs_openslide": best["openslide_only_s"] / best["extract_s"],
            # Each repeat's own pair (measured back to back): the spread shows the machine's noise.
            "pair_ratios": times.pairs("openslide_only_s", "extract_s"),
            "extract_loop_vs_openslide": best["openslide_only_s"] / best["extract_loop_s"]}
        if real:
            results.update(encode_only_patches_s=patches / best["encode_only_s"],
                           ratio=best["extract_s"] / best["encode_only_s"])
    return results
