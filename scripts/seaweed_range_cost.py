"""What one ranged GET costs SeaweedFS, by object size and internal-chunk layout (docs/STORAGE.md).

Starts SeaweedFS through featurestore's launcher (1 MiB internal chunks unless ``--weed-args``
says otherwise, e.g. ``--weed-args=-filer.maxMB=4`` for the stock layout), PUTs 8 objects of each
size, prints each object's internal chunks (from the filer's metadata), then times 192 KiB ranged
GETs at random row offsets with 1, 8 and 16 in flight, and whole-object GETs with 8 in flight,
through obstore directly. "server" is the weed process's CPU (utime + stime from /proc) per
request, "client" this process's. The server's files were just written: page-cache warm.

    python scripts/seaweed_range_cost.py [--weed-args=-filer.maxMB=4] [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import obstore

from featurestore.testing.seaweedfs import seaweed_server
from featurestore.core.storage.io_loop import run

ROW = 192 << 10
SIZES = {"192K": ROW, "1M": 1 << 20, "4M": 4 << 20, "8M chunk (42 rows + crc)": 42 * ROW + 4}


def _cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weed-args", default="", help="extra weed server flags, space separated (use '=')")
    parser.add_argument("--requests", type=int, default=200, help="ranged GETs per measurement")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with seaweed_server(extra_args=tuple(args.weed_args.split())) as server:
        filer = [a for a in server.process.args if str(a).startswith("-filer.port=")][-1].split("=")[1]
        server.create_bucket("rangecost")
        store = server.store("rangecost")
        names = {name: f"o{i}" for i, name in enumerate(SIZES)}
        for name, size in SIZES.items():
            for k in range(8):
                obstore.put(store, f"{names[name]}/{k}", rng.integers(0, 255, size, dtype=np.uint8).tobytes())
            url = f"http://127.0.0.1:{filer}/buckets/rangecost/{names[name]}/0?metadata=true"
            with urllib.request.urlopen(url, timeout=10) as response:
                chunks = [c.get("size") for c in json.load(response).get("chunks") or []]
            print(f"{name}: internal chunks {chunks}")

        def measure(label: str, make: Callable[[], Coroutine[Any, Any, int]], count: int) -> None:
            run(make())  # warm: connections, the server's caches
            server_0, client_0, t0 = _cpu(server.process.pid), _cpu(os.getpid()), time.perf_counter()
            got = run(make())
            seconds = time.perf_counter() - t0
            server_ms = 1e3 * (_cpu(server.process.pid) - server_0) / count
            client_ms = 1e3 * (_cpu(os.getpid()) - client_0) / count
            print(f"  {label:<44} {got / seconds / 1e9:6.3f} GB/s  server {server_ms:5.2f} ms CPU/request  "
                  f"client {client_ms:5.2f}")

        async def ranged(prefix: str, size: int, in_flight: int, count: int) -> int:
            semaphore = asyncio.Semaphore(in_flight)
            rows = max(1, size // ROW)

            async def one(j: int) -> int:
                start = int(rng.integers(0, rows)) * ROW
                async with semaphore:
                    data = await obstore.get_range_async(store, f"{prefix}/{j % 8}", start=start,
                                                         end=min(start + ROW, size))
                return len(data)

            return sum(await asyncio.gather(*(one(j) for j in range(count))))

        async def whole(prefix: str, count: int) -> int:
            semaphore = asyncio.Semaphore(8)

            async def one(j: int) -> int:
                async with semaphore:
                    result = await obstore.get_async(store, f"{prefix}/{j % 8}")
                    return len(await result.bytes_async())

            return sum(await asyncio.gather(*(one(j) for j in range(count))))

        print("weed server flags:", " ".join(str(a) for a in server.process.args if str(a).startswith("-filer.maxMB")))
        for name, size in SIZES.items():
            for in_flight in (1, 8, 16):
                measure(f"192 KiB range in {name}, {in_flight} in flight",
                        lambda: ranged(names[name], size, in_flight, args.requests), args.requests)
            count = args.requests if size < (4 << 20) else 40
            measure(f"whole {name}, 8 in flight", lambda: whole(names[name], count), count)


if __name__ == "__main__":
    main()
