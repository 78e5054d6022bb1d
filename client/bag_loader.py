"""BagLoader: stream a bag split's bags (slides) to the GPU for multiple-instance learning.

The machinery is :class:`client.loader.FeatureLoader`'s (read-ahead threads handing batches over
in order, at most ``prefetch`` in flight, pinned slots and ``non_blocking`` copies on a side
stream, upcast on the device, ``set_epoch`` / ``state_dict`` / ``rank`` and ``world_size``):
:class:`client.streaming.StreamingLoader` runs the epoch, :class:`client.bag_transfer.BagTransfer`
produces each batch. What is particular to bags:

* ``batch_size=1`` yields each bag as it is, ``[1, n, D]`` with an all-true mask; ``batch_size>1``
  pads to the longest bag of the batch (or to ``max_patches`` with ``pad_to="max_patches"``, for
  fixed shapes) and the mask marks the patches. ``bucket=True`` groups bags of similar length
  (:func:`client.bag_sampling.bag_batches`) so little of a padded batch is padding.
* ``max_patches=P`` reads a seeded uniform subset of P patches of each longer bag, per epoch
  (:func:`client.bag_sampling.subset_rows`): only those rows are read.
* ``return_ids=True`` adds the batch's bag ids, so a batch says which slides it holds.
* Empty bags (a slide without tissue) are left out of every epoch with ``skip_empty=True`` (one
  warning per epoch with their count; ``loader.stats["empty_skipped"]``); ``skip_empty=False``
  raises :class:`featurestore.errors.EmptyBag` when the batch holding one is read.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from client import bag_sampling, sampling
from client.bag_transfer import PAD_TO, PIECE_BYTES, BagTransfer
from client.bag_dataset import BagDataset
from client.readahead import bag_chunks
from client.loader_options import check_count, check_loader_options
from client.streaming import StreamingLoader, channel_normalization
from featurestore.core import descriptor_reads
from featurestore.errors import IndexOutOfRange, InvalidOption


class BagLoader(StreamingLoader):
    """Batches ``(features [B, P, D], mask [B, P], coords [B, P, 2], labels [B])`` of a
    :class:`BagDataset`, on ``device``; features in ``dtype`` (None: the stored dtype).
    ``return_ids=True`` appends ``ids``, the batch's bag ids (a list of str, in batch order).
    ``normalize=True``: ``(x - mean) / std`` per channel with the split's stored ``channel_stats``,
    as :class:`client.loader.FeatureLoader` does; padding stays zero.

    ``max_patches`` and ``seed`` default to the dataset's; the subset drawn for bag i in epoch e
    depends on ``(seed, e, i)`` only, and the epoch's order on ``(seed, e)``. ``indices``
    restricts every epoch to those bags (a cross-validation fold). ``rank`` / ``world_size`` give
    each DDP rank an equal, contiguous share of the epoch's bags (see
    :func:`client.sampling.partition`). ``piece_mib`` bounds each host read/copy piece
    (docs/LOADER.md, "Bags": the memory bound).
    """

    def __init__(
        self,
        ds: BagDataset,
        batch_size: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
        device: str | torch.device = "cuda",
        dtype: torch.dtype | None = torch.float32,
        max_patches: int | None = None,
        prefetch: int = 2,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        *,
        bucket: bool = False,
        skip_empty: bool = True,
        pad_to: str = "longest",
        indices: Sequence[int] | np.ndarray | None = None,
        normalize: bool = False,
        return_ids: bool = False,
        pin_memory: bool | str = "auto",
        num_threads: int | None = None,
        piece_mib: float = PIECE_BYTES / 2**20,
    ) -> None:
        if not isinstance(ds, BagDataset):
            raise TypeError(f"ds must be a client.BagDataset, but got: {type(ds).__name__}")
        seed = ds.seed if seed is None else seed  # as max_patches: the dataset's, unless given here
        options = check_loader_options(ds, batch_size=batch_size, prefetch=prefetch, seed=seed, rank=rank,
                                       world_size=world_size, device=device, dtype=dtype, pin_memory=pin_memory,
                                       num_threads=num_threads)  # fmt: skip
        if max_patches is not None:
            check_count("max_patches", max_patches, 1)
        if pad_to not in PAD_TO:
            raise InvalidOption(f"`pad_to` must be one of {', '.join(PAD_TO)}, but got: {pad_to!r}")
        if not isinstance(piece_mib, (int, float)) or isinstance(piece_mib, bool) or not piece_mib > 0:
            raise InvalidOption(f"`piece_mib` must be a positive number, but got: {piece_mib!r}")
        self.device = options.device
        self.ds = ds
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.dtype = options.dtype
        self.max_patches = ds.max_patches if max_patches is None else int(max_patches)
        if pad_to == "max_patches" and self.max_patches is None:
            # Without it the batch would silently be padded to its longest bag, not a fixed shape.
            raise InvalidOption("pad_to='max_patches' needs max_patches (on the loader or the dataset): pass "
                                "max_patches=P, or pad_to='longest'")
        self.prefetch = int(prefetch)
        self.drop_last = bool(drop_last)
        self.rank, self.world_size = int(rank), int(world_size)
        self.bucket = bool(bucket)
        self.skip_empty = bool(skip_empty)
        self.pad_to = pad_to
        self.indices = None if indices is None else self._check_indices(indices)
        self.normalize = bool(normalize)
        self._mean_std = channel_normalization(ds, self.normalize)
        self.return_ids = bool(return_ids)
        self.pin_memory = options.pin_memory
        self.piece_bytes = int(piece_mib * 2**20)
        # One bag per batch is one long read: two threads keep a local disk busy, but on two cores
        # the second only contends with the first and the consumer (warm epochs: 0.84-0.88x the
        # bare reader with one, 0.69-0.76x with two; cold and the stall alike). Remote reads are
        # latency bound. Never more than `prefetch` batches in flight (the memory bound).
        local = 2 if descriptor_reads.cores() > 2 else 1
        self.num_threads = min(num_threads or (local if ds.read_path != "http" else 4), self.prefetch)
        self._warned_epoch = -1
        self._init_epochs()

    def _check_indices(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        index = np.asarray(indices)
        if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
            raise InvalidOption(f"`indices` must be a 1-D sequence of bag positions, but got shape {index.shape} "
                                f"of {index.dtype}")
        index = index.astype(np.int64)
        if index.size and (int(index.min()) < 0 or int(index.max()) >= self.ds.num_bags):
            raise IndexOutOfRange(f"`indices` holds bag positions outside [0, {self.ds.num_bags}): pass positions "
                                  "into ds.ids")
        return index

    # ------------------------------------------------------------------ the epoch's batches
    def plan(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's batches of bag positions for ``epoch`` (default: the current one)."""
        return self._plan(self.epoch if epoch is None else epoch)[0]

    def _plan(self, epoch: int) -> tuple[list[np.ndarray], int]:
        order, skipped = bag_sampling.bag_order(
            self.ds.lengths, shuffle=self.shuffle, seed=self.seed, epoch=epoch, indices=self.indices,
            skip_empty=self.skip_empty, rank=self.rank, world_size=self.world_size, drop_last=self.drop_last)
        lengths = bag_sampling.effective_lengths(self.ds.lengths, self.max_patches)
        batches = bag_sampling.bag_batches(order, self.batch_size, lengths=lengths, bucket=self.bucket, seed=self.seed,
                                           epoch=epoch, drop_last=self.drop_last)
        return batches, skipped

    def __len__(self) -> int:
        pool = self.ds.lengths if self.indices is None else self.ds.lengths[self.indices]
        count = int((pool > 0).sum()) if self.skip_empty else len(pool)
        return sampling.num_batches(count, self.batch_size, drop_last=self.drop_last, world_size=self.world_size)

    # ------------------------------------------------------------------ what StreamingLoader runs
    def _epoch_values(self, skip: int) -> int | None:
        lengths = bag_sampling.effective_lengths(self.ds.lengths, self.max_patches)
        pool = lengths if self.indices is None else lengths[self.indices]
        share = 1 - skip / max(1, len(self))  # this rank's part of the epoch, from batch `skip` on
        return int(pool.sum() * self.ds.dim * share / self.world_size)

    def _epoch_batches(self, skip: int) -> Iterator[tuple[int, np.ndarray]]:
        epoch = self.epoch
        batches, skipped = self._plan(epoch)
        if skipped and self._warned_epoch != epoch:
            self._warned_epoch = epoch
            warnings.warn(f"{skipped} empty bag(s) of {self.ds.dataset}/{self.ds.encoder}/{self.ds.split} left out of "
                          f"epoch {epoch} (skip_empty=True; pass skip_empty=False to raise instead)", stacklevel=3)
        self._skipped = skipped
        split = self.ds.bags
        self._read_ahead(self.ds, lambda: [bag_chunks(split.offsets, batch, split.features.chunk_rows)
                                           for batch in batches[skip:]], skip)
        return ((epoch, batch) for batch in batches[skip:])

    def _start_stats(self) -> dict[str, float]:
        return {"batches": 0, "stall_s": 0.0, "empty_skipped": getattr(self, "_skipped", 0)}

    def _make_producer(self) -> BagTransfer:
        return BagTransfer(self.ds, self.device, self.dtype, self.pin_memory, self.num_threads,
                           max_patches=self.max_patches, seed=self.seed, pad_to=self.pad_to,
                           skip_empty=self.skip_empty, piece_bytes=self.piece_bytes, prefetch=self.prefetch,
                           mean_std=self._mean_std, return_ids=self.return_ids)

    def _identity(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "batch_size": self.batch_size, "drop_last": self.drop_last,
                "rank": self.rank, "world_size": self.world_size, "num_bags": self.ds.num_bags,
                "max_patches": self.max_patches, "bucket": self.bucket, "skip_empty": self.skip_empty,
                "indices": None if self.indices is None else _indices_key(self.indices)}

    def _resumes(self, key: str, saved: Any) -> bool:
        # A state saved before the indices were recorded by value held their count only.
        return key == "indices" and self.indices is not None and saved == len(self.indices)


def _indices_key(indices: Any) -> str:
    """``count:digest`` of a loader's bag subset: the folds of a cross-validation have the same
    count, and a state saved in one must not resume another."""
    values = np.ascontiguousarray(np.asarray(indices, np.int64))
    return f"{len(values)}:{hashlib.sha256(values.tobytes()).hexdigest()[:16]}"
