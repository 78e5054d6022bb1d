"""Turning one batch of bags into ready ``(features, mask, coords, labels)`` on the loader's device.

The bag loader's producer (:class:`client.prefetch.Producer`), the twin of
:class:`client.transfer.Transfer` for ragged rows; both are a :class:`client.stager.DeviceStager`
(slots, side stream, buffer pool, read threads, hand-over). A batch of B bags is laid out padded,
``[B, P, D]`` with ``P`` the longest (subsampled) bag of the batch, or ``max_patches`` with
``pad_to="max_patches"``; padding is zeros and ``mask`` says which rows are patches.

* CUDA: the device tensors are allocated zeroed on a side stream; the bags' rows are read, at the
  stored width, into reusable (pinned) host slots of at most ``piece_bytes`` each (several small
  bags share a slot, a large bag spans several), and each piece is copied ``non_blocking`` into
  its place. A slot is refilled only after the copy out of it has completed (its event), so host
  memory is ``(threads + 1) x piece_bytes`` however long a bag is: a 100k x 2560 float16 bag
  (512 MB) streams through 64 MiB slots. Upcast, normalisation, mask and labels are made on the
  side stream; the consumer's stream waits on the batch's event.
* CPU: the batch handed out is a leased buffer of :class:`featurestore.core.buffers.BufferPool`;
  rows are read straight into it at the stored dtype, or through a staging piece of at most
  ``piece_bytes`` and upcast into it otherwise.
* int8: the codes travel as any stored rows; each piece is multiplied by its bag's scales into the
  batch (CPU), or the batch's ``B x D`` scales go to the device and one multiply upcasts and
  scales there (:mod:`client.dequantize`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from client import dequantize
from client.bag_dataset import BagDataset
from client.dataset import NO_LABEL
from client.stager import DeviceStager, widen
from featurestore.core.buffers import aligned_empty, grown_size
from featurestore.errors import EmptyBag
from featurestore.format import dtypes

PIECE_BYTES = 64 << 20
PAD_TO = ("longest", "max_patches")


class Piece(NamedTuple):
    """Rows ``start:stop`` of the ``slot``-th bag of a batch (positions in its yielded rows)."""

    slot: int
    start: int
    stop: int
    rows: np.ndarray | None  # the bag's stored rows to read; None: the whole bag


def fills(pieces: Iterator[Piece], piece_rows: int) -> Iterator[list[Piece]]:
    """Consecutive pieces grouped into slot fills of at most ``piece_rows`` rows (a piece is never
    longer than that): several small bags share one fill, a long bag's pieces fill one each."""
    take: list[Piece] = []
    filled = 0
    for piece in pieces:
        rows = piece.stop - piece.start
        if take and filled + rows > piece_rows:
            yield take
            take, filled = [], 0
        take.append(piece)
        filled += rows
    if take:
        yield take


