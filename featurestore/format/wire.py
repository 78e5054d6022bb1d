"""The HTTP wire contract, defined once and imported by both ``server/`` and ``client/``.

A data response is the raw C-order little-endian bytes of one array, described by two headers:
``X-Shape`` (``"64,256,384"``; ``""`` for a 0-d array) and ``X-Dtype`` (the *logical* dtype, e.g.
``bfloat16``). bfloat16 has no numpy/Zarr dtype, so its bits travel as ``uint16`` and only the
header says how to view them. ``Accept: application/x-npy`` asks for the same bytes behind a
standard ``.npy`` header (NPY format 1.0; bfloat16 is then ``<u2`` bits, as on storage).

Besides the headers, this module holds everything else both sides must agree on: the route
templates, the structure of an opened split (:class:`SplitStructure`, what ``GET .../arrays``
answers: shapes, dtypes, chunking, labels/ids presence and the metadata, so opening a remote split
is one request), the error body, the one index normaliser and bounds check, the binary framing
of a features+labels batch (:data:`SAMPLES`), and the bag routes of a bag split: the
listing (:class:`BagsListing`), one bag's features+coords framing (:data:`BAG_MEDIA`) and
the encoding of a bag id into a URL (:func:`quote_bag_id`).

It is one module on purpose (over the ~400-line guide, since the bag routes joined it): the
contract both sides must agree on is read in one place. Credential redaction, used by both sides' messages, lives in
``featurestore/format/redact.py`` and is re-exported here.

This module must stay importable without torch, fastapi or httpx: the server image has no torch
and ``import client`` must not pull in the server stack.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import numpy as np

from featurestore.errors import DtypeMismatch, IndexOutOfRange, InvalidIndices
from featurestore.format.dtypes import storage_dtype
from featurestore.format.names import validate_name
from featurestore.format.redact import redact
from featurestore.format.wire_npy import (  # noqa: F401
    NPY,
    NPY_MAGIC,
    WireFormatError,
    npy_header,
    parse_npy_header,
    wants_npy,
)

__all__ = [
    "ARRAYS",
    "BAG",
    "BAGS",
    "BAGS_PAGE",
    "BAG_MEDIA",
    "BAG_ROUTE",
    "BATCH",
    "BY_ID",
    "COORDS_DTYPE_HEADER",
    "COORDS_SHAPE_HEADER",
    "CODES",
    "DTYPE_PARAM",
    "SCALES_DTYPE_HEADER",
    "SCALES_SHAPE_HEADER",
    "VALUE_DTYPES",
    "scale_chunks",
    "served_dtype",
    "quote_bag_id",
    "DATASETS",
    "DTYPE_HEADER",
    "ENCODERS",
    "GENERATION_HEADER",
    "HEALTHZ",
    "IDS",
    "INDICES",
    "ITEM",
    "LABELS_DTYPE_HEADER",
    "LABELS_SHAPE_HEADER",
    "SAMPLES",
    "SAMPLES_MEDIA",
    "SPLIT",
    "SPLITS",
    "ArrayStructure",
    "SplitStructure",
    "as_index_array",
    "check_bounds",
    "decode_indices",
    "encode_indices",
    "error_body",
    "parse_error_body",
    "redact",
    "route",
    "wire_dtype",
    "NPY",
    "NPY_MAGIC",
    "OCTET_STREAM",
    "SHAPE_HEADER",
    "WireFormatError",
    "encode_shape",
    "expected_nbytes",
    "json_safe",
    "npy_header",
    "parse_npy_header",
    "parse_shape",
    "storage_dtype",
    "wants_npy",
]

SHAPE_HEADER = "X-Shape"
DTYPE_HEADER = "X-Dtype"
# A features+labels response (SAMPLES) also describes the labels part; see SAMPLES_MEDIA.
LABELS_SHAPE_HEADER = "X-Labels-Shape"
LABELS_DTYPE_HEADER = "X-Labels-Dtype"
OCTET_STREAM = "application/octet-stream"
# A request body of raw little-endian int64 indices (no JSON to parse on either side).
INDICES = "application/x-featurestore-indices"
# The features+labels framing: the features' bytes (X-Shape/X-Dtype), then, only if the split has
# labels, the labels' bytes (X-Labels-Shape/X-Labels-Dtype); Content-Length is their sum. Both
# parts are raw C-order little-endian, as in a single-array response; no padding between them.
SAMPLES_MEDIA = "application/x-featurestore-samples"
# One bag of a bag split (BAG): the features' bytes (X-Shape "n,D", X-Dtype), then the coordinates'
# (X-Coords-Shape "n,2", X-Coords-Dtype); Content-Length is their sum. The same rules as SAMPLES.
BAG_MEDIA = "application/x-featurestore-bag"
COORDS_SHAPE_HEADER = "X-Coords-Shape"
COORDS_DTYPE_HEADER = "X-Coords-Dtype"
# Every data response (rows, samples, one bag) names the generation of the split its bytes are
# from (absent for a split written before generations existed). The server answers from the split
# as it is now; a client compares this with the generation its listing or structure named and
# raises SplitChanged on a mismatch, so it never takes rows of another generation as those it
# planned for (docs/READS.md, "Generations").
GENERATION_HEADER = "X-Featurestore-Generation"
# What a data response's features part holds (?dtype=, docs/SERVER.md "int8 splits"): float32 or
# float16 values (an int8 split dequantized by the server, any other cast as read_numpy(dtype=)
# casts), or CODES: an int8 split's stored codes with their float32 scales as one more part after
# the others (X-Scales-Shape/X-Scales-Dtype): rows [k, *S] of the chunks the rows asked touch, in
# the order of scale_chunks (dense), or the bag's own row [1, D]. Without ?dtype= any other split
# is served as stored and an int8 split as float32 values, so a client that knows nothing of
# scales never takes codes for values.
DTYPE_PARAM = "dtype"
CODES = "int8"
VALUE_DTYPES = ("float32", "float16")
SCALES_SHAPE_HEADER = "X-Scales-Shape"
SCALES_DTYPE_HEADER = "X-Scales-Dtype"

# Route templates (FastAPI path syntax), used verbatim by the server's routers and, filled in by
# route(), by the client.
HEALTHZ = "/healthz"
DATASETS = "/v1/datasets"
ENCODERS = "/v1/datasets/{dataset}/encoders"
SPLITS = "/v1/datasets/{dataset}/encoders/{encoder}/splits"
SPLIT = "/v1/features/{dataset}/{encoder}/{split}"
ARRAYS = SPLIT + "/arrays"
IDS = SPLIT + "/ids"
ITEM = SPLIT + "/items/{index}"
BATCH = SPLIT + "/batch"
SAMPLES = SPLIT + "/samples"
# Samples named by id (POST JSON {"ids": [...]}): answered in the SAMPLES framing, rows in the order
# asked; an id the split does not hold is a 404 naming it (SampleNotFound).
BY_ID = SPLIT + "/by-id"
# Bag splits. A bag id is data, any string a slide name holds (slashes, "..", spaces,
# unicode): route() percent-encodes every byte of it but letters, digits, "-", "_" and "~"
# (quote_bag_id), so no "/" or ".." segment ever reaches a URL normaliser, and the server matches
# the rest of the path, newlines included, with its own converter (BAG_ROUTE, registered by
# server/routes_bags.py) and looks the id up in the split's index; an id is never joined into a
# storage path.
BAGS = "/v1/bags/{dataset}/{encoder}/{split}"
BAG = BAGS + "/{bag_id}"
BAG_ROUTE = BAGS + "/{bag_id:bag_id}"  # the server's template of BAG
# Most bags one listing page holds (about 100 bytes of JSON each: ~10 MB); ?offset= pages on.
BAGS_PAGE = 100_000

_MAX_DIMS = 32  # numpy's own limit (NPY_MAXDIMS) in numpy < 2; plenty for features
_SHAPE_RE = re.compile(r"(?:0|[1-9][0-9]{0,18})(?:,(?:0|[1-9][0-9]{0,18}))*")


def wire_dtype(logical: str) -> np.dtype:
    """:func:`~featurestore.format.dtypes.storage_dtype` for a name that came off the wire.

    The mapping (``bfloat16`` -> ``<u2`` bits, anything else little-endian numpy) is the store's
    one; this adds the check a peer's header needs: only bool, integer and float arrays travel.
    """
    try:
        dtype = storage_dtype(logical)
    except TypeError as error:
        raise WireFormatError(f"unknown dtype {logical!r} in {DTYPE_HEADER}") from error
    if dtype.kind not in "biuf" or dtype.itemsize == 0:
        raise WireFormatError(
            f"dtype {logical!r} cannot travel on the wire: only bool, integer and float arrays do"
        )
    return dtype


def served_dtype(asked: str | None, logical: str) -> str:
    """The logical dtype of a data response's features part for ``?dtype=asked`` on an array of
    ``logical`` dtype (see :data:`DTYPE_PARAM`); :class:`DtypeMismatch` for one not offered."""
    if asked is None:
        return "float32" if logical == CODES else logical
    if asked in VALUE_DTYPES or (asked == CODES and logical == CODES):
        return asked
    offered = " or ".join((*VALUE_DTYPES, CODES) if logical == CODES else VALUE_DTYPES)
    raise DtypeMismatch(f"dtype={asked!r} is not offered for this {logical} array: use {offered}, or leave "
                        f"dtype out ({'float32 values' if logical == CODES else 'the stored ' + logical})")


def scale_chunks(index: np.ndarray, chunk_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The chunks whose scales rows a dense :data:`CODES` answer carries (sorted, each once) and
    each row's place among them: both sides compute it from the rows asked."""
    chunks, inverse = np.unique(np.asarray(index, np.int64) // int(chunk_rows), return_inverse=True)
    return chunks, inverse.reshape(-1)


def route(template: str, **parts: object) -> str:
    """A route template filled in: ``route(ITEM, dataset="d", encoder="e", split="s", index=3)``.

    Names are checked here, on the client, so a bad one is :class:`InvalidName` before any
    request (a slash in a name would otherwise reach another route, or none).
    """
    for name in ("dataset", "encoder", "split"):
        if name in parts:
            validate_name(parts[name], name)
    if "bag_id" in parts:
        parts["bag_id"] = quote_bag_id(parts["bag_id"])
    return template.format(**{name: str(value) for name, value in parts.items()})


def quote_bag_id(bag_id: object) -> str:
    """A bag id as one URL path segment: UTF-8, every byte but ``[A-Za-z0-9_~-]`` percent-encoded
    (``.`` and ``/`` too, so ``..`` or ``a/../b`` cannot be folded away by a client or proxy that
    normalises dot segments); the server decodes it once."""
    if not isinstance(bag_id, str):
        raise InvalidIndices(f"a bag id is a string, got {type(bag_id).__name__} {bag_id!r}: pass the "
                             "id, or an int position in the split's bag order")
    return quote(bag_id, safe="").replace(".", "%2E")


def encode_shape(shape: Iterable[int]) -> str:
    """``(64, 256, 384)`` -> ``"64,256,384"``; ``()`` -> ``""``."""
    return ",".join(str(int(dim)) for dim in shape)


def parse_shape(text: str) -> tuple[int, ...]:
    """Inverse of :func:`encode_shape`; refuses anything but non-negative decimal integers."""
    text = text.strip()
    if text == "":
        return ()
    if _SHAPE_RE.fullmatch(text) is None:
        raise WireFormatError(
            f"bad {SHAPE_HEADER} header {text!r}: expected comma-separated non-negative integers"
        )
    shape = tuple(int(part) for part in text.split(","))
    if len(shape) > _MAX_DIMS:
        raise WireFormatError(f"bad {SHAPE_HEADER} header: {len(shape)} dimensions")
    return shape


def expected_nbytes(shape: Iterable[int], dtype: np.dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def json_safe(value: Any) -> Any:
    """Make metadata strict-JSON: non-finite floats become Zarr v3's ``"NaN"``/``"Infinity"``.

    Split metadata can hold NaN/Inf (a quantization report of a failed run); strict JSON
    encoders (Starlette's, ``allow_nan=False``) would fail on them with a 500.
    """
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return "NaN"
        return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    return value


# ---------------------------------------------------------------------- indices
def as_index_array(indices: Any) -> np.ndarray:
    """Any 1-D int sequence (list, numpy, torch; a scalar counts as one) as int64 numpy.

    The one normaliser for every reader (local, object storage, HTTP) and the server's index
    bodies, so the same input is accepted or refused with the same error everywhere.
    """
    if type(indices).__module__.startswith("torch"):
        indices = indices.detach().cpu().numpy()
    index = np.asarray(indices)
    if index.ndim == 0:
        index = index.reshape(1)
    values = index.tolist() if index.dtype == object and index.ndim == 1 else []
    if values and all(type(i) is int for i in values):
        # Python ints beyond 64 bits (numpy keeps them as objects): out of range, as any index is
        big = max(values, key=abs)
        if not -(2**63) <= big < 2**63:
            raise IndexOutOfRange(f"index {big} does not fit in int64: use indices in [0, the split's length)")
    if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
        raise InvalidIndices(
            f"indices must be a 1-D sequence of integers, got {index.dtype} with shape "
            f"{index.shape}: pass e.g. a list of ints or a torch.LongTensor"
        )
    if index.dtype == np.uint64 and index.size and int(index.max()) > np.iinfo(np.int64).max:
        raise IndexOutOfRange(f"index {int(index.max())} does not fit in int64")
    return index.astype(np.int64, copy=False)


def check_bounds(index: np.ndarray, length: int, what: str) -> None:
    """Refuse any index outside ``[0, length)`` of ``what`` (a split, named for the message)."""
    if index.size:
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= length:
            bad = low if low < 0 else high
            raise IndexOutOfRange(
                f"index {bad} is out of range for {what} with {length} samples: use indices in "
                f"[0, {length - 1}]"
            )


def decode_indices(body: bytes | memoryview) -> np.ndarray:
    """An :data:`INDICES` body (little-endian int64s) as an int64 array; no copy."""
    if len(body) % 8:
        raise WireFormatError(f"an {INDICES} body holds 8-byte integers; got {len(body)} bytes")
    return np.frombuffer(body, dtype="<i8")


def encode_indices(index: np.ndarray) -> bytes:
    return np.ascontiguousarray(index, dtype="<i8").tobytes()


# ---------------------------------------------------------------------- structure
@dataclass(frozen=True)
class ArrayStructure:
    """Shape, logical dtype and chunking of one stored array (``features`` or ``labels``)."""

    shape: tuple[int, ...]
    dtype: str
    chunk_rows: int

    @property
    def storage_dtype(self) -> np.dtype:
        return storage_dtype(self.dtype)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def sample_nbytes(self) -> int:
        return math.prod(self.sample_shape) * self.storage_dtype.itemsize

    @classmethod
    def of(cls, array: Any) -> ArrayStructure:
        """The structure of any reader array (``shape``, ``dtype``, ``chunk_rows``)."""
        return cls(tuple(int(d) for d in array.shape), str(array.dtype), int(array.chunk_rows))

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "storage_dtype": str(self.storage_dtype),
            "sample_nbytes": self.sample_nbytes,
            "chunk_rows": self.chunk_rows,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ArrayStructure:
        try:
            shape = tuple(int(d) for d in doc["shape"])
            structure = cls(shape, str(doc["dtype"]), int(doc["chunk_rows"]))
        except (KeyError, TypeError, ValueError) as error:
            raise WireFormatError(f"bad array structure {dict(doc)!r}: {error!r}") from error
        wire_dtype(structure.dtype)
        if not shape or any(d < 0 for d in shape) or structure.chunk_rows < 1:
            raise WireFormatError(f"bad array structure {dict(doc)!r}")
        return structure


@dataclass(frozen=True)
class SplitStructure:
    """What a client needs to read an opened split, in one ``GET`` (:data:`ARRAYS`).

    ``metadata`` is the split's metadata document (docs/FORMAT.md, made strict-JSON by
    :func:`json_safe`); ``has_ids`` comes from it, never from reading the ids;
    ``max_response_bytes`` is the server's cap, so a client splits large reads itself.
    """

    features: ArrayStructure
    labels: ArrayStructure | None
    has_ids: bool
    max_response_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def generation(self) -> str | None:
        """The split's generation id, when its writer recorded one."""
        value = self.metadata.get("generation")
        return None if value is None else str(value)

    def to_json(self) -> dict[str, Any]:
        return {
            "features": self.features.to_json(),
            "labels": None if self.labels is None else self.labels.to_json(),
            "has_ids": self.has_ids,
            "max_response_bytes": self.max_response_bytes,
            "generation": self.generation,
            "metadata": json_safe(self.metadata),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SplitStructure:
        try:
            labels = doc.get("labels")
            metadata = doc.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise TypeError("metadata is not an object")
            return cls(
                features=ArrayStructure.from_json(doc["features"]),
                labels=None if labels is None else ArrayStructure.from_json(labels),
                has_ids=bool(doc.get("has_ids", metadata.get("ids", False))),
                max_response_bytes=int(doc["max_response_bytes"]),
                metadata=metadata,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            if isinstance(error, WireFormatError):
                raise
            raise WireFormatError(f"bad split structure: {error!r}") from error


# ---------------------------------------------------------------------- errors
def error_body(detail: Any, error: str, **extra: Any) -> dict[str, Any]:
    """Every JSON error: ``{"detail": message, "error": class name, ...extra}``."""
    return {"detail": detail, "error": error, **extra}


def parse_error_body(doc: Any) -> tuple[Any, str | None, dict[str, Any]]:
    """``(detail, error class name or None, the other keys)`` of an error body (any JSON)."""
    if not isinstance(doc, dict):
        return doc, None, {}
    name = doc.get("error")
    extra = {k: v for k, v in doc.items() if k not in ("detail", "error")}
    return doc.get("detail"), name if isinstance(name, str) else None, extra
