"""SplitMetadata: a split's metadata (``<split>/zarr.json`` ``attributes.featurestore``), typed.

Built, validated and serialised here only: ``create_split`` builds one with :meth:`SplitMetadata.new`,
every reader of a split's document goes through :meth:`SplitMetadata.from_json`, and the writer's
commit goes back through :meth:`SplitMetadata.to_json`, whose key order is the document's
(pinned byte for byte by tests/test_format.py). Users still see a plain dict (``arr.metadata``,
``store.split_metadata``): keys this class does not know (user metadata) ride along in ``extra``
and are written after the known ones.

The ``generation`` is a random id drawn when a split is created or overwritten and kept by a
resume; every chunk's statistics row carries it (:func:`seal`), so a chunk written by another run
of the same split name is told apart from the split's own (docs/FORMAT.md, "Generation").
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from featurestore.errors import InvalidMetadata, ShapeMismatch, SplitNotFound, UnsupportedFormatVersion
from featurestore.format import dtypes, layout
from featurestore.format.stats import row_length

DENSE = "dense"
BAGS = "bags"
KINDS = (DENSE, BAGS)
WRITING = "writing"
COMPLETE = "complete"
# The generation is 13 hex digits (52 bits): it fits a float64 exactly, so the statistics row
# (float64) can carry it.
GENERATION_DIGITS = 13
# Two float64 slots after a chunk's statistics row: the split's generation and the chunk's index.
SEAL_SLOTS = 2


@dataclass(frozen=True)
class LabelSpec:
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Provenance:
    """Where a split's values come from, as the extractor knows it (``create_split(provenance=)``)."""

    encoder: dict[str, Any] | None = None  # name, spec, weights_hash, output_dtype, precision
    preprocessing: Any = None
    token_layout: Any = None
    cache_key: str | None = None
    source_dtype: str | None = None


