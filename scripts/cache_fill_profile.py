"""Where a chunk cache's epoch 1 loses to the machine's own cache-fill ceiling, bare loopback.

Starts SeaweedFS on loopback, writes one ``[256, 384]`` float16 split, then times, interleaved
round after round (alternating order), each into a new empty cache directory:

* ``fill ceiling``: every object GET whole on 8 threads, streamed into preallocated files in
  1 MiB writes (:func:`fill_whole`: no checks, locks, renames);
* ``cache fill only``: the cache's own fill of every chunk (``CachedArray.ensure``: streamed
  GET, size and crc32c, download lock, generation check, rename), no rows delivered;
* ``cache epoch 1``: a ``FeatureLoader`` shuffled epoch through the empty cache (the fills
  driven by the batches, plus the rows gathered from the cached files).

For each: GB/s (median, min-max), this process's CPU seconds per GB and the server's. The first
gap is the cache's per-chunk machinery, the second what delivering batches adds.

    python scripts/cache_fill_profile.py [--num-samples 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


class CpuClock:
    """CPU seconds (user + system) of this process so far and of another one (the server, from
    ``/proc``; None where unreadable): on a shared machine a run's seconds swing with the load,
    its CPU seconds do not."""

    def __init__(self, other_pid: int) -> None:
        self.other_pid = other_pid

    def read(self) -> tuple[float, float | None]:
        try:
            with open(f"/proc/{self.other_pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return time.process_time(), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return time.process_time(), None


def fill_whole(store: Any, keys: list[str], directory: str, in_flight: int = 8) -> int:
    """GET every object of ``keys`` whole on ``in_flight`` threads, each streamed into a new
    preallocated file of ``directory`` in 1 MiB writes as it arrives (obstore ``store``): the
    least that filling any chunk cache costs this machine, without featurestore's checks, locks,
    renames or batches. The files are removed before it returns. Returns the bytes written."""
    import obstore

    from featurestore.core.storage.files import PIECE_BYTES, preallocate, stream_parts

    os.makedirs(directory, exist_ok=True)

    def fill(item: tuple[int, str]) -> int:
        number, key = item
        result = obstore.get(store, key)
        size = int(result.meta["size"])
        with open(os.path.join(directory, str(number)), "wb") as f:
            preallocate(f.fileno(), size)
            for piece in result.stream(min_chunk_size=PIECE_BYTES):
                stream_parts(f, [piece])  # the cache's own writes: pieces of at most 1 MiB
        return size

    try:
        with ThreadPoolExecutor(in_flight) as pool:
            return sum(pool.map(fill, enumerate(keys)))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import featurestore
    from client import FeatureDataset, FeatureLoader
    from featurestore.testing.seaweedfs import seaweed_server

    shape, n = (256, 384), args.num_samples
    values = np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32).astype(np.float16)
    work = tempfile.mkdtemp(prefix="cache-fill-profile-")
    try:
        with seaweed_server() as server:
            server.create_bucket("fill")
            url = f"s3://fill/s-{uuid.uuid4().hex[:6]}"
            options = server.storage_options
            writer = featurestore.open_store(url, mode="a", **options).create_split(
                "d", "e", "train", num_samples=n, sample_shape=shape, dtype="float16")
            for lo in range(0, n, 64):
                writer.write(lo, values[lo : lo + 64])
            writer.commit()
            probe = featurestore.open_store(url, **options).open("d", "e", "train")
            keys = probe.chunk_keys()
            client = server.store("fill", prefix=url.split("/", 3)[3])
            nbytes = values.nbytes
            clock = CpuClock(server.process.pid)
            print(f"[cache_fill_profile] {n} rows of {shape} float16 ({nbytes / 1e6:.0f} MB), {len(keys)} chunks, "
                  f"SeaweedFS on loopback, load {os.getloadavg()[0]:.1f} (2 cores, shared)")

            def fresh_dir() -> str:
                return tempfile.mkdtemp(dir=work)

            def ceiling() -> None:
                fill_whole(client, keys, os.path.join(fresh_dir(), "fill"))

            def fill_only() -> None:
                directory = fresh_dir()
                array = featurestore.open_store(url, **options, cache_dir=directory).open("d", "e", "train")
                fetched, absent = array.chunk_cache.ensure(list(range(array.num_chunks)))
                assert not absent and len(fetched) == array.num_chunks
                shutil.rmtree(directory, ignore_errors=True)

            def epoch1() -> None:
                directory = fresh_dir()
                ds = FeatureDataset(url, "d", "e", "train", storage_options={**options, "cache_dir": directory})
                seen = 0
                for features, _ in FeatureLoader(ds, batch_size=64, order="shuffle", device="cpu", dtype=None,
                                                 seed=int(time.time())):
                    seen += features.shape[0]
                assert seen == n
                shutil.rmtree(directory, ignore_errors=True)

            methods: dict[str, Callable[[], None]] = {"fill ceiling": ceiling, "cache fill only": fill_only,
                                                      "cache epoch 1": epoch1}
            for method in methods.values():  # untimed: imports, connections, the server's caches
                method()
            runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in methods}
            for r in range(args.repeats):
                for name in (list(methods) if r % 2 == 0 else list(reversed(methods))):
                    (c0, s0), t0 = clock.read(), time.perf_counter()
                    methods[name]()
                    seconds = time.perf_counter() - t0
                    c1, s1 = clock.read()
                    runs[name].append((nbytes / seconds / 1e9, (c1 - c0) / (nbytes / 1e9),
                                       ((s1 or 0) - (s0 or 0)) / (nbytes / 1e9)))
            base = float(np.median([g for g, _, _ in runs["fill ceiling"]]))
            print(f"{'method':<16} {'GB/s':>6} {'min-max':>13} {'vs ceiling':>10} {'client CPU s/GB':>15} "
                  f"{'server CPU s/GB':>15}")
            for name, got in runs.items():
                gb = [g for g, _, _ in got]
                med = float(np.median(gb))
                print(f"{name:<16} {med:6.3f} {min(gb):6.3f}-{max(gb):<6.3f} {med / base:9.2f}x "
                      f"{np.median([c for _, c, _ in got]):15.2f} {np.median([s for _, _, s in got]):15.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
