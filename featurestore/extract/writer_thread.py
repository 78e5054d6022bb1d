"""The extraction writer thread: drains encoded batches into the split writer behind a bounded queue.

The encoder (main thread) puts ``(start, features, labels)``; this thread calls ``writer.write``,
which checks, casts and measures the batch on its device and hands finished chunks to the put
pool. The queue bounds memory to ``queue_size`` batches; the first error is kept and re-raised on
the main thread at its next ``put`` or at ``finish``.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from featurestore.format import dtypes


class WriterThread(threading.Thread):
    """Drains ``(start, features, labels)`` into the split writer; keeps the first error."""

    def __init__(self, writer: Any, maxsize: int) -> None:
        super().__init__(name="featurestore-writer", daemon=True)
        self.writer = writer
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, maxsize))
        self.error: BaseException | None = None
        self.bytes_written = 0
        self.waited = 0.0
        self.itemsize = dtypes.storage_dtype(writer.dtype).itemsize

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # keep draining so the producer never blocks on a dead consumer
            try:
                self.bytes_written += self.write(item)
            except BaseException as error:  # handed to the main thread, which raises it
                self.error = error

    def write(self, item: Any) -> int:
        """Hand one item to the writer; returns the bytes it stores (a subclass writes bags)."""
        start, features, labels = item
        # donate: the encoder never touches this batch again, so no defensive copy.
        self.writer.write(start, features, labels, donate=True)
        return int(features.numel()) * self.itemsize

    def put(self, item: Any) -> None:
        started = time.perf_counter()
        while self.error is None:
            try:
                self.queue.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        self.waited += time.perf_counter() - started  # ~0 when writes hide behind encoding
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        started = time.perf_counter()
        self.queue.put(None)
        self.join()
        self.waited += time.perf_counter() - started
        if self.error is not None:
            raise self.error