@dataclass(frozen=True)
class SplitMetadata:
    """One split's metadata; field order is the document's key order (docs/FORMAT.md)."""

    dataset: str
    encoder_name: str
    split: str
    num_samples: int
    sample_shape: tuple[int, ...]
    logical_dtype: str
    chunk_rows: int
    format: str = layout.FORMAT_NAME
    format_version: int = layout.FORMAT_VERSION
    status: str = WRITING
    source_dtype: str | None = None
    compressor: str | None = None
    labels: LabelSpec | None = None
    ids: bool = False
    encoder: dict[str, Any] | None = None
    preprocessing: Any = None
    token_layout: Any = None
    cache_key: str | None = None
    quantization: dict[str, Any] | None = None
    channel_stats: dict[str, Any] | None = None
    creator: dict[str, Any] | None = None
    created: str | None = None
    completed: str | None = None
    generation: str | None = None  # None only in splits written before generations existed
    # "dense" ([N, *sample_shape] samples) or "bags" (ragged per-slide bags, format.bags); a dense
    # split's document has no "kind" key, as before version 2.
    kind: str = DENSE
    bags: dict[str, Any] | None = None  # a bag split's own settings and counts (format.bags)
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ building
    @classmethod
    def new(cls, *, dataset: str, encoder_name: str, split: str, num_samples: int,
            sample_shape: Any, logical_dtype: str, chunk_rows: int, compressor: str | None = None,
            labels: LabelSpec | None = None, ids: bool = False, user: dict[str, Any] | None = None,
            provenance: Provenance | None = None, creator_version: str = "",
            bags: dict[str, Any] | None = None) -> SplitMetadata:
        """A fresh split's metadata (status ``writing``, a new generation), validated.

        ``user`` is the ``metadata=`` of ``create_split``: its ``encoder``, ``preprocessing``,
        ``token_layout``, ``cache_key`` and ``source_dtype`` fill those fields, the rest is kept
        as extra keys. ``provenance`` gives the same fields typed; its values win. ``bags`` (the
        settings of format.bags.bag_spec) makes it a bag split (format version 2).
        """
        user = dict(user or {})
        if provenance is not None:
            user.update({k: v for k, v in dataclasses.asdict(provenance).items() if v is not None})
        reserved = sorted(set(user) & (_OWN_KEYS - _USER_KEYS))
        if reserved:  # the split's own record: a user value there would misstate or break the split
            own = ", ".join(sorted(_OWN_KEYS - _USER_KEYS))
            raise InvalidMetadata(f"metadata key {reserved[0]!r} is the split's own ({own} are set by "
                                  "featurestore): name your key otherwise")
        meta = cls(
            dataset=dataset, encoder_name=encoder_name, split=split, num_samples=num_samples,
            sample_shape=tuple(sample_shape), logical_dtype=logical_dtype, chunk_rows=chunk_rows,
            source_dtype=user.pop("source_dtype", None), compressor=compressor, labels=labels, ids=ids,
            encoder=user.pop("encoder", {"name": encoder_name, "spec": None, "weights_hash": None}),
            preprocessing=user.pop("preprocessing", None), token_layout=user.pop("token_layout", None),
            cache_key=user.pop("cache_key", None),
            creator={"name": "featurestore", "version": creator_version},
            created=_now(), generation=new_generation(), extra=user,
            kind=DENSE if bags is None else BAGS, bags=bags,
            format_version=(layout.INT8_FORMAT_VERSION if dtypes.is_int8(logical_dtype) else
                            layout.FORMAT_VERSION if bags is None else layout.BAGS_FORMAT_VERSION),
        )
        meta.validate()
        try:  # metadata must be plain JSON: fail here, not at commit
            json.dumps(meta.to_json(), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidMetadata(f"split metadata is not plain JSON ({error}): pass str/int/float/list/dict values") from None
        return meta

    def validate(self) -> None:
        dtypes.check_feature_dtype(self.logical_dtype)
        if self.kind not in KINDS:
            raise InvalidMetadata(f"split kind {self.kind!r} is not one of {', '.join(KINDS)}")
        # A bag split counts its patch rows in num_samples: 0 until its first commit.
        least = 0 if self.kind == BAGS else 1
        if not isinstance(self.num_samples, (int, np.integer)) or isinstance(self.num_samples, bool) or self.num_samples < least:
            raise ShapeMismatch(f"num_samples must be a positive int, got {self.num_samples!r}")
        if self.kind == BAGS:
            from featurestore.format import bags

            bags.check_spec(self.bags, len(self.sample_shape))
        if not self.sample_shape or any(not isinstance(s, (int, np.integer)) or s < 1 for s in self.sample_shape):
            raise ShapeMismatch(f"sample_shape must have at least one positive axis (e.g. (tokens, dim)), got {self.sample_shape!r}")
        if not isinstance(self.chunk_rows, (int, np.integer)) or self.chunk_rows < 1:
            raise ShapeMismatch(f"chunk_rows must be a positive int, got {self.chunk_rows!r}")
        if self.compressor is not None:
            layout.parse_compressor(self.compressor)
        if self.status not in (WRITING, COMPLETE):
            raise InvalidMetadata(f"split status {self.status!r} is not {WRITING!r} or {COMPLETE!r}")

    def replace(self, **changes: Any) -> SplitMetadata:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived
    @property
    def complete(self) -> bool:
        return self.status == COMPLETE

    @property
    def is_bags(self) -> bool:
        return self.kind == BAGS

    @property
    def num_chunks(self) -> int:
        return layout.num_chunks(self.num_samples, self.chunk_rows)

    @property
    def generation_number(self) -> float | None:
        """The generation as the float64 stored in every chunk's statistics row."""
        return None if self.generation is None else float(int(self.generation, 16))

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": self.format,
            "format_version": self.format_version,
            **({"kind": self.kind} if self.kind != DENSE else {}),
            "status": self.status,
            "dataset": self.dataset,
            "encoder_name": self.encoder_name,
            "split": self.split,
            "num_samples": int(self.num_samples),
            "sample_shape": [int(s) for s in self.sample_shape],
            "logical_dtype": self.logical_dtype,
            "source_dtype": self.source_dtype,
            "chunk_rows": int(self.chunk_rows),
            "compressor": self.compressor,
            "labels": None if self.labels is None else self.labels.to_json(),
            "ids": self.ids,
            **({"bags": self.bags} if self.kind != DENSE else {}),
            "encoder": self.encoder,
            "preprocessing": self.preprocessing,
            "token_layout": self.token_layout,
            "cache_key": self.cache_key,
            "quantization": self.quantization,
            "channel_stats": self.channel_stats,
            "creator": self.creator,
            "created": self.created,
            "completed": self.completed,
        }
        if self.generation is not None:
            doc["generation"] = self.generation
        doc.update(self.extra)
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str) -> SplitMetadata:
        """Parse ``attributes.featurestore`` of a split's zarr.json; ``where`` names it in errors."""
        if not isinstance(doc, dict) or "num_samples" not in doc:
            raise SplitNotFound(f"{where} is not a featurestore split (no split metadata in its zarr.json)")
        check_version(doc.get("format_version"), where)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "labels", "sample_shape"}
        values = {name: doc[name] for name in known if name in doc}
        try:
            labels = doc.get("labels")
            meta = cls(
                **values,
                sample_shape=tuple(doc["sample_shape"]),
                labels=None if not labels else LabelSpec(tuple(int(s) for s in labels["shape"]), str(labels["dtype"])),
                extra={k: v for k, v in doc.items() if k not in known and k not in ("labels", "sample_shape")},
            )
            meta.validate()
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidMetadata(
                f"the split metadata of {where} is damaged ({type(error).__name__}: {error}): "
                "rewrite the split (extract --overwrite)") from None
        return meta


