"""How fast this host lets a process touch memory: freed a moment ago vs freed ``--idle`` seconds ago.

Some virtual machines (this project's 2-core test VM: KVM with virtio-balloon free page
reporting) hand memory that stays free for a few seconds back to the host; the next first touch
of it then waits for the host to back each page again. A fresh process's first write (``bench
write``) allocates its batch buffers from such memory, a second write reuses its own, and numpy's
``tofile`` needs none beyond the page cache: this script measures the gap each round, interleaved.

Each round maps ``--mb`` MiB of anonymous memory (2 MiB pages advised, as ``core.buffers`` does),
touches every page, unmaps it, and maps and touches the same size again right away ("reused"),
then sleeps ``--idle`` s and does it once more ("after idle"). Prints GB/s per round and the medians.

    python scripts/fresh_memory.py [--mb 800] [--idle 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import numpy as np


def touch_seconds(nbytes: int) -> float:
    """Seconds to write one byte per 4 KiB page of a new anonymous map of ``nbytes``."""
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapped.madvise(mmap.MADV_HUGEPAGE)
    pages = np.frombuffer(mapped, np.uint8)
    start = time.perf_counter()
    pages[:: mmap.PAGESIZE] = 1
    seconds = time.perf_counter() - start
    del pages
    mapped.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=800, help="MiB touched per measurement (default 800)")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds freed before 'after idle' (default 30)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    nbytes = args.mb << 20
    reused, idle = [], []
    touch_seconds(nbytes)  # the first map of the run: whatever state the host left it in
    for r in range(args.rounds):
        reused.append(nbytes / touch_seconds(nbytes) / 1e9)
        time.sleep(args.idle)
        idle.append(nbytes / touch_seconds(nbytes) / 1e9)
        print(f"round {r + 1}: reused {reused[-1]:.2f} GB/s, after {args.idle:g} s idle {idle[-1]:.2f} GB/s",
              flush=True)
    ratio = statistics.median(reused) / statistics.median(idle)
    print(f"median: reused {statistics.median(reused):.2f} GB/s, after idle {statistics.median(idle):.2f} GB/s "
          f"({ratio:.1f}x slower); {args.mb} MiB after idle costs {nbytes / statistics.median(idle) / 1e9:.2f} s")


if __name__ == "__main__":
    main()
