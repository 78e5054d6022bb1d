"""``featurestore bench http``: the HTTP path against raw loopback TCP, latency, and a load test.

What it measures: docs/BENCHMARKS.md, "What each bench measures".
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
from typing import Any

import numpy as np

import featurestore
from featurestore.bench import harness
from featurestore.bench.harness import Method, gbps, interleaved
from featurestore.testing import dies_with_this_process
from featurestore.testing.serving import SHAPE, build_store, load_test, serve_subprocess


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "http", "HTTP server + client vs raw loopback TCP; item latency; load test", {
        "--store": (str, "serve this store (its first split) instead of building one"),
        "--num-samples": (1024, "samples in the built store"), "--batch-size": (64, None),
        "--batches": (30, "timed batches per method and repeat"), "--items": (300, "single-item requests timed"),
        "--load-seconds": (30.0, "seconds of the load test, 0 skips it",
                           {"type": harness.number(float, inclusive=True)}),
        "--clients": (16, "load-test concurrent clients"),
        "--threads": (2, "FeatureLoader threads over HTTP"),
        "--workers": (1, "server worker processes (featurestore serve --workers)")}, repeats=3)


# ---------------------------------------------------------------------- raw TCP baseline
_RAW_SERVER = r"""
import socket, struct, sys, numpy as np, featurestore
arr = featurestore.open_store(sys.argv[1]).open(sys.argv[2], sys.argv[3], sys.argv[4])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
static = None
def recv_exact(n):
    buf = bytearray(n); view = memoryview(buf); got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if not k: raise SystemExit(0)
        got += k
    return buf
while True:
    count, mode = struct.unpack("<IB", recv_exact(5))
    index = np.frombuffer(recv_exact(8 * count), np.int64)
    if mode == 0:  # gather the batch like the server does
        conn.sendall(memoryview(arr.read_numpy(index).reshape(-1).view(np.uint8)))
    else:  # stream one pre-gathered batch: the transport alone
        if static is None or len(static) != count:
            static = arr.read_numpy(index)
        conn.sendall(memoryview(static.reshape(-1).view(np.uint8)))
