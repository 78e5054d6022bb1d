"""``featurestore bench s3``: object-storage reads and writes against the server's own limit.

Every method returns GB/s and opens its own array, client, loader or cache inside its timing (a
first epoch); the ratios are of the medians of the runs in ``PAIRS``. Method: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import featurestore
from featurestore.bench import harness
from featurestore.bench.harness import Method, gbps, interleaved
from featurestore.core.buffers import aligned_empty
from featurestore.demo.synthetic_splits import write_split
from featurestore.errors import InvalidOption
from featurestore.testing import netlink as link
from featurestore.testing.cgroup import evict, unmap

CEILING, FS_EPOCH, BARE_EPOCH = "ceiling (whole chunks, 8 GETs)", "featurestore epoch (fresh array)", \
    "bare get_ranges epoch (new client)"
LOADER, ZARR, WRITE, PUT = "FeatureLoader epoch (uniform shuffle)", "zarr-python FsspecStore", "featurestore write", \
    "plain concurrent put"
EPOCH1, EPOCH2 = "cache epoch 1 (empty, full-size cache)", "cache epoch 2 (filled, cold files)"
HALF1, HALF2, LOCAL = "half cache epoch 1", "half cache epoch 2", "local cold loader"
BAGS_CEILING, BAGS_USERS = "bags ceiling (whole chunks, 8 GETs)", "bags, .pt per slide (4 in flight)"
BAGS_NO_CACHE, BAGS_EPOCH1 = "bag loader, no cache (ranged GETs)", "bag loader, cache epoch 1 (empty)"
BAGS_EPOCH2 = "bag loader, cache epoch 2 (cold files)"
BAG_FIGURES = (BAGS_CEILING, BAGS_USERS, BAGS_NO_CACHE, BAGS_EPOCH1, BAGS_EPOCH2)
# Each ratio: the median GB/s of the first run over the second's (figure spread: per repeat).
PAIRS = {"read_vs_ceiling": (FS_EPOCH, CEILING), "read_vs_zarr": (FS_EPOCH, ZARR),
         "loader_vs_ceiling": (LOADER, CEILING),
         "write_vs_put": (WRITE, PUT), "read_vs_bare_ranges": (FS_EPOCH, BARE_EPOCH),
         "cache_epoch1_vs_ceiling": (EPOCH1, CEILING), "cache_epoch2_vs_local_cold": (EPOCH2, LOCAL),
         "half_cache_vs_ceiling": (HALF2, CEILING), "half_cache_epoch1_vs_ceiling": (HALF1, CEILING),
         "bags_cache_epoch1_vs_ceiling": (BAGS_EPOCH1, BAGS_CEILING),
         "bags_cache_epoch1_vs_pt_per_slide": (BAGS_EPOCH1, BAGS_USERS),
         "bags_cache_epoch2_vs_pt_per_slide": (BAGS_EPOCH2, BAGS_USERS),
         "bags_no_cache_vs_pt_per_slide": (BAGS_NO_CACHE, BAGS_USERS)}


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "s3", "S3 reads/writes (obstore) vs whole-object GETs, zarr-python, plain puts", {
        "--num-samples": (1024, None), "--shape": ("256x384", "sample shape TxD (float16)"), "--batch-size": (64, None),
        "--slow-batches": (6, "batches per repeat for zarr-python (it is slow)"),
        "--chunk-mb": (8.0, "chunk size in MiB, as the writer's"),
        "--coalesce-gap": (int, "coalesce_gap storage option in bytes (default: FEATURESTORE_OBJECT_COALESCE_GAP "
                                "or 1 MiB)"),
        "--weed-args": ("", "extra SeaweedFS server flags, space separated, after featurestore's own; write "
                            "--weed-args=-filer.maxMB=4 (with '=') for SeaweedFS's stock 4 MiB internal chunks"),
        "--prefetch": (4, "FeatureLoader prefetch, batches in flight"),
        "--no-cache": (False, "skip the chunk cache figures"),
        "--bags": (48, "slides of the bag figures (0: skip them)", {"type": harness.number(int, inclusive=True)}),
        "--bag-median": (2000, "median patches per slide"),
        "--bag-dim": (1024, "feature width of the bag split"),
        "--link-gbit": (float, "put a link of this many Gbit/s between the bench and SeaweedFS (root: a private "
                               "network namespace, tc); default: bare loopback, where both share the cores"),
        "--endpoint": (str, "use this S3 endpoint instead of starting SeaweedFS"),
        "--bucket": ("featurestore-bench", None), "--key": (str, "--endpoint: the access key"),
        "--secret": (str, "--endpoint: the secret key")},
        repeats=3, description=__doc__,
        workdir="SeaweedFS data, cache and local copy directory (default: a temp dir, removed)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    link_gbit = getattr(args, "link_gbit", None)
    if link_gbit is not None:
        if args.endpoint:
            raise InvalidOption(f"--link-gbit {link_gbit:g} shapes the loopback of the SeaweedFS the bench starts; "
                                "leave it out with --endpoint (that server's own network is the link)")
        if not link_gbit > 0:
            raise InvalidOption(f"--link-gbit {link_gbit:g} must be a positive speed in Gbit/s, such as 10")
        if not link.isolated():
            return link.run_isolated(run, argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"}))
    if args.endpoint:
        options = {"endpoint_url": args.endpoint}
        if args.key:
            options.update(key=args.key, secret=args.secret or "")
        return _bench(args, options, "endpoint " + args.endpoint)
    from featurestore.testing.seaweedfs import READ_TUNED_ARGS, seaweed_server

    extra = tuple(args.weed_args.split())
    with seaweed_server(args.workdir, extra_args=extra) as server:
        server.create_bucket(args.bucket)
        where = "on loopback" if link_gbit is None else "over a " + link.shape(
            int(server.endpoint.rsplit(":", 1)[1]), link_gbit)
        return _bench(args, server.storage_options,
                      f"SeaweedFS {where} ({server.endpoint}, {' '.join((*READ_TUNED_ARGS, *extra))})")


def _bench(args: argparse.Namespace, options: dict[str, Any], server: str) -> dict[str, Any]:
    import obstore
    import zarr
    from zarr.storage import FsspecStore

    from client import FeatureDataset, FeatureLoader
    from featurestore.core.storage.io_loop import run as run_async
    from featurestore.core.storage.obstore import ObjectStorage
    from featurestore.core.storage.options import FEATURESTORE_KEYS
    from featurestore.format import layout

    shape = harness.parse_shapes(args.shape)[0]
    n, batch = args.num_samples, args.batch_size
    sample_bytes = int(np.prod(shape)) * 2
    url = f"s3://{args.bucket}/bench-{uuid.uuid4().hex[:8]}"
    fs_options = {**options, **({"coalesce_gap": args.coalesce_gap} if args.coalesce_gap is not None else {})}
    values = np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32).astype(np.float16)
    chunk_bytes = int(args.chunk_mb * (1 << 20))
    chunk_rows = layout.chunk_rows_for(sample_bytes, chunk_bytes, n)
    print(f"[s3] {server}; N={n} samples [{args.shape}] float16 ({values.nbytes / 1e6:.0f} MB), "
          f"{chunk_rows} rows ({chunk_rows * sample_bytes / 2**20:.1f} MiB) per chunk, batches of {batch}")
    store = featurestore.open_store(url, mode="a", **fs_options)
    plain = ObjectStorage(f"{url}/plain", fs_options)

    def write_featurestore() -> None:
        writer = store.create_split("bench", "enc", "train", num_samples=n, sample_shape=shape, dtype="float16",
                                    chunk_bytes=chunk_bytes, overwrite=True)
        for start in range(0, n, batch):
            writer.write(start, values[start : start + batch])
        writer.commit()

    def write_plain() -> None:
        _in_flight(lambda i: obstore.put_async(plain.obstore, f"c/{i}", memoryview(
            np.ascontiguousarray(values[i : i + chunk_rows])).cast("B")), range(0, n, chunk_rows))

    writes = interleaved([Method(PUT, harness.rate(write_plain, values.nbytes), own=True),
                          Method(WRITE, harness.rate(write_featurestore, values.nbytes), own=True)], args.repeats)
    # Only to check the data and name the chunks: every timed method opens its own array (client).
    probe = featurestore.open_store(url, **fs_options).open("bench", "enc", "train")
    assert np.array_equal(probe.read_numpy(np.arange(0, n, max(1, n // 50))), values[:: max(1, n // 50)])
    storage, chunk_keys = probe.storage, probe.chunk_keys()
    del probe
    rng = np.random.default_rng(1)
    out = aligned_empty((batch, *shape), np.float16)

    def batches(opened: Any, read: Any, count: int | None = None) -> Any:
        """GB/s of ``opened()`` then ``read(it, idx)`` over ``count`` batches of a new permutation
        (None: every row once): the open is timed, as a user's first epoch pays it."""
        def epoch() -> float:
            order = rng.permutation(n)[: n if count is None else count * batch]
            which = [order[i : i + batch] for i in range(0, len(order), batch)]
            seconds = harness.timed(lambda: [read(it, idx) for it in [opened()] for idx in which])
            return gbps(len(order) * sample_bytes, seconds)
        return epoch

    def loader(source: str, opts: dict[str, Any]) -> Any:
        ds = FeatureDataset(source, "bench", "enc", "train", storage_options=opts)
        return FeatureLoader(ds, batch_size=batch, order="shuffle", device="cpu", dtype=None, prefetch=args.prefetch,
                             seed=int(time.time()))

    def loader_epoch() -> None:
        assert sum(features.shape[0] for features, _ in loader(url, fs_options)) == n

    def zarr_open() -> Any:  # the same server for s3fs: featurestore's own keys removed
        s3fs = {k: v for k, v in options.items() if k not in FEATURESTORE_KEYS}
        return zarr.open_array(store=FsspecStore.from_url(url, storage_options=s3fs, read_only=True),
                               path="bench/enc/train/features", mode="r")

    def bare_batch(client: Any, idx: np.ndarray) -> None:
        """The reference: the batch's rows, adjacent ones of a chunk merged into one range, one
        ``get_ranges`` per chunk, all chunks at once, copied into ``out``: no featurestore code."""
        sort = np.argsort(idx)
        chunk_of, offset = np.divmod(idx[sort], chunk_rows)
        flat = out.reshape(batch, -1).view(np.uint8)
        plan = []
        for c in np.unique(chunk_of):
            at = np.flatnonzero(chunk_of == c)
            plan.append((int(c), np.split(at, np.flatnonzero(np.diff(offset[at]) != 1) + 1)))

        async def gather() -> Any:  # obstore's futures need the running loop: made inside it
            return await asyncio.gather(*(obstore.get_ranges_async(
                client, chunk_keys[c], starts=[int(offset[r[0]]) * sample_bytes for r in runs],
                ends=[int(offset[r[-1]] + 1) * sample_bytes for r in runs]) for c, runs in plan))

        for (_, runs), buffers in zip(plan, run_async(gather())):
            for r, buf in zip(runs, buffers):
                flat[sort[r]] = np.frombuffer(buf, np.uint8).reshape(len(r), -1)

    methods: dict[str, Any] = {
        FS_EPOCH: batches(lambda: featurestore.open_store(url, **fs_options).open("bench", "enc", "train"),
                          lambda it, idx: it.read_numpy(idx, out=out[: len(idx)])),
        CEILING: lambda: _ceiling(storage.obstore, chunk_keys),
        BARE_EPOCH: batches(lambda: ObjectStorage(url, fs_options).obstore, bare_batch),
        LOADER: harness.rate(loader_epoch, n * sample_bytes),
        ZARR: batches(zarr_open, lambda it, idx: it.get_orthogonal_selection((np.sort(idx),)), args.slow_batches)}
    extra: dict[str, list[float]] = {}  # GB/s of a cache's epoch 2, and the bytes half a cache downloads
    with tempfile.TemporaryDirectory(prefix="featurestore-s3-", dir=args.workdir) as work:
        if not args.no_cache:
            cache = Epochs(loader, fs_options, work, extra, n, values.nbytes)
            local = f"{work}/local"
            write_split(local, n, shape, rows=batch, chunk_bytes=chunk_bytes)
            methods.update({EPOCH1: cache.cached(url, EPOCH2), HALF1: cache.cached(url, HALF2, half=True),
                            LOCAL: cache.first(local, {}, cold=True)})
        if args.bags:
            methods.update(bag_methods(url, fs_options, args, work, extra))
        timed = [Method(name, fn, own=True) for name, fn in methods.items()]  # each returns its GB/s
        # One warm-up call each (the server's caches, imports; then forgotten). It warms no timed read:
        # each opens its own array and client, so its first-read checks and connections are timed.
        interleaved(timed, 1)
        extra.clear()
        runs = {**interleaved(timed, args.repeats), **extra, **writes}
    median = {name: float(np.median(v)) for name, v in runs.items() if not name.startswith("downloaded")}
    with contextlib.suppress(Exception):  # a scratch prefix; the server's temp dir goes anyway
        store.storage.delete_tree("")
    return {
        "benchmark": "s3", "server": server, "num_samples": n, "sample_shape": list(shape), "batch_size": batch,
        "chunk_rows": chunk_rows, "cache": "warm (server's volume files just written, page-cached)",
        "epochs": "each read method opens its array (or client, or FeatureDataset) inside its timing: a first epoch",
        "max_concurrency": storage.settings.max_concurrency, "coalesce_gap": storage.gap, "gb_per_s": median,
        "runs": runs, "pairs": {k: list(v) for k, v in PAIRS.items() if v[0] in median and v[1] in median},
        "ratios": {k: median[a] / median[b] for k, (a, b) in PAIRS.items() if a in median and b in median},
        "downloaded_per_epoch_vs_split": {k.split(": ")[1]: float(np.median(v)) for k, v in runs.items()
                                          if k.startswith("downloaded")}}


