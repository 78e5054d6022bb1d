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
"""

from __future__ import annotations

import os
import queue
import weakref
from typing import Any

import numpy as np
import torch

from client.dataset import FeatureDataset
from featurestore.core.buffers import BufferPool, aligned_empty
from featurestore.core.pread import ReadPool
from featurestore.format import dtypes


class Transfer:
    """Turns one index array into a ready ``(features, labels)`` batch on the target device."""

    def __init__(self, ds: FeatureDataset, device: torch.device, dtype: torch.dtype,
                 pin: bool, mean_std: tuple[np.ndarray, np.ndarray] | None, num_threads: int, prefetch: int = 2) -> None:
        self.ds = ds
        self.device = device
        self.dtype = dtype
        self.stored = ds.torch_dtype
        self.cuda = device.type == "cuda"
        self.norm = norm_tensors(mean_std, device, dtype)
        self.pool = BufferPool(keep=keep_for(prefetch))
        # The loader's own read threads (local stores): shut down with the loader; a forked
        # DataLoader worker gets its own (ReadPool is per process).
        self.read_pool = ReadPool(int(os.environ.get("FEATURESTORE_READ_THREADS", "8")))
        self._weak = weakref.finalize(self, self.read_pool.shutdown)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            # T threads + 1: every thread can read while the previous copy is still in flight.
            self.slots: queue.Queue[HostSlot] = queue.Queue()
            for _ in range(num_threads + 1):
                self.slots.put(HostSlot(pin))

    def shutdown(self) -> None:
        self.read_pool.shutdown()
        self.pool.clear()  # the idle batch buffers (leased ones go when their batches do)

    # ------------------------------------------------------------------ producer side (threads)
    def produce(self, index: np.ndarray, staging: dict[str, np.ndarray]) -> Any:
        array = self.ds.array  # this process's reader: give it the loader's read threads
        for reader in (array, getattr(array, "labels", None)):
            if reader is not None and hasattr(reader, "read_pool") and reader.read_pool is not self.read_pool:
                reader.read_pool = self.read_pool
        return self._produce_cuda(index) if self.cuda else self._produce_cpu(index, staging)

    def _produce_cpu(self, index: np.ndarray, staging: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        ds, b = self.ds, len(index)
        labels_np = np.empty((b, *ds.label_shape), ds.label_numpy_dtype)
        shape = (b, *ds.sample_shape)
        if self.dtype == self.stored:
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
            features.copy_(dtypes.to_torch(stored, ds.dtype))  # exact upcast, into a recycled buffer
        if self.norm is not None:
            features.sub_(self.norm[0]).mul_(self.norm[1])
        return features, widen(torch.from_numpy(labels_np))

    def _produce_cuda(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, Any]:
        ds, b = self.ds, len(index)
        slot = self.slots.get()  # never blocks for long: one more slot than threads
        try:
            slot.wait_copied()  # the copy out of this slot's last batch must be done first
            host_f, host_l = slot.views(ds, b)
            ds.read_into(index, host_f, host_l)
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                raw_f = slot.features[: host_f.nbytes].to(self.device, non_blocking=True)
                raw_l = slot.labels[: host_l.nbytes].to(self.device, non_blocking=True)
                slot.record_copied(self.stream)
                features = raw_f.view(self.stored).view(b, *ds.sample_shape).to(self.dtype)
                if self.norm is not None:
                    features = features.sub_(self.norm[0]).mul_(self.norm[1])
                label_dtype = torch.from_numpy(host_l[:0]).dtype
                labels = widen(raw_l.view(label_dtype).view(b, *ds.label_shape))
                ready = torch.cuda.Event()
                ready.record(self.stream)
        finally:
            self.slots.put(slot)
        return features, labels, ready

    # ------------------------------------------------------------------ consumer side
    def finish(self, item: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cuda:
            return item
        features, labels, ready = item
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(ready)  # the GPU waits, the host does not
        # Allocated on the side stream, used on this one: keep the allocator from handing the
        # memory out again before this stream's work on it is done.
        features.record_stream(stream)
        labels.record_stream(stream)
        return features, labels


class HostSlot:
    """One reusable host buffer (pinned when asked) for a batch's features and labels (a bag
    batch's features and coordinates: :mod:`client.bag_transfer`)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.features = torch.empty(0, dtype=torch.uint8)
        self.labels = torch.empty(0, dtype=torch.uint8)
        self.copied: Any = None

    def _grown(self, buffer: torch.Tensor, need: int) -> torch.Tensor:
        if buffer.numel() >= need:
            return buffer
        return torch.empty(need, dtype=torch.uint8, pin_memory=self.pin)

    def reserve(self, features_nbytes: int, labels_nbytes: int) -> None:
        """Grow the buffers to hold at least these many bytes (they never shrink)."""
        self.features = self._grown(self.features, features_nbytes)
        self.labels = self._grown(self.labels, labels_nbytes)

    def views(self, ds: FeatureDataset, b: int) -> tuple[np.ndarray, np.ndarray]:
        self.reserve(b * ds.sample_nbytes, b * ds.label_nbytes)
        f = self.features[: b * ds.sample_nbytes].numpy().view(ds.numpy_dtype).reshape(b, *ds.sample_shape)
        lab = self.labels[: b * ds.label_nbytes].numpy().view(ds.label_numpy_dtype).reshape(b, *ds.label_shape)
        return f, lab

    def wait_copied(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def record_copied(self, stream: Any) -> None:
        self.copied = torch.cuda.Event()
        self.copied.record(stream)


def keep_for(prefetch: int) -> int:
    """Idle batch buffers a loader's pool keeps: as many as can be out at once (``prefetch`` in
    production or ready, the one the consumer holds, the one it takes or reads itself), plus one
    for a buffer that comes back a moment after the next batch leased one, so a returning buffer
    is never unmapped only for a fresh one to be mapped and faulted in for the next batch (first
    touches of fresh memory cost ~5x a copy on this VM; with ``prefetch + 2`` a later epoch still
    mapped 2 now and then). The pool holds at most one batch more than the epoch's peak;
    ``close()`` gives it back."""
    return int(prefetch) + 3


def norm_tensors(mean_std: tuple[np.ndarray, np.ndarray] | None, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(mean, 1 / std)`` on ``device`` in ``dtype`` for ``x.sub_(mean).mul_(inv)``; channels
    with std 0 are only centred. None without statistics."""
    if mean_std is None:
        return None
    mean, std = mean_std
    inv = np.where(std > 0, 1.0 / np.where(std > 0, std, 1.0), 1.0)  # constant channels: no scaling
    norm = (torch.from_numpy(mean).to(device, dtype), torch.from_numpy(inv.astype(np.float32)).to(device, dtype))
    if device.type == "cuda":  # made on this thread's stream, read on the side stream later
        torch.cuda.synchronize(device)
    return norm


def widen(labels: torch.Tensor) -> torch.Tensor:
    """Integer and bool labels to int64 (what losses index with); float labels as they are."""
    if labels.dtype.is_floating_point or labels.dtype == torch.int64:
        return labels
    return labels.to(torch.int64)
