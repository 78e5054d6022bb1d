"""Whole-slide extraction: ``featurestore extract --images wsi:...`` -> one bag per slide.

The pipeline (featurestore.extract.wsi_patches has the DataLoader side):

1. slide plans (open, scale, level, tissue mask, kept grid patches) are made in DataLoader
   workers, one slide per item, as the patch loader needs them;
2. patches are read and preprocessed in the patch loader's workers, in batches of
   ``--batch-size`` that run across slide boundaries;
3. the encoder runs on the main thread; every call gets exactly ``[batch_size, 3, P, P]`` (the
   last batch is padded with zeros), so a patch's embedding does not depend on which patches
   share its batch: matrix kernels are picked by shape, and rows of one shape do not mix. That is
   why a resumed run, another ``--num-workers`` and another torchrun world size give the same
   bytes although their batches hold other patches;
4. a slide's bag is handed to the writer thread as soon as its last patch is encoded; bags are
   finished in slide order (a slide without tissue is an empty bag, as TRIDENT writes it).

A slide that cannot be used (missing, not a slide, no resolution, too coarse for the target,
a damaged tile) is skipped with one line naming it; the others go on. The split is committed
with the bags that were made; ``ExtractResult.skipped`` lists the rest, and the CLI exits with
status 3 (docs/EXTRACT.md). ``--resume`` skips the bags already complete (bag id = slide file
stem) and redoes any slide whose bag was cut short, skipped ones included.

Under torchrun, slide ``i`` of the sorted cohort belongs to rank ``i % world_size`` (the same
partition on every resume); each rank adds its bags through its own writer session, rank 0
commits once every rank has closed (the run's steps are featurestore.extract.dist_run's).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from featurestore.core.bag_repair import RepairWriter
from featurestore.errors import InputChanged, InvalidOption
from featurestore.extract.coords_from import SourceGrid, load_source
from featurestore.extract.dist import Coordinator, coordinated
from featurestore.extract.dist_run import left_out, progress_bar, run_split
from featurestore.extract.encode_loop import EncodeJob, Progress, autocast, feed, first_sample_dtypes, gathered
from featurestore.extract.encode_loop import load_encoder_on, num_workers, worker_init
from featurestore.extract.encoders import Encoder, EncoderError, resolve_layout
from featurestore.extract.input_check import refuse_changed_files
from featurestore.extract.label_csv import read_label_csv
from featurestore.extract.options import RunOptions, torch_threads
from featurestore.extract.sources import Preprocessing
from featurestore.extract.tissue import check_tissue_options
from featurestore.extract.wsi import SlideRef, Target, list_slides
from featurestore.extract.wsi_bags import BagAssembler
from featurestore.extract.wsi_patches import (
    PatchBatches,
    PatchReader,
    Patching,
    SlidePlan,
    SlidePlanner,
    collate_patches,
    identity,
    to_encoder,
)
from featurestore.extract.workers import DieWithParent
from featurestore.extract.writer_thread import WriterThread

SLIDE_TOKENS = ("cls", "mean")
EXIT_SKIPPED = 3  # the CLI's exit status when the split is complete but slides were skipped


@dataclass
class SlideOptions(RunOptions):
    """Everything ``featurestore extract --images wsi:...`` takes; see docs/EXTRACT.md. ``labels``
    is a CSV slide_id,label (as for featurestore import); ``limit`` the first N slides."""

    tokens: str = "cls"  # one vector per patch: the CLS token (or "mean")
    magnification: float | None = None
    mpp: float | None = None
    slide_mpp: float | None = None
    patch_size: int = 256
    tissue: str = "otsu"
    min_tissue: float = 0.5
    verify_chunks: bool = False  # re-read every chunk of an existing split; the bags of damaged ones are redone
    coords_from: str | None = None  # D/E/S: cut at that bag split's coordinates (extract.coords_from)
    coords_store: str | None = None  # its store, when not --store
    worker: Any = None  # extract.workers_share.WorkerOptions: claim slides beside other workers (--worker)


@dataclass
class SlideResult:
    status: str  # "complete" | "already-complete"
    key: str
    slides: int  # in the cohort
    bags: int = 0  # bags added by this run (all ranks)
    patches: int = 0  # patches encoded by this run (all ranks)
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"id", "path", "reason"}
    bytes_written: int = 0
    seconds: float = 0.0  # the encode-and-write loop (slowest rank)
    wall_seconds: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)


class BagWriterThread(WriterThread):
    """The writer thread for bags: items are ``(bag_id, features, coords, label, attrs)``."""

    def write(self, item: Any) -> int:
        bag_id, features, coords, label, attrs = item
        self.writer.add_bag(bag_id, features, coords=coords, label=label, attrs=attrs)
        return int(features.numel()) * self.itemsize


@dataclass
class Embedding:
    """What one patch becomes: the CLS token, the mean of the patch tokens, or the encoder's vector."""

    mode: str  # "cls" | "mean" | "vector"
    prefix: int  # tokens before the patch grid (mean skips them)
    tokens: int | None  # tokens per patch the encoder returns (None for vectors)

    def select(self, out: torch.Tensor) -> torch.Tensor:
        if self.mode == "vector":
            return out
        if self.mode == "cls":
            return out[:, 0]
        return out[:, self.prefix :].float().mean(dim=1)  # accumulated in float32

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.mode, "prefix_tokens": 0, "grid": None, "encoder_tokens": self.tokens,
                "encoder_prefix_tokens": None if self.mode == "vector" else self.prefix,
                "per_patch": {"cls": "the CLS token", "mean": "the mean of the patch tokens (float32)",
                              "vector": "the encoder's [B, D] output"}[self.mode]}


