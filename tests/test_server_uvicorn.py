"""The server as users run it: ``featurestore serve`` (uvicorn) on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("uvicorn")

import featurestore  # noqa: E402
from featurestore.testing.memory import process_rss  # noqa: E402
from featurestore.testing.serving import load_test, serve_subprocess  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import expected, make_store, raw_get  # noqa: E402


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_store(str(tmp_path_factory.mktemp("uvicorn") / "store"))


@pytest.fixture(scope="module")
def server(store_path: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with serve_subprocess(store_path) as running:
        yield running


def test_zarr_python_opens_the_store_through_the_server(server: tuple[str, object], store_path: str) -> None:
    zarr = pytest.importorskip("zarr")
    pytest.importorskip("aiohttp")
    url, _ = server
    group = zarr.open_group(f"{url}/zarr", mode="r")
    assert group.attrs["featurestore"]["format"] == "featurestore"
    features = zarr.open_array(f"{url}/zarr/pannuke/tiny/train/features", mode="r")
    assert features.shape == (40, 4, 8)
    np.testing.assert_array_equal(features[:], expected(store_path, "train", range(40)))
    np.testing.assert_array_equal(features[[3, 17, 38]], expected(store_path, "train", [3, 17, 38]))
    bf16 = zarr.open_array(f"{url}/zarr/pannuke/tiny/val/features", mode="r")
    assert bf16.dtype == np.uint16  # bfloat16 bits, as on storage
    np.testing.assert_array_equal(bf16[:], expected(store_path, "val", range(12)))


@pytest.mark.parametrize(
    "target",
    ["/zarr/../../../../etc/passwd", "/zarr/%2e%2e/%2e%2e/%2e%2e/etc/passwd", "/zarr/..%2f..%2f..%2fetc%2fpasswd",
     "/zarr/pannuke/../../../etc/passwd", "/zarr/%2E%2E%5C%2E%2E%5Cetc%5Cpasswd", "/v1/features/..%2f..%2fetc/x/y",
     "/zarr//etc/passwd"],
)  # fmt: skip
def test_traversal_is_refused_on_the_wire(server: tuple[str, object], target: str) -> None:
    url, _ = server
    answer = raw_get(url, target)
    status = int(answer.split(b" ", 2)[1])
    assert status in (400, 404), answer[:300]
    assert b"root:" not in answer


def test_server_survives_garbage(server: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, proc = server
    host, port = url.removeprefix("http://").split(":")
    for junk in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\x00\xff" * 100, b"POST /v1/features/a/b/c/batch HTTP/1.1\r\nContent-Length: 5\r\n\r\n{{{{{"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            try:
                while sock.recv(65536):
                    pass
            except OSError:
                pass
    assert proc.poll() is None
    assert b"200 OK" in raw_get(url, "/healthz")


def test_load_16_clients_no_errors(server: tuple[str, subprocess.Popen[bytes]], store_path: str) -> None:
    url, proc = server
    result = load_test(url, store_path, ("pannuke", "tiny", "train"), clients=16, seconds=5.0,
                       server_pid=proc.pid)  # fmt: skip
    print(f"\nload: {result['requests']} requests in {result['seconds']:.1f} s, errors {result['errors']}, "
          f"mismatches {result['mismatches']}, server RSS {result['server_rss_start'] / 2**20:.0f} -> "
          f"{result['server_rss_end'] / 2**20:.0f} MiB (anonymous {result['server_rss_anon_start'] / 2**20:.0f}"
          f" -> {result['server_rss_anon_end'] / 2**20:.0f} MiB)")  # fmt: skip
    assert result["errors"] == 0 and result["mismatches"] == 0, result["failures"]
    assert result["requests"] >= 16
    assert result["server_rss_anon_end"] < result["server_rss_anon_start"] + 100 * 2**20
    assert proc.poll() is None


def test_sigterm_shuts_down_gracefully(store_path: str) -> None:
    with serve_subprocess(store_path, args=("--log-level", "info")) as (_, proc):
        proc.send_signal(signal.SIGTERM)
        # uvicorn finishes in-flight requests, runs the shutdown, then re-raises the signal so
        # the exit status still says "terminated" (what process supervisors expect).
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert proc.stderr is not None
        log = proc.stderr.read().decode()
    assert "Shutting down" in log and "Finished server process" in log


def test_workers(store_path: str) -> None:
    with serve_subprocess(store_path, args=("--workers", "2")) as (url, proc):
        from client import FeatureClient

        with FeatureClient(url) as fc:
            for i in range(6):
                np.testing.assert_array_equal(fc.open("pannuke", "tiny", "train").read_numpy([i]),
                                              expected(store_path, "train", [i]))  # fmt: skip
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) >= 2
        assert all(process_rss(int(pid)) > 0 for pid in children)


def test_serve_cli_errors_are_one_line(tmp_path: object) -> None:
    out = subprocess.run([sys.executable, "-m", "featurestore.cli", "serve", str(tmp_path) + "/missing"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.startswith("featurestore: error: no featurestore at") and out.stderr.count("\n") == 1
    out = subprocess.run([sys.executable, "-m", "featurestore.cli", "serve", "x", "--token-env", "FS_UNSET_VAR_XYZ"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1 and "FS_UNSET_VAR_XYZ" in out.stderr
    out = subprocess.run([sys.executable, "-m", "featurestore.cli", "serve", "x", "--workers", "0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1 and "--workers" in out.stderr


def test_serve_an_empty_url_a_busy_port_or_an_unknown_host_is_one_line(store_path: str) -> None:
    """'' was a ValueError traceback of server/state.py; a busy port or a host not of this machine
    was uvicorn's bare errno among its log lines (exit 3), after the app had started."""
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "featurestore.cli", "serve", *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    out = serve("", "--port", "0")
    assert (out.returncode, out.stderr) == (1, "featurestore: error: store URL '' is empty: pass a directory path or "
                                               "an fsspec URL such as s3://bucket/prefix\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = serve(store_path, "--host", "127.0.0.1", "--port", str(port))
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"featurestore: error: --host '127.0.0.1' --port {port}: cannot listen there "
                                 "(Address already in use): give an address of this machine"), out.stderr
    out = serve(store_path, "--host", "no such host.invalid", "--port", "0")
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("featurestore: error: --host 'no such host.invalid' --port 0: cannot listen there ")
    assert "(--port 0 picks one)" in out.stderr


