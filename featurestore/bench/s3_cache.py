"""The chunk cache's part of ``featurestore bench s3``: loader epochs through a local chunk cache
(full and half size, epoch 2 cold), a local cold loader, the cache fill ceiling, CPU per GB.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from featurestore.bench import harness
from featurestore.bench.harness import gbps

TARGETS = {"cache_epoch1_vs_ceiling": 0.6, "cache_epoch2_vs_local_cold": 0.85, "half_cache_vs_ceiling": 0.3}


class CpuClock:
    """CPU seconds (user + system) of this process so far and, if given, of another one (the
    server, from ``/proc``; None where unreadable): on a shared machine a run's seconds swing with
    the load, its CPU seconds do not."""

    def __init__(self, other_pid: int | None = None) -> None:
        self.other_pid = other_pid

    def read(self) -> tuple[float, float | None]:
        if self.other_pid is None:
            return time.process_time(), None
        try:
            with open(f"/proc/{self.other_pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return time.process_time(), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return time.process_time(), None


class CachedEpochs:
    """Loader epochs over ``url`` with and without a chunk cache, and over a local copy."""

    def __init__(self, url: str, options: dict[str, Any], values: np.ndarray, chunk_bytes: int, batch: int,
                 prefetch: int, threads: int | None, workdir: str | None = None, *, clock: CpuClock | None = None,
                 cpu: dict[str, list[tuple[float, float | None]]] | None = None) -> None:
        import featurestore

        self.clock, self.cpu = clock or CpuClock(), cpu if cpu is not None else {}
        self.url, self.options, self.batch = url, dict(options), batch
        self.prefetch, self.threads = prefetch, threads
        self.n = len(values)
        self.nbytes = values.nbytes
        self.work = tempfile.mkdtemp(prefix="featurestore-s3cache-", dir=workdir)
        self.local = os.path.join(self.work, "local")
        writer = featurestore.open_store(self.local, mode="a").create_split(
            "bench", "enc", "train", num_samples=self.n, sample_shape=values.shape[1:], dtype="float16",
            chunk_bytes=chunk_bytes)
        for start in range(0, self.n, batch):
            writer.write(start, values[start : start + batch])
        writer.commit()
        self.downloaded: dict[str, list[float]] = {"half cache epoch 1": [], "half cache epoch 2": []}

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def _loader(self, source: str, options: dict[str, Any]) -> Any:
        from client import FeatureDataset, FeatureLoader

        ds = FeatureDataset(source, "bench", "enc", "train", storage_options=options)
        return FeatureLoader(ds, batch_size=self.batch, order="shuffle", device="cpu", dtype=None,
                             prefetch=self.prefetch, num_threads=self.threads, seed=int(time.time()))

    def _epoch(self, loader: Any, epoch: int, label: str | None = None) -> float:
        loader.set_epoch(epoch)
        before = self.clock.read()
        t0, seen = time.perf_counter(), 0
        for features, _ in loader:
            seen += features.shape[0]
        seconds = time.perf_counter() - t0
        if label is not None:
            record_cpu(self.cpu, label, before, self.clock.read(), self.nbytes)
        assert seen == self.n
        return gbps(self.nbytes, seconds)

    def _cache_dir(self) -> str:
        return tempfile.mkdtemp(prefix="cache-", dir=self.work)

    def full_cache(self) -> tuple[float, float]:
        """(epoch 1, epoch 2) through a cache as large as the split."""
        directory = self._cache_dir()
        loader = self._loader(self.url, {**self.options, "cache_dir": directory})
        first = self._epoch(loader, 0, EPOCH1)
        evict_cold(directory)
        second = self._epoch(loader, 1)
        loader.close()
        remove_cache(directory)
        return first, second

    def half_cache(self) -> tuple[float, float]:
        """(epoch 1, epoch 2) through a cache of half the split; bytes downloaded recorded."""
        directory = self._cache_dir()
        loader = self._loader(self.url, {**self.options, "cache_dir": directory, "cache_bytes": self.nbytes // 2})
        storage = loader.ds.array.storage
        speeds = []
        for epoch, name in enumerate(("half cache epoch 1", "half cache epoch 2")):
            before = storage.bytes_read
            speeds.append(self._epoch(loader, epoch))
            self.downloaded[name].append((storage.bytes_read - before) / self.nbytes)
        loader.close()
        remove_cache(directory)
        return speeds[0], speeds[1]

    def local_cold(self) -> float:
        loader = self._loader(self.local, {})
        evict_cold(self.local)
        speed = self._epoch(loader, 0)
        loader.close()
        return speed


def evict_cold(path: str) -> None:
    """Evict ``path``'s files from the page cache; the process's chunk maps go first (a page
    still mapped is not dropped)."""
    harness.unmap()
    harness.evict(path)


def fetch_whole(store: Any, keys: list[str], in_flight: int = 8) -> int:
    """GET every object of ``keys`` whole, ``in_flight`` at a time (obstore ``store``): the
    server's own limit for these bytes (the ceilings of ``bench s3``). Returns the bytes read."""
    import asyncio

    import obstore

    from featurestore.core.storage.io_loop import run as run_async

    async def get_all() -> int:
        semaphore = asyncio.Semaphore(in_flight)

        async def get(key: str) -> int:
            async with semaphore:
                result = await obstore.get_async(store, key)
                return len(await result.bytes_async())

        return sum(await asyncio.gather(*(get(k) for k in keys)))

    return run_async(get_all())


