"""A process forked while one of its threads holds the lock of a process-wide reading object (the
pool of check buffers, a read pool, the object-storage I/O loop as it starts) gets a child whose
first use of that object works. Before, the
child inherited the lock as held, by a thread it does not have, and its first read waited forever:
a DataLoader worker forked while a loader's thread read in the parent. (The chunk cache's locks:
tests/test_chunk_cache_eviction.py.)"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from featurestore.core import checked, pread
from featurestore.core.storage import io_loop

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _held(lock: Any) -> threading.Event:
    """A thread holding ``lock`` until the returned event is set."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(60)

    threading.Thread(target=hold, daemon=True).start()
    assert taken.wait(10)
    return release


def _child_exit(call: Callable[[], Any], seconds: int = 20) -> int:
    """Fork; the child runs ``call`` (on its main thread: a new thread could reuse the holder's
    ident, which an RLock takes for its owner) and exits 0, or is ended by SIGALRM after ``seconds``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running (Python 3.12+)
        pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(seconds)
            call()
            os._exit(0)
        finally:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_child_forked_while_a_check_buffer_is_leased_leases_its_own() -> None:
    release = _held(checked._pool()._lock)
    try:
        assert _child_exit(lambda: checked.lease(1 << 20)) == 0
    finally:
        release.set()


def test_a_child_forked_while_a_read_pool_starts_its_threads_reads_with_its_own() -> None:
    pool = pread.default_pool()
    release = _held(pool._lock)
    try:
        assert _child_exit(lambda: pool.executor().submit(int).result(10)) == 0
    finally:
        release.set()


def test_a_child_forked_while_the_object_io_loop_starts_starts_its_own() -> None:
    release = _held(io_loop._loop_lock)
    try:
        assert _child_exit(lambda: io_loop.run(_nothing())) == 0
    finally:
        release.set()


async def _nothing() -> None:
    return None
