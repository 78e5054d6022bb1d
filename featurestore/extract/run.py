"""Extraction: images -> encoder -> a complete split, with overlapped writes and resume.

Which samples share a batch is fixed by ``plan.plan_batches`` (see there for why), so a fresh, a
resumed and a torchrun run write byte-identical chunks.

Encoding runs on the main thread; a writer thread drains a bounded queue into the split writer,
which checks, casts and measures each batch on the encoder's device and hands finished chunks to
its pool of put threads (crc32c + atomic put). The encoder waits only when ``queue_size`` batches
are queued and the put pool is full, so memory stays bounded: ``queue_size`` batches on the
device plus the pool's pending chunks on the host. The first writer error stops the main loop at
its next batch (extract.encode_loop). The run's steps, one process or torchrun ranks, are
extract.dist_run's; here, its units are the split's chunks.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from featurestore.errors import InvalidOption
from featurestore.extract.dist import Coordinator, coordinated
from featurestore.extract.dist_run import progress_bar, run_split
from featurestore.extract.encode_loop import EncodeJob, Progress, autocast, feed, first_sample_dtypes, gathered
from featurestore.extract.encode_loop import load_encoder_on, num_workers, worker_init
from featurestore.extract.encoders import Encoder, EncoderError, TokenLayout, resolve_layout
from featurestore.extract.input_check import refuse_changed_inputs_of
from featurestore.extract.options import RunOptions, torch_threads
from featurestore.extract.plan import chunk_rows_for, plan_batches
from featurestore.extract.sources import (
    Failure,
    ImageSource,
    PreparedImages,
    Preprocessing,
    SourceError,
    collate,
    open_source,
)
from featurestore.extract.workers import DieWithParent
from featurestore.extract.writer_thread import WriterThread
from featurestore.format.layout import parse_compressor
from featurestore.format.metadata import Provenance


@dataclass
class ExtractOptions(RunOptions):
    """Everything ``featurestore extract`` takes for image sources; see docs/EXTRACT.md."""

    crop: tuple[int, int] | None = None
    resize: tuple[int, int] | None = None
    compressor: str | None = None
    verify_chunks: bool = False  # re-read every chunk of an existing split: crc32c, seal, features vs stats

    def check(self) -> None:
        super().check()
        if self.compressor is not None:  # before the store is opened: a bad name must not create one
            parse_compressor(self.compressor)


@dataclass
class ExtractResult:
    status: str  # "complete" | "already-complete"
    key: str
    num_samples: int
    encoded: int = 0  # samples encoded by this run (all ranks)
    bytes_written: int = 0
    seconds: float = 0.0  # the encode-and-write loop (slowest rank)
    wall_seconds: float = 0.0  # everything, from loading the encoder to the commit
    writer_wait_seconds: float = 0.0  # the encoder blocked on the writer (full queue, final drain)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Prepared:
    source: ImageSource
    images: PreparedImages
    encoder: Encoder
    layout: TokenLayout
    device: torch.device
    precision: str
    dtype: str
    num_samples: int
    sample_shape: tuple[int, ...]
    encoder_name: str
    provenance: Provenance
    metadata: dict[str, Any]  # extra split metadata keys (the image source)


def _prepare(opts: ExtractOptions, coord: Coordinator) -> _Prepared:
    opts.check()
    source = open_source(opts.images, labels=opts.labels)
    num_samples = len(source) if opts.limit is None else min(len(source), opts.limit)
    if num_samples < 1:
        raise InvalidOption(f"--limit must be a positive integer, but got: {opts.limit}")
    encoder, encoder_name, device, precision = load_encoder_on(opts, coord)
    prep = Preprocessing(opts.crop, opts.resize, opts.mean or encoder.mean, opts.std or encoder.std)
    images = PreparedImages(source, prep)
    # One sample through the encoder: token count, output dtype and grid, before any storage.
    first = images[0]
    if isinstance(first, Failure):
        raise SourceError(first.message)
    with torch.inference_mode(), autocast(device, precision):
        tokens = encoder(first[1][None].to(device))
    image_hw = (int(first[1].shape[-2]), int(first[1].shape[-1]))
    layout = resolve_layout(encoder, int(tokens.shape[1]), image_hw, opts.tokens, opts.prefix_tokens)
    sample = layout.select(tokens)
    output_dtype, dtype = first_sample_dtypes(sample, opts, "sample 0",
                                              "Check the encoder (try --precision fp32) and its input")
    key_parts = {
        "weights_hash": encoder.weights_hash,
        "preprocessing": prep.to_dict(),
        "tokens": layout.to_dict(),
        "precision": precision,
        "dtype": dtype,
        "input": source.fingerprint(),
        "num_samples": num_samples,
    }
    cache_key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()
    provenance = Provenance(
        encoder={"name": encoder_name, "spec": opts.encoder, "weights_hash": encoder.weights_hash,
                 "output_dtype": output_dtype, "precision": precision},
        preprocessing=prep.to_dict(), token_layout=layout.to_dict(), cache_key=cache_key,
        source_dtype=output_dtype)
    metadata = {"source": {"spec": source.spec, "fingerprint": key_parts["input"], "num_samples": num_samples,
                           "labels": source.label_info}}
    return _Prepared(source, images, encoder, layout, device, precision, dtype, num_samples,
                     tuple(sample.shape[1:]), encoder_name, provenance, metadata)


class _ImagesJob(EncodeJob):
    """Image extraction as a :func:`~featurestore.extract.dist_run.run_split` job: units are chunks."""

    def create(self, *, resume: bool, overwrite: bool) -> Any:
        opts, prep = self.opts, self.prep
        ids = prep.source.ids[: prep.num_samples] if prep.source.ids is not None else None
        return self.store.create_split(
            opts.dataset, prep.encoder_name, opts.split, num_samples=prep.num_samples,
            sample_shape=prep.sample_shape, dtype=prep.dtype,
            label_shape=prep.source.label_shape or (), label_dtype=prep.source.label_dtype,
            metadata=prep.metadata, provenance=prep.provenance,
            chunk_rows=chunk_rows_for(prep.sample_shape, prep.dtype, opts.chunk_mb, opts.batch_size),
            resume=resume, overwrite=overwrite, compressor=opts.compressor, ids=ids,
            verify_chunks=opts.verify_chunks)

    def check_kept(self, writer: Any) -> None:
        # rows kept from an earlier run must still match the input (extract.input_check)
        refuse_changed_inputs_of(writer, self.prep.source.input_files, self.key)

    def work(self, writer: Any, mine: list[int]) -> Progress:
        return _encode_chunks(self.opts, self.prep, writer, mine, self.coord)

    def close(self, writer: Any, rank: int) -> None:
        if rank == 0:
            writer.flush()  # rank 0 commits with this writer
        else:
            writer.close()

    def result(self, progress: list[Progress] | None, metadata: dict[str, Any], wall_seconds: float) -> ExtractResult:
        if progress is None:
            return ExtractResult("already-complete", self.key, self.prep.num_samples, metadata=metadata)
        total = gathered(progress)
        return ExtractResult("complete", self.key, self.prep.num_samples, total.items, total.bytes_written,
                             total.seconds, wall_seconds, total.waited, metadata)


def _encode_chunks(opts: ExtractOptions, prep: _Prepared, writer: Any, chunks: list[int],
                   coord: Coordinator) -> Progress:
    """Encode and write the samples of ``chunks``."""
    plan = plan_batches(chunks, writer.chunk_rows, prep.num_samples, opts.batch_size)
    if not plan:
        return Progress()
    workers = num_workers(opts, coord)
    # DieWithParent: a SIGKILL of this process takes the workers with it (they fork in iter(loader),
    # on the caller's thread; featurestore.extract.workers says why that matters).
    loader = torch.utils.data.DataLoader(
        prep.images, batch_sampler=plan, num_workers=workers, collate_fn=collate,
        pin_memory=prep.device.type == "cuda", worker_init_fn=DieWithParent(worker_init) if workers else None)
    thread = WriterThread(writer, opts.queue_size)
    total = sum(len(b) for b in plan)
    bar = progress_bar(opts, total, "img", "extract", coord)
    started = time.perf_counter()

    def step(batch: Any) -> None:
        if isinstance(batch, Failure):
            raise SourceError(batch.message)
        indices, images, labels = batch
        with autocast(prep.device, prep.precision):
            tokens = prep.encoder(images.to(prep.device, non_blocking=True))
        if tokens.shape[1] != prep.layout.encoder_tokens:
            raise EncoderError(f"encoder {prep.encoder.spec} returned {tokens.shape[1]} tokens for samples "
                               f"{indices[0]}..{indices[-1]}, but {prep.layout.encoder_tokens} for sample 0")
        # Left on the device: the writer thread casts and measures it there, and only the
        # stored-dtype bytes cross to the host (featurestore.core.device_stats).
        thread.put((indices[0], prep.layout.select(tokens), labels))
        bar.update(len(indices))
        elapsed = max(time.perf_counter() - started, 1e-9)
        bar.set_postfix_str(f"{thread.bytes_written / elapsed / 1e6:.3g} MB/s", refresh=False)

    return feed(loader, thread, bar, prep.device, (prep.provenance.source_dtype, prep.dtype), step,
                done=Progress(items=total))


def extract(opts: ExtractOptions, coord: Coordinator | None = None) -> ExtractResult:
    """Run one extraction (or this rank's share of it); raises FeatureStoreError on bad input."""
    with coordinated(coord) as coord, torch_threads(opts.threads):
        return run_split(_ImagesJob(opts, coord, _prepare), coord)
