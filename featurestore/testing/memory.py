"""A process's memory, as the benches, the demo and the tests measure it (Linux ``/proc``): one
field of a process's status (:func:`process_rss`), this process's anonymous RSS and its peak
(reset where the kernel allows), that peak sampled on a thread while a block runs
(:func:`anon_peak`), and one pass over batches with both (:func:`rss_epoch`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any


def process_rss(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of process ``pid`` in bytes (Linux /proc; 0 where unavailable).

    ``VmRSS`` counts the store's memory-mapped chunk pages the process touched (page cache, not
    leaks); ``RssAnon`` is the part that is the process's own heap, the one a leak would grow.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon), the part a page cache cannot reclaim
    (without /proc: the peak RSS, the nearest the OS gives)."""
    import resource

    return process_rss(os.getpid(), "RssAnon") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_reset() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS, where the kernel allows."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """This process's peak RSS (VmHWM) since the last :func:`peak_reset`."""
    return process_rss(os.getpid(), "VmHWM")


@contextlib.contextmanager
def anon_peak(every: float = 0.005) -> Iterator[list[int]]:
    """This process's peak anonymous RSS while the block runs, sampled every ``every`` seconds on a
    thread (a peak between two reads of the block's own would be missed): yields ``[peak]``, whose
    one number is final once the block has ended."""
    peak, stop = [rss_anon_bytes()], threading.Event()

    def sample() -> None:
        while not stop.wait(every):
            peak[0] = max(peak[0], rss_anon_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], rss_anon_bytes())


def rss_epoch(batches: Iterable[Any]) -> dict[str, Any]:
    """(In a child.) One pass over ``batches``, each touched as it is made, its anonymous RSS sampled
    every 5 ms on a thread: ``baseline_anon``, ``peak_anon`` and ``epoch_s``; and the whole RSS as
    ``top``, SLURM and Kubernetes count it (anonymous + mapped file pages): ``baseline_rss`` (VmRSS)
    and ``peak_rss`` (VmHWM, reset at the baseline)."""
    baseline, baseline_rss = rss_anon_bytes(), process_rss(os.getpid(), "VmRSS")
    peak_reset()
    with anon_peak() as peak:
        start = time.perf_counter()
        for _ in batches:
            pass
        seconds = time.perf_counter() - start
    return {"baseline_anon": baseline, "peak_anon": max(baseline, peak[0]), "epoch_s": seconds,
            "baseline_rss": baseline_rss, "peak_rss": peak_rss()}

