"""Single-item latency over HTTP, trees side by side, with the machine's floor beside them.

For each tree in ``--trees A,B`` (checkouts; default: this one) a ``featurestore serve`` of that
tree and a client process of that tree; the requests alternate between them one by one, so every
method sees the same load. Methods, each a warm keep-alive connection on 127.0.0.1:

* ``client[T]``: ``FeatureClient.item`` (tree T's client against tree T's server);
* ``raw[T]``: a raw-socket HTTP/1.1 GET of the same item route of tree T's server (no client
  code: what the server costs);
* ``floor``: the same raw GET against a minimal ASGI app under uvicorn with the same loop and
  HTTP parser, answering a constant 192 KiB body (the machine's floor for any uvicorn route);
* ``floor client``: ``http.client`` against that app, ``readinto`` a buffer (a client's floor).

Prints p50/p99 in ms per method. The store (``bench/enc/train``, [256, 384] float16) is kept in
``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

_FLOOR_APP = r"""
import sys, uvicorn
BODY = b"\0" * int(sys.argv[2])
START = {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(BODY)).encode())]}
MSG = {"type": "http.response.body", "body": BODY, "more_body": False}
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send(START)
    await send(MSG)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""

# One client process per tree: reads "item I" / "raw I" / "quit" lines, answers seconds taken.
_CLIENT = r"""
import socket, sys, time, numpy as np
from client import FeatureClient
url, route = sys.argv[1], sys.argv[2]
host, port = url.removeprefix("http://").split(":")
fc = FeatureClient(url)
key = ("bench", "enc", "train")
arr = fc.open(*key)
sock = socket.create_connection((host, int(port)))
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(1 << 20)
view = memoryview(buf)

def raw_get(path):
    sock.sendall(f"GET {path} HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
    got, end = 0, -1
    while end < 0:
        got += sock.recv_into(view[got:])
        end = buf.find(b"\r\n\r\n", 0, got)
    head = bytes(buf[:end + 2]).lower()
    i = head.index(b"content-length:") + 15
    total = end + 4 + int(head[i:head.index(b"\r\n", i)])
    while got < total:
        got += sock.recv_into(view[got:])
    assert got == total, (got, total)

for line in sys.stdin:
    what, i = line.split()
    i = int(i)
    t = time.perf_counter()
    if what == "item":
        fc.item(*key, i)
    elif what == "raw":
        raw_get(route.format(index=i))
    else:
        break
    sys.stdout.write(f"{time.perf_counter() - t}\n")
    sys.stdout.flush()
"""

_FLOOR_CLIENT = r"""
import http.client, socket, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]))
conn.connect()
conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = memoryview(bytearray(int(sys.argv[2])))
for line in sys.stdin:
    if line.startswith("quit"):
        break
    t = time.perf_counter()
    conn.request("GET", "/x")
    r = conn.getresponse()
    got = 0
    while got < len(buf):
        got += r.readinto(buf[got:])
    r.read()
    sys.stdout.write(f"{time.perf_counter() - t}\n")
    sys.stdout.flush()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", default=os.getcwd(), help="comma-separated checkouts to compare")
    parser.add_argument("--items", type=int, default=1000, help="timed requests per method")
    parser.add_argument("--workdir", default=None, help="keeps the store between runs")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    work = args.workdir or tempfile.mkdtemp(prefix="fs-item-")
    path = os.path.join(work, "store")
    env0 = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if not os.path.isdir(os.path.join(path, "bench", "enc", "train")):
        build = "import sys; from featurestore.testing.serving import build_store; build_store(sys.argv[1], 256)"
        subprocess.run([sys.executable, "-c", build, path], check=True, env={**env0, "PYTHONPATH": trees[0]},
                       cwd=trees[0])
    for root, _, files in os.walk(path):  # warm page cache
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(1 << 24):
                    pass
    route = "/v1/features/bench/enc/train/items/{index}"
    procs: list[subprocess.Popen[bytes]] = []
    clients: dict[str, subprocess.Popen[str]] = {}
    nbytes = 256 * 384 * 2
    try:
        for k, tree in enumerate(trees):
            port = _free_port()
            env = {**env0, "PYTHONPATH": tree}  # and cwd=tree: "-m"/"-c" put the cwd first on sys.path
            server = subprocess.Popen([sys.executable, "-m", "featurestore.cli", "serve", path, "--port", str(port),
                                       "--log-level", "warning", "--no-access-log"], env=env, cwd=tree)
            procs.append(server)
            _wait_port(port, server)
            clients[f"T{k}"] = subprocess.Popen([sys.executable, "-c", _CLIENT, f"http://127.0.0.1:{port}", route],
                                                env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                text=True)
        port = _free_port()
        floor = subprocess.Popen([sys.executable, "-c", _FLOOR_APP, str(port), str(nbytes)], env=env0)
        procs.append(floor)
        _wait_port(port, floor)
        floor_client = subprocess.Popen([sys.executable, "-c", _FLOOR_CLIENT, str(port), str(nbytes)], env=env0,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        floor_raw = subprocess.Popen([sys.executable, "-c", _CLIENT.replace("fc = FeatureClient(url)", "fc = None")
                                      .replace("arr = fc.open(*key)", ""), f"http://127.0.0.1:{port}", "/x"],
                                     env={**env0, "PYTHONPATH": trees[0]}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

        def ask(proc: subprocess.Popen[str], line: str) -> float:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            return float(proc.stdout.readline())

        methods = {}
        for name, proc in clients.items():
            methods[f"client[{name}]"] = (proc, "item")
            methods[f"raw[{name}]"] = (proc, "raw")
        methods["floor"] = (floor_raw, "raw")
        methods["floor client"] = (floor_client, "go")
        times: dict[str, list[float]] = {name: [] for name in methods}
        rng = np.random.default_rng(0)
        for r in range(args.items + 20):
            i = int(rng.integers(0, 256))
            order = list(methods.items())
            rng.shuffle(order)
            for name, (proc, verb) in order:
                took = ask(proc, f"{verb} {i}")
                if r >= 20:  # warm-up
                    times[name].append(took)
        for proc in [*clients.values(), floor_client, floor_raw]:
            assert proc.stdin is not None
            proc.stdin.write("quit 0\n")
            proc.stdin.flush()
            proc.wait(10)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    figures = {}
    for k, tree in enumerate(trees):
        print(f"T{k} = {tree}")
    print(f"{'method':<16} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}   load average {os.getloadavg()[0]:.2f}")
    for name, values in times.items():
        ms = np.array(values) * 1e3
        figures[name] = {q: float(np.percentile(ms, q)) for q in (50, 90, 99)}
        print(f"{name:<16} {figures[name][50]:8.3f} {figures[name][90]:8.3f} {figures[name][99]:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trees": trees, "ms": figures}, f, indent=1)


if __name__ == "__main__":
    main()