def fill_whole(store: Any, keys: list[str], directory: str, in_flight: int = 8) -> int:
    """GET every object of ``keys`` whole on ``in_flight`` threads, each streamed into a new
    preallocated file of ``directory`` in 1 MiB writes as it arrives (obstore ``store``): the
    least that filling any chunk cache costs this machine, without featurestore's checks, locks,
    renames or batches (the ``cache fill ceiling`` of ``bench s3``). The files are removed before
    it returns. Returns the bytes written."""
    from concurrent.futures import ThreadPoolExecutor

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


def remove_cache(directory: str) -> None:
    """Remove a repeat's cache directory. Its files are still mapped by the process's chunk maps,
    which would keep their pages (dirty: never written back) after the unlink: repeat after repeat
    they pile up until the kernel's writeback starts, and later repeats pay for the earlier ones
    (measured: epoch 1 at 2.2-3.2 s of client CPU per GB from the sixth repeat on, 1 s before)."""
    harness.unmap()
    shutil.rmtree(directory, ignore_errors=True)


EPOCH1 = "cache epoch 1 (empty, full-size cache)"
CEILING = "ceiling (whole chunks, 8 GETs)"
FILL = "cache fill ceiling (chunks into files)"


def record_cpu(cpu: dict[str, list[tuple[float, float | None]]], name: str, before: tuple[float, float | None],
               after: tuple[float, float | None], nbytes: int) -> None:
    """Append ``name``'s (client, server) CPU seconds per GB between two ``CpuClock.read()``s."""
    server = None if before[1] is None or after[1] is None else (after[1] - before[1]) * 1e9 / nbytes
    cpu.setdefault(name, []).append(((after[0] - before[0]) * 1e9 / nbytes, server))


def cpu_medians(cpu: dict[str, list[tuple[float, float | None]]]) -> dict[str, tuple[float, float | None]]:
    """Median (client, server) CPU milliseconds per GB of each figure."""
    out: dict[str, tuple[float, float | None]] = {}
    for name, values in cpu.items():
        servers = [s for _, s in values if s is not None]
        out[name] = (float(np.median([c for c, _ in values])) * 1e3,
                     float(np.median(servers)) * 1e3 if servers else None)
    return out


def ratios(median: dict[str, float], ceiling: float, runs: dict[str, list[float]] | None = None) -> dict[str, float]:
    paired = {}
    if runs is not None and len(runs.get(EPOCH1, [])) == len(runs.get(CEILING, [])) > 0:
        paired["cache_epoch1_vs_ceiling_paired"] = float(np.median(np.divide(runs[EPOCH1], runs[CEILING])))
    fill = {"cache_epoch1_vs_fill_ceiling": median[EPOCH1] / median[FILL]} if FILL in median else {}
    return {
        **paired,
        "cache_epoch1_vs_ceiling": median[EPOCH1] / ceiling,
        **fill,
        "cache_epoch2_vs_local_cold": median["cache epoch 2 (filled, cold files)"] / median["local cold loader"],
        "half_cache_vs_ceiling": median["half cache epoch 2"] / ceiling,
        "half_cache_epoch1_vs_ceiling": median["half cache epoch 1"] / ceiling,
    }
