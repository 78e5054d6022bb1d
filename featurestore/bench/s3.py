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
from featurestore.bench.figures import (
    S3_BARE_EPOCH,
    S3_BARE_SHORT,
    S3_FS_EPOCH,
    S3_FS_SHORT,
    S3_PAIRS,
)
from featurestore.bench.harness import Method, gbps, interleaved
from featurestore.errors import InvalidOption


def register(subparsers: Any) -> None:
    parser = harness.add_bench(subparsers, "s3", "S3 reads/writes (obstore) vs whole-object GETs, zarr-python, plain puts",
                               repeats=3, description=__doc__.split("\n\n")[0] if __doc__ else None,
                               workdir="SeaweedFS data, cache and local copy directory (default: a temp dir, removed)")
    parser.add_argument("--num-samples", type=int, default=1024)
    parser.add_argument("--shape", default="256x384", help="sample shape TxD (float16)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=4,
                        help="batches of the short epoch (a fresh array's first batches; default 4); the long "
                             "epoch reads every row once")
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

    # Only to check the data and name the chunks: every timed method opens its own array (client),
    # so none reads chunks another one (or the untimed round) has already checked.
    probe = featurestore.open_store(url, **fs_options).open("bench", "enc", "train")
    assert np.array_equal(probe.read_numpy(np.arange(0, n, max(1, n // 50))), values[:: max(1, n // 50)])
    storage = probe.storage  # its ObjectStorage: the ceiling's client
    chunk_keys = probe.chunk_keys()
    del probe
    rng = np.random.default_rng(1)

    def epoch(count: int | None = None) -> list[np.ndarray]:
        """The first ``count`` batches (default: all, every row once) of a new permutation."""
        order = rng.permutation(n)
        return [order[i : i + batch] for i in range(0, n if count is None else min(n, count * batch), batch)]

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

    def batches(opened: Callable[[], Any], read: Callable[[Any, np.ndarray], Any], count: int | None) -> Callable[[], float]:
        """GB/s of ``opened()`` then ``read(it, idx)`` over ``count`` batches of a new permutation
        (None: every row once): the open is timed, as a user's first epoch pays it."""
        def rate() -> float:
            which = epoch(count)
            moved = sum(len(idx) for idx in which) * sample_bytes

            def all_of_them() -> None:
                it = opened()
                for idx in which:
                    read(it, idx)
            return gbps(moved, harness.timed(all_of_them))
        return rate

    def fresh_array() -> Any:
        return featurestore.open_store(url, **fs_options).open("bench", "enc", "train")

    def read_numpy(it: Any, idx: np.ndarray) -> Any:
        return it.read_numpy(idx, out=out[: len(idx)])

    def loader_epoch() -> float:
        t0 = time.perf_counter()
        ds = FeatureDataset(url, "bench", "enc", "train", storage_options=fs_options)
        loader = FeatureLoader(ds, batch_size=batch, order="shuffle", device="cpu", dtype=None,
                               prefetch=args.prefetch, num_threads=args.loader_threads, seed=int(time.time()))
        seen = 0
        for features, _ in loader:
            seen += features.shape[0]
        assert seen == n
        return gbps(n * sample_bytes, time.perf_counter() - t0)

    def zarr_open() -> Any:
        return zarr.open_array(store=FsspecStore.from_url(url, storage_options=_s3fs_options(options), read_only=True),
                               path="bench/enc/train/features", mode="r")

    zarr_python = batches(zarr_open, lambda it, idx: it.get_orthogonal_selection((np.sort(idx),)), args.slow_batches)
    fsspec_path = batches(lambda: featurestore.FeatureStore(FsspecStorage(url, _s3fs_options(options)), mode="r").open(
        "bench", "enc", "train"), read_numpy, args.slow_batches)

    def bare_batch(client: Any, idx: np.ndarray) -> None:
        """The reference: the batch's rows, adjacent ones of a chunk merged into one range, one
        ``get_ranges`` per chunk, all chunks at once, copied into ``out``: no featurestore code."""
        sort = np.argsort(idx)
        rows = idx[sort]
        chunk_of, offset = np.divmod(rows, chunk_rows)
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

    def new_client() -> Any:  # a new S3Store per epoch: its connections start cold, as a new array's do
        return ObjectStorage(url, fs_options).obstore

    reads: dict[str, list[float]] = {S3_FS_EPOCH: [], S3_FS_SHORT: [], ep.CEILING: [], S3_BARE_EPOCH: [],
                                     S3_BARE_SHORT: [], "FeatureLoader epoch (uniform shuffle)": [],
                                     "zarr-python FsspecStore": [], "featurestore via fsspec (before)": []}
    methods = dict(zip(reads, (batches(fresh_array, read_numpy, None), batches(fresh_array, read_numpy, args.batches),
                               ceiling, batches(new_client, bare_batch, None),
                               batches(new_client, bare_batch, args.batches), loader_epoch, zarr_python, fsspec_path)))
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
    # One warm-up call each (the server's caches, imports; then forgotten). It warms no timed read:
    # each opens its own array and client, so its first-read checks and connections are timed.
    interleaved(timed, 1)
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
        "short_epoch_batches": args.batches,
        "epochs": "each read method opens its array (or client, or FeatureDataset) inside its timing: a first epoch",
        "max_concurrency": storage.settings.max_concurrency, "coalesce_gap": storage.gap, "gb_per_s": median,
        "runs": runs, "ratios": ratios,
        "downloaded_per_epoch_vs_split": downloaded, "cpu_ms_per_gb": ep.cpu_medians(cpu),
    }


def _s3fs_options(options: dict[str, Any]) -> dict[str, Any]:
    """The same server for s3fs (the baselines): featurestore's own keys removed."""
    from featurestore.core.storage.options import FEATURESTORE_KEYS

    return {k: v for k, v in options.items() if k not in FEATURESTORE_KEYS}
