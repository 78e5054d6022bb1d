"""What both loaders' producers share to hand a batch to the device: :class:`DeviceStager`.

:class:`client.transfer.Transfer` (rows of a dense split) and :class:`client.bag_transfer.BagTransfer`
(padded bags) differ in how a batch is laid out; the rest is this module's: the recycled CPU batch
buffers (a :class:`~featurestore.core.buffers.BufferPool` keeping :func:`keep_for` idle ones), the
loader's own read threads, and on CUDA the side stream, the reusable (pinned) host slots (one
more than threads, each refilled only after the copy out of it completed) and the hand-over on the
consumer's stream (it waits on the batch's event, no host sync; ``record_stream`` keeps the
caching allocator from reusing the tensors too early).
"""

from __future__ import annotations

import contextlib
import os
import queue
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from featurestore.core.buffers import BufferPool
from featurestore.core.pread import ReadPool


class DeviceStager:
    """The staging both transfers share: ``pool``, ``read_pool``, ``norm``; on CUDA ``stream``
    and the host slots (:meth:`slot`), and :meth:`hand_over` on the consumer's side."""

    def __init__(self, device: torch.device, dtype: torch.dtype, pin: bool,
                 mean_std: tuple[np.ndarray, np.ndarray] | None, num_threads: int, *, prefetch: int,
                 grow: bool = False) -> None:  # fmt: skip
        self.device = device
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self.norm = norm_tensors(mean_std, device, dtype)
        self.pool = BufferPool(keep=keep_for(prefetch), grow=grow)
        # The loader's own read threads (local stores): shut down with the loader; a forked
        # DataLoader worker gets its own (ReadPool is per process). Its producers already read
        # batches concurrently, so a warm gather takes no helpers from it: on 2 cores they gained
        # the loader nothing and took the consumer's core (`bench loader` stall 5.6% -> 9.7%).
        self.read_pool = ReadPool(int(os.environ.get("FEATURESTORE_READ_THREADS", "8")), share_gathers=False)
        # The finalizer never joins: the collector may run it anywhere (see ReadPool.shutdown).
        self._weak = weakref.finalize(self, self.read_pool.shutdown, wait=False)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            # T threads + 1: every thread can fill one while the previous copy is still in flight.
            self.slots: queue.Queue[HostSlot] = queue.Queue()
            for _ in range(num_threads + 1):
                self.slots.put(HostSlot(pin))

    def shutdown(self) -> None:
        self.read_pool.shutdown()
        self.pool.clear()  # the idle batch buffers (leased ones go when their batches do)

    @contextlib.contextmanager
    def slot(self) -> Iterator[HostSlot]:
        """A host slot whose last copy to the device has completed (CUDA only)."""
        slot = self.slots.get()  # never blocks for long: one more slot than threads
        try:
            slot.wait_copied()
            yield slot
        finally:
            self.slots.put(slot)

    def ready_event(self) -> Any:
        """An event recorded on the side stream after the batch's work (call inside it)."""
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return ready

    def hand_over(self, tensors: tuple[torch.Tensor, ...], ready: Any) -> tuple[torch.Tensor, ...]:
        """``tensors`` made on the side stream, usable on the consumer's current stream."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(ready)  # the GPU waits, the host does not
        for tensor in tensors:  # allocated on the side stream, used on this one
            tensor.record_stream(stream)
        return tensors


class HostSlot:
    """Reusable host buffers (pinned when asked) for a batch: ``features``, and ``second``,
    the batch's second array (a dense batch's labels, a bag batch's coordinates:
    :mod:`client.bag_transfer`); ``scales``, an int8 batch's scales (empty otherwise)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.features = torch.empty(0, dtype=torch.uint8)
        self.second = torch.empty(0, dtype=torch.uint8)
        self.scales = torch.empty(0, dtype=torch.uint8)
        self.copied: Any = None

    def _grown(self, buffer: torch.Tensor, need: int) -> torch.Tensor:
        if buffer.numel() >= need:
            return buffer
        return torch.empty(need, dtype=torch.uint8, pin_memory=self.pin)

    def reserve(self, features_nbytes: int, second_nbytes: int) -> None:
        """Grow the buffers to hold at least these many bytes (they never shrink)."""
        self.features = self._grown(self.features, features_nbytes)
        self.second = self._grown(self.second, second_nbytes)

    def reserve_scales(self, nbytes: int) -> None:
        self.scales = self._grown(self.scales, nbytes)

    def views(self, ds: Any, b: int) -> tuple[np.ndarray, np.ndarray]:
        self.reserve(b * ds.sample_nbytes, b * ds.label_nbytes)
        f = self.features[: b * ds.sample_nbytes].numpy().view(ds.numpy_dtype).reshape(b, *ds.sample_shape)
        lab = self.second[: b * ds.label_nbytes].numpy().view(ds.label_numpy_dtype).reshape(b, *ds.label_shape)
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
    touches of fresh memory cost several times a copy; with ``prefetch + 2`` a later epoch still
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
