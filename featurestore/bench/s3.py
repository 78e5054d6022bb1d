"""``featurestore bench s3``: object-storage reads and writes against the server's own limit.

Starts SeaweedFS on loopback (or uses ``--endpoint``); the loader epochs through the chunk cache and
the bags' are :mod:`featurestore.bench.s3_epochs`, ``--link-gbit`` :mod:`featurestore.bench.link`.
What it measures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from featurestore.bench import harness, link
from featurestore.bench import s3_epochs as ep
from featurestore.bench.figures import S3_PAIRS
from featurestore.bench.harness import Method, gbps, interleaved
from featurestore.errors import InvalidOption


def register(subparsers: Any) -> None:
    parser = harness.add_bench(subparsers, "s3", "S3 reads/writes (obstore) vs whole-object GETs, zarr-python, plain puts",
                               repeats=3, description=__doc__.split("\n\n")[0] if __doc__ else None,
                               workdir="SeaweedFS data, cache and local copy directory (default: a temp dir, removed)")
    parser.add_argument("--num-samples", type=int, default=1024)
    parser.add_argument("--shape", default="256x384", help="sample shape TxD (float16)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=48, help="shuffled batches per repeat (featurestore)")
    parser.add_argument("--slow-batches", type=int, default=6,
                        help="batches per repeat for zarr-python and the fsspec path (they are slow)")
    parser.add_argument("--chunk-mb", type=float, default=8.0, help="chunk size in MiB (default: the writer's 8)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="max_concurrency storage option (default: FEATURESTORE_OBJECT_CONCURRENCY or 64)")
    parser.add_argument("--coalesce-gap", type=int, default=None,
                        help="coalesce_gap storage option in bytes (default: FEATURESTORE_OBJECT_COALESCE_GAP or 1 MiB)")
    parser.add_argument("--weed-args", default="",
                        help="extra SeaweedFS server flags, space separated, after featurestore's own; write "
                             "--weed-args=-filer.maxMB=4 (with '=') for SeaweedFS's stock 4 MiB internal chunks")
    parser.add_argument("--loader-threads", type=int, default=None, help="FeatureLoader num_threads (default: its own)")
    parser.add_argument("--prefetch", type=int, default=4, help="FeatureLoader prefetch (batches in flight)")
    parser.add_argument("--no-cache", action="store_true", help="skip the chunk cache figures")
    parser.add_argument("--bags", type=int, default=48, help="slides of the bag figures (0: skip them)")
    parser.add_argument("--bag-median", type=int, default=2000, help="median patches per slide")
    parser.add_argument("--bag-dim", type=int, default=1024, help="feature width of the bag split")
    parser.add_argument("--link-gbit", type=float, default=None,
                        help="put a link of this many Gbit/s between the bench and SeaweedFS (root: a private network "
                             "namespace, tc); default: bare loopback, where both share the cores")
    parser.add_argument("--endpoint", default=None, help="use this S3 endpoint instead of starting SeaweedFS")
    parser.add_argument("--bucket", default="featurestore-bench")
    parser.add_argument("--key", default=None)
    parser.add_argument("--secret", default=None)


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
        return _bench(args, options, server="endpoint " + args.endpoint, server_pid=None)
    from featurestore.testing.seaweedfs import READ_TUNED_ARGS, seaweed_server

    extra = tuple(args.weed_args.split())
    with seaweed_server(args.workdir, extra_args=extra) as server:
        server.create_bucket(args.bucket)
        flags = " ".join((*READ_TUNED_ARGS, *extra))
        where = "on loopback"
        if link_gbit is not None:
            where = "over a " + link.shape(int(server.endpoint.rsplit(":", 1)[1]), link_gbit)
        return _bench(args, server.storage_options, server=f"SeaweedFS {where} ({server.endpoint}, {flags})",
                      server_pid=server.process.pid)


def _bench(args: argparse.Namespace, options: dict[str, Any], server: str, server_pid: int | None) -> dict[str, Any]:
    import obstore
    import torch
    import zarr
    from zarr.storage import FsspecStore

    import featurestore
    from client import FeatureDataset, FeatureLoader
    from featurestore.core.reader import aligned_empty
    from featurestore.core.storage import FsspecStorage
    from featurestore.core.storage.io_loop import run as run_async
    from featurestore.core.storage.obstore import ObjectStorage
    from featurestore.format import layout

    shape = tuple(int(v) for v in args.shape.lower().split("x"))
    n, batch = args.num_samples, args.batch_size
    sample_bytes = int(np.prod(shape)) * 2
    url = f"s3://{args.bucket}/bench-{uuid.uuid4().hex[:8]}"
    fs_options = dict(options)
    if args.concurrency:
        fs_options["max_concurrency"] = args.concurrency
    if args.coalesce_gap is not None:
        fs_options["coalesce_gap"] = args.coalesce_gap
    values = np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32).astype(np.float16)
    nbytes = values.nbytes
    chunk_bytes = int(args.chunk_mb * (1 << 20))
    chunk_rows = layout.chunk_rows_for(sample_bytes, chunk_bytes, n)
    print(f"[s3] {server}; N={n} samples [{args.shape}] float16 ({nbytes / 1e6:.0f} MB), "
          f"{chunk_rows} rows ({chunk_rows * sample_bytes / 2**20:.1f} MiB) per chunk, batches of {batch}")

    store = featurestore.open_store(url, mode="a", **fs_options)
    plain = ObjectStorage(f"{url}/plain", fs_options)
    chunks = [values[i : i + chunk_rows] for i in range(0, n, chunk_rows)]

    def write_featurestore() -> float:
        t0 = time.perf_counter()
        writer = store.create_split("bench", "enc", "train", num_samples=n, sample_shape=shape, dtype="float16",
                                    chunk_bytes=chunk_bytes, overwrite=True)
        for start in range(0, n, batch):
            writer.write(start, values[start : start + batch])
        writer.commit()
        return gbps(nbytes, time.perf_counter() - t0)

    def write_plain() -> float:
        async def put_all() -> None:
            semaphore = asyncio.Semaphore(8)

            async def put(i: int, rows: np.ndarray) -> None:
                async with semaphore:
                    await obstore.put_async(plain.obstore, f"c/{i}", memoryview(np.ascontiguousarray(rows)).cast("B"))

            await asyncio.gather(*(put(i, rows) for i, rows in enumerate(chunks)))

        t0 = time.perf_counter()
        run_async(put_all())
        return gbps(nbytes, time.perf_counter() - t0)

    writes = interleaved([Method("plain concurrent put", write_plain, own=True),
                          Method("featurestore write", write_featurestore, own=True)],
                         args.repeats)

    array = featurestore.open_store(url, **fs_options).open("bench", "enc", "train")
    assert np.array_equal(array.read_numpy(np.arange(0, n, max(1, n // 50))), values[:: max(1, n // 50)])
    storage = array.storage  # the ObjectStorage the reader uses
    chunk_keys = array.chunk_keys()
    rng = np.random.default_rng(1)
    orders = [rng.choice(n, size=batch, replace=False) for _ in range(args.batches)]
    slow_orders = orders[: args.slow_batches]
    out = aligned_empty((batch, *shape), np.float16)

    clock = ep.CpuClock(server_pid)
    cpu: ep.CpuTimes = {}  # figure -> (client, server) CPU seconds per GB

    def with_cpu(name: str, fetch: Callable[[], int]) -> float:
        """GB/s of ``fetch()`` (which returns the bytes it moved), its CPU per GB recorded as ``name``."""
        before, t0 = clock.read(), time.perf_counter()
        got = fetch()
        seconds = time.perf_counter() - t0
        clock.record(cpu, name, before, got)
        return gbps(got, seconds)

    def ceiling() -> float:
        return with_cpu(ep.CEILING, lambda: ep.fetch_whole(storage.obstore, chunk_keys))

    def batches(read: Callable[[np.ndarray], Any], which: list[np.ndarray]) -> Callable[[], float]:
        """GB/s of ``read(idx)`` over the shuffled batches ``which``."""
        return lambda: gbps(len(which) * batch * sample_bytes, harness.timed(lambda: [read(idx) for idx in which]))

    shuffled_reads = batches(lambda idx: array.read_numpy(idx, out=out), orders)

    ds = FeatureDataset(url, "bench", "enc", "train", storage_options=fs_options)

    def loader_epoch() -> float:
        loader = FeatureLoader(ds, batch_size=batch, order="shuffle", device="cpu", dtype=None,
                               prefetch=args.prefetch, num_threads=args.loader_threads, seed=int(time.time()))
        t0, seen = time.perf_counter(), 0
        for features, _ in loader:
            seen += features.shape[0]
        assert seen == n
        return gbps(n * sample_bytes, time.perf_counter() - t0)

    zarr_array = zarr.open_array(store=FsspecStore.from_url(url, storage_options=_s3fs_options(options), read_only=True),
                                 path="bench/enc/train/features", mode="r")

    zarr_python = batches(lambda idx: zarr_array.get_orthogonal_selection((np.sort(idx),)), slow_orders)
    fsspec_array = featurestore.FeatureStore(FsspecStorage(url, _s3fs_options(options)), mode="r").open(
        "bench", "enc", "train")
    fsspec_path = batches(lambda idx: fsspec_array.read_numpy(idx, out=out), slow_orders)

    async def batch_ranges(idx: np.ndarray) -> None:  # one ranged GET per row, all of a batch at once
        semaphore = asyncio.Semaphore(storage.settings.max_concurrency)

        async def get(row: int) -> None:
            chunk, offset = divmod(int(row), chunk_rows)
            async with semaphore:
                await obstore.get_range_async(storage.obstore, chunk_keys[chunk], start=offset * sample_bytes,
                                              end=(offset + 1) * sample_bytes)

        await asyncio.gather(*(get(row) for row in idx))

    bare_ranges = batches(lambda idx: run_async(batch_ranges(idx)), orders)

    reads: dict[str, list[float]] = {"featurestore shuffled batches": [], ep.CEILING: [],
                                     "bare ranged GETs (one per row)": [],
                                     "FeatureLoader epoch (uniform shuffle)": [], "zarr-python FsspecStore": [],
                                     "featurestore via fsspec (before)": []}
    methods = dict(zip(reads, (shuffled_reads, ceiling, bare_ranges, loader_epoch, zarr_python, fsspec_path)))
    closing: list[Any] = []
    if not args.no_cache:
        cached = ep.CachedEpochs(url, fs_options, values, chunk_bytes, batch, args.prefetch, args.loader_threads,
                                 args.workdir, clock=clock, cpu=cpu)
        closing.append(cached)

        def two_epochs(fn: Callable[[], tuple[float, float]], second: str) -> Callable[[], float]:
            def first() -> float:
                one, two = fn()
                reads[second].append(two)
                return one
            return first

        def fill_ceiling() -> float:
            return with_cpu(ep.FILL, lambda: ep.fill_whole(storage.obstore, chunk_keys, os.path.join(cached.work, "fill")))

        methods.update({ep.EPOCH1: two_epochs(cached.full_cache, "cache epoch 2 (filled, cold files)"),
                        "half cache epoch 1": two_epochs(cached.half_cache, "half cache epoch 2"),
                        "local cold loader": cached.local_cold, ep.FILL: fill_ceiling})
        reads.update({name: [] for name in (*methods, "cache epoch 2 (filled, cold files)", "half cache epoch 2")
                      if name not in reads})
    if args.bags:
        bag_epochs = ep.BagEpochs(url, fs_options, bags=args.bags, median=args.bag_median, dim=args.bag_dim,
                                  prefetch=args.prefetch, workdir=args.workdir)
        closing.append(bag_epochs)
        bag_epoch2: list[float] = []
        methods.update(bag_epochs.methods(bag_epoch2))
        reads.update({name: [] for name in methods if name not in reads})
        reads[ep.BAGS_EPOCH2] = bag_epoch2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    timed = [Method(name, fn, own=True) for name, fn in methods.items()]  # each returns its GB/s
    interleaved(timed, 1)  # one warm-up call each: connections, first-touch maps, imports; then forgotten
    for values_list in [*reads.values(), *(v for c in closing for v in getattr(c, "downloaded", {}).values())]:
        values_list.clear()
    cpu.clear()
    reads.update(interleaved(timed, args.repeats))
    for part in closing:
        part.close()

    runs = {**reads, **writes}
    median = {name: float(np.median(v)) for name, v in runs.items()}
    ratios = {name: median[a] / median[b] for name, (a, b) in S3_PAIRS.items() if a in median and b in median}
    if len(reads.get(ep.EPOCH1, [])) == len(reads[ep.CEILING]) > 0:
        ratios["cache_epoch1_vs_ceiling_paired"] = float(np.median(np.divide(reads[ep.EPOCH1], reads[ep.CEILING])))
    downloaded = {name: float(np.median(v)) for c in closing if hasattr(c, "downloaded") for name, v in c.downloaded.items()}
    try:
        store.storage.delete_tree("")
    except Exception:  # noqa: BLE001 - a scratch prefix; the server's temp dir goes anyway
        pass
    return {
        "benchmark": "s3", "server": server, "num_samples": n, "sample_shape": list(shape), "batch_size": batch,
        "chunk_rows": chunk_rows, "cache": "warm (server's volume files just written, page-cached)",
        "max_concurrency": storage.settings.max_concurrency, "coalesce_gap": storage.gap, "gb_per_s": median,
        "runs": runs, "ratios": ratios,
        "downloaded_per_epoch_vs_split": downloaded, "cpu_ms_per_gb": ep.cpu_medians(cpu),
    }


def _s3fs_options(options: dict[str, Any]) -> dict[str, Any]:
    """The same server for s3fs (the baselines): featurestore's own keys removed."""
    from featurestore.core.storage.options import FEATURESTORE_KEYS

    return {k: v for k, v in options.items() if k not in FEATURESTORE_KEYS}