def new_generation() -> str:
    return f"{secrets.randbits(4 * GENERATION_DIGITS):0{GENERATION_DIGITS}x}"


def seal(row: np.ndarray, meta: SplitMetadata, index: int) -> np.ndarray:
    """A chunk's statistics row with the split's generation and the chunk's index appended.

    The row's crc32c then binds both: a chunk copied from another run of the split (another
    generation) or moved to another index is found by ``verify`` and by resume.
    """
    if meta.generation is None:
        return row
    return np.concatenate([row, np.asarray([meta.generation_number, index], np.float64)])


def unseal(row: np.ndarray, meta: SplitMetadata) -> tuple[np.ndarray, float | None, int | None]:
    """``(statistics row, generation number, chunk index)`` of a stored row (see :func:`seal`)."""
    if meta.generation is None:
        return row, None, None
    return row[:-SEAL_SLOTS], float(row[-2]), int(row[-1])


def stats_row_length(meta: SplitMetadata) -> int:
    """Float64 values in one stored statistics row: the statistics, then the seal (if any)."""
    return row_length(meta.sample_shape[-1]) + (SEAL_SLOTS if meta.generation is not None else 0)


def chunk_arrays(meta: SplitMetadata) -> list[tuple[str, int, int | None]]:
    """(array name, ndim, payload bytes of one chunk or None when compressed) for every chunked
    array of a split: features, labels if any, statistics rows, int8 scales rows."""
    rows, shape = meta.chunk_rows, meta.sample_shape
    itemsize = dtypes.storage_dtype(meta.logical_dtype).itemsize
    arrays: list[tuple[str, int, int | None]] = [
        (layout.FEATURES, 1 + len(shape), None if meta.compressor else rows * int(np.prod(shape)) * itemsize),
    ]
    if meta.labels is not None:
        label_shape = meta.labels.shape
        nbytes = rows * int(np.prod(label_shape, dtype=np.int64)) * np.dtype(meta.labels.dtype).itemsize
        arrays.append((layout.LABELS, 1 + len(label_shape), nbytes))
    arrays.append((layout.CHUNK_STATS, 2, 8 * stats_row_length(meta)))
    if dtypes.is_int8(meta.logical_dtype):  # a chunk's codes are nothing without its scales row
        arrays.append((layout.SCALES, 1 + len(shape), 4 * int(np.prod(shape))))
    return arrays


def seal_problem(raw: bytes, meta: SplitMetadata, index: int) -> str | None:
    """Why a stored statistics row (crc already checked) is not chunk ``index`` of this
    generation of the split, or None."""
    if meta.generation is None:
        return None
    row = np.frombuffer(raw[: -layout.CRC_BYTES], np.float64)
    _, generation, at = unseal(row, meta)
    if generation != meta.generation_number:
        return (f"written by another generation of the split ({int(generation or 0):0{GENERATION_DIGITS}x}, "
                f"the split's is {meta.generation}): a concurrent --overwrite or a copied file")
    if at != index:
        return f"holds the statistics of chunk {at}, not {index} (a moved or swapped file)"
    return None


def check_version(version: Any, where: str) -> None:
    from featurestore import __version__

    if not isinstance(version, int) or isinstance(version, bool) or version > layout.READ_FORMAT_VERSION or version < 1:
        raise UnsupportedFormatVersion(
            f"{where} uses featurestore format version {version!r}, this featurestore "
            f"({__version__}) reads versions 1 to {layout.READ_FORMAT_VERSION}: upgrade featurestore"
        )


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# The keys of a split's document that featurestore writes itself, and those of them a caller's
# metadata= may give (they describe where the values come from).
_OWN_KEYS = frozenset(f.name for f in dataclasses.fields(SplitMetadata)) - {"extra"}
_USER_KEYS = frozenset({"source_dtype", "encoder", "preprocessing", "token_layout", "cache_key"})
