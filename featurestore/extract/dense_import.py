"""``featurestore import`` of a dense cache (extract/caches.py reads it) -> a split, chunk by chunk.

Rows go to the writer chunk by chunk, in batches of ``batch_size`` rows, so host RAM holds one
batch. The same precision policy as extraction applies (``--dtype auto``: float16/bfloat16 kept,
float32 -> float16 under the overflow guard) and the same quantization report closes the run.
``resume`` keeps the chunks already valid on storage and reads only the others. Every sample is
checked against sample 0's shape and dtype as it is read: a ragged or mismatched cache stops with
one :class:`~featurestore.errors.ShapeMismatch` line naming the sample, before its chunk is written.
The run's steps (create or resume, the chunks to write, commit) are extract.dist_run's.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from featurestore.errors import Float16Overflow, NonFiniteValues, ShapeMismatch, SourceError
from featurestore.extract.dist_run import SplitJob, progress_bar
from featurestore.extract.import_types import ImportOptions, ImportResult
from featurestore.extract.input_check import refuse_changed_inputs_of
from featurestore.extract.plan import chunk_rows_for, resolve_dtype

if TYPE_CHECKING:
    from featurestore.extract.caches import ArraySource, CacheSource

__all__ = ["DenseImport"]


def _token_layout(shape: tuple[int, ...], prefix: int, grid: tuple[int, int] | None) -> dict[str, Any]:
    if len(shape) == 1:
        return {"tokens": "cls", "prefix_tokens": 0, "grid": None, "encoder_tokens": None,
                "encoder_prefix_tokens": None}
    tokens = shape[0]
    if not 0 <= prefix < tokens:
        raise ShapeMismatch(f"--prefix-tokens {prefix} does not fit samples of {tokens} tokens: "
                            f"give 0 to {tokens - 1} (the CLS/register tokens before the patches)")
    if grid is not None and min(grid) < 1:
        raise ShapeMismatch(f"--grid {grid[0]} {grid[1]}: H and W must be positive (H x W = the "
                            f"{tokens - prefix} patch tokens), e.g. --grid 1 {tokens - prefix}")
    if grid is None:
        side = int(round((tokens - prefix) ** 0.5))
        grid = (side, side) if side * side == tokens - prefix else None
    elif grid[0] * grid[1] != tokens - prefix:
        raise ShapeMismatch(f"--grid {grid[0]} {grid[1]} needs {grid[0] * grid[1]} patch tokens, but samples "
                            f"have {tokens} tokens with {prefix} prefix tokens: give H W with H x W = "
                            f"{tokens - prefix}")
    return {"tokens": "all" if prefix else "patch", "prefix_tokens": prefix,
            "grid": list(grid) if grid else None, "encoder_tokens": tokens, "encoder_prefix_tokens": prefix}


class DenseImport(SplitJob):
    """The dense import as a :func:`~featurestore.extract.dist_run.run_split` job: units are chunks."""

    source: CacheSource  # load() opens them
    labels: ArraySource | None

    def load(self) -> None:
        # The dense caches' readers import torch (a .pt cache): imported here, so a bag import of
        # .h5 files starts without it (seconds of a CLI run).
        from featurestore.extract.caches import open_cache, open_labels

        opts = self.opts
        source = self.source = open_cache(opts.source, opts.key, opts.labels)
        if source.num_samples < 1:
            raise SourceError(f"cache {opts.source!r} holds 0 samples ({source.spec}): nothing to import; "
                              "give a cache with at least one sample")
        labels = self.labels = open_labels(opts.labels, source)
        source_dtype = source.dtype  # float64 too: the writer measures the float64 -> stored error
        self.dtype = resolve_dtype(opts.dtype, source_dtype)
        layout = _token_layout(source.sample_shape, opts.prefix_tokens, opts.grid)
        fingerprint = {"source": source.fingerprint(), "labels": labels.fingerprint() if labels else None}
        key_parts = {"import": fingerprint, "dtype": self.dtype, "tokens": layout, "num_samples": source.num_samples}
        cache_key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()
        self.metadata = {
            "encoder": {"name": opts.encoder_name, "spec": f"import:{source.spec}", "weights_hash": None,
                        "output_dtype": source.dtype, "precision": None},
            "preprocessing": None,
            "token_layout": layout,
            "source_dtype": source_dtype,
            "cache_key": cache_key,
            "source": {"spec": source.spec, "format": source.kind, "fingerprint": fingerprint,
                       "num_samples": source.num_samples, "labels": labels.spec if labels else None},
        }

    def create(self, *, resume: bool, overwrite: bool) -> Any:
        opts, source, labels = self.opts, self.source, self.labels
        return self.store.create_split(
            opts.dataset, opts.encoder_name, opts.split, num_samples=source.num_samples,
            sample_shape=source.sample_shape, dtype=self.dtype,
            label_shape=labels.sample_shape if labels else (), label_dtype=labels.dtype if labels else None,
            metadata=self.metadata, chunk_rows=chunk_rows_for(source.sample_shape, self.dtype, opts.chunk_mb, 1),
            resume=resume, overwrite=overwrite, ids=source.ids, verify_chunks=opts.verify_chunks)

    def check_kept(self, writer: Any) -> None:
        source, labels = self.source, self.labels
        # rows kept from an earlier run must still match the input (extract.input_check)
        refuse_changed_inputs_of(writer, lambda a, b: source.input_files(a, b) + (
            labels.input_files(a, b) if labels else []), self.key)

    def work(self, writer: Any, mine: list[int]) -> int:
        return _copy(self.source, self.labels, writer, self.opts, mine)

    def result(self, progress: list[int] | None, metadata: dict[str, Any], wall_seconds: float) -> ImportResult:
        if progress is None:
            return ImportResult("already-complete", self.key, self.source.num_samples, metadata=metadata)
        return ImportResult("complete", self.key, self.source.num_samples, sum(progress), wall_seconds, metadata)


def _copy(source: CacheSource, labels: ArraySource | None, writer: Any, opts: ImportOptions,
          chunks: list[int]) -> int:
    """Read and write the rows of ``chunks``, ``batch_size`` rows at a time."""
    total = sum(writer.chunk_range(c)[1] - writer.chunk_range(c)[0] for c in chunks)
    bar = progress_bar(opts, total, "sample", "import")
    try:
        for chunk in chunks:
            lo, hi = writer.chunk_range(chunk)
            for start in range(lo, hi, opts.batch_size):
                stop = min(start + opts.batch_size, hi)
                rows = source.read(start, stop)
                try:
                    writer.write(start, rows, labels.read(start, stop) if labels else None)
                except (Float16Overflow, NonFiniteValues) as error:
                    raise _refused_values(error) from None
                bar.update(stop - start)
            writer.flush()  # the chunk is complete: on storage now, so a crash keeps it
    finally:
        bar.close()
    return total


_ADVICE = (" Use --dtype", " Check the encoder", " Scale the features down")


def _refused_values(error: Float16Overflow | NonFiniteValues) -> Exception:
    """The writer's refusal of a batch with an import's fix: the writer's advice is an
    extraction's (--precision, --dtype alone), but the split this import began has its dtype set
    and its first rows written, so the rerun needs --overwrite too."""
    text = str(error)
    for advice in _ADVICE:
        text = text.split(advice)[0]
    then = "then rerun with --overwrite (the split this run began is replaced)"
    if isinstance(error, Float16Overflow):
        fix = f"Store it as --dtype bfloat16 (float32's range, ~4e-3 relative error) or float32 (exact): {then}"
    elif "bfloat16" in text:
        fix = f"Store it as --dtype float32 (exact): {then}"
    elif "float64 values" in text:
        fix = f"Scale the features down in the cache, {then}"
    else:
        fix = f"Fix those samples in the cache (or leave them out of it), {then}"
    return type(error)(f"{text.rstrip()} {fix}")
