"""A fork waits for a kernel load in flight on a background thread.

The writer's statistics kernel and the int8 dequantize kernel load on a thread while the first
batches go by (numba's import and its cache). A process forked during that load hands the child
locks held by a thread the child does not have (the kernel module's import lock, numba's compiler
lock): the child's first use of the kernel would wait forever. Each loading module registers an
``os.register_at_fork(before=...)`` hook that calls :func:`wait_for_loads`: the fork waits for the
load instead (about a second, once per process).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

#: The longest a fork waits for a load in flight (a bound, not an expected time).
FORK_WAIT_S = 120.0


def wait_for_loads(threads: Iterable[threading.Thread | None]) -> None:
    """Join every live thread of ``threads`` but the calling one, each for at most :data:`FORK_WAIT_S`."""
    current = threading.current_thread()
    for thread in threads:
        if thread is not None and thread is not current and thread.is_alive():
            thread.join(FORK_WAIT_S)
