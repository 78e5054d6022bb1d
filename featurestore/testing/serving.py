"""A ``featurestore serve`` process for benchmarks and tests, a small bench store, and the
multi-client load test (every payload checked against a local read, server RSS before and after).

Shared by ``featurestore bench http``, the demo and the server/client tests.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from featurestore.testing import dies_with_this_process, stop_process
from featurestore.testing.memory import process_rss

SHAPE = (256, 384)


# ---------------------------------------------------------------------- helpers shared with tests
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve_subprocess(store: str, *, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                     startup_timeout: float = 60.0) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:  # fmt: skip
    """Run ``featurestore serve STORE`` on a free loopback port; yield (url, process); always
    stop it (SIGTERM, then SIGKILL after 10 s)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "featurestore.cli", "serve", store, "--port", str(port),
           "--log-level", "warning", "--no-access-log", *args]  # fmt: skip
    proc = subprocess.Popen(dies_with_this_process(cmd), env={**os.environ, **(env or {})}, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"featurestore serve exited with {proc.returncode}: {err[-2000:]}")
            try:
                if httpx.get(url + "/healthz", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"featurestore serve did not answer /healthz within {startup_timeout} s")
            time.sleep(0.05)
        yield url, proc
    finally:
        stop_process(proc, grace=10)
        if proc.stderr:
            proc.stderr.close()


def build_store(path: str, num_samples: int, *, seed: int = 0) -> None:
    """``bench/enc/train``: [N, 256, 384] float16 features and int64 labels, written in slabs."""
    import featurestore

    rng = np.random.default_rng(seed)
    writer = featurestore.open_store(path, mode="a").create_split(
        "bench", "enc", "train", num_samples=num_samples, sample_shape=SHAPE, dtype="float16",
        label_shape=(), label_dtype="int64", overwrite=True,
    )  # fmt: skip
    for start in range(0, num_samples, 128):
        n = min(128, num_samples - start)
        values = rng.standard_normal((n, *SHAPE), dtype=np.float32).astype(np.float16)
        writer.write(start, values, labels=np.arange(start, start + n, dtype=np.int64))
    writer.commit()


# ---------------------------------------------------------------------- load test
def load_test(url: str, store: str, key: tuple[str, str, str], *, clients: int = 16,
              seconds: float = 30.0, server_pid: int | None = None, seed: int = 0,
              token: str | None = None) -> dict[str, Any]:  # fmt: skip
    """``clients`` threads of mixed random requests for ``seconds``; every payload is compared
    with a local read of the same store. Returns counts, errors and server RSS."""
    import featurestore
    from client import FeatureClient

    local = featurestore.open_store(store).open(*key)
    n = len(local)
    rss_start = process_rss(server_pid) if server_pid else 0
    anon_start = process_rss(server_pid, "RssAnon") if server_pid else 0
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()
    totals = {"requests": 0, "bytes": 0, "errors": 0, "mismatches": 0}
    failures: list[str] = []

    def worker(number: int) -> None:
        rng = np.random.default_rng(seed + number)
        counts = {"requests": 0, "bytes": 0, "errors": 0, "mismatches": 0}
        with FeatureClient(url, token=token, retries=0, max_connections=2) as fc:
            remote = None
            while time.monotonic() < stop_at:
                kind = int(rng.integers(0, 4 if local.labels is not None else 3))
                want: np.ndarray | None
                try:
                    remote = remote or fc.open(*key)
                    if kind == 0:  # shuffled batch, duplicates allowed
                        index = rng.integers(0, n, size=int(rng.integers(1, 129)))
                        got, want = remote.read_numpy(index), local.read_numpy(index)
                    elif kind == 1:  # contiguous range
                        start = int(rng.integers(0, n))
                        stop = min(n, start + int(rng.integers(0, 129)))
                        got, want = remote.read_range(start, stop), local.read_range(start, stop)
                    elif kind == 2:  # one item
                        i = int(rng.integers(0, n))
                        got, want = fc.item(*key, i), local.read_numpy([i])[0]
                    else:  # labels of a shuffled batch
                        index = rng.integers(0, n, size=int(rng.integers(1, 129)))
                        got = fc.read_numpy(*key, index, labels=True)
                        want = local.labels.read_numpy(index) if local.labels is not None else None
                    counts["requests"] += 1
                    counts["bytes"] += got.nbytes
                    if want is None or got.shape != want.shape or not np.array_equal(got, want):
                        counts["mismatches"] += 1
                        failures.append(f"client {number}: payload mismatch on request kind {kind}")
                except Exception as error:  # counted, reported: the load test must not stop
                    counts["errors"] += 1
                    failures.append(f"client {number}: {type(error).__name__}: {error}")
        with lock:
            for name, value in counts.items():
                totals[name] += value

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 120)
    elapsed = time.perf_counter() - started
    # Response buffers go back to the server's pool once their last byte is sent: wait a moment
    # and make one small request, so "end" is the server at rest after the load, not the buffers
    # of the last in-flight requests.
    time.sleep(1.1)
    with FeatureClient(url, token=token) as fc:
        fc.item(*key, 0)
    rss_end = process_rss(server_pid) if server_pid else 0
    anon_end = process_rss(server_pid, "RssAnon") if server_pid else 0
    return {
        **totals,
        "clients": clients,
        "seconds": elapsed,
        "requests_per_s": totals["requests"] / elapsed,
        "gb_per_s": totals["bytes"] / elapsed / 1e9 if elapsed > 0 else float("inf"),
        "server_rss_start": rss_start,
        "server_rss_end": rss_end,
        "server_rss_anon_start": anon_start,
        "server_rss_anon_end": anon_end,
        "failures": failures[:20],
    }
