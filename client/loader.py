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

import queue
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from client import sampling
from client.dataset import FeatureDataset
from featurestore.core.buffers import BufferPool, aligned_empty
from featurestore.format import dtypes

_JOIN_TIMEOUT_S = 60.0  # a thread stuck in a remote read is abandoned (daemon) after this


class _Failure:
    """An exception raised while producing a batch, delivered to the consumer in order."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Transfer:
    """Turns one index array into a ready ``(features, labels)`` batch on the target device."""

    def __init__(self, ds: FeatureDataset, device: torch.device, dtype: torch.dtype,
                 pin: bool, mean_std: tuple[np.ndarray, np.ndarray] | None, num_threads: int) -> None:
        self.ds = ds
        self.device = device
        self.dtype = dtype
        self.stored = ds.torch_dtype
        self.cuda = device.type == "cuda"
        self.norm: tuple[torch.Tensor, torch.Tensor] | None = None
        if mean_std is not None:
            mean, std = mean_std
            inv = np.where(std > 0, 1.0 / np.where(std > 0, std, 1.0), 1.0)  # constant channels: no scaling
            self.norm = (torch.from_numpy(mean).to(device, dtype), torch.from_numpy(inv.astype(np.float32)).to(device, dtype))
            if device.type == "cuda":  # made on this thread's stream, read on the side stream later
                torch.cuda.synchronize(device)
        self.pool = BufferPool(keep=2)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            # T threads + 1: every thread can read while the previous copy is still in flight.
            self.slots: queue.Queue[_HostSlot] = queue.Queue()
            for _ in range(num_threads + 1):
                self.slots.put(_HostSlot(pin))

    # ------------------------------------------------------------------ producer side (threads)
    def produce(self, index: np.ndarray, staging: dict[str, np.ndarray]) -> Any:
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
        return features, _widen(torch.from_numpy(labels_np))

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
                labels = _widen(raw_l.view(label_dtype).view(b, *ds.label_shape))
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


class _HostSlot:
    """One reusable host buffer (pinned when asked) for a batch's features and labels."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.features = torch.empty(0, dtype=torch.uint8)
        self.labels = torch.empty(0, dtype=torch.uint8)
        self.copied: Any = None

    def _grown(self, buffer: torch.Tensor, need: int) -> torch.Tensor:
        if buffer.numel() >= need:
            return buffer
        return torch.empty(need, dtype=torch.uint8, pin_memory=self.pin)

    def views(self, ds: FeatureDataset, b: int) -> tuple[np.ndarray, np.ndarray]:
        self.features = self._grown(self.features, b * ds.sample_nbytes)
        self.labels = self._grown(self.labels, b * ds.label_nbytes)
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


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    # numpy has no bfloat16: such a tensor is allocated as int16 and viewed back after the read.
    return torch.int16 if dtype == torch.bfloat16 else dtype


def _widen(labels: torch.Tensor) -> torch.Tensor:
    """Integer and bool labels to int64 (what losses index with); float labels as they are."""
    if labels.dtype.is_floating_point or labels.dtype == torch.int64:
        return labels
    return labels.to(torch.int64)


