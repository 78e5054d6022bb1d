"""Threads that produce a loader's batches ahead of the consumer and hand them over in order.

At most ``prefetch`` batches are in production or ready (a semaphore the consumer releases as it
takes each one), which bounds host memory whatever the split's length. A failure while producing
a batch (a read error, a user sampler raising) is delivered to the consumer in order, and every
thread stops; no thread is ever left blocked and the consumer never waits on a dead one.

The threads are not started per epoch: a process-wide :class:`WorkerPool` keeps them between
epochs and loaders (a short epoch or a fresh loader per fold would otherwise pay thread start-up
before its first batch). A thread runs one prefetcher's loop at a time and is named
``featurestore-prefetch-<i>`` while it does, ``featurestore-worker-idle`` between loops. The pool
is per process (a forked child starts its own on first use) and is stopped at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import warnings
import weakref
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

_EXIT_WAIT_S = 10.0  # at interpreter exit, as featurestore's I/O loop waits for its requests
_JOIN_TIMEOUT_S = 60.0  # a thread stuck in a remote read is abandoned (daemon) after this


_IDLE_NAME = "featurestore-worker-idle"
_MAX_IDLE = 16  # idle threads kept; a thread finishing a loop beyond this many idle ones exits


class WorkerPool:
    """Daemon threads that run prefetch loops, reused across epochs and loaders of a process.

    :meth:`run` hands a loop to an idle thread (or starts one when none is idle), so an epoch's
    threads are already running when its first batch is claimed; :meth:`shutdown` (at exit) stops
    the idle ones. Idle threads block on a queue and never keep the interpreter from exiting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: queue.SimpleQueue[tuple[Any, str, threading.Event] | None] = queue.SimpleQueue()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._closed = False

    def run(self, loop: Any, name: str) -> threading.Event:
        """Run ``loop()`` on a pool thread named ``name`` while it runs; the event is set when it
        has returned (or raised) and the thread is idle again."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                raise RuntimeError("the prefetch worker pool is shut down (interpreter exit)")
            self._tasks.put((loop, name, done))
            if self._idle:
                self._idle -= 1  # that idle thread takes this loop
            else:
                thread = threading.Thread(target=self._serve, name=name, daemon=True)
                self._threads.append(thread)
                thread.start()
        return done

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            task = self._tasks.get()
            if task is None:
                return
            loop, name, done = task
            me.name = name
            try:
                loop()
            except BaseException:  # noqa: BLE001 - a loop delivers its failures itself; the thread survives
                pass
            finally:
                # An idle thread must not keep the last loop (its loader, staging buffers and
                # batch pool) alive while it waits for the next one: up to a batch of memory.
                task = loop = None
                me.name = _IDLE_NAME
                with self._lock:
                    # Counted idle before `done` is set: a loop submitted right after a close()
                    # that waited on `done` reuses this thread instead of starting another one.
                    stay = not self._closed and self._idle < _MAX_IDLE
                    if stay:
                        self._idle += 1
                    else:
                        self._threads.remove(me)
                done.set()
            if not stay:
                return

    @property
    def threads(self) -> int:
        """Threads the pool holds (idle or running a loop)."""
        with self._lock:
            return len(self._threads)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Stop the idle threads (those still running a loop stop when it returns)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
            threads = list(self._threads)
        for _ in range(idle):
            self._tasks.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[Prefetcher] = weakref.WeakSet()  # epochs in flight, stopped at exit


def worker_pool() -> WorkerPool:
    """This process's pool, made on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = WorkerPool()
        return _POOL


def _forget_pool_in_child() -> None:
    # A forked child has none of the parent's threads (and maybe a lock held by one of them):
    # it starts its own pool on first use.
    global _POOL, _POOL_LOCK, _LIVE
    _POOL, _POOL_LOCK, _LIVE = None, threading.Lock(), weakref.WeakSet()


def _shutdown_at_exit() -> None:
    # Epochs a consumer left unfinished: stop their loops first, and give a batch still being read
    # time to finish (up to _EXIT_WAIT_S in all). A loop thread still inside torch when the
    # interpreter finalizes is ended inside C++ frames, and the process aborts after its work.
    deadline = time.monotonic() + _EXIT_WAIT_S
    for prefetcher in list(_LIVE):
        prefetcher.close(timeout=max(0.0, deadline - time.monotonic()), warn=False)
    pool = _POOL
    if pool is not None:
        pool.shutdown(timeout=max(0.0, deadline - time.monotonic()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)
atexit.register(_shutdown_at_exit)


class _Failure:
    """An exception raised while producing a batch, delivered to the consumer in order."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Loops on pool threads that produce batches ahead of the consumer and hand them over in order."""

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
        self._waiting = -1  # the position the consumer is blocked on, if any
        pool = worker_pool()
        _LIVE.add(self)
        self._loop_idents: set[int] = set()  # threads running this prefetcher's loops
        self._loops = [pool.run(self._work, f"featurestore-prefetch-{i}") for i in range(num_threads)]

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
        self._loop_idents.add(threading.get_ident())
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
                wanted = self._waiting == position
            if wanted:
                # The consumer waits for this very batch: it is woken, but needs the GIL, which
                # this thread would otherwise keep through its next batch's Python work until
                # the interpreter's switch interval (5 ms) forces a hand-off. Yield it now: the
                # hand-over costs microseconds instead of up to a switch interval per batch.
                time.sleep(0)

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
                    self._waiting = self._position
                    self._cond.wait()
                    self._waiting = -1
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

    def close(self, timeout: float = _JOIN_TIMEOUT_S, warn: bool = True) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        _LIVE.discard(self)
        for _ in self._loops:  # wake loops blocked on a token so they see the stop flag
            self._tokens.release()
        deadline = time.monotonic() + timeout
        if threading.get_ident() in self._loop_idents:
            deadline = 0.0  # closed from one of its own loops: it cannot wait for itself
            warn = False
        for k, done in enumerate(self._loops):
            if not done.wait(max(0.0, deadline - time.monotonic())) and warn:
                warnings.warn(f"featurestore-prefetch-{k} did not stop within {timeout:.0f} s (stuck in a read?); "
                              "its daemon thread is abandoned", ResourceWarning, stacklevel=2)
        with self._cond:
            self._ready.clear()  # drop read-ahead batches now, not when the iterator is collected
            self._cond.notify_all()
