"""Threads that produce a loader's batches ahead of the consumer and hand them over in order.

At most ``prefetch`` batches are in production or ready (a semaphore the consumer releases as it
takes each one), which bounds host memory whatever the split's length. A failure while producing
a batch (a read error, a user sampler raising) is delivered to the consumer in order, and every
thread stops; no thread is ever left blocked and the consumer never waits on a dead one.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np


class Producer(Protocol):
    """Turns one batch description into device tensors: ``produce`` runs on a prefetch thread,
    ``finish`` on the consumer's (e.g. making its CUDA stream wait for the batch's copies).
    :class:`client.transfer.Transfer` (rows) and :class:`client.bag_transfer.BagTransfer` (bags)."""

    def produce(self, batch: Any, staging: dict[str, np.ndarray]) -> Any: ...

    def finish(self, item: Any) -> Any: ...

    def shutdown(self) -> None: ...

_JOIN_TIMEOUT_S = 60.0  # a thread stuck in a remote read is abandoned (daemon) after this


class _Failure:
    """An exception raised while producing a batch, delivered to the consumer in order."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Threads that produce batches ahead of the consumer and hand them over in order."""

    def __init__(self, batches: Iterator[Any], transfer: Producer, prefetch: int, num_threads: int) -> None:
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

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
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
