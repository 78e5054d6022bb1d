"""DataLoader workers that die with their parent: a ``worker_init_fn`` for every DataLoader we make.

A SIGKILLed (preempted, OOM-killed) ``featurestore extract`` cannot shut its workers down, and
torch's own check of the parent does not save them: a worker whose queue still holds a batch
waits, at exit, for its feeder thread to write into a pipe that its siblings keep open and nobody
reads, so it sits there, reparented to init, with its few hundred MiB, for good. Every resume
of a preempted job would add more.

``die_with_parent`` kills the worker instead. Where its workers fork matters: a DataLoader forks
them in ``iter(loader)``, on the calling thread; in ``run._encode_chunks`` that is the thread that
called ``extract()``, the main thread for the CLI and for torchrun ranks.

* Linux, forked from the main thread (the ``featurestore extract`` CLI, torchrun ranks, a plain
  script): ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, then one check that the parent is still the
  process that forked us (it may have died before prctl ran, and then no signal would come).
  The kernel sends the signal even to a worker stuck in C code or blocked holding the GIL.
* Linux, forked from another thread (``extract()`` called from a thread of the user's
  application): PR_SET_PDEATHSIG fires when the parent *thread* that forked the child exits,
  not the process, so a worker would be killed as soon as that thread ends while the process
  lives on. There, and on other POSIX systems (macOS), a daemon watchdog thread polls
  ``os.getppid()`` and SIGKILLs the worker once it was reparented (its parent process is gone),
  within ``WATCHDOG_INTERVAL`` seconds. It needs the GIL, so a worker blocked in C code holding
  it would wait; PR_SET_PDEATHSIG has no such limit.
* Spawned or forkserver workers (a fresh interpreter, no fork hook ran in it): the watchdog.
* Windows (no getppid that changes, no SIGKILL): the watchdog polls the parent process handle
  multiprocessing hands every child, then exits the worker.

Which thread forked is recorded by an ``os.register_at_fork`` hook at import: this module is
imported wherever a DataLoader is built with the hook, so it is in place before the fork.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

WATCHDOG_INTERVAL = 0.25  # seconds between the watchdog's looks at the parent
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class _ForkOrigin:
    parent_pid: int
    main_thread: bool  # the fork ran on the parent's main thread, which lives as long as the process


_forking: _ForkOrigin | None = None  # set in the parent just before each fork
_fork_origin: _ForkOrigin | None = None  # in a forked child: who forked it; None when not forked


def _before_fork() -> None:
    global _forking
    _forking = _ForkOrigin(os.getpid(), threading.current_thread() is threading.main_thread())


def _after_fork_in_child() -> None:
    global _fork_origin
    _fork_origin = _forking


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def die_with_parent(worker_id: int = 0) -> None:
    """Make this (worker) process die when its parent process dies; a ``worker_init_fn``.

    Call it first thing in the worker (``DieWithParent`` composes it with another init)."""
    origin = _fork_origin
    if origin is not None and os.getppid() != origin.parent_pid:
        _kill_self()  # the parent died between our fork and now: nobody will read what we load
    if sys.platform.startswith("linux") and origin is not None and origin.main_thread and _set_pdeathsig():
        if os.getppid() != origin.parent_pid:  # died after the check above, before prctl took hold
            _kill_self()
        return
    _start_watchdog()


def _set_pdeathsig() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``; False where the call is unavailable or refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _start_watchdog() -> None:
    parent_gone = _parent_gone_check()
    if parent_gone is None:
        return  # not started by multiprocessing on Windows: nothing to watch

    def watch() -> None:
        while not parent_gone():
            time.sleep(WATCHDOG_INTERVAL)
        _kill_self()

    threading.Thread(target=watch, name="featurestore-parent-watchdog", daemon=True).start()


def _parent_gone_check() -> Callable[[], bool] | None:
    if os.name == "posix":
        # A dead parent's children are reparented (to init or a subreaper), so getppid changes.
        parent = os.getppid()
        return lambda: os.getppid() != parent
    process = multiprocessing.parent_process()
    if process is None:
        return None
    return lambda: not process.is_alive()


def _kill_self() -> None:
    kill = getattr(signal, "SIGKILL", None)
    if kill is not None:
        os.kill(os.getpid(), kill)
    os._exit(1)  # no SIGKILL (Windows): exit without running atexit hooks or joining queue threads


@dataclass(frozen=True)
class DieWithParent:
    """A picklable ``worker_init_fn``: ``die_with_parent``, then ``then(worker_id)`` if given
    (the init a caller already had)."""

    then: Callable[[int], None] | None = None

    def __call__(self, worker_id: int) -> None:
        die_with_parent(worker_id)
        if self.then is not None:
            self.then(worker_id)
