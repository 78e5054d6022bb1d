"""Lock files that a forked child does not go on holding.

``flock`` belongs to the open file description, which ``fork()`` shares with the child: a lock a
thread held when the process forked stays held until the child closes its copy too, and nothing in
the child ever does (the thread that would is not there). A DataLoader worker forked while a fetch
thread made room in the chunk cache would hold the cache's eviction lock for its whole life: the
parent's next eviction would wait for the worker to exit, and the worker's own would wait forever.
A descriptor opened by :func:`lock_file` is closed in the child right after the fork; the parent's
lock stands until the parent closes its own.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_open_here: set[int] = set()  # descriptors open through lock_file in this process
_guard = threading.Lock()  # held around each open and close, and across a fork: the set is exact then


@contextlib.contextmanager
def lock_file(path: str, flags: int = os.O_CREAT | os.O_RDWR) -> Iterator[int]:
    """``os.open(path, flags, 0o644)``, for a ``flock``: closed on exit, and in a child forked
    meanwhile (where it would keep the lock of a thread the child does not have)."""
    with _guard:
        fd = os.open(path, flags, 0o644)
        _open_here.add(fd)
    try:
        yield fd
    finally:
        with _guard:
            _open_here.discard(fd)
            os.close(fd)


def _after_fork_in_child() -> None:
    for fd in _open_here:
        with contextlib.suppress(OSError):
            os.close(fd)
    _open_here.clear()
    _guard.release()


os.register_at_fork(before=_guard.acquire, after_in_parent=_guard.release, after_in_child=_after_fork_in_child)
