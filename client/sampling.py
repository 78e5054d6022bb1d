"""Batch orders for :class:`client.loader.FeatureLoader`: which rows go in batch k of an epoch.

Every built-in order is a pure function of ``(num_samples, batch_size, seed, epoch, rank,
world_size, drop_last)``: no global RNG, no dependence on thread or worker count, so the same
arguments give the same batches on any machine and a resumed run can recompute the plan and skip
what was consumed. numpy only (no torch), so it is cheap to test.

Orders:

* ``sequential``: 0, 1, 2, ...
* ``shuffle``: a uniform permutation drawn from ``SeedSequence([seed, epoch])``.
* ``block``: chunk-sized blocks of consecutive rows in a random order, rows shuffled within each
  block. A batch then touches ~``batch_size / block_rows + 1`` chunks instead of ~``batch_size``,
  which is what object storage and HTTP need (few large ranged reads instead of many tiny ones).

Partitioning for DDP (``world_size > 1``) splits the epoch's order into ``world_size`` contiguous
equal slices (contiguous, not strided like ``DistributedSampler``, so a block order stays
chunk-local on every rank). Equal slices need the length to be a multiple of ``world_size``:
``drop_last=False`` pads by wrapping to the start of the order (as ``DistributedSampler`` does; at
most ``world_size - 1`` samples are seen twice per epoch), ``drop_last=True`` drops the tail (at
most ``world_size - 1`` samples are skipped per epoch) and then drops each rank's partial batch.
Either way every rank gets the same number of batches, so collective ops never deadlock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from featurestore.errors import IndexOutOfRange, InvalidIndices
from featurestore.format import wire

ORDERS = ("sequential", "shuffle", "block")


def epoch_order(
    num_samples: int,
    order: str,
    *,
    seed: int = 0,
    epoch: int = 0,
    block_rows: int = 1,
) -> np.ndarray:
    """The full epoch's sample order (int64, a permutation of ``range(num_samples)``)."""
    if order == "sequential":
        return np.arange(num_samples, dtype=np.int64)
    # SeedSequence mixes (seed, epoch) into independent streams: epoch e and e+1 are unrelated
    # permutations, and no state carries over between epochs (exact resume needs only the pair).
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])))
    if order == "shuffle":
        return rng.permutation(num_samples).astype(np.int64, copy=False)
    if order == "block":
        block_rows = max(1, int(block_rows))
        num_blocks = -(-num_samples // block_rows)
        position = np.empty(num_blocks, np.int64)  # where each block lands in the epoch
        position[rng.permutation(num_blocks)] = np.arange(num_blocks, dtype=np.int64)
        rows = np.arange(num_samples, dtype=np.int64)
        # lexsort's last key is the primary one: rows sort by their block's position, then by a
        # random key, which is a uniform permutation within each block. One vectorised pass.
        return np.lexsort((rng.random(num_samples), position[rows // block_rows])).astype(np.int64)
    raise ValueError(f"order must be one of {', '.join(ORDERS)}, but got: {order!r}")


class BatchPlan:
    """The batches of one rank for one epoch, as slices of one int64 order array.

    Holding the order (8 bytes per sample of this rank) instead of a list of index lists keeps
    the plan compact; ``batch(k)`` is a view, not a copy.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        order: str,
        *,
        seed: int = 0,
        epoch: int = 0,
        block_rows: int = 1,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.batch_size = int(batch_size)
        full = epoch_order(num_samples, order, seed=seed, epoch=epoch, block_rows=block_rows)
        self.indices = partition(full, rank, world_size, drop_last=drop_last)
        count = len(self.indices)
        self.num_batches = count // self.batch_size if drop_last else -(-count // self.batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def batch(self, k: int) -> np.ndarray:
        return self.indices[k * self.batch_size : (k + 1) * self.batch_size]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.batch(k) for k in range(self.num_batches))

    def __getitem__(self, k: int) -> np.ndarray:
        """Batch ``k`` (negative from the end), as a sequence of batches answers it."""
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
            raise TypeError(f"a plan's batches are indexed by an int, but got {type(k).__name__}: "
                            "list(plan) for a list")
        if not -self.num_batches <= k < self.num_batches:
            raise IndexError(f"batch {k} of an epoch of {self.num_batches} batches")
        return self.batch(int(k) % self.num_batches)


def partition(order: np.ndarray, rank: int, world_size: int, *, drop_last: bool) -> np.ndarray:
    """Rank ``rank``'s contiguous slice of ``order``, all ranks equally long (see module doc)."""
    if world_size == 1:
        return order
    n = len(order)
    if drop_last:
        per_rank = n // world_size
    else:
        per_rank = -(-n // world_size)
        pad = per_rank * world_size - n
        if pad:
            # np.resize repeats the order cyclically: pads by wrapping even when pad > n.
            order = np.resize(order, per_rank * world_size)
    return order[rank * per_rank : (rank + 1) * per_rank]


def num_batches(num_samples: int, batch_size: int, *, drop_last: bool, world_size: int = 1) -> int:
    """Batches per rank per epoch for the built-in orders (what ``len(loader)`` returns)."""
    per_rank = num_samples // world_size if drop_last else -(-num_samples // world_size)
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def sampler_batch(batch: Any, num_samples: int) -> np.ndarray:
    """One batch of a user ``batch_sampler`` as checked int64 indices.

    The readers' one normaliser (:func:`featurestore.format.wire.as_index_array`) does the
    conversion; only the messages differ, so they name the ``batch_sampler`` that yielded the
    batch rather than a read call. A scalar is refused here (a sampler yields sequences)."""
    try:
        index = wire.as_index_array(batch) if np.ndim(batch) == 1 else None
    except InvalidIndices:
        index = None
    if index is None:
        shape = np.shape(batch)
        raise InvalidIndices(
            f"batch_sampler must yield 1-D sequences of integer indices, but got {type(batch).__name__} "
            f"with shape {tuple(shape)}: yield e.g. a list of ints per batch"
        )
    try:
        wire.check_bounds(index, num_samples, "this dataset")
    except IndexOutOfRange as error:
        raise IndexOutOfRange(f"batch_sampler yielded a bad batch: {error} (yield indices of this split only)") from None
    return index


def user_batches(batch_sampler: Iterable[Sequence[int]], epoch: int, skip: int) -> Iterator[Any]:
    """Iterate a user batch sampler for ``epoch``, skipping the first ``skip`` batches unread.

    A sampler with ``set_epoch`` (e.g. one wrapping ``DistributedSampler``) is told the epoch
    first. Skipping replays the sampler: exact resume needs a sampler that yields the same batches
    when iterated again for the same epoch.
    """
    set_epoch = getattr(batch_sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    iterator = iter(batch_sampler)
    for _ in range(skip):
        if next(iterator, None) is None:
            break
    return iterator