"""


class RawTCP:
    """Client side of the raw baseline; the server runs in its own process, like uvicorn."""

    def __init__(self, store: str, key: tuple[str, str, str]) -> None:
        self.proc = subprocess.Popen(dies_with_this_process([sys.executable, "-c", _RAW_SERVER, store, *key]),
                                     stdout=subprocess.PIPE)  # fmt: skip
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read(self, index: np.ndarray, out: np.ndarray, *, gather: bool) -> None:
        index = np.ascontiguousarray(index, dtype=np.int64)
        self.sock.sendall(struct.pack("<IB", len(index), 0 if gather else 1) + index.tobytes())
        view, got = out.reshape(-1).view(np.uint8).data, 0
        while got < view.nbytes:  # straight into the output's bytes
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("raw TCP baseline server went away")
            got += k

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


# ---------------------------------------------------------------------- the benchmark
def run(args: argparse.Namespace) -> dict[str, Any]:
    with harness.scratch(args, "http") as work:
        path, key = args.store, ("bench", "enc", "train")
        if path:
            store = featurestore.open_store(path)
            dataset = store.datasets()[0]
            encoder = store.encoders(dataset)[0]
            key = (dataset, encoder, store.splits(dataset, encoder)[0])
        else:
            path = os.path.join(work, "store")
            print(f"[http] building {args.num_samples} samples of {list(SHAPE)} float16 ...")
            build_store(path, args.num_samples)
        if os.path.isdir(path):
            harness.warm(path)  # page-cached, so every method measures transport, not disk
        with serve_subprocess(path, args=("--workers", str(args.workers))) as (url, proc):
            return _measure(url, proc, path, key, args)


def _measure(url: str, proc: subprocess.Popen[bytes], path: str, key: tuple[str, str, str],
             args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    import httpx

    from client import FeatureClient
    from featurestore.format import wire

    fc = FeatureClient(url)
    remote = fc.open(*key)
    n, batch = len(remote), args.batch_size
    out = np.empty((batch, *remote.sample_shape), remote.numpy_dtype)
    naive = httpx.Client(timeout=60)
    raw = RawTCP(path, key)
    post_path = wire.route(wire.BATCH, dataset=key[0], encoder=key[1], split=key[2])

    def naive_read(index: np.ndarray) -> np.ndarray:
        response = naive.post(url + post_path, json={"indices": index.tolist()})
        return np.frombuffer(response.content, remote.numpy_dtype).reshape(out.shape)

    methods = {
        "http": lambda idx: remote.read_numpy(idx, out=out),
        "http naive client": naive_read,
        "raw tcp": lambda idx: raw.read(idx, out, gather=False),
        "raw tcp + gather": lambda idx: raw.read(idx, out, gather=True),
    }
    # Methods alternate batch by batch, and each is rated by its median batch time: on a shared
    # machine the load changes from second to second, and this way every method sees the same
    # conditions and a scheduling hiccup does not decide the ratio. One untimed batch each first
    # warms connections and caches.
    rng = np.random.default_rng(0)
    current: list[Any] = [None]

    def draw(_: int, methods: list[Method]) -> list[Method]:
        current[0] = rng.choice(n, size=batch, replace=n < batch)
        return methods

    try:
        times = interleaved([Method(name, lambda fn=fn: fn(current[0])) for name, fn in methods.items()],
                            args.repeats * args.batches, warmup=1, order=draw)
    finally:
        raw.close()
        naive.close()
    median = {name: gbps(out.nbytes, seconds) for name, seconds in times.medians().items()}
    loader = _loader_vs_client(url, key, remote, args)

    items = np.random.default_rng(99).integers(0, n, size=args.items + 10)  # the first 10 warm up, not kept
    lat = np.array([harness.timed(lambda i=i: fc.item(*key, int(i))) for i in items][10:]) * 1e3
    p50, p99 = np.percentile(lat, [50, 99]).tolist()
    fc.close()

    # Each repeat's own ratio (its batches' median times, side by side): the spread of the figure.
    by_repeat = {name: np.median(np.reshape(v, (args.repeats, args.batches)), axis=1) for name, v in times.items()}
    paired_vs_raw = {name: (by_repeat["raw tcp"] / by_repeat[name]).tolist() for name in ("http", "http naive client")}
    results: dict[str, Any] = {
        "benchmark": "http", "paired_vs_raw_tcp": paired_vs_raw, "batch_size": batch,
        "sample_shape": list(remote.sample_shape), "page_cache": "warm", "gb_per_s": median,
        "http_vs_raw_tcp": median["http"] / median["raw tcp"],
        "http_vs_raw_tcp_gather": median["http"] / median["raw tcp + gather"],
        "item_latency_ms": {"p50": p50, "p99": p99, "count": len(lat)}, "loader": loader}
    if args.load_seconds > 0:
        results["load"] = load_test(url, path, key, clients=args.clients, seconds=args.load_seconds,
                                    server_pid=proc.pid)
    return results


def _loader_vs_client(url: str, key: tuple[str, str, str], remote: Any,
                      args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """FeatureLoader over HTTP (uniform shuffle, CPU, stored dtype) against FeatureClient reading
    the same batches (features+labels, one request each) one after another; epochs alternate."""
    try:
        from client import FeatureDataset, FeatureLoader  # client.loader imports torch
    except ImportError:  # the client extra without torch: nothing to compare
        return {}
    n, batch = len(remote), args.batch_size
    ds = FeatureDataset(url, *key)
    loader = FeatureLoader(ds, batch_size=batch, order="shuffle", device="cpu", dtype=None,
                           num_threads=args.threads, prefetch=args.threads + 1, drop_last=True)  # fmt: skip
    features = np.empty((batch, *remote.sample_shape), remote.numpy_dtype)
    labels = None if remote.labels is None else np.empty((batch, *remote.labels.sample_shape),
                                                         remote.labels.numpy_dtype)  # fmt: skip
    batches, epoch = n // batch, [0]  # drop_last: the loader's epochs are n // batch batches too

    def client_epoch() -> None:
        order = np.random.default_rng(epoch[0]).permutation(n)
        for k in range(batches):
            index = order[k * batch: (k + 1) * batch]
            remote.read_numpy(index, out=features) if labels is None else remote.read_into(index, features, labels)

    def next_epoch(r: int, methods: list[Method]) -> list[Method]:
        epoch[0] = r + 1
        return methods

    # Epochs alternate; the warm-up epoch warms connections and threads. Seconds per batch.
    times = interleaved([Method("loader", lambda: harness.drain(loader), lambda: loader.set_epoch(epoch[0])),
                         Method("client", client_epoch)], args.repeats, warmup=1, order=next_epoch)
    per_batch = {name: [s / max(batches, 1) for s in seconds] for name, seconds in times.items()}
    nbytes = features.nbytes + (0 if labels is None else labels.nbytes)
    rates = {name: gbps(nbytes, float(np.median(v))) for name, v in per_batch.items()}
    return {"gb_per_s": rates, "loader_vs_client": rates["loader"] / rates["client"], "threads": args.threads,
            "per_epoch_s": per_batch}


def failed(results: dict[str, Any]) -> str | None:
    load = results.get("load")
    if load and (load["errors"] or load["mismatches"]):
        return f"load test {load['errors']} errors, {load['mismatches']} mismatches"
    return None
