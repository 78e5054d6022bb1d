"""BagDataset: one bag split (ragged per-slide features) as a map-style torch Dataset.

``ds[i] -> (features [n, D], coords [n, 2], label)``, one slide per item, drop-in for
``torch.utils.data.DataLoader(ds, batch_size=1, num_workers=4)`` (CLAM's and most MIL code's
loop). The source is a local path, any fsspec URL or an ``http(s)://`` featurestore server; over
HTTP the bag reader is ``FeatureClient.open_bags(...)`` (``client.http``), which answers the same
calls as the store's bag reader, so the loader has one read path.

``max_patches=P`` draws, per bag and epoch, a uniform subset of P patches (all of them when the
bag has no more) from ``SeedSequence([seed, epoch, ..., bag])`` (:func:`client.bag_sampling.subset_rows`):
reproducible, independent of workers and threads, and no draw from the global random streams.
The subset's rows are sorted, so the reader reads only those rows, in one ascending pass: a
100k-patch bag subsampled to 4096 costs 4096 rows of I/O, not the whole bag.

As with :class:`client.dataset.FeatureDataset`, the opened reader is never pickled: each
DataLoader worker (forked or spawned) reopens the split on its first read.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from client import bag_sampling
from client.dataset import (
    NO_LABEL,
    OpenedPerProcess,
    _is_http,
    channel_stats_of,
    item_index,
    scales_of,
)
from featurestore.core.protocol import BagReader
from featurestore.errors import InvalidOption
from featurestore.format import dtypes
from featurestore.format.redact import redact_url


class BagDataset(OpenedPerProcess, torch.utils.data.Dataset):
    """Map-style dataset over the bags of ``source/dataset/encoder/split``.

    ``ds[i] -> (features, coords, label)``: features ``[n, D]`` in the stored dtype
    (``torch.float16``, ``torch.bfloat16`` or ``torch.float32``; upcast in your loop, or use
    :class:`client.bag_loader.BagLoader`, which upcasts on the device; an int8 split's values,
    codes times the bag's scales, as ``torch.float32``: ``ds.torch_dtype``), coords ``[n, 2]`` in the
    stored coordinate dtype (level-0 pixels or micrometres: ``ds.coords_unit``), label a scalar
    tensor of the stored label dtype, or ``tensor(-1)`` (:data:`client.dataset.NO_LABEL`) when the
    split has no labels. ``n`` is the bag's length, or ``max_patches`` when it is longer.

    ``set_epoch(e)`` selects the epoch of the subset draw (call it before each epoch, as for a
    ``DistributedSampler``; a DataLoader with ``persistent_workers=True`` keeps the epoch its
    workers were started with). ``storage_options`` go to fsspec; ``token`` is the bearer token
    of an ``http(s)://`` server.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        dataset: str,
        encoder: str,
        split: str,
        max_patches: int | None = None,
        seed: int = 0,
        *,
        storage_options: dict[str, Any] | None = None,
        token: str | None = None,
    ) -> None:
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"source must be a path, fsspec URL or http(s):// URL, but got: {source!r}")
        if max_patches is not None and (not isinstance(max_patches, (int, np.integer)) or isinstance(max_patches, bool)
                                        or max_patches < 1):
            raise InvalidOption(f"`max_patches` must be a positive integer or None (whole bags), but got: {max_patches!r}")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise InvalidOption(f"`seed` must be an integer >= 0, but got: {seed!r}")
        self.source = os.fspath(source)
        self.dataset, self.encoder, self.split = dataset, encoder, split
        self.storage_options = dict(storage_options or {})
        self.token = token
        if _is_http(self.source) and self.storage_options:
            raise InvalidOption("storage_options apply to fsspec sources only; an http(s):// source takes token=")
        self.max_patches = None if max_patches is None else int(max_patches)
        self.seed = int(seed)
        self.epoch = 0
        # Opened here so a wrong name fails now, in the main process; workers reopen.
        bags = self.bags
        self.num_bags = len(bags)
        self.ids: list[str] = list(bags.ids)
        self.lengths = np.asarray(bags.lengths, dtype=np.int64)
        labels = bags.labels
        self.labels: np.ndarray | None = None if labels is None else np.asarray(labels)
        self.dim = int(bags.dim)
        self.dtype: str = str(bags.dtype)
        self.numpy_dtype = dtypes.storage_dtype(self.dtype)  # of the stored bytes (int8 codes for int8)
        # int8: codes times their bag's scales (ds.scales()); features come out as float32 values
        self.quantized = dtypes.is_int8(self.dtype)
        self.torch_dtype = torch.float32 if self.quantized else dtypes.torch_dtype(self.dtype)
        self.coords_dtype = np.dtype(getattr(bags, "coords_dtype", "int64"))
        self.metadata: dict[str, Any] = dict(getattr(bags, "metadata", {}) or {})
        # The split's dtype on storage: int8 over HTTP too, where ``dtype`` is the float32 values read.
        self.stored_dtype: str = str(self.metadata.get("logical_dtype") or self.dtype)
        self.coords_unit: str | None = getattr(bags, "coords_unit", "px")
        # "mmap" / "ranges" / "zarr" for store readers (that of the features array), "http" for a server.
        self.read_path: str = "http" if _is_http(self.source) else str(getattr(bags.features, "path", "ranges"))

    # ------------------------------------------------------------------ opening
    @property
    def bags(self) -> BagReader:
        """The split's bag reader (:class:`featurestore.core.protocol.BagReader`: the store's, or
        the server's through ``FeatureClient.open_bags``), opened in this process on first use."""
        return self._reader_here()

    def _open_remote(self, client: Any) -> BagReader:
        return client.open_bags(self.dataset, self.encoder, self.split)

    def _open_store(self, store: Any) -> BagReader:
        return store.open_bags(self.dataset, self.encoder, self.split)

    def __repr__(self) -> str:
        return (f"BagDataset({redact_url(self.source)!r}, {self.dataset!r}, {self.encoder!r}, {self.split!r}, "
                f"bags={self.num_bags}, dim={self.dim}, dtype={self.dtype!r}, max_patches={self.max_patches})")

    def channel_stats(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The split's stored per-channel mean and std as float32 (``metadata["channel_stats"]``), or None."""
        return channel_stats_of(self.metadata)

    # ------------------------------------------------------------------ epochs and subsets
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the ``max_patches`` draw."""
        if not isinstance(epoch, (int, np.integer)) or isinstance(epoch, bool) or epoch < 0:
            raise InvalidOption(f"`epoch` must be a non-negative integer, but got: {epoch!r}")
        self.epoch = int(epoch)

    def rows(self, index: int, *, max_patches: int | None = None, seed: int | None = None,
             epoch: int | None = None) -> np.ndarray | None:
        """The sorted rows bag ``index`` yields (None: all of them), for this dataset's (or the
        given) ``max_patches``, ``seed`` and ``epoch``."""
        cap = self.max_patches if max_patches is None else max_patches
        return bag_sampling.subset_rows(int(self.lengths[index]), cap, seed=self.seed if seed is None else seed,
                                        epoch=self.epoch if epoch is None else epoch, bag=index)

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return self.num_bags

    @property
    def row_nbytes(self) -> int:
        """Bytes of one patch's features at the stored width."""
        return self.dim * self.numpy_dtype.itemsize

    def label_of(self, index: int) -> torch.Tensor:
        if self.labels is None:
            return torch.tensor(NO_LABEL, dtype=torch.int64)
        return torch.from_numpy(np.array(self.labels[index]))

    def read_into(self, index: int, rows: np.ndarray | None, features: np.ndarray, coords: np.ndarray) -> None:
        """Bag ``index``'s ``rows`` (None: all) into the preallocated C-contiguous ``features``
        ``[len(rows), D]`` (storage dtype: int8 codes for an int8 split, or float32/float16 for
        its values) and ``coords`` ``[len(rows), 2]``: the loaders' hot path, no allocation of the bag."""
        if self.quantized and features.dtype != self.numpy_dtype:
            _, stored = self.bags.read_numpy(int(index), rows=rows, out=features, dtype=features.dtype.name)
        else:
            _, stored = self.bags.read_numpy(int(index), rows=rows, out=features)
        coords[...] = stored

    def scales(self) -> np.ndarray:
        """An int8 split's float32 scales ``[num_bags, D]``: bag ``i``'s values are its codes
        times ``scales[i]`` (read with the split's index, in the reading process)."""
        return scales_of(getattr(self.bags, "scales", None))

    def use_read_pool(self, pool: Any) -> None:
        """Give this process's reader the loader's read threads (local stores; a no-op elsewhere)."""
        bags = self.bags
        for array in (getattr(bags, "features", None), getattr(bags, "coords", None)):
            if array is not None and hasattr(array, "read_pool") and array.read_pool is not pool:
                array.read_pool = pool

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        index = self._check_index(index)
        rows = self.rows(index)
        n = int(self.lengths[index]) if rows is None else len(rows)
        features = np.empty((n, self.dim), np.float32 if self.quantized else self.numpy_dtype)
        coords = np.empty((n, 2), self.coords_dtype)
        if n:
            self.read_into(index, rows, features, coords)
        values = torch.from_numpy(features) if self.quantized else dtypes.to_torch(features, self.dtype)
        return values, torch.from_numpy(coords), self.label_of(index)

    def _check_index(self, index: Any) -> int:
        return item_index(index, self.num_bags, "bag", "e.g. ds[3] (ds.ids.index(bag_id) for a bag id)")
