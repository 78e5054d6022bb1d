"""How a ``--worker`` stops when its scheduler takes the node back.

Spot instances, SLURM preemption and ``scancel``, and a Kubernetes pod's end all send SIGTERM,
then SIGKILL after a grace period (30 s by default on Kubernetes and SLURM). Without a handler
SIGTERM kills the process at once: the slide it held stays claimed until its lease runs out (two
minutes by default, the slide idle), and the takeover counts the stop as a failed attempt, so a
slide preempted ``--max-attempts`` times is recorded as failed although nothing is wrong with it.

So while a worker shares slides (:class:`StopOnSignal` around its loop), SIGTERM and SIGINT raise
:class:`~featurestore.errors.Stopped` in the main thread: the worker gives its slide back at once,
not counted as an attempt (``ClaimBoard.release``), and exits with 128 + the signal. A write of a
claim record is never cut in two: inside :meth:`StopOnSignal.deferred` a signal is only noted, and
raised when the write is over.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from featurestore.core.swallowed_stops import redelivered
from featurestore.errors import Stopped

__all__ = ["StopOnSignal"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """Turns SIGTERM and SIGINT into :class:`Stopped` while entered (main thread only; elsewhere
    the signals keep their handlers, and a stop is never raised)."""

    def __init__(self) -> None:
        self.received: int | None = None  # the signal, once one came
        self._raised = False  # Stopped is raised once: the worker's clean-up runs undisturbed
        self._deferred = 0
        self._previous: dict[int, Any] = {}
        self._again: Any = None

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
            # A Stopped raised inside a weakref callback is swallowed: raised once more, after it.
            self._again = redelivered(before=lambda: setattr(self, "_raised", False))
            self._again.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._again is not None:
            self._again.__exit__(None, None, None)
            self._again = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = self.received or signum
        self.check()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal arriving inside is raised when the block ends (a claim's write is whole)."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1
        self.check()

    def check(self) -> None:
        """Raise :class:`Stopped` if a signal came, outside :meth:`deferred`, once."""
        if self.received is not None and not self._deferred and not self._raised:
            self._raised = True
            raise Stopped(self.received)
