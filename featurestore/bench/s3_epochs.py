"""The loader epochs of ``featurestore bench s3``: FeatureLoader through a local chunk cache (full
and half size, epoch 2 cold) and a local cold loader (:class:`CachedEpochs`); BagLoader without and
through a cache against one ``.pt`` object per slide (:class:`BagEpochs`); the whole-object ceilings
(:func:`fetch_whole`, :func:`fill_whole`) and CPU per GB (:class:`CpuClock`).
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from featurestore.bench import harness
from featurestore.bench.harness import gbps

EPOCH1 = "cache epoch 1 (empty, full-size cache)"
CEILING = "ceiling (whole chunks, 8 GETs)"
FILL = "cache fill ceiling (chunks into files)"
BAGS_CEILING = "bags ceiling (whole chunks, 8 GETs)"
BAGS_USERS = "bags, .pt per slide (4 in flight)"
BAGS_NO_CACHE = "bag loader, no cache (ranged GETs)"
BAGS_EPOCH1 = "bag loader, cache epoch 1 (empty)"
BAGS_EPOCH2 = "bag loader, cache epoch 2 (cold files)"
BAG_FIGURES = (BAGS_CEILING, BAGS_USERS, BAGS_NO_CACHE, BAGS_EPOCH1, BAGS_EPOCH2)
CpuTimes = dict[str, list[tuple[float, float | None]]]


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

    def record(self, cpu: CpuTimes, name: str, before: tuple[float, float | None], nbytes: int) -> None:
        """Append ``name``'s (client, server) CPU seconds per GB since ``before`` (a :meth:`read`)."""
        after = self.read()
        server = None if before[1] is None or after[1] is None else (after[1] - before[1]) * 1e9 / nbytes
        cpu.setdefault(name, []).append(((after[0] - before[0]) * 1e9 / nbytes, server))


class _Epochs:
    """Timed epochs of one split (``nbytes`` stored bytes, ``rows`` rows), each checked complete."""

    nbytes: int
    rows: int
    axis = 0  # of a batch's features that counts rows

    def __init__(self, options: dict[str, Any], prefetch: int, workdir: str | None, name: str,
                 clock: CpuClock | None = None, cpu: CpuTimes | None = None) -> None:
        self.options, self.prefetch = dict(options), prefetch
        self.clock, self.cpu = clock or CpuClock(), cpu if cpu is not None else {}
        self.work = tempfile.mkdtemp(prefix=f"featurestore-{name}-", dir=workdir)

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def loader(self, source: str, options: dict[str, Any]) -> Any:
        raise NotImplementedError

    def epoch(self, loader: Any, epoch: int, label: str | None = None) -> float:
        """GB/s of one epoch of ``loader``; its CPU per GB recorded as ``label``, if given."""
        loader.set_epoch(epoch)
        before, t0, seen = self.clock.read(), time.perf_counter(), 0
        for batch in loader:
            seen += int(batch[0].shape[self.axis])
        seconds = time.perf_counter() - t0
        if label is not None:
            self.clock.record(self.cpu, label, before, self.nbytes)
        assert seen == self.rows, (seen, self.rows)
        return gbps(self.nbytes, seconds)

    def cached(self, source: str, label: str | None = None, **cache: Any) -> tuple[float, float]:
        """(epoch 1 into an empty cache, epoch 2 from its files evicted) through a new cache."""
        directory = tempfile.mkdtemp(prefix="cache-", dir=self.work)
        loader = self.loader(source, {**self.options, "cache_dir": directory, **cache})
        first = self.epoch(loader, 0, label)
        evict_cold(directory)
        second = self.epoch(loader, 1)
        loader.close()
        remove_cache(directory)
        return first, second