class BagTransfer(DeviceStager):
    """Reads one batch of bags and hands it over on the target device (see the module doc)."""

    def __init__(self, ds: BagDataset, device: torch.device, dtype: torch.dtype, pin: bool, num_threads: int, *,
                 max_patches: int | None, seed: int, pad_to: str = "longest", skip_empty: bool = True,
                 piece_bytes: int = PIECE_BYTES, prefetch: int = 2,
                 mean_std: tuple[np.ndarray, np.ndarray] | None = None, return_ids: bool = False) -> None:
        # Bags differ in length: a pool that keeps its largest buffers (grow=True) serves them all
        # without mapping (and faulting in) fresh memory per bag, which made epochs 2x slower than
        # the bare reader (measured). It keeps as many as can be out at once (keep_for): with 2, a
        # warm epoch of 48 bags still mapped 13 fresh buffers.
        super().__init__(device, dtype, pin, mean_std, num_threads, prefetch=prefetch, grow=True)
        self.ds = ds
        self.stored = ds.torch_dtype
        self.max_patches = max_patches
        self.seed = seed
        self.pad_to = pad_to
        self.skip_empty = skip_empty
        self.return_ids = return_ids
        self.piece_rows = max(1, int(piece_bytes) // ds.row_nbytes)
        self.coords_torch = torch.from_numpy(np.empty(0, ds.coords_dtype)).dtype

    # ------------------------------------------------------------------ the batch's layout
    def layout(self, epoch: int, index: np.ndarray) -> tuple[list[np.ndarray | None], np.ndarray, int]:
        """Per bag the rows it yields this epoch (None: all), their counts, and the padded length."""
        ds = self.ds
        rows = [ds.rows(int(i), max_patches=self.max_patches, seed=self.seed, epoch=epoch) for i in index]
        counts = np.array([int(ds.lengths[i]) if r is None else len(r) for i, r in zip(index, rows)], np.int64)
        if not self.skip_empty and len(counts) and int(counts.min()) == 0:
            empty = ds.ids[int(index[int(np.argmin(counts))])]
            raise EmptyBag(f"bag {empty!r} of {ds.dataset}/{ds.encoder}/{ds.split} has no patches (skip_empty=False): "
                           "pass skip_empty=True to leave empty bags out of every epoch, or drop the bag from the split")
        longest = int(counts.max()) if len(counts) else 0
        if self.pad_to == "max_patches" and self.max_patches is not None:
            longest = max(longest, self.max_patches)
        return rows, counts, longest

    def pieces(self, rows: list[np.ndarray | None], counts: np.ndarray) -> Iterator[Piece]:
        """The batch's rows in pieces of at most ``piece_rows`` rows, bag by bag."""
        for slot, (bag_rows, count) in enumerate(zip(rows, counts)):
            for start in range(0, int(count), self.piece_rows):
                stop = min(int(count), start + self.piece_rows)
                if bag_rows is not None:
                    selected: np.ndarray | None = bag_rows[start:stop]
                elif start == 0 and stop == count:
                    selected = None
                else:
                    selected = np.arange(start, stop, dtype=np.int64)
                yield Piece(slot, start, stop, selected)

    def labels(self, index: np.ndarray) -> torch.Tensor:
        if self.ds.labels is None:
            return torch.full((len(index),), NO_LABEL, dtype=torch.int64)
        return widen(torch.from_numpy(np.ascontiguousarray(self.ds.labels[index])))

    # ------------------------------------------------------------------ producer side (threads)
    def produce(self, batch: tuple[int, np.ndarray], staging: dict[str, np.ndarray]) -> Any:
        epoch, index = batch
        self.ds.use_read_pool(self.read_pool)  # this process's reader: the loader's read threads
        rows, counts, longest = self.layout(epoch, index)
        if self.cuda:
            return index, self._produce_cuda(index, rows, counts, longest)
        return index, self._produce_cpu(index, rows, counts, longest, staging)

    def _produce_cpu(self, index: np.ndarray, rows: list[np.ndarray | None], counts: np.ndarray, longest: int,
                     staging: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
        ds, b, dim = self.ds, len(index), self.ds.dim
        padded = bool(len(counts)) and int(counts.min()) < longest  # else every row is read: nothing to zero
        coords = (np.zeros if padded else np.empty)((b, longest, 2), ds.coords_dtype)
        host = self.pool.lease(b * longest * dim * self.dtype.itemsize)
        features = torch.from_numpy(host).view(self.dtype).view(b, longest, dim)
        if self.dtype == self.stored and not ds.quantized:
            out = host.view(ds.numpy_dtype).reshape(b, longest, dim)
            del host
            for piece in self.pieces(rows, counts):  # straight into the batch handed out
                ds.read_into(int(index[piece.slot]), piece.rows, out[piece.slot, piece.start:piece.stop],
                             coords[piece.slot, piece.start:piece.stop])
        else:
            del host
            scales = ds.scales() if ds.quantized else None
            for piece in self.pieces(rows, counts):
                need = (piece.stop - piece.start) * ds.row_nbytes
                if staging.get("bags") is None or staging["bags"].size < need:  # at most one piece, +25 %
                    staging["bags"] = aligned_empty((grown_size(need),), np.uint8)
                stored = staging["bags"][:need].view(ds.numpy_dtype).reshape(piece.stop - piece.start, dim)
                bag = int(index[piece.slot])
                ds.read_into(bag, piece.rows, stored, coords[piece.slot, piece.start:piece.stop])
                if ds.quantized:  # codes times the bag's scales, into the batch handed out
                    dequantize.into(stored, np.zeros(len(stored), np.int64), scales[bag:bag + 1],
                                    features[piece.slot, piece.start:piece.stop])
                else:
                    features[piece.slot, piece.start:piece.stop].copy_(dtypes.to_torch(stored, ds.dtype))
        if self.norm is not None:
            features.sub_(self.norm[0]).mul_(self.norm[1])
        if padded:  # after the normalisation: padding stays zero
            for slot, count in enumerate(counts):
                features[slot, int(count):].zero_()
        # numpy, not torch, for these few small arrays: a bag of one batch is read in ~1 ms warm,
        # and each small torch op costs ~10 us of it
        mask = torch.from_numpy(np.arange(longest)[None, :] < counts[:, None])
        return features, mask, torch.from_numpy(coords), self.labels(index)

    def _produce_cuda(self, index: np.ndarray, rows: list[np.ndarray | None], counts: np.ndarray,
                      longest: int) -> tuple[Any, ...]:
        ds, b, dim = self.ds, len(index), self.ds.dim
        row_bytes, coord_bytes = ds.row_nbytes, 2 * ds.coords_dtype.itemsize
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            raw = torch.zeros((b, longest, row_bytes), dtype=torch.uint8, device=self.device)  # padding: zeros
            raw_coords = torch.zeros((b, longest, coord_bytes), dtype=torch.uint8, device=self.device)
        for take in fills(self.pieces(rows, counts), self.piece_rows):
            filled = sum(piece.stop - piece.start for piece in take)
            with self.slot() as slot:  # the copy out of this slot's last fill is done
                slot.reserve(filled * row_bytes, filled * coord_bytes)
                host_f = slot.features[: filled * row_bytes].numpy().view(ds.numpy_dtype).reshape(filled, dim)
                host_c = slot.second[: filled * coord_bytes].numpy().view(ds.coords_dtype).reshape(filled, 2)
                at = 0
                for piece in take:
                    n = piece.stop - piece.start
                    ds.read_into(int(index[piece.slot]), piece.rows, host_f[at:at + n], host_c[at:at + n])
                    at += n
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                    at = 0
                    for piece in take:
                        n = piece.stop - piece.start
                        raw[piece.slot, piece.start:piece.stop].view(-1).copy_(
                            slot.features[at * row_bytes:(at + n) * row_bytes], non_blocking=True)
                        raw_coords[piece.slot, piece.start:piece.stop].view(-1).copy_(
                            slot.second[at * coord_bytes:(at + n) * coord_bytes], non_blocking=True)
                        at += n
                    slot.record_copied(self.stream)
        labels = self.labels(index)
        scales = self._scales_cuda(index) if ds.quantized else None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if scales is not None:  # padding: codes 0 times the scale stay 0
                codes = raw.view(torch.int8).view(b, longest, dim)
                features = dequantize.on_device(codes, scales[:, None, :], None, self.dtype)
            else:
                features = raw.view(self.stored).view(b, longest, dim).to(self.dtype)
            coords = raw_coords.view(self.coords_torch).view(b, longest, 2)
            lengths = torch.from_numpy(counts).to(self.device)
            mask = torch.arange(longest, device=self.device)[None, :] < lengths[:, None]
            if self.norm is not None:
                features = features.sub_(self.norm[0]).mul_(self.norm[1]).masked_fill_(~mask[..., None], 0)
            labels = labels.to(self.device)
            ready = self.ready_event()
        return features, mask, coords, labels, ready

    def _scales_cuda(self, index: np.ndarray) -> torch.Tensor:
        """The batch's bags' scales rows (``B x D`` float32, small beside the codes) on the device,
        copied from a host slot like the codes (a pageable copy would make this thread wait for
        the side stream's queued copies)."""
        b, dim = len(index), self.ds.dim
        with self.slot() as slot:
            slot.reserve_scales(b * dim * 4)
            host = slot.scales[: b * dim * 4].numpy().view(np.float32).reshape(b, dim)
            np.take(self.ds.scales(), index, axis=0, out=host)
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                scales = slot.scales[: b * dim * 4].to(self.device, non_blocking=True)
                slot.record_copied(self.stream)
        return scales.view(torch.float32).view(b, dim)

    # ------------------------------------------------------------------ consumer side
    def finish(self, item: Any) -> tuple[Any, ...]:
        index, produced = item
        if self.cuda:
            *tensors, ready = produced
            produced = self.hand_over(tuple(tensors), ready)
        if self.return_ids:
            return (*produced, [self.ds.ids[int(i)] for i in index])
        return tuple(produced)
