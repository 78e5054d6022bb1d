"""FeatureDataset: one stored split as a map-style torch Dataset, drop-in for a DataLoader.

``ds[i]`` reads one sample; ``ds.__getitems__(indices)`` (which ``torch.utils.data.DataLoader``
calls when it exists, torch >= 2.0) reads a whole batch with one gathered read, so a DataLoader
with ``batch_size=64`` costs one read per batch instead of 64. The source is a local path, any
fsspec URL (``s3://``, ``gs://``, ``memory://``...) or an ``http(s)://`` featurestore server.

The opened reader is never pickled: DataLoader workers (spawned or forked) reopen the split
lazily, in their own process, on their first read. A forked worker notices the changed process
id and reopens too, so no file map, fsspec session or HTTP connection is shared across processes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from client.stale import stale_reason_of
from featurestore.core.lineage import warn_stale
from featurestore.core.reader import as_index_array
from featurestore.errors import IndexOutOfRange, InvalidIndices, InvalidOption
from featurestore.format import dtypes
from featurestore.format.redact import redact_url

NO_LABEL = -1
"""Label returned for every sample of a split stored without labels (an int64 scalar tensor), so
the default collate still works and ``(features, label)`` unpacking never changes shape."""


def _is_http(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def item_index(index: Any, count: int, noun: str, example: str) -> int:
    """``ds[index]``'s position among ``count`` items: an int (a 0-d integer tensor too),
    Python-style negatives allowed; anything else is one error naming it."""
    if isinstance(index, torch.Tensor) and index.ndim == 0 and not index.dtype.is_floating_point \
            and index.dtype != torch.bool:
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        # int(1.9) would read item 1 and int('3') item 3: refuse, as the server does
        raise InvalidIndices(f"a {noun} index must be an integer, but got {index!r} ({type(index).__name__}): "
                             f"pass an int, {example}")
    index = int(index)
    if not -count <= index < count:
        raise IndexOutOfRange(f"{noun} index {index} is out of range for a split of {count} {noun}s: use "
                              f"0 <= index < {count} (or a negative index down to -{count})")
    return index + count if index < 0 else index


class OpenedPerProcess:
    """A dataset's reader, opened in the process that reads (the datasets below pickle without
    it: a DataLoader worker opens its own, no maps, sessions or sockets cross a process boundary).
    A subclass sets ``source``, ``storage_options`` and ``token`` and says what to open of a
    server (``FeatureClient``) and of a store."""

    source: str
    storage_options: dict[str, Any]
    token: str | None
    _reader: Any = None
    _reader_pid = -1

    def _reader_here(self) -> Any:
        if self._reader is None or self._reader_pid != os.getpid():
            reader = self._open_reader()
            self._check_same_split(reader)
            self._reader = reader
            self._reader_pid = os.getpid()
        return self._reader

    def _check_same_split(self, reader: Any) -> None:
        """A process reopening the split (a DataLoader worker, a dataset unpickled) must find the
        generation the dataset was opened on: an overwrite since would feed it other rows under the
        old length and metadata, where the main process's reader raises SplitChanged."""
        opened = (getattr(self, "metadata", None) or {}).get("generation")
        found = (getattr(reader, "metadata", None) or {}).get("generation")
        if opened is not None and found != opened:
            from featurestore.errors import SplitChanged

            name = "/".join(str(getattr(self, k, "?")) for k in ("dataset", "encoder", "split"))
            raise SplitChanged(f"{name}: the split was overwritten since this dataset opened it (generation "
                               f"{opened!r}, now {found!r}): its length and metadata are the old split's; make the "
                               "dataset (and its DataLoader) again")

    def _open_reader(self) -> Any:
        if _is_http(self.source):
            from client.http import FeatureClient

            from client.remote_values import values_over_http

            client = FeatureClient(self.source, token=self.token)
            client.check_stale = False  # the dataset checks and warns once (ds.stale), not each worker
            return values_over_http(self._open_remote(client))
        import featurestore

        return self._open_store(featurestore.open_store(self.source, mode="r", **self.storage_options))

    def _open_remote(self, client: Any) -> Any:
        raise NotImplementedError

    def _open_store(self, store: Any) -> Any:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_reader", None)
        state.pop("_reader_pid", None)
        return state


