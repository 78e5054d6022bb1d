"""How many chunk files the local readers may hold open at once, process-wide.

Every memory map of a chunk holds a file descriptor (CPython's ``mmap`` keeps a ``dup`` of it), one
more once rows are read through it without mapping them (core.mapped_file), and one entry of the
process's map table (``vm.max_map_count``); a pread gather holds one
descriptor per chunk file it reads. Kept per chunk, they grew with the chunk count until the
process failed with ``EMFILE`` (a split of one-row chunks under ``ulimit -n 1024``).
Both are bounded here, by a share of the soft ``RLIMIT_NOFILE`` read on first use, so sockets,
libraries and the rest of the process keep the other half:

* maps (:mod:`featurestore.core.chunk_maps`): a quarter of it, their descriptors of both kinds
  counted together, at most an eighth of ``vm.max_map_count`` maps; ``FEATURESTORE_MAX_MAPS``
  overrides the count of maps;
* descriptors held by pread gathers (:class:`FileBudget`): another quarter.
"""

from __future__ import annotations

import os
import resource
import threading

from featurestore.errors import InvalidOption

_SHARE = 4  # each of the two users may hold 1/_SHARE of the soft descriptor limit
_MIN = 8  # below this a gather would wait on itself too often to be useful


def descriptor_share() -> int:
    """A quarter of the soft ``RLIMIT_NOFILE`` (at least 8)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(_MIN, soft // _SHARE)


def per_read(share: int) -> int:
    """How many files one read holds open together out of ``share`` descriptors: a quarter (at
    least 4), the rest taken a group at a time. A read over hundreds of chunks by several threads
    at once, each holding all of its files, outnumbered what a process may open (EMFILE under
    ``ulimit -n 64``)."""
    return max(4, share // 4)


def max_maps() -> int:
    """How many chunk maps the process keeps: ``FEATURESTORE_MAX_MAPS``, else a quarter of the
    descriptor limit, at most an eighth of ``vm.max_map_count`` (numpy, torch and malloc map too)."""
    text = os.environ.get("FEATURESTORE_MAX_MAPS", "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise InvalidOption(f"FEATURESTORE_MAX_MAPS={text!r} is not a positive integer: unset it or give "
                                "the number of chunk maps to keep, e.g. 256")
        return int(text)
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            table = int(f.read())
    except (OSError, ValueError):
        table = 65530  # Linux's default
    return max(_MIN, min(descriptor_share(), table // 8))


class FileBudget:
    """A counting semaphore of chunk-file descriptors shared by every pread gather of the process.

    ``try_take`` never waits; ``take`` does. A gather that cannot get one more descriptor first
    finishes and closes what it holds, then waits: a waiting gather holds nothing, so gathers never
    wait on each other in a circle.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = threading.Semaphore(size)

    def try_take(self) -> bool:
        return self._free.acquire(blocking=False)

    def take(self) -> None:
        self._free.acquire()

    def give(self) -> None:
        self._free.release()


_BUDGET: FileBudget | None = None
_LOCK = threading.Lock()


def file_budget() -> FileBudget:
    """The process's budget for pread gathers (made on first use, fresh after a fork)."""
    global _BUDGET
    with _LOCK:
        if _BUDGET is None:
            _BUDGET = FileBudget(descriptor_share())
        return _BUDGET


def _after_fork_in_child() -> None:
    global _BUDGET, _LOCK
    _BUDGET, _LOCK = None, threading.Lock()  # the parent's gathers are not running here


os.register_at_fork(after_in_child=_after_fork_in_child)
