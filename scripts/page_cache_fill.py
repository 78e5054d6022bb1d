"""How the way files enter the page cache changes later warm reads of them (docs/BENCHMARKS.md,
"The harness"). For each way of filling it, the files under DIR are evicted, read once that way
(timed: the fill's GB/s), then read again warm by a bare ``preadv`` loop in 2 MiB pieces (its GB/s,
several passes). No featurestore code in any timed read.

    PYTHONPATH=. python scripts/page_cache_fill.py /path/to/store/ds/enc/split/features

Ways: sequential reads of one size per file (128 KiB as ``cat``, up to 8 MiB), and 2 MiB pieces
spread over threads (a reader's parallel pieces).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from featurestore.testing.cgroup import evict, files_under


def sequential(files: list[str], piece: int, threads: int = 1) -> Callable[[], None]:
    def one(path: str) -> None:
        buffer = memoryview(bytearray(piece))
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset in range(0, os.fstat(fd).st_size, piece):
                os.preadv(fd, [buffer], offset)
        finally:
            os.close(fd)

    def fill() -> None:
        with ThreadPoolExecutor(threads) as pool:  # its threads end with the fill
            list(pool.map(one, files))
    return fill


def pieces(files: list[str], piece: int, threads: int) -> Callable[[], None]:
    def fill() -> None:
        fds = {path: os.open(path, os.O_RDONLY) for path in files}
        local = threading.local()

        def one(item: tuple[str, int]) -> None:
            if not hasattr(local, "buffer"):
                local.buffer = memoryview(bytearray(piece))
            os.preadv(fds[item[0]], [local.buffer], item[1])
        items = [(path, offset) for path in files for offset in range(0, os.path.getsize(path), piece)]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, items))
        for fd in fds.values():
            os.close(fd)
    return fill


def warm_rate(files: list[str]) -> float:
    buffer, total = memoryview(bytearray(2 << 20)), 0
    fds = [os.open(path, os.O_RDONLY) for path in files]
    start = time.perf_counter()
    for fd in fds:
        for offset in range(0, os.fstat(fd).st_size, len(buffer)):
            total += os.preadv(fd, [buffer], offset)
    seconds = time.perf_counter() - start
    for fd in fds:
        os.close(fd)
    return total / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="files to read (e.g. a split's features folder), some MiB each")
    parser.add_argument("--passes", type=int, default=4, help="warm passes after each fill (default 4)")
    args = parser.parse_args()
    files = [path for path in files_under(args.directory) if os.path.getsize(path) >= 1 << 20]
    nbytes = sum(os.path.getsize(path) for path in files)
    ways = {"128 KiB sequential (cat)": sequential(files, 128 << 10),
            "128 KiB sequential, 4 files at once": sequential(files, 128 << 10, 4),
            "1 MiB sequential": sequential(files, 1 << 20), "8 MiB sequential": sequential(files, 8 << 20),
            "2 MiB pieces on 4 threads": pieces(files, 2 << 20, 4),
            "2 MiB pieces on 8 threads": pieces(files, 2 << 20, 8)}
    print(f"{len(files)} files, {nbytes / 2**20:.0f} MiB")
    for name, fill in ways.items():
        evict(args.directory)
        start = time.perf_counter()
        fill()
        rate = nbytes / (time.perf_counter() - start) / 1e9
        warm = [warm_rate(files) for _ in range(args.passes)]
        print(f"{name:<38} fill {rate:5.2f} GB/s; warm reads after it " + " ".join(f"{w:.1f}" for w in warm) + " GB/s")


if __name__ == "__main__":
    main()