def _embedding(encoder: Encoder, out: torch.Tensor, patch_size: int, opts: SlideOptions) -> Embedding:
    if out.ndim == 2:
        return Embedding("vector", 0, None)
    layout = resolve_layout(encoder, int(out.shape[1]), (patch_size, patch_size),
                            "cls" if opts.tokens == "cls" else "patch", opts.prefix_tokens)
    return Embedding(opts.tokens, int(layout.encoder_prefix_tokens or 0), int(out.shape[1]))


def _labels(refs: list[SlideRef], labels_csv: str | None, list_csv: str | None) -> tuple[dict[str, Any] | None, list[str] | None]:
    """Bag labels by id and class names (text labels) from ``--labels CSV``, else from a
    ``wsi:LIST.csv`` with a ``label`` column; ``featurestore import``'s rules (bag_import)."""
    path = labels_csv or (list_csv if any(r.label is not None for r in refs) else None)
    if path is None:
        return None, None
    labels, names, _ = read_label_csv(path, [r.id for r in refs])
    return labels, names


@dataclass
class _Prepared:
    refs: list[SlideRef]
    labels: dict[str, Any] | None
    label_names: list[str] | None
    patching: Patching
    preprocessing: Preprocessing
    encoder: Encoder
    embedding: Embedding
    device: torch.device
    precision: str
    dtype: str
    dim: int
    encoder_name: str
    metadata: dict[str, Any]
    grid: SourceGrid | None = None  # --coords-from


def _check_options(opts: SlideOptions) -> None:
    opts.check()
    if opts.tokens not in SLIDE_TOKENS:
        raise InvalidOption(f"--tokens {opts.tokens!r} does not apply to slides: a bag row is one vector per patch, "
                            "use --tokens cls (default) or mean")
    if opts.limit is not None and opts.limit < 1:
        raise InvalidOption(f"--limit must be a positive integer, but got: {opts.limit}")
    check_tissue_options(opts.tissue, opts.min_tissue)


