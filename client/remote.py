"""``RemoteFeatureArray``: one split's features (or labels) on a server, with the interface of a
local :class:`featurestore.FeatureArray`, so datasets and loaders treat both sources alike.

Everything it knows about the split comes from one :class:`~featurestore.format.wire.SplitStructure`
(one ``GET .../arrays``); every byte it reads comes through :meth:`FeatureClient.fetch_parts` /
:meth:`FeatureClient.fetch_samples`, the client's public data calls, each response checked to be
of the generation the structure named (``SplitChanged`` if the split was overwritten since). An
int8 split's codes come with their chunks' scales (``?dtype=int8``) and are dequantized here as
the local reader does (``format.int8``).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore import errors as fse
from featurestore.core.quantize_int8 import check_read_dtype
from featurestore.format import dtypes, int8, wire

if TYPE_CHECKING:
    from client.http import FeatureClient

__all__ = ["RemoteFeatureArray", "check_generation", "reopening"]

REOPENS = 3  # tries of a by-name read whose split keeps being overwritten under it


def reopening(method: Any) -> Any:
    """A by-name read (``fc.read_numpy(dataset, encoder, split, ...)``) reads the split as it is
    now: when it was overwritten since the client cached its structure (SplitChanged), the split
    is opened again and the read done again, whole (no rows of two generations). A reader the
    caller holds (``fc.open(...)``) raises SplitChanged instead: its offsets and lengths are the
    old generation's."""

    @functools.wraps(method)
    def call(self: Any, dataset: str, encoder: str, split: str, *args: Any, **kwargs: Any) -> Any:
        for attempt in range(REOPENS):
            try:
                return method(self, dataset, encoder, split, *args, **kwargs)
            except fse.SplitChanged:
                self._layouts.pop((dataset, encoder, split), None)
                self._bags.pop((dataset, encoder, split), None)
                if attempt == REOPENS - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    return call


def check_generation(headers: Any, generation: str | None, where: str) -> None:
    """Refuse (SplitChanged) a data response from another generation of the split than the one
    the reader opened (``generation``, from its structure or listing): the server answers from
    the split as it is now, and rows of an overwritten split must not pass for the old ones."""
    served = headers.get(wire.GENERATION_HEADER)
    if generation is not None and served is not None and served != generation:
        raise fse.SplitChanged(wire.redact(
            f"{where} answered from generation {served!r} of the split, this reader opened {generation!r}: "
            "the split was overwritten since it was opened; open it again"))


