"""Answering a data request on the event loop when nothing in it can wait.

Data routes do their store work in the thread pool, so that a read waiting on a disk does not
stall the other requests. That hand-over costs two thread wake-ups; for one page-cached item it
was most of the request (in-process, a 192 KiB item: ~0.65 ms through the pool, ~0.27 ms on the
loop; docs/SERVER.md). So a data route first runs its work here in *inline* mode, in which every
step that could wait refuses with :class:`WouldBlock` instead: a split this worker has not opened
yet (or that changed since), a derived split (its source's document is read), a read of more than
``FEATURESTORE_INLINE_READ_BYTES`` or one not wholly in memory
(:meth:`~featurestore.core.reader.FeatureArray.in_memory`), an in-flight budget without room for
it. Such a request goes to the thread pool, as every request did before. Nothing in inline mode
has an effect before its last refusal point, so the pool starts the work afresh.

Object storage is never read inline; local stores are (their split document's ``stat`` included,
which every request makes). A store on a network file system whose ``stat`` can wait: set
``FEATURESTORE_INLINE_READ_BYTES=0``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

if TYPE_CHECKING:
    from server.state import StoreState


class WouldBlock(Exception):
    """This request's work may wait (a disk, a network, the in-flight budget): run it in the pool."""


async def answer(state: StoreState, work: Callable[[bool], Response]) -> Response:
    """``work(True)`` on the event loop where the store is local and inline reads are on, else
    (or when it raised :class:`WouldBlock`) ``work(False)`` in the thread pool."""
    if state.local and state.settings.inline_read_bytes:
        try:
            response = work(True)
        except WouldBlock:
            pass
        else:
            state.inline_answers += 1
            return response
    return await run_in_threadpool(work, False)