def _prepare(opts: SlideOptions, coord: Coordinator) -> _Prepared:
    _check_options(opts)
    kind, _, target = opts.images.partition(":")
    if kind != "wsi" or not target:
        raise InvalidOption(f"slide sources are wsi:DIR, wsi:SLIDE or wsi:LIST.csv, but got: {opts.images!r}")
    patching = Patching(Target(opts.patch_size, opts.magnification, opts.mpp, opts.slide_mpp),
                        opts.tissue, opts.min_tissue)
    refs = list_slides(target)[: opts.limit]
    labels, label_names = _labels(refs, opts.labels, target if target.lower().endswith(".csv") else None)
    grid = None
    if opts.coords_from is not None:
        grid = load_source(opts.coords_from, opts.store, opts.coords_store, opts.storage_options, refs,
                           patching.target)
    elif opts.coords_store is not None:
        raise InvalidOption("--coords-store names the store of --coords-from: give --coords-from D/E/S too")
    encoder, encoder_name, device, precision = load_encoder_on(opts, coord)
    size = opts.patch_size
    preprocessing = Preprocessing(resize=(size, size), mean=opts.mean or encoder.mean, std=opts.std or encoder.std)
    # A white patch through the encoder: its output shape, dtype and width, before any slide or storage.
    white = to_encoder(torch.full((1, 3, size, size), 255, dtype=torch.uint8), preprocessing, device)
    with torch.inference_mode(), autocast(device, precision):
        out = encoder(white, vectors=True)
    embedding = _embedding(encoder, out, opts.patch_size, opts)
    sample = embedding.select(out)
    output_dtype, dtype = first_sample_dtypes(sample, opts, "a white patch", "Check the encoder (try --precision fp32)")
    recorded = {**preprocessing.to_dict(), "resize_mode": "bilinear-antialias, rounded to uint8",
                "patching": patching.to_dict(),
                "read": "OpenSlide read_region at the level, transparent pixels on white"}
    key_parts = {"weights_hash": encoder.weights_hash, "preprocessing": recorded,
                 "tokens": embedding.to_dict(), "precision": precision, "dtype": dtype}
    if grid is not None:  # other patches, other rows: a resume or re-run must cut at the same source
        key_parts["coords_from"] = {k: grid.lineage[k] for k in ("dataset", "encoder", "split", "generation")}
    cache_key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()
    metadata = {
        "encoder": {"name": encoder_name, "spec": opts.encoder, "weights_hash": encoder.weights_hash,
                    "output_dtype": output_dtype, "precision": precision},
        "preprocessing": recorded, "token_layout": embedding.to_dict(), "cache_key": cache_key,
        "source_dtype": output_dtype,
        "source": {"spec": opts.images, "kind": "wsi", "slides": len(refs), "slides_digest": slides_digest(refs),
                   "batch_size": opts.batch_size, "partition": "slide i of the sorted cohort -> rank i % world_size"},
    }
    if label_names is not None:
        metadata["label_names"] = label_names
    if grid is not None:
        metadata["coords_from"] = grid.lineage
    return _Prepared(refs, labels, label_names, patching, preprocessing, encoder, embedding, device, precision,
                     dtype, int(sample.shape[-1]), encoder_name, metadata, grid)


def slides_digest(refs: list[SlideRef]) -> str:
    """The cohort a split is made of: a digest of its slide ids, in order (the slide list is sorted)."""
    return hashlib.sha256("\n".join(ref.id for ref in refs).encode()).hexdigest()


