"""A stop by signal that Python swallowed, delivered again.

A signal handler runs between two bytecodes of the main thread, wherever it is. When that is
inside a weakref callback or a ``__del__``, the handler's exception (a :class:`Stopped`) ends the
callback and Python only prints it ("Exception ignored in ..."): the command runs on as if no
signal had come, until the scheduler's SIGKILL. While :func:`redelivered` lasts, such a stop is
raised again 10 ms later, through the signal's own handler, out of the callback.
"""

from __future__ import annotations

import _thread
import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from featurestore.errors import Stopped

__all__ = ["redelivered"]


@contextlib.contextmanager
def redelivered(before: Callable[[], None] | None = None) -> Iterator[None]:
    """Swallowed :class:`Stopped` exceptions are delivered again while this lasts (main thread's
    handler of their signal); ``before``: called first (a handler that raises once forgets it did)."""
    previous = sys.unraisablehook

    def swallowed(info: Any) -> None:
        previous(info)
        if isinstance(info.exc_value, Stopped):
            if before is not None:
                before()
            # Not from here: this hook runs inside the callback, and a raise here is swallowed too.
            threading.Timer(0.01, _thread.interrupt_main, (info.exc_value.signum,)).start()

    sys.unraisablehook = swallowed
    try:
        yield
    finally:
        sys.unraisablehook = previous
