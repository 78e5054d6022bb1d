"""``featurestore embed``: a bag split -> a dense split of slide (or patient) embeddings, with lineage.

Rows are written through the dense writer (``store.create_split(..., ids=...)``): a killed run
resumes with the chunks it had put (``--resume``), and under ``torchrun`` rank ``r`` computes the
chunks ``i`` with ``i % world_size == r`` (featurestore.extract.dist.Coordinator), rank 0
creating the split before and committing it after. Chunks are small (:func:`chunk_rows_for`), so
a kill loses little work. A target whose source changed since it was computed (stale: see
featurestore.core.lineage) is recomputed whole, never resumed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from featurestore.core import fused_stats
from featurestore.core import lineage as core_lineage
from featurestore.embed import rows as row_plan
from featurestore.embed import slide_encoders
from featurestore.embed.pooling import Pooler, gather
from featurestore.errors import (CacheKeyMismatch, DatasetNotFound, EmptyBag, EncoderNotFound, InvalidMetadata,
                                 InvalidOption, SplitExists, SplitNotFound)
from featurestore.extract.dist import Coordinator, coordinated
from featurestore.extract.dist_run import progress_bar
from featurestore.format import dtypes, lineage
from featurestore.format.names import validate_name

EMPTY_BAGS = ("refuse", "skip")
# At most this many chunks per split: a kill loses at most one chunk per rank (1 row per chunk
# up to this many rows), and a 10,000-slide split is 256 chunk files, not 10,000.
MAX_CHUNKS = 256


@dataclass
class EmbedOptions:
    store: str
    dataset: str
    encoder: str  # the bag split's encoder
    split: str
    slide_encoder: str
    encoder_name: str  # the embedding split's encoder name
    out_split: str | None = None
    dtype: str = "float32"
    max_patches: int | None = None
    seed: int = 0
    group_by: str | None = None
    groups: str | None = None  # a table (CSV) of each slide's group_by value, for bags without the attribute
    id_column: str = "slide_id"  # the table's column of slide ids
    empty_bags: str = "refuse"
    no_labels: bool = False  # the rows carry no labels (recorded in the lineage)
    resume: bool = False
    overwrite: bool = False
    device: str = "auto"
    autocast: str = "none"
    storage_options: dict[str, Any] = field(default_factory=dict)
    progress: bool = True  # a bar on stderr (a terminal's only), rows per second

    def check(self) -> None:
        for name, value in (("--dataset", self.dataset), ("--encoder", self.encoder), ("--split", self.split),
                            ("--encoder-name", self.encoder_name), ("--out-split", self.target_split)):
            validate_name(value, name)
        slide_encoders.parse(self.slide_encoder)
        dtypes.check_feature_dtype(self.dtype)
        if self.resume and self.overwrite:
            raise InvalidOption("--resume and --overwrite exclude each other: choose one")
        if self.groups is not None and self.group_by is None:
            raise InvalidOption("--groups CSV gives each slide's value of --group-by COLUMN: add --group-by")
        if self.max_patches is not None and (isinstance(self.max_patches, bool) or self.max_patches < 1):
            raise InvalidOption(f"--max-patches must be a positive integer, got {self.max_patches!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise InvalidOption(f"--seed must be an integer >= 0 (it seeds the --max-patches subsets), "
                                f"got {self.seed!r}: pass e.g. --seed 0")
        if self.empty_bags not in EMPTY_BAGS:
            raise InvalidOption(f"--empty-bags {self.empty_bags!r} is not one of {', '.join(EMPTY_BAGS)}")
        if self.autocast not in slide_encoders.AUTOCAST:
            raise InvalidOption(f"--autocast {self.autocast!r} is not one of {', '.join(slide_encoders.AUTOCAST)}")
        if self.autocast != "none" and self.slide_encoder in slide_encoders.POOLINGS:
            raise InvalidOption(f"--autocast {self.autocast} applies to python: slide encoders; "
                                f"{self.slide_encoder} pooling runs in float32/float64 on the CPU")
        if (self.encoder_name, self.target_split) == (self.encoder, self.split):
            raise InvalidOption(f"--encoder-name {self.encoder_name} --out-split {self.target_split} would replace "
                                "the bag split itself: choose another --encoder-name")

    @property
    def target_split(self) -> str:
        return self.split if self.out_split is None else self.out_split


@dataclass
class EmbedResult:
    status: str  # "complete" | "already-complete"
    key: str
    num_rows: int
    computed: int = 0  # rows computed by this run (all ranks)
    seconds: float = 0.0
    recomputed_stale: str | None = None  # the reason, when a stale target was recomputed whole
    metadata: dict[str, Any] = field(default_factory=dict)
    rank: int = 0  # the torchrun rank that returns it (the command reports on rank 0 only)


def chunk_rows_for(num_rows: int, dim: int, dtype: str) -> int:
    """Rows per chunk: 1 up to MAX_CHUNKS rows, then enough for MAX_CHUNKS chunks (within 8 MiB)."""
    per_bytes = max(1, (8 << 20) // (dim * dtypes.storage_dtype(dtype).itemsize))
    return max(1, min(-(-num_rows // MAX_CHUNKS), per_bytes))


@dataclass
class _Prepared:
    bags: Any
    encoder: slide_encoders.SlideEncoder
    rows: list[row_plan.Row]
    kept: list[np.ndarray | None]
    output_dim: int
    device: Any
    autocast: Any
    lineage: dict[str, Any]
    source_key: str
    label_dtype: Any = None  # of the rows' labels; None: the split has none


def _prepare(opts: EmbedOptions, store: Any, coord: Coordinator) -> _Prepared:
    source_key = f"{opts.dataset}/{opts.encoder}/{opts.split}"
    bags = store.open_bags(opts.dataset, opts.encoder, opts.split)
    encoder = slide_encoders.load(opts.slide_encoder)
    slide_encoders.check_requirements(encoder, bags, source_key)
    slide_encoders.check_inputs(encoder, bags, source_key)
    table_values = None
    if opts.groups is not None:
        from featurestore.probes.groups import GroupSpec, table_groups

        table_values = table_groups(GroupSpec(str(opts.group_by), opts.groups, opts.id_column), bags.ids,
                                    source_key, "bag")
    rows = row_plan.plan(bags, opts.group_by, source_key, with_labels=not opts.no_labels, table_values=table_values)
    empty = [row for row in rows if row_plan.patch_count(row, bags.lengths) == 0]
    if empty and opts.empty_bags == "refuse":
        what = "group" if opts.group_by else "bag"
        names = ", ".join(repr(row.id) for row in empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise EmptyBag(f"{len(empty)} {what}(s) of {source_key} have no patches ({names}): an embedding of no "
                       "patches is undefined; pass --empty-bags skip to leave them out (recorded in the lineage)")
    skipped = {row.id for row in empty}
    rows = [row for row in rows if row.id not in skipped]
    if not rows:
        raise EmptyBag(f"every bag of {source_key} is empty: nothing to embed")
    kept = [row_plan.subset(row_plan.patch_count(r, bags.lengths), opts.max_patches, opts.seed, r.id) for r in rows]
    device = autocast = None
    if encoder.pooling is None:
        from featurestore.core.device import resolve_device

        device = resolve_device(opts.device, coord.local_rank)
        encoder.module.to(device)
        autocast = slide_encoders.autocast_dtype(opts.autocast)
        declared = getattr(encoder.module, "featurestore_output_dim", None)
        output_dim = int(declared) if declared else len(_encode(encoder, bags, rows[0], kept[0], device, autocast))
    else:
        output_dim = int(bags.dim)
    doc = lineage.build(dataset=opts.dataset, encoder=opts.encoder, split=opts.split, source_metadata=bags.metadata,
                        slide_encoder=encoder.to_json(output_dim),
                        autocast=None if encoder.pooling else opts.autocast, max_patches=opts.max_patches,
                        seed=opts.seed, group_by=opts.group_by, empty_bags=opts.empty_bags,
                        groups=None if opts.groups is None else row_plan.groups_record(rows, opts.groups,
                                                                                       opts.id_column),
                        skipped=[row.id for row in empty], no_labels=opts.no_labels)
    label_dtype = None if opts.no_labels or bags.labels is None else bags.labels.dtype
    return _Prepared(bags, encoder, rows, kept, output_dim, device, autocast, doc, source_key, label_dtype)


def _encode(encoder: slide_encoders.SlideEncoder, bags: Any, row: row_plan.Row, kept: np.ndarray | None,
            device: Any, autocast: Any) -> np.ndarray:
    patch_size = slide_encoders.row_patch_size(bags, row, encoder.spec)  # before any read: one per call
    features, coords = gather(bags, row, kept, patch_size)
    return slide_encoders.call(encoder, features, coords, patch_size, device, autocast, row.id)


def _create(opts: EmbedOptions, prep: _Prepared, store: Any, *, resume: bool, overwrite: bool) -> Any:
    return store.create_split(
        opts.dataset, opts.encoder_name, opts.target_split, num_samples=len(prep.rows),
        sample_shape=(prep.output_dim,), dtype=opts.dtype, label_dtype=prep.label_dtype,
        metadata={lineage.KEY: prep.lineage, "cache_key": lineage.cache_key(prep.lineage, opts.dtype),
                  "source_dtype": "float32",
                  "encoder": {"name": opts.encoder_name, "spec": opts.slide_encoder,
                              "weights_hash": prep.encoder.weights_hash, "slide_encoder": True},
                  **_class_names(prep)},
        chunk_rows=chunk_rows_for(len(prep.rows), prep.output_dim, opts.dtype),
        resume=resume, overwrite=overwrite, ids=[row.id for row in prep.rows])


def _class_names(prep: _Prepared) -> dict[str, Any]:
    """The source's class names (``label_names`` of an import, ``label_info`` of an extraction),
    carried with its labels: an export's labels.csv and a probe's report name the classes."""
    if prep.label_dtype is None:
        return {}
    meta = prep.bags.metadata
    return {key: meta[key] for key in ("label_names", "label_info") if meta.get(key) is not None}


def _refuse_other_recipe(key: str, stale: str, existing: dict[str, Any], prep: _Prepared, dtype: str) -> None:
    try:
        old = lineage.of(existing)
    except InvalidMetadata:  # a lineage no longer readable: nothing to compare, nothing worth keeping
        return
    if old is None:
        return
    differ = lineage.recipe_differences(old, prep.lineage)
    if existing.get("logical_dtype") not in (None, dtype):
        differ.append("dtype")
    if differ:
        raise CacheKeyMismatch(f"split {key} is stale ({stale}) and was computed with another {', '.join(differ)} "
                               "than this run's: recomputing it would replace that computation; pass --overwrite "
                               "to replace it, or give this one another --encoder-name")


def _open_target(opts: EmbedOptions, prep: _Prepared, store: Any) -> tuple[Any, str | None]:
    """``(writer or None when already complete, the stale reason when a stale target is recomputed)``."""
    key = f"{opts.dataset}/{opts.encoder_name}/{opts.target_split}"
    if opts.overwrite:
        return _create(opts, prep, store, resume=False, overwrite=True), None
    try:
        existing = store.split_metadata(opts.dataset, opts.encoder_name, opts.target_split)
    except (DatasetNotFound, EncoderNotFound, SplitNotFound):
        return _create(opts, prep, store, resume=False, overwrite=False), None
    stale = core_lineage.stale_reason(store, existing)  # None for a split that is not derived
    if stale is not None:
        # Its rows describe another source (or a lineage no longer readable): none may be kept,
        # whatever --resume says. Recomputed only as what it was: another recipe under its name
        # replaces a computation, which takes --overwrite, as for a current split.
        _refuse_other_recipe(key, stale, existing, prep, opts.dtype)
        print(f"featurestore embed: {key} is stale ({stale}): recomputing every row", file=sys.stderr)
        return _create(opts, prep, store, resume=False, overwrite=True), stale
    if existing.get("status") != "complete" and not opts.resume:
        raise SplitExists(f"split {key} exists but is incomplete (status {existing.get('status')!r}): pass --resume "
                          "to continue it or --overwrite to start over")
    writer = _create(opts, prep, store, resume=True, overwrite=False)
    return (None if writer.metadata.complete else writer), None


def embed(opts: EmbedOptions, coord: Coordinator | None = None) -> EmbedResult:
    """Run one embedding (or this rank's share of it); raises FeatureStoreError on bad input."""
    with coordinated(coord) as coord:
        return _embed(opts, coord)


def _embed(opts: EmbedOptions, coord: Coordinator) -> EmbedResult:
    from featurestore import open_store

    started = time.perf_counter()
    key = f"{opts.dataset}/{opts.encoder_name}/{opts.target_split}"
    prep: _Prepared | None = None
    error: BaseException | None = None
    try:
        opts.check()
        # The bag split read is in this store, so it must exist: opened read-only first, a mistyped
        # path is StoreNotFound ("check the URL") and does not become a new, empty store.
        open_store(opts.store, mode="r", **opts.storage_options)
        store = open_store(opts.store, mode="a", **opts.storage_options)
        prep = _prepare(opts, store, coord)
    except BaseException as e:  # every rank must reach agree(), or the others would wait forever
        error = e
    coord.agree(error)
    assert prep is not None
    writer, stale, error = None, None, None
    if coord.rank == 0:
        try:
            writer, stale = _open_target(opts, prep, store)
        except BaseException as e:
            error = e
    done = coord.agree(error, payload=writer is None if coord.rank == 0 else None)[0]
    if done:
        return EmbedResult("already-complete", key, len(prep.rows), rank=coord.rank,
                           metadata=store.split_metadata(opts.dataset, opts.encoder_name, opts.target_split))
    error, computed = None, 0
    # The writer's statistics kernel compiles (or loads) while the first rows are computed.
    fused_stats.warm_up_soon("float32", opts.dtype)
    try:
        if coord.rank != 0:  # attach to the split rank 0 created or resumed
            writer = _create(opts, prep, store, resume=True, overwrite=False)
        mine = [c for c in writer.pending_chunks() if coord.owns(c)]
        bar = progress_bar(opts, sum(min(writer.chunk_rows, len(prep.rows) - c * writer.chunk_rows) for c in mine),
                           "patient" if opts.group_by else "slide", "embed", coord)
        try:
            computed = _compute(prep, writer, mine, bar)
        finally:
            bar.close()
        if coord.rank == 0:
            writer.flush()
        else:
            writer.close()
    except BaseException as e:
        error = e
    counts = coord.agree(error, payload=computed)
    meta = coord.on_rank_zero(lambda: writer.commit(), default={})
    return EmbedResult("complete", key, len(prep.rows), sum(counts), time.perf_counter() - started, stale, meta,
                       coord.rank)


def _compute(prep: _Prepared, writer: Any, chunks: list[int], bar: Any) -> int:
    """Compute and write the rows of ``chunks`` (one chunk per write); the number of rows."""
    n, per = len(prep.rows), writer.chunk_rows
    spans = [(c * per, min((c + 1) * per, n)) for c in chunks]
    order = [i for start, stop in spans for i in range(start, stop)]
    rows, kept = [prep.rows[i] for i in order], [prep.kept[i] for i in order]
    if prep.encoder.pooling is not None:
        # One stream over all of this rank's rows: the reader thread reads ahead across rows.
        pooler = Pooler(prep.bags, prep.encoder.pooling)
        try:
            _write(prep, writer, spans, (v for _, v in pooler.pool(rows, kept)), bar)
        finally:
            pooler.close()
    else:
        _write(prep, writer, spans, (_encode(prep.encoder, prep.bags, r, k, prep.device, prep.autocast)
                                     for r, k in zip(rows, kept, strict=True)), bar)
    return len(rows)


def _write(prep: _Prepared, writer: Any, spans: list[tuple[int, int]], vectors: Any, bar: Any) -> None:
    for start, stop in spans:
        block = np.empty((stop - start, prep.output_dim), np.float32)
        for i in range(start, stop):
            vector = next(vectors)
            if vector.shape != (prep.output_dim,):
                raise slide_encoders.SlideEncoderError(
                    f"slide encoder {prep.encoder.spec} returned {vector.shape[0]} values for {prep.rows[i].id!r}, "
                    f"{prep.output_dim} for the first row: it must return one size")
            block[i - start] = vector
            bar.update(1)
        row_labels = None
        if prep.label_dtype is not None:
            row_labels = np.asarray([prep.rows[i].label for i in range(start, stop)], dtype=prep.label_dtype)
        writer.write(start, block, row_labels)
