"""The object-storage backend's event loop, and a clean exit for the Rust threads that feed it.

obstore's async calls (``get_range_async``, ``bytes_async``...) run on tokio threads; when one
finishes, a tokio thread takes the GIL and hands the result to this loop with
``loop.call_soon_threadsafe``, whose wake-up write (``sock.send``) releases the GIL for a moment.
If the program finishes in that moment (the loop already ran the callback, so the caller has its
bytes and returns), ``Py_FinalizeEx`` starts; when the tokio thread then takes the GIL back,
CPython (< 3.14) ends it with ``pthread_exit``, whose forced unwind cannot cross Rust frames, and
the process aborts: "Fatal Python error: Aborted", exit 134, after correct reads (seen in a
core dump: ``take_gil`` -> ``PyThread_exit_thread`` -> ``__pthread_unwind`` -> ``abort`` under
``pyo3_async_runtimes::generic::set_result``). The same holds for a request still in flight at
exit (its completion takes the GIL later) and for obstore's call of a Python credential provider.

The fix lives here, so it holds for every program (CLI, a user's script, a server): an ``atexit``
hook, which runs while the interpreter is still whole, waits (GIL released) until

* no request started through :func:`settled` is still in flight, and
* no foreign thread is inside this loop's ``call_soon_threadsafe``.

After both counts reach zero no tokio thread touches Python again: a completion's last Python
step is that call, and the thread keeps the GIL from it until it lets go for good. The wait is
bounded (:data:`EXIT_DRAIN_SECONDS`), so a hung server cannot hold an exit forever.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: How long an exiting process waits for object-storage requests still in flight.
EXIT_DRAIN_SECONDS = 10.0


class _Activity:
    """Counts of Rust work that may still take the GIL: requests in flight, completions inside
    ``call_soon_threadsafe``; :meth:`wait_idle` blocks (GIL released) until both are zero."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self.requests = 0
        self.handing_over = 0

    def change(self, requests: int = 0, handing_over: int = 0) -> None:
        with self._idle:
            self.requests += requests
            self.handing_over += handing_over
            if self.requests == 0 and self.handing_over == 0:
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._idle:
            while self.requests or self.handing_over:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True


_activity = _Activity()


def _forget_parent_activity() -> None:
    # A forked child has none of its parent's requests in flight (nor its loop, nor its threads,
    # one of which may have held the loop's lock while starting it).
    global _activity, _loop_lock
    _activity, _loop_lock = _Activity(), threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_activity)


class _TrackedLoop(asyncio.SelectorEventLoop):
    """An event loop that knows when another thread is handing it a result."""

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any, context: Any = None) -> Any:
        _activity.change(handing_over=1)
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            _activity.change(handing_over=-1)


async def settled(start: Callable[[], Awaitable[T]]) -> T:
    """Await the obstore coroutine ``start()`` returns, counted as in flight until it is done,
    so that an exiting process waits for its result to arrive (module docstring)."""
    _activity.change(requests=1)
    try:
        return await start()
    finally:
        _activity.change(requests=-1)


_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0


def event_loop() -> asyncio.AbstractEventLoop:
    """This process's I/O loop (a daemon thread; a forked child starts its own)."""
    global _loop, _loop_pid
    if _loop is not None and _loop_pid == os.getpid():
        return _loop
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():
            loop = _TrackedLoop()
            thread = threading.Thread(target=loop.run_forever, name="featurestore-objectio", daemon=True)
            thread.start()
            _loop, _loop_pid = loop, os.getpid()
            atexit.register(_drain_at_exit, os.getpid())
    return _loop


def run(coro: Awaitable[T]) -> T:
    """Run ``coro`` on the I/O loop and wait for it (safe from any number of threads)."""
    return asyncio.run_coroutine_threadsafe(coro, event_loop()).result()  # type: ignore[arg-type]


def _drain_at_exit(pid: int) -> None:
    if pid != os.getpid():  # a forked child inherits the hook, not the parent's loop or requests
        return
    _activity.wait_idle(EXIT_DRAIN_SECONDS)