class CachedEpochs(_Epochs):
    """FeatureLoader epochs over ``url`` through a chunk cache, and over a local copy."""

    def __init__(self, url: str, options: dict[str, Any], values: np.ndarray, chunk_bytes: int, batch: int,
                 prefetch: int, threads: int | None, workdir: str | None = None, *, clock: CpuClock | None = None,
                 cpu: CpuTimes | None = None) -> None:
        super().__init__(options, prefetch, workdir, "s3cache", clock, cpu)
        self.url, self.batch, self.threads = url, batch, threads
        self.rows, self.nbytes = len(values), values.nbytes
        self.local = os.path.join(self.work, "local")
        harness.write_split(self.local, len(values), values.shape[1:], rows=batch, chunk_bytes=chunk_bytes)
        self.downloaded: dict[str, list[float]] = {"half cache epoch 1": [], "half cache epoch 2": []}

    def loader(self, source: str, options: dict[str, Any]) -> Any:
        from client import FeatureDataset, FeatureLoader

        ds = FeatureDataset(source, "bench", "enc", "train", storage_options=options)
        return FeatureLoader(ds, batch_size=self.batch, order="shuffle", device="cpu", dtype=None,
                             prefetch=self.prefetch, num_threads=self.threads, seed=int(time.time()))

    def full_cache(self) -> tuple[float, float]:
        """(epoch 1, epoch 2) through a cache as large as the split."""
        return self.cached(self.url, EPOCH1)

    def half_cache(self) -> tuple[float, float]:
        """(epoch 1, epoch 2) through a cache of half the split; bytes downloaded recorded."""
        directory = tempfile.mkdtemp(prefix="cache-", dir=self.work)
        loader = self.loader(self.url, {**self.options, "cache_dir": directory, "cache_bytes": self.nbytes // 2})
        storage = loader.ds.array.storage
        speeds = []
        for epoch, name in enumerate(("half cache epoch 1", "half cache epoch 2")):
            before = storage.bytes_read
            speeds.append(self.epoch(loader, epoch))
            self.downloaded[name].append((storage.bytes_read - before) / self.nbytes)
        loader.close()
        remove_cache(directory)
        return speeds[0], speeds[1]

    def local_cold(self) -> float:
        loader = self.loader(self.local, {})
        evict_cold(self.local)
        speed = self.epoch(loader, 0)
        loader.close()
        return speed


class BagEpochs(_Epochs):
    """BagLoader epochs over a bag split written to ``url``, and ``torch.load`` of a ``.pt`` object
    per slide; GB/s of the split's float16 feature bytes."""

    axis = -2

    def __init__(self, url: str, options: dict[str, Any], *, bags: int, median: int, dim: int, prefetch: int,
                 workdir: str | None = None) -> None:
        import torch

        import featurestore
        from featurestore.bench.bag_loader import make_cohort
        from featurestore.core.storage.obstore import ObjectStorage
        from featurestore.demo.synthetic_bags import bag_lengths

        super().__init__(options, prefetch, workdir, "s3bags")
        self.url, self.lengths = url, bag_lengths(median, count=bags)
        self.slides = ObjectStorage(f"{url}/pt_files", options)

        def pt_object(bag_id: str, features: np.ndarray, _coords: Any) -> None:
            buffer = io.BytesIO()
            torch.save(torch.from_numpy(features.astype(np.float32)), buffer)
            self.slides.write(f"{bag_id}.pt", buffer.getvalue())
        make_cohort(url, "bags", self.lengths, dim, "float16", names=("bench", "enc"), each=pt_object,
                    storage_options=options)
        split = featurestore.open_store(url, **options).open_bags("bench", "enc", "bags")
        self.rows = int(self.lengths.sum())
        self.nbytes = self.rows * dim * 2
        self.keys = split.features.chunk_keys() + split.coords.chunk_keys()
        self.storage = split.features.storage
        print(f"[s3] bags: {bags} slides, {self.rows} patches x {dim} float16 ({self.nbytes / 1e6:.0f} MB), "
              f"median {median} patches, {len(self.keys) // 2} chunks per array")

    def methods(self, epoch2: list[float]) -> dict[str, Any]:
        """Figure name -> a call that runs it once and returns GB/s; the cache's epoch 1 call
        appends its epoch 2 to ``epoch2``."""
        def cache_epoch1() -> float:
            first, second = self.cached(self.url)
            epoch2.append(second)
            return first

        return {BAGS_CEILING: self.ceiling, BAGS_USERS: self.users_way, BAGS_NO_CACHE: self.no_cache,
                BAGS_EPOCH1: cache_epoch1}

    def ceiling(self) -> float:
        return gbps(self.nbytes, harness.timed(lambda: fetch_whole(self.storage.obstore, self.keys)))

    def users_way(self) -> float:
        import torch

        order = np.random.default_rng(int(time.time())).permutation(len(self.lengths))

        def load(i: int) -> int:
            data = self.slides.read(f"slide-{i:05d}.pt")
            return int(torch.load(io.BytesIO(data), weights_only=True).shape[0])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            rows = sum(pool.map(load, order.tolist()))
        assert rows == self.rows
        return gbps(self.nbytes, time.perf_counter() - t0)

    def loader(self, source: str, options: dict[str, Any]) -> Any:
        from client import BagDataset, BagLoader

        ds = BagDataset(source, "bench", "enc", "bags", storage_options=options)
        return BagLoader(ds, batch_size=1, shuffle=True, seed=int(time.time()), device="cpu", dtype=None,
                         prefetch=self.prefetch)

    def no_cache(self) -> float:
        loader = self.loader(self.url, self.options)
        speed = self.epoch(loader, 0)
        loader.close()
        return speed


def evict_cold(path: str) -> None:
    """Evict ``path``'s files from the page cache; the process's chunk maps go first (a page
    still mapped is not dropped)."""
    harness.unmap()
    harness.evict(path)


def remove_cache(directory: str) -> None:
    """Remove a repeat's cache directory. Its files are still mapped by the process's chunk maps,
    which would keep their pages (dirty: never written back) after the unlink: repeat after repeat
    they pile up until the kernel's writeback starts, and later repeats pay for the earlier ones
    (measured: epoch 1 at 2.2-3.2 s of client CPU per GB from the sixth repeat on, 1 s before)."""
    harness.unmap()
    shutil.rmtree(directory, ignore_errors=True)


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


def cpu_medians(cpu: CpuTimes) -> dict[str, tuple[float, float | None]]:
    """Median (client, server) CPU milliseconds per GB of each figure."""
    out: dict[str, tuple[float, float | None]] = {}
    for name, values in cpu.items():
        servers = [s for _, s in values if s is not None]
        out[name] = (float(np.median([c for c, _ in values])) * 1e3,
                     float(np.median(servers)) * 1e3 if servers else None)
    return out