def _in_flight(call: Callable[[Any], Awaitable[Any]], items: Iterable[Any], limit: int = 8) -> list[Any]:
    """``await call(item)`` for every item, ``limit`` at a time, on featurestore's I/O loop."""
    from featurestore.core.storage.io_loop import run as run_async

    async def gather() -> list[Any]:
        semaphore = asyncio.Semaphore(limit)

        async def one(item: Any) -> Any:
            async with semaphore:
                return await call(item)
        return await asyncio.gather(*(one(item) for item in items))
    return run_async(gather())  # type: ignore[no-any-return]


def _ceiling(store: Any, keys: list[str], nbytes: float | None = None) -> float:
    """GB/s of GETting every object of ``keys`` whole, 8 at a time (obstore ``store``): the server's
    own limit for these bytes; ``nbytes``: rate these bytes instead of the bytes read."""
    import obstore

    async def get(key: str) -> int:
        return len(await (await obstore.get_async(store, key)).bytes_async())
    start = time.perf_counter()
    got = sum(_in_flight(get, keys))
    return gbps(got if nbytes is None else nbytes, time.perf_counter() - start)


class Epochs:
    """Timed epochs of the loaders ``loader(source, storage_options)`` makes over one split (``rows``
    rows, ``nbytes`` stored bytes), each checked complete."""

    def __init__(self, loader: Callable[[str, dict[str, Any]], Any], options: dict[str, Any], work: str,
                 extra: dict[str, list[float]], rows: int, nbytes: int, axis: int = 0) -> None:
        self.loader, self.options, self.work, self.extra = loader, options, work, extra
        self.rows, self.nbytes, self.axis = rows, nbytes, axis

    def epoch(self, loader: Any, epoch: int) -> float:
        loader.set_epoch(epoch)
        seen: list[int] = []
        elapsed = harness.timed(lambda: seen.extend(int(batch[0].shape[self.axis]) for batch in loader))
        assert sum(seen) == self.rows, (sum(seen), self.rows)
        return gbps(self.nbytes, elapsed)

    def cached(self, source: str, second: str, half: bool = False) -> Any:
        """GB/s of epoch 1 through a new cache as large as the split, epoch 2 (its files evicted) kept
        as ``second``; with ``half``, a cache of half the split, not evicted, the bytes each downloads kept."""
        def first() -> float:
            directory = tempfile.mkdtemp(prefix="cache-", dir=self.work)
            cache = {"cache_dir": directory, **({"cache_bytes": self.nbytes // 2} if half else {})}
            loader = self.loader(source, {**self.options, **cache})
            storage, speeds = loader.ds.array.storage if half else None, []  # half: a FeatureLoader's
            for epoch, name in enumerate((HALF1, HALF2)):
                before = storage.bytes_read if half else 0
                speeds.append(self.epoch(loader, epoch))
                if half:
                    self.extra.setdefault(f"downloaded: {name}", []).append((storage.bytes_read - before) / self.nbytes)
                elif epoch == 0:  # epoch 2 reads the cache files cold; a page still mapped is not dropped
                    unmap()
                    evict(directory)
            loader.close()
            # Its files are still mapped by the chunk maps, whose pages (dirty: never written back)
            # would pile up repeat after repeat until writeback starts and slows the later repeats.
            unmap()
            shutil.rmtree(directory, ignore_errors=True)
            self.extra.setdefault(second, []).append(speeds[1])
            return speeds[0]
        return first

    def first(self, source: str, options: dict[str, Any], cold: bool = False) -> Any:
        """GB/s of a new loader's first epoch; ``cold``: ``source`` (local) evicted first."""
        def epoch() -> float:
            with self.loader(source, options) as loader:
                if cold:
                    unmap()
                    evict(source)
                return self.epoch(loader, 0)
        return epoch


def bag_methods(url: str, options: dict[str, Any], args: argparse.Namespace, work: str,
                extra: dict[str, list[float]]) -> dict[str, Any]:
    """BagLoader epochs over a bag split written to ``url`` without and through a cache against
    ``torch.load`` of one ``.pt`` object per slide (the users' way) and the chunks' ceiling; GB/s of
    the split's float16 feature bytes."""
    import torch

    from client import BagDataset, BagLoader
    from featurestore.core.storage.obstore import ObjectStorage
    from featurestore.demo.synthetic_bags import bag_lengths, write_io_cohort

    lengths = bag_lengths(args.bag_median, count=args.bags)
    slides = ObjectStorage(f"{url}/pt_files", options)

    def pt_object(bag_id: str, features: np.ndarray, _coords: Any) -> None:
        buffer = io.BytesIO()
        torch.save(torch.from_numpy(features.astype(np.float32)), buffer)
        slides.write(f"{bag_id}.pt", buffer.getvalue())
    write_io_cohort(url, ("bench", "enc", "bags"), lengths, args.bag_dim, "float16", each=pt_object,
                    storage_options=options)
    split = featurestore.open_store(url, **options).open_bags("bench", "enc", "bags")
    rows = int(lengths.sum())
    epochs = Epochs(lambda source, opts: BagLoader(BagDataset(source, "bench", "enc", "bags", storage_options=opts),
                                                   batch_size=1, shuffle=True, seed=int(time.time()), device="cpu",
                                                   dtype=None, prefetch=args.prefetch),
                    options, work, extra, rows, rows * args.bag_dim * 2, axis=-2)
    keys, storage = split.features.chunk_keys() + split.coords.chunk_keys(), split.features.storage
    print(f"[s3] bags: {args.bags} slides, {rows} patches x {args.bag_dim} float16 ({epochs.nbytes / 1e6:.0f} MB), "
          f"median {args.bag_median} patches, {len(keys) // 2} chunks per array")

    def users_way() -> None:
        def load(i: int) -> int:
            data = slides.read(f"slide-{i:05d}.pt")
            return int(torch.load(io.BytesIO(data), weights_only=True).shape[0])
        with ThreadPoolExecutor(4) as pool:
            order = np.random.default_rng(int(time.time())).permutation(len(lengths)).tolist()
            assert sum(pool.map(load, order)) == rows

    return {BAGS_CEILING: lambda: _ceiling(storage.obstore, keys, epochs.nbytes),
            BAGS_USERS: harness.rate(users_way, epochs.nbytes), BAGS_NO_CACHE: epochs.first(url, options),
            BAGS_EPOCH1: epochs.cached(url, BAGS_EPOCH2)}
