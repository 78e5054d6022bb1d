"""FeatureLoader: stream a split's batches to the GPU from background threads, in bounded memory.

Data path per batch (docs/LOADER.md has the picture and the memory bound):

* CUDA: a prefetch thread gathers the rows into a reusable (pinned) host slot at the stored
  width, enqueues ``non_blocking`` host-to-device copies on a side stream, upcasts, widens labels
  and normalises there, and records events. The consumer's stream waits on the batch's event
  (no host sync) and ``record_stream`` tells the caching allocator the tensors are used there. A
  host slot is rewritten only after the event of the copy out of it has completed.
* CPU: the thread reads straight into the batch handed out (or into a reusable staging buffer,
  then converts, when ``dtype`` differs from the stored dtype). Batches live in recycled buffers
  that return to the loader only when the consumer drops the last view of them, because a probe
  may keep its batches (``torch.cat`` of all features is the classic use).

Batches are delivered in order whatever the number of threads; at most ``prefetch`` batches are
read ahead of the consumer, which bounds host memory whatever the split's length.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from client import sampling
from client.dataset import FeatureDataset
from client.readahead import row_chunks
from client.loader_options import check_loader_options
from client.streaming import StreamingLoader, channel_normalization
from client.transfer import Transfer
from featurestore.errors import InvalidOption


class FeatureLoader(StreamingLoader):
    """Batches ``(features, labels)`` of a :class:`FeatureDataset`, on ``device``, in ``dtype``.

    ``shuffle=True`` is a uniform permutation of the rows on every backend (local, object storage,
    HTTP), so a probe sees the same batch statistics as with an in-RAM cache; ``shuffle=False`` is
    ``order="sequential"``. ``order="block"`` (chunk-sized blocks in random order, rows shuffled
    within each block) is available explicitly: cheaper on object storage, but each batch then
    holds rows from one or two chunks, i.e. neighbouring samples (docs/LOADER.md: effect on
    training). An explicit ``order`` wins over ``shuffle``. A ``batch_sampler`` (any iterable of index lists)
    is used as given, on every rank: it replaces ``shuffle``/``order``/``drop_last``/``seed``, and
    ``rank``/``world_size`` must stay at their defaults (partition inside the sampler).

    Labels: integer and bool labels come out as int64 on ``device``, float labels unchanged;
    a split without labels yields ``-1`` per sample (:data:`client.dataset.NO_LABEL`).
    ``return_ids=True`` appends ``ids``, the batch's sample ids (a list of str, in batch order), for
    a split that has them (an embedding split's slide or patient ids).
    """

    def __init__(
        self,
        ds: FeatureDataset,
        batch_size: int = 64,
        shuffle: bool = True,
        seed: int = 0,
        device: str | torch.device = "cuda",
        dtype: torch.dtype | None = torch.float32,
        prefetch: int = 2,
        drop_last: bool = False,
        batch_sampler: Iterable[Sequence[int]] | None = None,
        rank: int = 0,
        world_size: int = 1,
        *,
        order: str = "auto",
        normalize: bool = False,
        pin_memory: bool | str = "auto",
        num_threads: int | None = None,
        return_ids: bool = False,
    ) -> None:
        if not isinstance(ds, FeatureDataset):
            raise TypeError(f"ds must be a client.FeatureDataset, but got: {type(ds).__name__}")
        if order not in ("auto", *sampling.ORDERS):
            raise InvalidOption(f"`order` must be one of auto, {', '.join(sampling.ORDERS)}, but got: {order!r}")
        if batch_sampler is not None and world_size != 1:
            raise InvalidOption("a batch_sampler is used as given on every rank: leave rank/world_size at "
                                "their defaults and partition inside the sampler (e.g. with DistributedSampler)")
        options = check_loader_options(ds, batch_size=batch_size, prefetch=prefetch, seed=seed, rank=rank,
                                       world_size=world_size, device=device, dtype=dtype, pin_memory=pin_memory,
                                       num_threads=num_threads)  # fmt: skip
        self.device = options.device
        self.ds = ds
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.dtype = options.dtype
        self.prefetch = int(prefetch)
        self.drop_last = bool(drop_last)
        self.batch_sampler = batch_sampler
        self.rank, self.world_size = int(rank), int(world_size)
        if batch_sampler is not None:
            self.order = "batch_sampler"
        elif order != "auto":
            self.order = order
        else:  # "auto": uniform on every backend; "block" only when asked for
            self.order = "shuffle" if self.shuffle else "sequential"
        self.normalize = bool(normalize)
        self._mean_std = channel_normalization(ds, self.normalize)
        self.return_ids = bool(return_ids)
        self._ids = None if not return_ids else ds.array.ids
        if return_ids and self._ids is None:
            raise InvalidOption(f"return_ids=True needs sample ids, and {ds.dataset}/{ds.encoder}/{ds.split} has none "
                                "(a split written with ids=, e.g. by featurestore embed, has them): drop return_ids")
        self.pin_memory = options.pin_memory
        # Read-ahead: each thread has one batch's reads in flight. Locally a batch's rows are read
        # concurrently by the read pool already, so two batches keep the device queue full while
        # the consumer works; remote reads are latency bound, so more batches are requested at
        # once. Never more than `prefetch` are in flight (the memory bound).
        # A chunk cache's reads are local too (its downloads have their own threads).
        # An int8 split read to the CPU dequantizes on these threads too: a third overlaps one batch's
        # reads with two dequantizes (a cold [1024, 3072] epoch: 296 -> 324 samples/s, fresh processes).
        if ds.read_path in ("mmap", "cached"):
            default_threads = 3 if ds.quantized and self.device.type == "cpu" else 2
        else:
            default_threads = 4
        self.num_threads = min(num_threads or default_threads, self.prefetch)
        self._init_epochs()

    # ------------------------------------------------------------------ length and plan
    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]  # TypeError if it has no len
        return sampling.num_batches(self.ds.num_samples, self.batch_size, drop_last=self.drop_last,
                                    world_size=self.world_size)

    def plan(self, epoch: int | None = None) -> sampling.BatchPlan:
        """This rank's batches for ``epoch`` (default: the current one), built-in orders only."""
        if self.batch_sampler is not None:
            raise InvalidOption("this loader uses a batch_sampler: its batches are the sampler's")
        return sampling.BatchPlan(self.ds.num_samples, self.batch_size, self.order, seed=self.seed,
                                  epoch=self.epoch if epoch is None else epoch, block_rows=self.ds.chunk_rows,
                                  drop_last=self.drop_last, rank=self.rank, world_size=self.world_size)

    # ------------------------------------------------------------------ what StreamingLoader runs
    def _epoch_batches(self, skip: int) -> Iterator[np.ndarray]:
        if self.batch_sampler is not None:
            n = self.ds.num_samples
            return (sampling.sampler_batch(b, n) for b in sampling.user_batches(self.batch_sampler, self.epoch, skip))
        plan = self.plan()
        rows = self.ds.chunk_rows
        self._read_ahead(self.ds, lambda: [row_chunks(plan.batch(k), rows) for k in range(skip, len(plan))], skip)
        return (plan.batch(k) for k in range(skip, len(plan)))

    def _epoch_values(self, skip: int) -> int | None:
        try:
            batches = len(self) - skip
        except TypeError:  # a batch_sampler without a length
            return None
        return batches * self.batch_size * int(np.prod(self.ds.sample_shape))

    def _make_producer(self) -> Transfer:
        return Transfer(self.ds, self.device, self.dtype, self.pin_memory, self._mean_std, self.num_threads,
                        prefetch=self.prefetch, ids=self._ids)

    @property
    def _transfer(self) -> Transfer | None:
        return self._producer

    def _identity(self) -> dict[str, Any]:
        return {"seed": self.seed, "order": self.order, "batch_size": self.batch_size, "drop_last": self.drop_last,
                "rank": self.rank, "world_size": self.world_size, "num_samples": self.ds.num_samples}