class FeatureDataset(OpenedPerProcess, torch.utils.data.Dataset):
    """Map-style dataset over ``source/dataset/encoder/split``.

    ``ds[i] -> (features, label)``: features as a tensor of the stored dtype (``torch.float16``,
    ``torch.bfloat16`` or ``torch.float32``, shape ``sample_shape``; an int8 split's values,
    codes times scales, as ``torch.float32``: ``ds.torch_dtype``), label as a tensor of the
    stored label dtype, or ``tensor(-1)`` (:data:`NO_LABEL`) when the split has no labels.
    Upcasting is left to the consumer (or to :class:`~client.loader.FeatureLoader`, which does it
    on the GPU, and dequantizes int8 there), so the bytes crossing process boundaries stay at the
    stored width.

    ``storage_options`` go to fsspec (e.g. ``endpoint_url``, ``key``, ``secret``; on object storage
    also ``cache_dir``/``cache_bytes``, a local chunk cache that :class:`FeatureLoader` fills ahead
    by its plan, docs/STORAGE.md); ``token`` is the
    bearer token of an ``http(s)://`` server; ``allow_incomplete`` reads a split still being
    written (store sources only). ``ds.stale``: why a derived split (``featurestore embed``) no
    longer describes its source, which was rewritten or removed since (None: current); opening
    one warns (:class:`~featurestore.errors.StaleSplitWarning`, :mod:`client.stale`).
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        dataset: str,
        encoder: str,
        split: str,
        *,
        storage_options: dict[str, Any] | None = None,
        token: str | None = None,
        allow_incomplete: bool = False,
    ) -> None:
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"source must be a path, fsspec URL or http(s):// URL, but got: {source!r}")
        self.source = os.fspath(source)
        self.dataset, self.encoder, self.split = dataset, encoder, split
        self.storage_options = dict(storage_options or {})
        self.token = token
        self.allow_incomplete = bool(allow_incomplete)
        if _is_http(self.source) and self.storage_options:
            raise InvalidOption("storage_options apply to fsspec sources only; an http(s):// source takes token=")
        if _is_http(self.source) and self.allow_incomplete:
            raise InvalidOption("allow_incomplete applies to store sources only: a server serves complete splits "
                             "(409 otherwise); open the store URL directly to read an incomplete split")
        # Opened once here so a wrong name or URL fails now, in the main process, and so the
        # shape and metadata are known without a reader; workers reopen (see __getstate__).
        array = self.array
        self.num_samples = int(array.shape[0])
        self.sample_shape: tuple[int, ...] = tuple(int(s) for s in array.sample_shape)
        self.dtype: str = array.dtype
        self.numpy_dtype = np.dtype(array.numpy_dtype)  # of the stored bytes (int8 codes for int8)
        # int8: codes times their chunk's scales (ds.scales()); features come out as float32 values
        self.quantized = dtypes.is_int8(self.dtype)
        self.torch_dtype = torch.float32 if self.quantized else dtypes.torch_dtype(self.dtype)
        self.metadata: dict[str, Any] = dict(array.metadata)
        # The split's dtype on storage: int8 over HTTP too, where ``dtype`` is the float32 values read.
        self.stored_dtype: str = str(self.metadata.get("logical_dtype") or self.dtype)
        labels = array.labels
        self.has_labels = labels is not None
        self.label_shape: tuple[int, ...] = tuple(int(s) for s in labels.sample_shape) if labels is not None else ()
        self.label_numpy_dtype = np.dtype(labels.numpy_dtype) if labels is not None else np.dtype(np.int64)
        # "mmap" / "ranges" / "zarr" for store readers; "http" for a server. The loader picks its
        # default shuffle from this (random row access is cheap only on "mmap").
        self.read_path: str = "http" if _is_http(self.source) else str(getattr(array, "path", "ranges"))
        self.chunk_rows = int(getattr(array, "chunk_rows", 0) or self.metadata.get("chunk_rows") or 1)
        # A derived split whose source changed since is read, never as current (client.stale).
        self.stale: str | None = stale_reason_of(self.source, self.metadata, storage_options=self.storage_options,
                                                 token=self.token)
        if self.stale is not None:
            warn_stale(f"{dataset}/{encoder}/{split}", self.stale, stacklevel=2)

    # ------------------------------------------------------------------ opening
    @property
    def array(self) -> Any:
        """The split's feature reader, opened in this process on first use."""
        return self._reader_here()

    def _open_remote(self, client: Any) -> Any:
        return client.open(self.dataset, self.encoder, self.split)

    def _open_store(self, store: Any) -> Any:
        return store.open(self.dataset, self.encoder, self.split, allow_incomplete=self.allow_incomplete)

    def __repr__(self) -> str:
        return (f"FeatureDataset({redact_url(self.source)!r}, {self.dataset!r}, {self.encoder!r}, {self.split!r}, "
                f"n={self.num_samples}, sample_shape={self.sample_shape}, dtype={self.dtype!r})")

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return self.num_samples

    @property
    def sample_nbytes(self) -> int:
        return int(np.prod(self.sample_shape, dtype=np.int64)) * self.numpy_dtype.itemsize

    @property
    def label_nbytes(self) -> int:
        return int(np.prod(self.label_shape, dtype=np.int64)) * self.label_numpy_dtype.itemsize

    def read_into(self, indices: np.ndarray, features: np.ndarray, labels: np.ndarray | None = None) -> None:
        """Gather rows ``indices`` into the preallocated ``features`` (storage dtype, C-contiguous,
        ``[len(indices), *sample_shape]``; int8 codes for an int8 split, or float32/float16 for
        its values) and, if given and the split has labels, ``labels``.

        This is the loader's hot path: one gathered read per array, no allocation of the batch.
        """
        array = self.array
        both = getattr(array, "read_into", None)  # HTTP: features and labels in one request
        if both is not None and labels is not None and array.labels is not None:
            both(indices, features, labels)
            return
        if self.quantized and features.dtype != self.numpy_dtype:
            array.read_numpy(indices, out=features, dtype=features.dtype.name)
        else:
            array.read_numpy(indices, out=features)
        if labels is not None:
            if array.labels is not None:
                array.labels.read_numpy(indices, out=labels)
            else:
                labels.fill(NO_LABEL)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = item_index(index, self.num_samples, "sample", "e.g. ds[3]")
        features, labels = self._read_batch(np.asarray([index], dtype=np.int64))
        return features[0], labels[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One gathered read for the whole batch; samples are views into that batch."""
        features, labels = self._read_batch(as_index_array(indices))
        return [(features[j], labels[j]) for j in range(len(features))]

    def _read_batch(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        array = self.array
        if self.quantized:
            features = torch.from_numpy(array.read_numpy(index, dtype="float32"))
        else:
            features = dtypes.to_torch(array.read_numpy(index), self.dtype)
        if array.labels is not None:
            labels = torch.from_numpy(array.labels.read_numpy(index))
        else:
            labels = torch.full((len(index),), NO_LABEL, dtype=torch.int64)
        return features, labels

    def scales(self) -> np.ndarray:
        """An int8 split's float32 scales ``[num_chunks, *sample_shape]``: row ``r``'s values are
        ``codes[r] * scales[r // chunk_rows]`` (read once per process)."""
        return scales_of(self.array.scales)

    def channel_stats(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The split's stored per-channel (last axis) mean and std as float32, or None."""
        return channel_stats_of(self.metadata)


def scales_of(scales: Any) -> np.ndarray:
    """A reader's int8 scales as an array: the dense reader's table (read on first use), a bag
    reader's array."""
    if scales is None:
        from featurestore.errors import DtypeMismatch

        raise DtypeMismatch("scales are held by int8 splits only: this split stores its values as they are")
    return scales.table() if hasattr(scales, "table") else np.asarray(scales, np.float32)


def channel_stats_of(metadata: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """``metadata["channel_stats"]`` (dense and bag splits alike) as float32 mean and std, or None."""
    stats = metadata.get("channel_stats")
    if not stats or stats.get("mean") is None or stats.get("std") is None:
        return None
    return np.asarray(stats["mean"], np.float32), np.asarray(stats["std"], np.float32)
