"""Python's cyclic garbage collector paused around a numba kernel module's load.

Importing numba creates some 250k Python objects, and the collector, run every few hundred
allocations, walks the young ones again and again as they pile up: loading the int8 dequantize
kernel (``client.dequantize.wait_warm``: import and first calls, from numba's cache) took 0.52-0.64
s of CPU with the collector on and 0.35-0.38 s with it paused (3 of 4 alternating runs; one 0.60),
in a process that had already imported torch, on a 2-core VM. A loader pays that load in its first
int8 epoch, and a writer in its first batch, so the pause covers exactly the load. The pause is
process-wide but brief; nested or concurrent pauses (a writer and a loader loading at once) end
together, and the collector's earlier state is restored.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_DEPTH = 0
_WAS_ENABLED = True


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block; on leaving the outermost pause, the
    collector is on again if it was on when that pause began."""
    global _DEPTH, _WAS_ENABLED
    with _LOCK:
        if _DEPTH == 0:
            _WAS_ENABLED = gc.isenabled()
            gc.disable()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0 and _WAS_ENABLED:
                gc.enable()