def test_local_and_served_reads_agree_bit_for_bit(server: tuple[str, object], store_path: str) -> None:
    from client import FeatureClient

    url, _ = server
    local = featurestore.open_store(store_path)
    with FeatureClient(url) as fc:
        for split in ("train", "val", "f32"):
            arr = local.open("pannuke", "tiny", split)
            index = np.random.default_rng(3).integers(0, len(arr), size=25)
            got = fc.open("pannuke", "tiny", split).read_numpy(index)
            assert got.tobytes() == arr.read_numpy(index).tobytes()
    time.sleep(0)


def test_an_int8_split_reads_through_the_servers_zarr_route(tmp_path: object) -> None:
    """Its scales were checked against a listing of their chunks, which an HTTP store does not
    give: every read of an int8 split over /zarr said MissingChunks (damaged store)."""
    root = os.path.join(str(tmp_path), "store")
    x = np.random.default_rng(3).standard_normal((12, 2, 8)).astype(np.float32)
    writer = featurestore.open_store(root, mode="a").create_split("d", "e", "s", num_samples=12, sample_shape=(2, 8),
                                                                   dtype="int8", chunk_rows=4)
    writer.write(0, x)
    writer.commit()
    local = featurestore.open_store(root).open("d", "e", "s").read_numpy([0, 5, 11], dtype="float32")
    with serve_subprocess(root) as (url, _):
        served = featurestore.open_store(f"{url}/zarr").open("d", "e", "s").read_numpy([0, 5, 11], dtype="float32")
    assert served.tobytes() == local.tobytes()


def test_served_process_stops_with_the_process_that_started_it(store_path: str) -> None:
    """A process holding ``serve_subprocess`` killed with SIGKILL (its ``finally`` never runs): the
    kernel sends the server SIGTERM, and it stops instead of keeping its port."""
    import shutil

    from _orphans import outlives_sigkilled_parent

    if shutil.which("setpriv") is None:
        pytest.skip("util-linux setpriv is not installed: the server cannot be tied to its parent")
    script = ("import sys, time\nfrom featurestore.testing.serving import serve_subprocess\n"
              "with serve_subprocess(sys.argv[1]) as (url, proc):\n"
              "    print(proc.pid, url, flush=True)\n    time.sleep(600)\n")
    server, outlived = outlives_sigkilled_parent(script, store_path)
    assert not outlived, f"featurestore serve (pid {server}) outlived the process that started it"
