"""Extraction: images -> encoder -> a complete split, with overlapped writes and resume.

Which samples share a batch is fixed by ``plan.plan_batches`` (see there for why), so a fresh, a
resumed and a torchrun run write byte-identical chunks.

Encoding runs on the main thread; a writer thread drains a bounded queue into the split writer,
which checks, casts and measures each batch on the encoder's device and hands finished chunks to
its pool of put threads (crc32c + atomic put). The encoder waits only when ``queue_size`` batches
are queued and the put pool is full, so memory stays bounded: ``queue_size`` batches on the
device plus the pool's pending chunks on the host. The first writer error stops the main loop at
its next batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from featurestore.core import fused_stats
from featurestore.core.device import resolve_device
from featurestore.errors import (
    DatasetNotFound,
    EncoderNotFound,
    Float16Overflow,
    InvalidOption,
    NonFiniteValues,
    SplitExists,
    SplitNotFound,
)
from featurestore.extract.dist import Coordinator, coordinator_from_env
from featurestore.extract.encoders import Encoder, EncoderError, TokenLayout, load_encoder, resolve_layout
from featurestore.extract.input_check import refuse_changed_inputs_of
from featurestore.extract.plan import chunk_rows_for, plan_batches, resolve_dtype
from featurestore.extract.sources import (
    Failure,
    ImageSource,
    PreparedImages,
    Preprocessing,
    SourceError,
    collate,
    open_source,
)
from featurestore.extract.options import RunOptions, torch_threads
from featurestore.extract.workers import DieWithParent
from featurestore.extract.writer_thread import WriterThread
from featurestore.format import dtypes
from featurestore.format.metadata import Provenance
from featurestore.format.names import validate_name


@dataclass
class ExtractOptions(RunOptions):
    """Everything ``featurestore extract`` takes for image sources; see docs/EXTRACT.md."""

    crop: tuple[int, int] | None = None
    resize: tuple[int, int] | None = None
    compressor: str | None = None
    verify_chunks: bool = False  # re-read every chunk of an existing split: crc32c, seal, features vs stats


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


def resolve_precision(choice: str, device: torch.device) -> str:
    """``bf16`` (autocast) or ``fp32``: bf16 by default on CUDA, float32 on the CPU."""
    if choice == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if choice not in ("bf16", "fp32"):
        raise InvalidOption(f"--precision {choice!r} is not one of auto, bf16, fp32")
    return choice


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


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def _prepare(opts: ExtractOptions, coord: Coordinator) -> _Prepared:
    opts.check()
    source = open_source(opts.images, labels=opts.labels)
    num_samples = len(source) if opts.limit is None else min(len(source), opts.limit)
    if num_samples < 1:
        raise InvalidOption(f"--limit must be a positive integer, but got: {opts.limit}")
    encoder = load_encoder(opts.encoder)
    encoder_name = validate_name(opts.encoder_name or encoder.default_name, "encoder name")
    device = resolve_device(opts.device, coord.local_rank)
    encoder.to(device)
    precision = resolve_precision(opts.precision, device)
    prep = Preprocessing(opts.crop, opts.resize, opts.mean or encoder.mean, opts.std or encoder.std)
    images = PreparedImages(source, prep)
    # One sample through the encoder: token count, output dtype and grid, before any storage.
    first = images[0]
    if isinstance(first, Failure):
        raise SourceError(first.message)
    with torch.inference_mode(), _autocast(device, precision):
        tokens = encoder(first[1][None].to(device))
    image_hw = (int(first[1].shape[-2]), int(first[1].shape[-1]))
    layout = resolve_layout(encoder, int(tokens.shape[1]), image_hw, opts.tokens, opts.prefix_tokens)
    sample = layout.select(tokens)
    if not bool(torch.isfinite(sample).all()):  # refuse before the store is touched
        raise NonFiniteValues(f"encoder {opts.encoder} returned NaN or Inf for sample 0: featurestore does "
                              "not store non-finite values. Check the encoder (try --precision fp32) and its input")
    output_dtype = str(sample.dtype).removeprefix("torch.")
    dtype = resolve_dtype(opts.dtype, output_dtype)
    _check_first_sample_fits(sample, dtype, opts.encoder)
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


def _check_first_sample_fits(sample: torch.Tensor, dtype: str, spec: str) -> None:
    """The writer's range rules, applied to sample 0 before the store is touched (like NaN):
    a run that cannot store its first sample must not leave a ``writing`` split behind."""
    abs_max = float(sample.detach().abs().max().float())
    if dtype == "float16" and abs_max > dtypes.FLOAT16_MAX:
        raise Float16Overflow(
            f"encoder {spec} returned values up to {abs_max:.6g} for sample 0, beyond float16's "
            "range +-65504; nothing was written. Use --dtype bfloat16 (float32's range, ~4e-3 "
            "relative error) or --dtype float32 (exact)")
    if dtype == "bfloat16" and abs_max >= dtypes.BFLOAT16_ROUNDS_TO_INF:
        raise NonFiniteValues(
            f"encoder {spec} returned values up to {abs_max:.6g} for sample 0, which round to Inf "
            "in bfloat16; nothing was written. Use --dtype float32 (exact)")


def _open_split(opts: ExtractOptions, prep: _Prepared, store: Any, *, resume: bool, overwrite: bool) -> Any:
    """The split's writer, or None when it is already complete and intact.

    An existing split is continued through ``create_split(resume=True)``, which is the one place
    that compares cache keys and settings; a complete split is re-checked there (sizes, crc32c
    with ``--verify-chunks``) and reopened for the chunks that are missing or damaged.
    """
    key = f"{opts.dataset}/{prep.encoder_name}/{opts.split}"
    if not overwrite:
        try:
            existing = store.split_info(opts.dataset, prep.encoder_name, opts.split)
        except (DatasetNotFound, EncoderNotFound, SplitNotFound):
            existing = None
        if existing is not None:
            if not existing.complete and not resume:
                raise SplitExists(f"split {key} exists but is incomplete (status "
                                  f"{existing.status!r}): pass --resume to continue it or "
                                  "--overwrite to start over")
            writer = _create_split(opts, prep, store, resume=True, overwrite=False)
            # Rows kept from an earlier run must still match the input (extract.input_check).
            refuse_changed_inputs_of(writer, prep.source.input_files, key)
            return None if writer.metadata.complete else writer
    return _create_split(opts, prep, store, resume=resume, overwrite=overwrite)


def _create_split(opts: ExtractOptions, prep: _Prepared, store: Any, *, resume: bool, overwrite: bool) -> Any:
    ids = prep.source.ids[: prep.num_samples] if prep.source.ids is not None else None
    return store.create_split(
        opts.dataset, prep.encoder_name, opts.split, num_samples=prep.num_samples,
        sample_shape=prep.sample_shape, dtype=prep.dtype,
        label_shape=prep.source.label_shape or (), label_dtype=prep.source.label_dtype,
        metadata=prep.metadata, provenance=prep.provenance,
        chunk_rows=chunk_rows_for(prep.sample_shape, prep.dtype, opts.chunk_mb, opts.batch_size),
        resume=resume, overwrite=overwrite, compressor=opts.compressor, ids=ids,
        verify_chunks=opts.verify_chunks)


def default_num_workers(world_size: int = 1) -> int:
    """Image workers when ``--num-workers`` is not given: leave a core to the encoder; ranks
    share the machine's cores."""
    return min(4, max(0, (os.cpu_count() or 1) // world_size - 1))


def _worker_init(_: int) -> None:
    # Workers only decode and resize one image at a time; intra-op threads would oversubscribe.
    torch.set_num_threads(1)


def _encode_chunks(opts: ExtractOptions, prep: _Prepared, writer: Any, chunks: list[int],
                   coord: Coordinator) -> tuple[int, int, float, float]:
    """Encode and write the samples of ``chunks``: (samples, bytes, seconds, seconds waited)."""
    plan = plan_batches(chunks, writer.chunk_rows, prep.num_samples, opts.batch_size)
    total = sum(len(b) for b in plan)
    if not plan:
        return 0, 0, 0.0, 0.0
    workers = opts.num_workers if opts.num_workers is not None else default_num_workers(coord.world_size)
    # DieWithParent: a SIGKILL of this process takes the workers with it (they fork in iter(loader)
    # below, on the caller's thread; featurestore.extract.workers says why that matters).
    loader = torch.utils.data.DataLoader(
        prep.images, batch_sampler=plan, num_workers=workers, collate_fn=collate,
        pin_memory=prep.device.type == "cuda", worker_init_fn=DieWithParent(_worker_init) if workers else None)
    from tqdm import tqdm

    thread = WriterThread(writer, opts.queue_size)
    thread.start()
    bar = tqdm(total=total, unit="img", desc=f"extract r{coord.rank}" if coord.world_size > 1 else "extract",
               # None: tqdm shows itself on a terminal only; one bar per job, on rank 0.
               disable=True if not opts.progress or coord.rank != 0 else None, file=sys.stderr,
               dynamic_ncols=True)
    started = time.perf_counter()
    try:
        batches = iter(loader)  # image workers start (fork) here, before the warm-up thread exists
        if prep.device.type == "cpu":  # host batches: the writer's fused kernel, loaded meanwhile
            threading.Thread(target=fused_stats.warm_up, args=(prep.provenance.source_dtype, prep.dtype),
                             name="featurestore-warm-up", daemon=True).start()
        with torch.inference_mode():
            for batch in batches:
                if isinstance(batch, Failure):
                    raise SourceError(batch.message)
                indices, images, labels = batch
                with _autocast(prep.device, prep.precision):
                    tokens = prep.encoder(images.to(prep.device, non_blocking=True))
                if tokens.shape[1] != prep.layout.encoder_tokens:
                    raise EncoderError(f"encoder {prep.encoder.spec} returned {tokens.shape[1]} tokens for samples "
                                       f"{indices[0]}..{indices[-1]}, but {prep.layout.encoder_tokens} for sample 0")
                # Left on the device: the writer thread casts and measures it there, and only
                # the stored-dtype bytes cross to the host (featurestore.core.device_stats).
                features = prep.layout.select(tokens)
                thread.put((indices[0], features, labels))
                bar.update(len(indices))
                elapsed = max(time.perf_counter() - started, 1e-9)
                bar.set_postfix_str(f"{thread.bytes_written / elapsed / 1e6:.3g} MB/s", refresh=False)
        thread.finish()
    except BaseException:
        # Let the thread write what is queued (complete chunks help a resume) and end.
        thread.queue.put(None)
        thread.join()
        raise
    finally:
        bar.close()
    return total, thread.bytes_written, time.perf_counter() - started, thread.waited


def extract(opts: ExtractOptions, coord: Coordinator | None = None) -> ExtractResult:
    """Run one extraction (or this rank's share of it); raises FeatureStoreError on bad input."""
    coord = coord or coordinator_from_env()
    with torch_threads(opts.threads):
        return _extract(opts, coord)


def _extract(opts: ExtractOptions, coord: Coordinator) -> ExtractResult:
    from featurestore import open_store

    started = time.perf_counter()
    key = f"{opts.dataset}/{opts.encoder_name or '?'}/{opts.split}"
    prep: _Prepared | None = None
    error: BaseException | None = None
    try:
        prep = _prepare(opts, coord)
        store = open_store(opts.store, mode="a", **opts.storage_options)
        key = f"{opts.dataset}/{prep.encoder_name}/{opts.split}"
    except BaseException as e:  # every rank must reach agree(), or the others would wait forever
        error = e
    coord.agree(error)
    assert prep is not None
    writer: Any = None
    error = None
    if coord.rank == 0:
        try:
            writer = _open_split(opts, prep, store, resume=opts.resume, overwrite=opts.overwrite)
        except BaseException as e:
            error = e
    done = coord.agree(error, payload=writer is None if coord.rank == 0 else None)[0]
    if done:
        meta = store.split_metadata(opts.dataset, prep.encoder_name, opts.split)
        return ExtractResult("already-complete", key, prep.num_samples, metadata=meta)
    error = None
    encoded = written = 0
    seconds = waited = 0.0
    try:
        if coord.rank != 0:  # attach to the split rank 0 created or resumed
            writer = _create_split(opts, prep, store, resume=True, overwrite=False)
        mine = [c for c in writer.pending_chunks() if coord.owns(c)]
        encoded, written, seconds, waited = _encode_chunks(opts, prep, writer, mine, coord)
        if coord.rank == 0:
            writer.flush()
        else:
            writer.close()
    except BaseException as e:
        error = e
    totals = coord.agree(error, payload=(encoded, written, seconds, waited))
    error, meta = None, {}
    if coord.rank == 0:
        try:
            meta = writer.commit()
        except BaseException as e:
            error = e
    coord.agree(error)
    return ExtractResult("complete", key, prep.num_samples, sum(t[0] for t in totals),
                         sum(t[1] for t in totals), max(t[2] for t in totals),
                         time.perf_counter() - started, max(t[3] for t in totals), meta)

