"""Turning one index array into a ready ``(features, labels)`` batch on the loader's device.

* CUDA: the rows are gathered into a reusable (pinned) host slot at the stored width,
  ``non_blocking`` host-to-device copies are enqueued on a side stream, upcast, labels widened
  and normalised there, and an event recorded. The consumer's stream waits on the batch's event
  (no host sync) and ``record_stream`` tells the caching allocator the tensors are used there. A
  host slot is rewritten only after the event of the copy out of it has completed.
* CPU: the rows are read straight into the batch handed out (or into a reusable staging buffer,
  then converted, when ``dtype`` differs from the stored dtype). Batches live in leased buffers of
  :class:`featurestore.core.buffers.BufferPool` that return only when the consumer drops the last
  view of them, because a probe may keep its batches (``torch.cat`` of all features).

An int8 split's codes travel at their width and are multiplied by their scales where the batch is
made, into the batch on the CPU, on the side stream on CUDA (:mod:`client.dequantize`).

Slots, side stream, buffer pool, read threads and the hand-over are :class:`client.stager.DeviceStager`'s,
shared with :class:`client.bag_transfer.BagTransfer`.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from client import dequantize
from client.dataset import FeatureDataset
from client.stager import DeviceStager, widen
from featurestore.core.buffers import aligned_empty
from featurestore.format import dtypes


class Transfer(DeviceStager):
    """Turns one index array into a ready ``(features, labels)`` batch on the target device, and
    ``(features, labels, ids)`` given the split's sample ``ids``."""

    def __init__(self, ds: FeatureDataset, device: torch.device, dtype: torch.dtype,
                 pin: bool, mean_std: tuple[np.ndarray, np.ndarray] | None, num_threads: int, prefetch: int = 2,
                 ids: list[str] | None = None) -> None:
        super().__init__(device, dtype, pin, mean_std, num_threads, prefetch=prefetch)
        self.ds, self.ids = ds, ids
        self.stored = ds.torch_dtype
        self._scales: dequantize.ChunkScales | None = None  # an int8 split's, on CUDA
        self._scales_lock = threading.Lock()

    # ------------------------------------------------------------------ producer side (threads)
    def produce(self, index: np.ndarray, staging: dict[str, np.ndarray]) -> Any:
        array = self.ds.array  # this process's reader: give it the loader's read threads
        for reader in (array, getattr(array, "labels", None)):
            if reader is not None and hasattr(reader, "read_pool") and reader.read_pool is not self.read_pool:
                reader.read_pool = self.read_pool
        produced = self._produce_cuda(index) if self.cuda else self._produce_cpu(index, staging)
        return produced if self.ids is None else (produced, [self.ids[int(i)] for i in index])

    def _produce_cpu(self, index: np.ndarray, staging: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        ds, b = self.ds, len(index)
        labels_np = np.empty((b, *ds.label_shape), ds.label_numpy_dtype)
        shape = (b, *ds.sample_shape)
        if self.dtype == self.stored and not ds.quantized:
            # Straight into the buffer handed out: one copy, as the bare reader does.
            host = self.pool.lease(b * ds.sample_nbytes)
            features = torch.from_numpy(host).view(self.stored).view(shape)
            ds.read_into(index, host.view(ds.numpy_dtype).reshape(shape), labels_np)
            del host
        else:
            need = b * ds.sample_nbytes
            if staging.get("features") is None or staging["features"].size < need:
                staging["features"] = aligned_empty((need,), np.uint8)  # see aligned_empty: 4x faster gathers
            stored = staging["features"][:need].view(ds.numpy_dtype).reshape(shape)
            ds.read_into(index, stored, labels_np)
            host = self.pool.lease(b * (ds.sample_nbytes // ds.numpy_dtype.itemsize) * self.dtype.itemsize)
            features = torch.from_numpy(host).view(self.dtype).view(shape)
            del host
            if ds.quantized:  # codes times their chunks' scales, into the recycled buffer
                dequantize.into(stored, index // ds.chunk_rows, ds.scales(), features)
            else:
                features.copy_(dtypes.to_torch(stored, ds.dtype))  # exact upcast, into a recycled buffer
        if self.norm is not None:
            features.sub_(self.norm[0]).mul_(self.norm[1])
        return features, widen(torch.from_numpy(labels_np))

    def _produce_cuda(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, Any]:
        ds, b = self.ds, len(index)
        with self.slot() as slot:  # the copy out of this slot's last batch is done
            host_f, host_l = slot.views(ds, b)
            scales = self._chunk_scales() if ds.quantized else None
            groups = index // ds.chunk_rows
            scales_nbytes = scales.stage(slot, groups) if scales is not None else 0
            ds.read_into(index, host_f, host_l)
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                raw_f = slot.features[: host_f.nbytes].to(self.device, non_blocking=True)
                raw_l = slot.second[: host_l.nbytes].to(self.device, non_blocking=True)
                raw_s = slot.scales[:scales_nbytes].to(self.device, non_blocking=True) if scales_nbytes else None
                slot.record_copied(self.stream)
                if scales is not None and raw_s is not None:  # the upcast inside the multiply by the scales
                    codes = raw_f.view(torch.int8).view(b, *ds.sample_shape)
                    features = scales.multiply(codes, raw_s, groups, self.dtype)
                else:
                    features = raw_f.view(self.stored).view(b, *ds.sample_shape).to(self.dtype)
                if self.norm is not None:
                    features = features.sub_(self.norm[0]).mul_(self.norm[1])
                label_dtype = torch.from_numpy(host_l[:0]).dtype
                labels = widen(raw_l.view(label_dtype).view(b, *ds.label_shape))
                ready = self.ready_event()
        return features, labels, ready

    def _chunk_scales(self) -> dequantize.ChunkScales:
        """The split's scales for the CUDA path, made by the first batch's thread (read once)."""
        with self._scales_lock:
            if self._scales is None:
                self._scales = dequantize.ChunkScales(self.ds.scales(), self.device, self.stream)
            return self._scales

    # ------------------------------------------------------------------ consumer side
    def finish(self, item: Any) -> tuple[Any, ...]:
        ids = None
        if self.ids is not None:
            item, ids = item
        if self.cuda:
            features, labels, ready = item
            item = self.hand_over((features, labels), ready)
        return tuple(item) if ids is None else (*item, ids)
