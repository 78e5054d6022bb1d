"""``featurestore import``: an existing feature cache -> a split, streaming and resumable (readers: extract/caches.py).

Caches people already hold, read without loading them whole:

- a **directory** with one ``.pt`` or ``.npy`` file per sample (eva's embeddings layout), in
  natural name order (``2.pt`` before ``10.pt``); the file stems become the sample ids;
- an **HDF5 file** (THUNDER-style; needs h5py) with one ``[N, ...]`` dataset, or one dataset per
  sample (in a group, natural name order, names -> ids);
- a directory of **per-slide files** (TRIDENT/CLAM/STAMP ``.h5``, CLAM ``pt_files/``): a bag split,
  one bag per slide (extract/bag_import.py, readers in extract/slide_files.py);
- a **tensor file**: ``torch.save`` of one ``[N, ...]`` tensor (the ``torch.cat`` cache of a probe),
  memory-mapped (``torch.load(mmap=True)``), or a ``.npy`` ``[N, ...]`` array (``mmap_mode="r"``).

Rows go to the writer chunk by chunk, in batches of ``batch_size`` rows, so host RAM holds one
batch. The same precision policy as extraction applies (``--dtype auto``: float16/bfloat16 kept,
float32 -> float16 under the overflow guard) and the same quantization report closes the run.
``resume`` keeps the chunks already valid on storage and reads only the others. Every sample is
checked against sample 0's shape and dtype as it is read: a ragged or mismatched cache stops with
one :class:`~featurestore.errors.ShapeMismatch` line naming the sample, before its chunk is written.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from featurestore.errors import (
    DatasetNotFound,
    EncoderNotFound,
    ShapeMismatch,
    SourceError,
    SplitExists,
    SplitNotFound,
)
from featurestore.extract.input_check import refuse_changed_inputs_of
from featurestore.extract.plan import check_chunk_mb, chunk_rows_for, resolve_dtype
from featurestore.extract.slide_files import SlideFiles, find_slides
from featurestore.format.names import validate_name

if TYPE_CHECKING:
    from featurestore.extract.caches import ArraySource, CacheSource

__all__ = ["ImportOptions", "ImportResult", "import_cache"]

# --------------------------------------------------------------------------- the import
@dataclass
class ImportOptions:
    source: str
    store: str
    dataset: str
    encoder_name: str
    split: str
    dtype: str = "auto"
    labels: str | None = None
    key: str | None = None
    prefix_tokens: int = 0
    grid: tuple[int, int] | None = None
    batch_size: int = 256
    chunk_mb: float = 8.0
    resume: bool = False
    overwrite: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    verify_chunks: bool = False  # re-read and check every chunk of an existing split (the repair)
    bags: bool = False  # read a directory of .pt files as one bag per file (CLAM pt_files under another name)
    label_column: str | None = None  # slide bags: the --labels CSV column stored as the label (None: "label")
    id_column: str | None = None  # slide bags: the CSV column naming the slides (None: "slide_id")


@dataclass
class ImportResult:
    status: str  # "complete" | "already-complete"
    key: str
    num_samples: int
    imported: int = 0
    seconds: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # one line each: what the import left out, and why


def _token_layout(shape: tuple[int, ...], prefix: int, grid: tuple[int, int] | None) -> dict[str, Any]:
    if len(shape) == 1:
        return {"tokens": "cls", "prefix_tokens": 0, "grid": None, "encoder_tokens": None,
                "encoder_prefix_tokens": None}
    tokens = shape[0]
    if not 0 <= prefix < tokens:
        raise ShapeMismatch(f"--prefix-tokens {prefix} does not fit samples of {tokens} tokens")
    if grid is None:
        side = int(round((tokens - prefix) ** 0.5))
        grid = (side, side) if side * side == tokens - prefix else None
    elif grid[0] * grid[1] != tokens - prefix:
        raise ShapeMismatch(f"--grid {grid[0]} {grid[1]} needs {grid[0] * grid[1]} patch tokens, but samples "
                            f"have {tokens} tokens with {prefix} prefix tokens")
    return {"tokens": "all" if prefix else "patch", "prefix_tokens": prefix,
            "grid": list(grid) if grid else None, "encoder_tokens": tokens, "encoder_prefix_tokens": prefix}


def import_cache(opts: ImportOptions) -> ImportResult:
    """Bring the cache at ``opts.source`` in as a split; raises FeatureStoreError on bad input."""
    from featurestore import open_store

    for value, what in ((opts.dataset, "dataset"), (opts.encoder_name, "encoder name"), (opts.split, "split")):
        validate_name(value, what)
    if opts.batch_size < 1:
        raise SourceError(f"--batch-size must be a positive integer, but got: {opts.batch_size}")
    if opts.resume and opts.overwrite:
        raise SourceError("--resume and --overwrite exclude each other: choose one")
    check_chunk_mb(opts.chunk_mb)
    slides = find_slides(opts.source, force=opts.bags)
    if slides is not None:  # per-slide files (TRIDENT, CLAM, STAMP): one bag per file
        from featurestore.extract.bag_import import import_bags

        return import_bags(opts, SlideFiles(*slides))
    if opts.bags:
        raise SourceError(f"--bags: {opts.source!r} is not a directory of per-slide .h5 or .pt files")
    if opts.label_column is not None or opts.id_column is not None:
        raise SourceError(f"--label-column/--id-column name columns of a slide-bags labels CSV, but {opts.source!r} "
                          "is not a directory of per-slide files: leave them out")
    # The dense caches' readers import torch (a .pt cache): imported here, so a bag import of
    # .h5 files starts without it (seconds of a CLI run).
    from featurestore.extract.caches import open_cache, open_labels

    started = time.perf_counter()
    source = open_cache(opts.source, opts.key, opts.labels)
    labels = open_labels(opts.labels, source)
    source_dtype = source.dtype  # float64 too: the writer measures the float64 -> stored error
    dtype = resolve_dtype(opts.dtype, source_dtype)
    layout = _token_layout(source.sample_shape, opts.prefix_tokens, opts.grid)
    fingerprint = {"source": source.fingerprint(), "labels": labels.fingerprint() if labels else None}
    key_parts = {"import": fingerprint, "dtype": dtype, "tokens": layout, "num_samples": source.num_samples}
    cache_key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()
    metadata = {
        "encoder": {"name": opts.encoder_name, "spec": f"import:{source.spec}", "weights_hash": None,
                    "output_dtype": source.dtype, "precision": None},
        "preprocessing": None,
        "token_layout": layout,
        "source_dtype": source_dtype,
        "cache_key": cache_key,
        "source": {"spec": source.spec, "format": source.kind, "fingerprint": fingerprint,
                   "num_samples": source.num_samples, "labels": labels.spec if labels else None},
    }
    store = open_store(opts.store, mode="a", **opts.storage_options)
    key = f"{opts.dataset}/{opts.encoder_name}/{opts.split}"
    resume = resume_existing(store, opts, key)
    writer = store.create_split(
        opts.dataset, opts.encoder_name, opts.split, num_samples=source.num_samples,
        sample_shape=source.sample_shape, dtype=dtype,
        label_shape=labels.sample_shape if labels else (), label_dtype=labels.dtype if labels else None,
        metadata=metadata, chunk_rows=chunk_rows_for(source.sample_shape, dtype, opts.chunk_mb, 1),
        resume=resume, overwrite=opts.overwrite, ids=source.ids, verify_chunks=opts.verify_chunks)
    if resume:  # rows kept from an earlier run must still match the input (extract.input_check)
        refuse_changed_inputs_of(writer, lambda a, b: source.input_files(a, b) + (
            labels.input_files(a, b) if labels else []), key)
    if writer.metadata.complete:
        return ImportResult("already-complete", key, source.num_samples, metadata=store.split_metadata(
            opts.dataset, opts.encoder_name, opts.split))
    imported = _copy(source, labels, writer, opts)
    meta = writer.commit()
    return ImportResult("complete", key, source.num_samples, imported, time.perf_counter() - started, meta)


def resume_existing(store: Any, opts: Any, key: str) -> bool:
    """Whether an import writes with ``resume=True``: asked for, or the split exists and is not
    being overwritten (a re-run of a complete split is then a check, not a refusal). An
    incomplete split needs ``--resume`` or ``--overwrite``. The writer (``create_split`` /
    ``create_bag_split`` with ``resume=True``) is the one place that compares cache keys and
    settings (CacheKeyMismatch for another cache) and re-checks what it keeps."""
    if opts.overwrite:
        return bool(opts.resume)
    try:
        existing = store.split_info(opts.dataset, opts.encoder_name, opts.split)
    except (DatasetNotFound, EncoderNotFound, SplitNotFound):
        return bool(opts.resume)
    if not existing.complete and not opts.resume:
        raise SplitExists(f"split {key} exists but is incomplete (status {existing.status!r}): "
                          "pass --resume to continue it or --overwrite to start over")
    return True


def _copy(source: CacheSource, labels: ArraySource | None, writer: Any, opts: ImportOptions) -> int:
    """Read and write the rows of the pending chunks, ``batch_size`` rows at a time."""
    from tqdm import tqdm

    pending = writer.pending_chunks()
    total = sum(writer.chunk_range(c)[1] - writer.chunk_range(c)[0] for c in pending)
    bar = tqdm(total=total, unit="sample", desc="import", disable=True if not opts.progress else None,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for chunk in pending:
            lo, hi = writer.chunk_range(chunk)
            for start in range(lo, hi, opts.batch_size):
                stop = min(start + opts.batch_size, hi)
                rows = source.read(start, stop)
                writer.write(start, rows, labels.read(start, stop) if labels else None)
                bar.update(stop - start)
            writer.flush()  # the chunk is complete: on storage now, so a crash keeps it
    finally:
        bar.close()
    return total