class _SlidesJob(EncodeJob):
    """Slide extraction as a :func:`~featurestore.extract.dist_run.run_split` job: units are slides,
    each added as one bag by the process that encodes it (a writer session of its own)."""

    def check_kept(self, writer: Any) -> None:
        """One split, one cohort: a resume, a re-run or a ``--worker`` listing other slides than the
        run that created the split is refused (two workers with two lists would race at the
        commit, and a complete split re-run with a new slide would report it complete)."""
        recorded = writer.metadata.extra.get("source") or {}
        refs = self.prep.refs
        if recorded.get("slides_digest") in (None, slides_digest(refs)):  # None: a split from before the digest
            # The same list: the slides whose bags are kept must be the files they were made from
            # (a slide re-scanned under its name would leave a split of two scans).
            try:
                refuse_changed_files([r.path for r in refs], [r.id for r in refs], writer, self.key)
            except InputChanged:
                writer.close()
                raise
            return
        listed = {ref.id for ref in refs}
        gone = sorted(writer.done_ids - listed)
        detail = f"its bag {gone[0]!r} is not in this list" if gone else "other slide ids"
        writer.close()
        raise InputChanged(f"split {self.key} was started on {recorded.get('slides')} slides and this run lists "
                           f"{len(refs)} ({detail}): every run of a split, each --worker too, takes the same slide "
                           "list (folder or CSV, and --limit); extract other slides into another --split, or "
                           + ("`featurestore rm` this split, then start the workers with this list"
                              if self.opts.worker is not None else "--overwrite to redo this one with this list"))

    def create(self, *, resume: bool, overwrite: bool) -> Any:
        opts, prep = self.opts, self.prep
        return self.store.create_bag_split(
            opts.dataset, prep.encoder_name, opts.split, dim=prep.dim, dtype=prep.dtype, metadata=prep.metadata,
            resume=resume, overwrite=overwrite, coords_unit="px", coords_dtype="int64",
            # Per slide (it follows each slide's scan): kept in each bag's attrs, not split-wide.
            patch_size_level0=None, label_dtype="int64" if prep.label_names is not None else None,
            chunk_bytes=int(opts.chunk_mb * (1 << 20)), verify_chunks=opts.verify_chunks)

    def units(self, writer: Any) -> list[tuple[int, SlideRef]]:
        done = writer.done_ids
        # A repair (core.bag_repair) redoes the bags of damaged chunks only: not the slides skipped
        # before, whose bags would be new ones, and the run's list of skipped slides stays.
        repair = writer.repair_ids if isinstance(writer, RepairWriter) else None
        return [(i, ref) for i, ref in enumerate(self.prep.refs)
                if ref.id not in done and (repair is None or ref.id in repair)]

    def missing_from(self, writer: Any, meta: dict[str, Any]) -> list[str]:
        gone = left_out(meta)
        return [ref.id for _, ref in self.units(writer) if ref.id not in gone]

    def unit_id(self, unit: SlideRef) -> str:
        return unit.id

    def unit_record(self, part: Progress) -> dict[str, Any]:
        return {"skipped": part.skipped[0]} if part.skipped else {}

    def merge(self, parts: list[Progress]) -> Progress:  # one process's slides, one after another
        return gathered(parts, in_turn=True) if parts else Progress()

    def work(self, writer: Any, mine: list[SlideRef]) -> Progress:
        return _encode_slides(self.opts, self.prep, writer, mine, self.coord)

    def close(self, writer: Any, rank: int) -> None:
        writer.close()

    def commit(self, writer: Any, progress: list[Progress]) -> dict[str, Any]:
        if isinstance(writer, RepairWriter):
            return writer.commit(extra=None)
        return writer.commit(extra={"skipped": gathered(progress).skipped})

    def result(self, progress: list[Progress] | None, metadata: dict[str, Any], wall_seconds: float) -> SlideResult:
        if progress is None:
            return SlideResult("already-complete", self.key, len(self.prep.refs), metadata=metadata)
        total = gathered(progress)
        return SlideResult("complete", self.key, len(self.prep.refs), total.items, total.patches, total.skipped,
                           total.bytes_written, total.seconds, wall_seconds, metadata)