class _Prefetcher:
    """Threads that produce batches ahead of the consumer and hand them over in order."""

    def __init__(self, batches: Iterator[np.ndarray], transfer: _Transfer, prefetch: int, num_threads: int) -> None:
        self._batches = batches
        self._transfer = transfer
        self._tokens = threading.Semaphore(prefetch)  # batches in production or ready, at most
        self._take = threading.Lock()  # the batch iterator is advanced by one thread at a time
        self._cond = threading.Condition()
        self._ready: dict[int, Any] = {}
        self._issued = 0
        self._end: int | None = None
        self._position = 0
        self._stop = threading.Event()
        self._own_staging: dict[str, np.ndarray] = {}  # the consumer's, when it reads a batch itself
        self.stall_s = 0.0
        self._threads = [threading.Thread(target=self._work, name=f"featurestore-prefetch-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def _claim(self, only: int | None = None) -> tuple[int, Any] | None:
        """The next batch position and its indices (or a :class:`_Failure`); None at the end, or
        when ``only`` is given and that position was already claimed by someone else."""
        with self._take:
            position = self._issued
            if only is not None and position != only:
                return None
            try:
                index: Any = next(self._batches)
            except StopIteration:
                with self._cond:
                    self._end = position if self._end is None else min(self._end, position)
                    self._cond.notify_all()
                return None
            except BaseException as error:  # a user sampler failed: surface it in order
                index = _Failure(error)
            self._issued += 1
        return position, index

    def _produce(self, index: Any, staging: dict[str, np.ndarray]) -> Any:
        if isinstance(index, _Failure):
            return index
        try:
            return self._transfer.produce(index, staging)
        except BaseException as error:
            return _Failure(error)

    def _work(self) -> None:
        staging: dict[str, np.ndarray] = {}
        while True:
            self._tokens.acquire()
            claimed = None if self._stop.is_set() else self._claim()
            if claimed is None:
                self._tokens.release()  # nothing was produced for this token
                return
            position, index = claimed
            item = self._produce(index, staging)
            with self._cond:
                self._ready[position] = item
                self._cond.notify_all()

    def __iter__(self) -> _Prefetcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        while True:
            with self._cond:
                if self._position in self._ready:
                    item = self._ready.pop(self._position)
                    self._tokens.release()  # a thread's batch: its read-ahead slot is free again
                    break
                if self._end is not None and self._position >= self._end:
                    raise StopIteration
                if self._stop.is_set():
                    raise RuntimeError("this epoch's iterator was closed (a new iter() of the same loader, or "
                                       "loader.close()): iterate the new one")
                unclaimed = self._issued == self._position
                if not unclaimed:
                    self._cond.wait()
                    continue
            # Nobody has started the batch the consumer needs (the threads are between batches):
            # read it here rather than sleep until a thread wakes up for it. A consumer slower
            # than the reads never gets here; a fast one gets a second reader in parallel.
            claimed = self._claim(only=self._position)
            if claimed is not None:
                item = self._produce(claimed[1], self._own_staging)
                break
        self.stall_s += time.perf_counter() - start
        self._position += 1
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return self._transfer.finish(item)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        for _ in self._threads:  # wake threads blocked on a token so they see the stop flag
            self._tokens.release()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_TIMEOUT_S)
                if thread.is_alive():
                    warnings.warn(f"{thread.name} did not stop within {_JOIN_TIMEOUT_S:.0f} s (stuck in a read?); "
                                  "it is a daemon thread and is abandoned", ResourceWarning, stacklevel=2)
        with self._cond:
            self._ready.clear()  # drop read-ahead batches now, not when the iterator is collected
            self._cond.notify_all()


class FeatureLoader:
    """Batches ``(features, labels)`` of a :class:`FeatureDataset`, on ``device``, in ``dtype``.

    ``shuffle`` picks between ``order="sequential"`` and a shuffled order; ``order="auto"``
    shuffles rows uniformly on memory-mapped local stores and uses the chunk-local ``"block"``
    shuffle on object storage, compressed arrays and HTTP, where one random row costs one request.
    An explicit ``order`` wins over ``shuffle``. A ``batch_sampler`` (any iterable of index lists)
    is used as given, on every rank: it replaces ``shuffle``/``order``/``drop_last``/``seed``, and
    ``rank``/``world_size`` must stay at their defaults (partition inside the sampler).

    Labels: integer and bool labels come out as int64 on ``device``, float labels unchanged;
    a split without labels yields ``-1`` per sample (:data:`client.dataset.NO_LABEL`).
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
    ) -> None:
        if not isinstance(ds, FeatureDataset):
            raise TypeError(f"ds must be a client.FeatureDataset, but got: {type(ds).__name__}")
        for name, value, low in (("batch_size", batch_size, 1), ("prefetch", prefetch, 1), ("seed", seed, 0),
                                 ("world_size", world_size, 1), ("rank", rank, 0)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}, but got: {value!r}")
        if rank >= world_size:
            raise ValueError(f"`rank` must be in [0, world_size={world_size}), but got: {rank!r}")
        if order not in ("auto", *sampling.ORDERS):
            raise ValueError(f"`order` must be one of auto, {', '.join(sampling.ORDERS)}, but got: {order!r}")
        if batch_sampler is not None and world_size != 1:
            raise ValueError("a batch_sampler is used as given on every rank: leave rank/world_size at "
                             "their defaults and partition inside the sampler (e.g. with DistributedSampler)")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"`dtype` must be a floating torch dtype or None (keep the stored dtype), but got: {dtype!r}")
        if pin_memory not in ("auto", True, False):
            raise ValueError(f"`pin_memory` must be 'auto', True or False, but got: {pin_memory!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available here: pass device='cpu'")
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"`device` must be a CUDA device or 'cpu', but got: {str(device)!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"`num_threads` must be a positive integer or None, but got: {num_threads!r}")
        self.ds = ds
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.dtype = dtype if dtype is not None else ds.torch_dtype
        self.prefetch = int(prefetch)
        self.drop_last = bool(drop_last)
        self.batch_sampler = batch_sampler
        self.rank, self.world_size = int(rank), int(world_size)
        if batch_sampler is not None:
            self.order = "batch_sampler"
        elif order != "auto":
            self.order = order
        elif not self.shuffle:
            self.order = "sequential"
        else:
            self.order = "shuffle" if ds.read_path == "mmap" else "block"
        self.normalize = bool(normalize)
        self._mean_std = ds.channel_stats() if self.normalize else None
        if self.normalize and self._mean_std is None:
            raise ValueError(f"normalize=True needs the split's channel_stats, and {ds.dataset}/{ds.encoder}/"
                             f"{ds.split} has none: pass normalize=False")
        self.pin_memory = self.device.type == "cuda" if pin_memory == "auto" else bool(pin_memory)
        # One thread keeps up with a page-cache gather; remote reads are latency bound, so several
        # batches are requested at once (never more than `prefetch` are in flight anyway).
        default_threads = 1 if ds.read_path == "mmap" else 4
        self.num_threads = min(num_threads or default_threads, self.prefetch)
        self.epoch = 0
        self._resume_batch = 0  # batches of `epoch` already consumed (load_state_dict)
        self._consumed = 0
        self._active: _Prefetcher | None = None
        self._transfer: _Transfer | None = None
        self.stats: dict[str, float] = {"batches": 0, "stall_s": 0.0}

    # ------------------------------------------------------------------ epoch and length
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields (call before each epoch)."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"`epoch` must be a non-negative integer, but got: {epoch!r}")
        if int(epoch) != self.epoch:
            self._resume_batch = 0  # a resume offset belongs to the epoch it was saved in
        self.epoch = int(epoch)

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]  # TypeError if it has no len
        return sampling.num_batches(self.ds.num_samples, self.batch_size, drop_last=self.drop_last,
                                    world_size=self.world_size)

    def plan(self, epoch: int | None = None) -> sampling.BatchPlan:
        """This rank's batches for ``epoch`` (default: the current one), built-in orders only."""
        if self.batch_sampler is not None:
            raise ValueError("this loader uses a batch_sampler: its batches are the sampler's")
        return sampling.BatchPlan(self.ds.num_samples, self.batch_size, self.order, seed=self.seed,
                                  epoch=self.epoch if epoch is None else epoch, block_rows=self.ds.chunk_rows,
                                  drop_last=self.drop_last, rank=self.rank, world_size=self.world_size)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.close()  # one epoch in flight per loader
        skip, self._resume_batch = self._resume_batch, 0
        if self.batch_sampler is not None:
            n = self.ds.num_samples
            batches: Iterator[Any] = (sampling.as_index_array(b, n)
                                      for b in sampling.user_batches(self.batch_sampler, self.epoch, skip))
        else:
            plan = self.plan()
            batches = (plan.batch(k) for k in range(skip, len(plan)))
        if self._transfer is None:  # the CUDA stream and pinned slots are reused across epochs
            self._transfer = _Transfer(self.ds, self.device, self.dtype, self.pin_memory, self._mean_std,
                                       self.num_threads)
        self._consumed = skip
        self.stats = {"batches": 0, "stall_s": 0.0}
        prefetcher = _Prefetcher(batches, self._transfer, self.prefetch, self.num_threads)
        self._active = prefetcher
        return self._run(prefetcher)

    def _run(self, prefetcher: _Prefetcher) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # A generator, so `break` out of the consumer's loop finalises it at once (CPython frees
        # it when the loop drops it) and the `finally` joins the threads: nothing leaks.
        try:
            for batch in prefetcher:
                self._consumed += 1
                self.stats["batches"] += 1
                self.stats["stall_s"] = prefetcher.stall_s
                yield batch
            self._consumed = 0  # the epoch is complete: a state saved now restarts it whole
        finally:
            prefetcher.close()
            if self._active is prefetcher:
                self._active = None

    def close(self) -> None:
        """Stop the prefetch threads of the epoch in flight, if any (iteration does this itself)."""
        if self._active is not None:
            self._active.close()
            self._active = None

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is: the epoch and how many of its batches it has received."""
        return {"epoch": self.epoch, "batch": self._consumed, "seed": self.seed, "order": self.order,
                "batch_size": self.batch_size, "drop_last": self.drop_last, "rank": self.rank,
                "world_size": self.world_size, "num_samples": self.ds.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields exactly the batches the saved run had not received."""
        mine = self.state_dict()
        for key in ("seed", "order", "batch_size", "drop_last", "rank", "world_size", "num_samples"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"cannot resume: the state has {key}={state[key]!r}, this loader has "
                                 f"{key}={mine[key]!r}; build the loader with the same arguments as the saved run")
        self.set_epoch(int(state["epoch"]))
        self._resume_batch = int(state["batch"])
        self._consumed = self._resume_batch