class RemoteFeatureArray:
    """A split's ``features`` (or ``labels``) over HTTP, with :class:`FeatureArray`'s interface.

    Reads larger than the server's byte cap are split into several requests, each written in
    place into the one output buffer. :meth:`read_into` fetches features and labels of a batch in
    one request (the loader's hot path).
    """

    def __init__(self, client: FeatureClient, key: tuple[str, str, str],
                 structure: wire.SplitStructure, *, labels: bool = False) -> None:  # fmt: skip
        self.client = client
        self.key = key
        self.structure = structure
        self.name = "labels" if labels else "features"
        array = structure.labels if labels else structure.features
        if array is None:
            raise fse.SplitNotFound(f"split {'/'.join(key)} has no labels")
        self.shape: tuple[int, ...] = array.shape
        self.sample_shape = array.sample_shape
        self.dtype: str = array.dtype
        self.numpy_dtype = array.storage_dtype
        self.sample_nbytes = array.sample_nbytes
        self.chunk_rows = array.chunk_rows
        self.max_response_bytes = structure.max_response_bytes
        self.metadata = structure.metadata
        self.stale: str | None = None  # why a derived split is stale (FeatureClient.open checks)
        self.path = "http"  # the read path, as FeatureArray.path names its own
        self.route = dict(zip(("dataset", "encoder", "split"), key, strict=True))
        self.params: dict[str, str] = {"labels": "true"} if labels else {}
        self._ids: list[str] | None = None
        self.labels: RemoteFeatureArray | None = None
        self.features_array: RemoteFeatureArray = self  # the labels' own: the one the client caches
        if not labels and structure.labels is not None:
            self.labels = RemoteFeatureArray(client, key, structure, labels=True)
            self.labels.features_array = self

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"RemoteFeatureArray({self.client.url!r}, {'/'.join(self.key)}, {self.name}, " \
               f"shape={self.shape}, dtype={self.dtype!r})"  # fmt: skip

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.sample_nbytes

    @property
    def ids(self) -> list[str] | None:
        """The sample ids (fetched on first use; ``None`` without asking when the split has none)."""
        if self.structure.has_ids and self._ids is None:
            self._ids = [str(i) for i in self.client.get_json(wire.route(wire.IDS, **self.route))["ids"]]
        return self._ids

    def positions_of(self, ids: Any) -> np.ndarray:
        """int64 positions of sample ``ids``, as ``FeatureArray.positions_of`` (the ids fetched once)."""
        from featurestore.format import sample_ids

        if self.ids is None:
            raise fse.SampleNotFound(f"split {'/'.join(self.key)} has no sample ids: read it by position")
        table = self.__dict__.get("_id_table")
        if table is None:
            table = self._id_table = sample_ids.id_positions(self.ids)
        return sample_ids.positions_of(ids, table, f"split {'/'.join(self.key)} at {self.client.url}")

    # ------------------------------------------------------------------ reads
    def read(self, indices: Any) -> Any:
        """Rows as a torch tensor of the stored dtype (float32 values for an int8 split, as locally)."""
        if self.dtype == wire.CODES:
            return dtypes.to_torch(self.read_numpy(indices, dtype="float32"), "float32")
        return dtypes.to_torch(self.read_numpy(indices), self.dtype)

    def read_range(self, start: int, stop: int) -> np.ndarray:
        if not (0 <= start <= stop <= len(self)):
            raise fse.IndexOutOfRange(
                f"range [{start}, {stop}) is outside [0, {len(self)}]: use 0 <= start <= stop <= {len(self)}"
            )
        return self.read_numpy(np.arange(start, stop, dtype=np.int64))

    def _index(self, indices: Any) -> np.ndarray:
        index = wire.as_index_array(indices)
        wire.check_bounds(index, len(self), f"{self.client.url} {'/'.join(self.key)} {self.name}")
        return index

    def _out(self, out: np.ndarray | None, rows: int, sample_shape: tuple[int, ...],
             dtype: np.dtype) -> np.ndarray:  # fmt: skip
        shape = (rows, *sample_shape)
        if out is None:
            return np.empty(shape, dtype)
        if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise fse.ShapeMismatch(
                f"out has shape {out.shape} and dtype {out.dtype}; this read needs a C-contiguous "
                f"{shape} array of {dtype}"
            )
        return out

    def read_numpy(self, indices: Any, out: np.ndarray | None = None, dtype: str | None = None) -> np.ndarray:
        """Rows ``indices`` (any order, duplicates allowed) in the storage dtype (int8 codes for
        int8), or as ``dtype`` ("float32"/"float16"), as ``FeatureArray.read_numpy`` answers them.

        An int8 split's values are its codes and their chunks' scales fetched (``?dtype=int8``)
        and dequantized here by the store's formula (``format.int8``: the same bits as a local
        read), or, where the scales would outweigh the values (rows of many chunks), the values
        the server dequantized the same way."""
        want = check_read_dtype(dtype, self.dtype)
        index = self._index(indices)
        if want is None or (self.dtype != wire.CODES and np.dtype(want) == self.numpy_dtype):
            out = self._out(out, len(index), self.sample_shape, self.numpy_dtype)
            self._read(index, out, wire.CODES if self.dtype == wire.CODES else None)
            return out
        out = self._out(out, len(index), self.sample_shape, np.dtype(want))
        if self.dtype != wire.CODES:  # stored rows cast here: fewer bytes, the local cast
            out[...] = dtypes.stored_as_float32(self.read_numpy(index), self.dtype)
            return out
        elements = math.prod(self.sample_shape)
        chunks = len(wire.scale_chunks(index, self.chunk_rows)[0])
        if len(index) * elements + chunks * elements * 4 >= out.nbytes:
            self._read(index, out, want)
            return out
        codes = np.empty((len(index), *self.sample_shape), np.int8)
        self._read(index, codes, wire.CODES, values=out)
        return out

    def _pieces(self, index: np.ndarray, row_bytes: int, scales: bool) -> list[slice]:
        """Runs of ``index`` whose answer fits the server's cap, an int8 answer's scales rows
        (one per chunk a piece touches) included."""
        cap, scale_bytes = self.max_response_bytes, 4 * math.prod(self.sample_shape) if scales else 0
        pieces, start = [], 0
        while start < len(index):
            rows = max(1, (cap - scale_bytes) // max(row_bytes, 1))
            while scales and rows > 1:
                chunks = len(wire.scale_chunks(index[start : start + rows], self.chunk_rows)[0])
                if min(rows, len(index) - start) * row_bytes + chunks * scale_bytes <= cap:
                    break
                rows = max(1, rows // 2)
            pieces.append(slice(start, start + rows))
            start += rows
        return pieces

    def _read(self, index: np.ndarray, out: np.ndarray, served: str | None, values: np.ndarray | None = None) -> None:
        """Rows ``index`` into ``out``, ``?dtype=served`` (None: as stored) in pieces the cap
        allows; with codes, each piece's scales too, and its values into ``values`` if given."""
        codes = served == wire.CODES
        try:
            for piece in self._pieces(index, out[:1].nbytes if len(out) else 0, codes):
                self._read_piece(index[piece], out[piece], served, None if values is None else values[piece])
        except fse.SplitChanged:
            self._forget()
            raise
        except fse.IndexOutOfRange as error:
            raise self._changed(error) from None

    def _changed(self, error: fse.IndexOutOfRange) -> fse.SplitChanged:
        """The server's 416 for rows this reader checked against the split it opened: the split
        was overwritten since with fewer rows (its 416 carries no generation to compare)."""
        self._forget()
        return fse.SplitChanged(wire.redact(
            f"{self.client.url} {'/'.join(self.key)}: the server holds fewer rows than the {len(self)} this reader "
            f"opened ({str(error).splitlines()[0]}): the split was overwritten since it was opened; open it again"))

    def _forget(self) -> None:
        """The split was overwritten: the client's next ``open`` of it asks for its structure again."""
        layouts = getattr(self.client, "_layouts", {})
        if layouts.get(self.key) in (self, self.features_array):
            del layouts[self.key]

    def read_into(self, indices: Any, features: np.ndarray,
                  labels: np.ndarray | None = None) -> None:  # fmt: skip
        """Features (and, if given and the split has them, labels) of ``indices`` in place, in one
        request per piece that fits the server's cap (:data:`wire.SAMPLES`)."""
        if self.name != "features":
            raise TypeError("read_into is a features-array call: it also fills the labels")
        index = self._index(indices)
        features = self._out(features, len(index), self.sample_shape, self.numpy_dtype)
        if labels is None or self.labels is None:
            self.read_numpy(index, out=features)
            return
        lab = self.labels
        labels = self._out(labels, len(index), lab.sample_shape, lab.numpy_dtype)
        codes = self.dtype == wire.CODES  # the stored codes, as read_numpy answers (their scales unused)
        try:
            for piece in self._pieces(index, self.sample_nbytes + lab.sample_nbytes, codes):
                scales = None
                if codes:
                    touched = len(wire.scale_chunks(index[piece], self.chunk_rows)[0])
                    scales = np.empty((touched, *self.sample_shape), np.float32)
                self.client.fetch_samples(self, index[piece], features[piece], labels[piece], scales=scales)
        except fse.SplitChanged:
            self._forget()
            raise
        except fse.IndexOutOfRange as error:
            raise self._changed(error) from None

    def _read_piece(self, index: np.ndarray, out: np.ndarray, served: str | None = None,
                    values: np.ndarray | None = None) -> None:  # fmt: skip
        if not len(index):
            return
        first = int(index[0])
        batch = wire.route(wire.BATCH, **self.route)
        params = dict(self.params)
        if served is not None:
            params[wire.DTYPE_PARAM] = served
        parts = [(out, served or self.dtype, wire.SHAPE_HEADER, wire.DTYPE_HEADER)]
        chunks = inverse = None
        if served == wire.CODES:
            chunks, inverse = wire.scale_chunks(index, self.chunk_rows)
            scales = np.empty((len(chunks), *self.sample_shape), np.float32)
            parts.append((scales, "float32", wire.SCALES_SHAPE_HEADER, wire.SCALES_DTYPE_HEADER))
        # A contiguous ascending run goes as GET ?start&stop: no body, and the server reads it
        # as one slice.
        if len(index) == 1 or (int(index[-1]) - first == len(index) - 1
                               and bool(np.all(np.diff(index) == 1))):  # fmt: skip
            params.update(start=str(first), stop=str(first + len(index)))
            self.client.fetch_parts("GET", batch, parts, params=params, generation=self.structure.generation)
        else:
            self.client.fetch_parts("POST", batch, parts, params=params, indices=index,
                                    generation=self.structure.generation)  # fmt: skip
        if values is not None and inverse is not None:
            int8.dequantize_into(out, inverse, scales, values)