def _encode_slides(opts: SlideOptions, prep: _Prepared, writer: Any, refs: list[SlideRef],
                   coord: Coordinator) -> Progress:
    """Plan, read, encode and add the bags of ``refs``, in order."""
    if not refs:
        return Progress()
    workers = num_workers(opts, coord)
    init = DieWithParent(worker_init) if workers else None
    # Planning is a small share of the work (one thumbnail per slide): one worker keeps ahead.
    plan_loader = torch.utils.data.DataLoader(
        SlidePlanner(refs, prep.patching, None if prep.grid is None else prep.grid.slides), batch_size=None, num_workers=min(workers, 1), collate_fn=identity,
        worker_init_fn=init)
    assembler = BagAssembler(prep.dim, prep.device)
    batches = PatchBatches(plan_loader, opts.batch_size, assembler.plan)
    # batch_sampler: PatchBatches is iterated here, on this thread, lazily (a generator, no len).
    loader = torch.utils.data.DataLoader(
        PatchReader(opts.patch_size), batch_sampler=batches, num_workers=workers,  # type: ignore[arg-type]
        collate_fn=collate_patches, pin_memory=prep.device.type == "cuda", worker_init_fn=init)
    thread = BagWriterThread(writer, opts.queue_size)
    bar = progress_bar(opts, len(refs), "slide", "extract", coord)
    started = time.perf_counter()
    done = Progress()

    def hand_over() -> None:  # the finished slides, in order, to the writer thread
        for slide in assembler.finished():
            ref = refs[slide.position]
            if slide.features is None:
                done.skipped.append({"id": ref.id, "path": ref.path, "reason": slide.reason or ""})
            else:
                plan = slide.plan
                assert isinstance(plan, SlidePlan)
                label = None if prep.labels is None else prep.labels[ref.id]
                thread.put((ref.id, slide.features, plan.coords, label, plan.attrs))
                done.items += 1
                done.patches += len(plan)
            bar.update(1)
            bar.set_postfix_str(f"{done.patches / max(time.perf_counter() - started, 1e-9):.0f} patches/s", refresh=False)

    def step(batch: Any) -> None:
        for failure in batch.skipped:
            assembler.skip(failure.position, failure.reason)
        if batch.keys:
            assembler.add(batch.keys, _encode(batch.images, prep, opts.batch_size))
        hand_over()

    def last() -> None:
        hand_over()
        if assembler.next != len(refs):  # every plan was recorded and every patch encoded by now
            raise RuntimeError(f"internal error: {len(refs) - assembler.next} slides were not finished")

    return feed(loader, thread, bar, prep.device, (prep.metadata["source_dtype"], prep.dtype), step, last, done)


def _encode(images: torch.Tensor, prep: _Prepared, batch_size: int) -> torch.Tensor:
    """One vector per patch of a uint8 batch: ``[n, dim]`` on the encoder's device."""
    n = len(images)
    if n < batch_size:  # one shape for every call: see the module docstring
        images = torch.cat([images, images.new_zeros((batch_size - n, *images.shape[1:]))])
    with autocast(prep.device, prep.precision):
        out = prep.encoder(to_encoder(images, prep.preprocessing, prep.device), vectors=True)
    if prep.embedding.tokens is not None and (out.ndim != 3 or out.shape[1] != prep.embedding.tokens):
        raise EncoderError(f"encoder {prep.encoder.spec} returned shape {list(out.shape)} for a batch of patches, "
                           f"but {prep.embedding.tokens} tokens for the first one")
    # contiguous(): a copy of the CLS rows, so a slide's pieces do not keep every [B, T, D] output alive.
    return prep.embedding.select(out)[:n].contiguous()


def extract_slides(opts: SlideOptions, coord: Coordinator | None = None) -> SlideResult:
    """Run one slide extraction (or this rank's share of it); raises FeatureStoreError on bad input."""
    with coordinated(coord) as coord, torch_threads(opts.threads):
        return run_split(_SlidesJob(opts, coord, _prepare), coord, _share(opts.worker, coord))


def _share(worker: Any, coord: Coordinator) -> Any:
    if worker is None:
        return None
    if coord.world_size > 1:
        raise InvalidOption("--worker runs independent processes that claim slides: do not start it under torchrun")
    from featurestore.extract.workers_share import ClaimShare

    return ClaimShare(worker)


__all__ = ["EXIT_SKIPPED", "SlideOptions", "SlideResult", "extract_slides"]
