"""S3 shuffled reads without a cache vs bare ranged GETs of the same rows, as a user's first epoch sees them.

Starts SeaweedFS on loopback (featurestore.testing.seaweedfs), writes one ``[256, 384]`` float16
split, then times, interleaved, round after round:

* ``bare get_ranges``: obstore ``get_ranges_async`` of the same rows (adjacent rows of a chunk
  merged into one range, as the reader does), one call per chunk, all of a batch at once, bytes
  copied into one output array; a new S3Store per epoch (its connections start cold too);
* ``read_numpy fresh``: ``open_store`` + ``open`` + ``read_numpy`` per batch: everything a new
  process pays (client, first-read crc32c checks, the generation checks);
* ``fresh, verify off``: the same with ``verify_reads="off"`` (no first-read crc32c check: the
  cause of the gap, shown);
* ``read_numpy warm``: the same array read again (its chunks already checked);
* ``loader fresh``: a new ``FeatureDataset`` + ``FeatureLoader(order="shuffle")`` epoch.

Each over a short epoch (``--short`` batches) and a long one (every row once). The profile of
each method is what it moved: bytes fetched per byte delivered, and the document (``zarr.json``)
GETs per batch. Prints medians and the spread (min-max) of ``--repeats`` rounds; this machine is
shared, so compare ratios of one run only.

    python scripts/s3_vs_ranged.py [--num-samples 1024] [--repeats 5] [--short 4]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--short", type=int, default=4, help="batches of the short epoch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated epochs to run (short,long)")
    args = parser.parse_args()

    import obstore

    import featurestore
    from client import FeatureDataset, FeatureLoader
    from featurestore.core.reader import aligned_empty
    from featurestore.core.storage.io_loop import run
    from featurestore.format import layout
    from featurestore.testing.seaweedfs import seaweed_server

    shape, n, batch = (256, 384), args.num_samples, args.batch_size
    row_bytes = shape[0] * shape[1] * 2
    values = np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32).astype(np.float16)
    with seaweed_server() as server:
        server.create_bucket("ranged")
        url = f"s3://ranged/s-{uuid.uuid4().hex[:6]}"
        options = server.storage_options
        store = featurestore.open_store(url, mode="a", **options)
        writer = store.create_split("d", "e", "train", num_samples=n, sample_shape=shape, dtype="float16")
        for start in range(0, n, 256):
            writer.write(start, values[start : start + 256])
        writer.commit()
        probe = featurestore.open_store(url, **options).open("d", "e", "train")
        chunk_rows, key = probe.chunk_rows, probe._key
        keys = [layout.chunk_key(key, c, probe._ndim) for c in range(probe.num_chunks)]
        prefix = url.split("/", 3)[3]
        print(f"[s3_vs_ranged] {n} rows of {shape} float16 ({values.nbytes / 1e6:.0f} MB), {chunk_rows} rows "
              f"per chunk, batches of {batch}, SeaweedFS on loopback ({server.endpoint})")

        def batches(count: int, seed: int) -> list[np.ndarray]:
            order = np.random.default_rng(seed).permutation(n)
            return [order[i * batch : (i + 1) * batch] for i in range(count)]

        stats: dict[str, dict[str, list[float]]] = {}

        def note(name: str, delivered: int, fetched: int, docs: int, count: int) -> None:
            s = stats.setdefault(name, {"fetched/delivered": [], "doc GETs/batch": []})
            s["fetched/delivered"].append(fetched / delivered)
            s["doc GETs/batch"].append(docs / count)

        def bare(order: list[np.ndarray], name: str) -> float:
            client = server.store("ranged", prefix=prefix)
            out = aligned_empty((batch, *shape), np.float16)
            flat = out.reshape(batch, -1).view(np.uint8)
            fetched = 0

            async def one(idx: np.ndarray) -> int:
                sort = np.argsort(idx)
                rows = idx[sort]
                chunk_of, offset = np.divmod(rows, chunk_rows)
                calls = []
                for c in np.unique(chunk_of):
                    at = np.flatnonzero(chunk_of == c)
                    runs = np.split(at, np.flatnonzero(np.diff(offset[at]) != 1) + 1)
                    starts = [int(offset[r[0]]) * row_bytes for r in runs]
                    ends = [int(offset[r[-1]] + 1) * row_bytes for r in runs]
                    calls.append((runs, obstore.get_ranges_async(client, keys[c], starts=starts, ends=ends)))
                got = await asyncio.gather(*(call for _, call in calls))
                total = 0
                for (runs, _), buffers in zip(calls, got):
                    for r, buf in zip(runs, buffers):
                        total += len(buf)
                        flat[sort[r]] = np.frombuffer(buf, np.uint8).reshape(len(r), -1)
                return total

            t0 = time.perf_counter()
            for idx in order:
                fetched += run(one(idx))
            seconds = time.perf_counter() - t0
            note(name, len(order) * batch * row_bytes, fetched, 0, len(order))
            return len(order) * batch * row_bytes / seconds / 1e9

        def counted(storage: Any) -> list[int]:
            docs = [0]
            read = storage.read

            def reading(k: str) -> bytes:
                if k.endswith("zarr.json"):
                    docs[0] += 1
                return read(k)

            storage.read = reading
            return docs

        def fs(order: list[np.ndarray], name: str, array: Any = None, verify: str = "auto") -> float:
            t0 = time.perf_counter()
            if array is None:
                array = featurestore.open_store(url, **options).open("d", "e", "train")
                array.verify_reads = verify
            storage = array.storage
            before, docs = storage.bytes_read, counted(storage)
            out = aligned_empty((batch, *shape), np.float16)
            for idx in order:
                array.read_numpy(idx, out=out)
            seconds = time.perf_counter() - t0
            del storage.read
            note(name, len(order) * batch * row_bytes, storage.bytes_read - before, docs[0], len(order))
            return len(order) * batch * row_bytes / seconds / 1e9

        def loader(count: int, name: str) -> float:
            t0 = time.perf_counter()
            ds = FeatureDataset(url, "d", "e", "train", storage_options=options)
            storage = ds.array.storage if hasattr(ds, "array") else None
            before = storage.bytes_read if storage is not None else 0
            docs = counted(storage) if storage is not None else [0]
            got = 0
            for features, _ in FeatureLoader(ds, batch_size=batch, order="shuffle", device="cpu", dtype=None,
                                             seed=int(time.time())):
                got += features.shape[0]
                if got >= count * batch:
                    break
            seconds = time.perf_counter() - t0
            if storage is not None:
                del storage.read
                note(name, got * row_bytes, storage.bytes_read - before, docs[0], count)
            return got * row_bytes / seconds / 1e9

        warm_array = featurestore.open_store(url, **options).open("d", "e", "train")
        warm_array.read_numpy(np.arange(n))  # every chunk checked once: the warm figure's array
        epochs = {"short": args.short, "long": n // batch}
        wanted = [e for e in (args.only.split(",") if args.only else epochs)]
        methods: dict[str, Callable[[int], float]] = {}
        for epoch in wanted:
            count = epochs[epoch]
            methods[f"{epoch}: bare get_ranges"] = lambda r, c=count, e=epoch: bare(batches(c, r), f"{e}: bare get_ranges")
            methods[f"{epoch}: read_numpy fresh"] = lambda r, c=count, e=epoch: fs(batches(c, r), f"{e}: read_numpy fresh")
            methods[f"{epoch}: fresh, verify off"] = (
                lambda r, c=count, e=epoch: fs(batches(c, r), f"{e}: fresh, verify off", verify="off"))
            methods[f"{epoch}: read_numpy warm"] = (
                lambda r, c=count, e=epoch: fs(batches(c, r), f"{e}: read_numpy warm", warm_array))
            methods[f"{epoch}: loader fresh"] = lambda r, c=count, e=epoch: loader(c, f"{e}: loader fresh")
        for name, method in methods.items():  # one untimed round: the server's caches, imports
            method(99)
        doc = f"d/e/train/{layout.ZARR_JSON}"
        doc_ms = []
        for _ in range(20):  # what the generation check adds to a read call: one small GET, after
            t0 = time.perf_counter()
            warm_array.storage.read(doc)
            doc_ms.append(1e3 * (time.perf_counter() - t0))
        stats.clear()
        times: dict[str, list[float]] = {name: [] for name in methods}
        for r in range(args.repeats):
            names = list(methods) if r % 2 == 0 else list(reversed(methods))  # alternate the order
            for name in names:
                times[name].append(methods[name](r))
        print(f"document GET (the generation check): {np.median(doc_ms):.2f} ms median, "
              f"{min(doc_ms):.2f}-{max(doc_ms):.2f}")
        print(f"{'method':<28} {'GB/s median':>11} {'min-max':>13} {'vs bare':>8} {'fetched/deliv':>13} "
              f"{'docGET/batch':>12}")
        for name, values_ in times.items():
            epoch = name.split(":")[0]
            base = float(np.median(times[f"{epoch}: bare get_ranges"]))
            med = float(np.median(values_))
            s = stats.get(name, {})
            fetched = float(np.median(s["fetched/delivered"])) if s.get("fetched/delivered") else float("nan")
            docs_ = float(np.median(s["doc GETs/batch"])) if s.get("doc GETs/batch") else float("nan")
            print(f"{name:<28} {med:11.3f} {min(values_):6.3f}-{max(values_):<6.3f} {med / base:7.2f}x "
                  f"{fetched:13.2f} {docs_:12.2f}")


if __name__ == "__main__":
    main()
