"""Which patches of a bag, and which bags in which batch: the bag loaders' pure functions.

Like :mod:`client.sampling`, every draw here is a pure function of its arguments (seed, epoch,
bag position, lengths): no global random stream is touched, no dependence on thread or worker
count, so a resumed run recomputes the same epoch and a ``DataLoader`` worker draws what the main
process would. numpy only (no torch).

* :func:`subset_rows`: ``max_patches=P`` draws P of a bag's n rows uniformly without replacement,
  from ``SeedSequence([seed, epoch, SUBSET_STREAM, bag])``, returned sorted so the read is one
  ascending pass (neighbouring rows coalesce into contiguous runs).
* :func:`bag_order`: the epoch's bag order (uniform shuffle or sequential), empty bags left out
  when asked, partitioned over DDP ranks by :func:`client.sampling.partition`.
* :func:`bag_batches`: that order cut into batches, optionally *bucketed*: bags of similar
  (effective) length grouped so a padded batch wastes little.
"""

from __future__ import annotations

import numpy as np

from client import sampling

# A tag in the subset streams' seed words, so a bag's draw never coincides with the stream of the
# epoch's bag order (SeedSequence([seed, epoch])) whatever the values.
SUBSET_STREAM = 0x5EB5E7
# Bucketing sorts windows of this many batches by length: wide enough to group similar bags,
# narrow enough that the epoch stays a shuffle (each window is a random draw of the cohort).
BUCKET_WINDOW_BATCHES = 32


def subset_rows(length: int, max_patches: int | None, *, seed: int, epoch: int, bag: int) -> np.ndarray | None:
    """Sorted int64 rows of a uniform draw of ``max_patches`` rows out of ``length``, or None when
    the whole bag is kept (no ``max_patches``, or the bag is not longer than it)."""
    if max_patches is None or length <= max_patches:
        return None
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), SUBSET_STREAM, int(bag)])))
    rows = rng.choice(int(length), size=int(max_patches), replace=False, shuffle=False)
    rows.sort()
    return rows.astype(np.int64, copy=False)


def effective_lengths(lengths: np.ndarray, max_patches: int | None) -> np.ndarray:
    """Rows each bag yields: its length, capped at ``max_patches``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths if max_patches is None else np.minimum(lengths, int(max_patches))


def bag_order(
    lengths: np.ndarray,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    indices: np.ndarray | None = None,
    skip_empty: bool = True,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
) -> tuple[np.ndarray, int]:
    """This rank's bags for the epoch, and how many empty bags were left out of the whole epoch.

    ``indices`` restricts the epoch to those bags (a fold), in the order they are given before
    shuffling. Empty bags are removed before partitioning, so every rank gets the same number.
    """
    pool = np.arange(len(lengths), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
    order = pool[sampling.epoch_order(len(pool), "shuffle" if shuffle else "sequential", seed=seed, epoch=epoch)]
    skipped = 0
    if skip_empty:
        keep = np.asarray(lengths, dtype=np.int64)[order] > 0
        skipped = int(len(order) - keep.sum())
        order = order[keep]
    return sampling.partition(order, rank, world_size, drop_last=drop_last), skipped


def bag_batches(
    order: np.ndarray,
    batch_size: int,
    *,
    lengths: np.ndarray | None = None,
    bucket: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> list[np.ndarray]:
    """``order`` cut into batches of ``batch_size`` bags (the last one partial unless ``drop_last``).

    ``bucket=True`` (needs ``lengths``, the effective lengths of all bags): the order is taken in
    windows of :data:`BUCKET_WINDOW_BATCHES` batches, each window sorted by length (stable, so ties
    keep the shuffled order) and cut into batches, and the batches of the epoch are shuffled with a
    stream of their own. Every bag is still seen once; only batch membership changes.
    """
    order = np.asarray(order, dtype=np.int64)
    if bucket and batch_size > 1:
        if lengths is None:
            raise ValueError("bucketing needs the bags' lengths")
        window = batch_size * BUCKET_WINDOW_BATCHES
        lengths = np.asarray(lengths, dtype=np.int64)
        parts = [order[s:s + window] for s in range(0, len(order), window)]
        order = np.concatenate([p[np.argsort(lengths[p], kind="stable")] for p in parts]) if parts else order
    count = len(order) // batch_size if drop_last else -(-len(order) // batch_size)
    batches = [order[k * batch_size:(k + 1) * batch_size] for k in range(count)]
    if bucket and batch_size > 1 and len(batches) > 1:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), SUBSET_STREAM])))
        batches = [batches[k] for k in rng.permutation(len(batches))]
    return batches
