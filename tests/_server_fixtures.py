"""A small store with every case the server must handle, and helpers to serve it.

``make_store`` writes, with the core API:
* ``pannuke/tiny/train``: float16 [40, 4, 8], int64 labels, sample ids, 5-row chunks;
* ``pannuke/tiny/val``: bfloat16 [12, 4, 8], no labels;
* ``pannuke/tiny/f32``: float32 [9, 3], uint8 mask labels [9, 2, 2];
* ``pannuke/tiny/writing``: a split whose writer never committed (status ``writing``);
* ``other/enc2/test``: float16 [3, 2, 2] (a second dataset/encoder for listings).
Values are a function of the row index, so any payload can be checked against ``expected``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

SHAPES: dict[str, tuple[int, tuple[int, ...], str]] = {
    "train": (40, (4, 8), "float16"),
    "val": (12, (4, 8), "bfloat16"),
    "f32": (9, (3,), "float32"),
}


def values(n: int, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
    """Row i holds ``i + k / 64`` for k over the sample: exact in float16 and bfloat16."""
    per = int(np.prod(shape))
    rows = np.arange(offset, offset + n, dtype=np.float32)[:, None]
    return (rows + (np.arange(per, dtype=np.float32) % 8)[None, :] / 8).reshape(n, *shape)


def make_store(path: str) -> str:
    import featurestore

    store = featurestore.open_store(path, mode="a")
    n, shape, dtype = SHAPES["train"]
    w = store.create_split("pannuke", "tiny", "train", num_samples=n, sample_shape=shape, dtype=dtype,
                           label_dtype="int64", chunk_bytes=5 * 4 * 8 * 2,
                           ids=[f"img-{i:03d}" for i in range(n)])  # fmt: skip
    w.write(0, values(n, shape), labels=np.arange(n, dtype=np.int64) * 10)
    w.commit()
    n, shape, dtype = SHAPES["val"]
    w = store.create_split("pannuke", "tiny", "val", num_samples=n, sample_shape=shape, dtype=dtype)
    w.write(0, values(n, shape))
    w.commit()
    n, shape, dtype = SHAPES["f32"]
    w = store.create_split("pannuke", "tiny", "f32", num_samples=n, sample_shape=shape, dtype=dtype,
                           label_shape=(2, 2), label_dtype="uint8")  # fmt: skip
    w.write(0, values(n, shape), labels=np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2))
    w.commit()
    w = store.create_split("pannuke", "tiny", "writing", num_samples=10, sample_shape=(2,),
                           dtype="float16", chunk_bytes=4)  # fmt: skip
    w.write(0, values(2, (2,)))
    w.close()
    w = store.create_split("other", "enc2", "test", num_samples=3, sample_shape=(2, 2), dtype="float16")
    w.write(0, values(3, (2, 2)))
    w.commit()
    return path


def expected(path: str, split: str, indices: Any, labels: bool = False) -> np.ndarray:
    """What any read must return: the local reader's answer (storage dtype)."""
    import featurestore

    arr = featurestore.open_store(path).open("pannuke", "tiny", split)
    target = arr.labels if labels else arr
    assert target is not None
    return target.read_numpy(np.asarray(indices, dtype=np.int64))


def served_store(make: Callable[[str], str], name: str, client: str = "client") -> tuple[Any, Any]:
    """The two module-scoped fixtures of a test module that serves one store: ``store_path``, the
    store ``make`` writes into a fresh directory, and ``client`` (the name given), a TestClient of
    the app over it with the default settings. Bind both: ``store_path, client = served_store(...)``."""

    @pytest.fixture(scope="module", name="store_path")
    def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
        return make(str(tmp_path_factory.mktemp(name) / "store"))

    @pytest.fixture(scope="module", name=client)
    def app_client(store_path: str) -> Iterator[Any]:
        from fastapi.testclient import TestClient

        from server import Settings, create_app

        with TestClient(create_app(store_path, Settings())) as test_client:
            yield test_client

    return store_path, app_client


class ScriptedHTTPServer:
    """A loopback socket server that answers each request with the next scripted raw response.

    For client behaviours a real server will not produce on demand: 5xx, chunked bodies, and
    keep-alive connections closed right after a response. ``close_after`` closes the connection
    after each response (without saying so), which is what a server does to an idle keep-alive
    socket. ``requests`` collects the raw request heads.
    """

    def __init__(self, responses: list[bytes], *, close_after: bool = False) -> None:
        import socket
        import threading

        self.responses = list(responses)
        self.close_after = close_after
        self.requests: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                buffer = b""
                while True:
                    while b"\r\n\r\n" not in buffer:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        buffer += chunk
                    if b"\r\n\r\n" not in buffer:
                        break
                    head, buffer = buffer.split(b"\r\n\r\n", 1)
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    while len(buffer) < length:
                        buffer += conn.recv(65536)
                    buffer = buffer[length:]
                    self.requests.append(head)
                    conn.sendall(self.responses.pop(0) if self.responses else _response(500, b"{}"))
                    if self.close_after:
                        break

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> ScriptedHTTPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _response(status: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def response(status: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    return _response(status, body, headers)


def raw_get(url: str, target: str) -> bytes:
    """Send ``target`` byte for byte to a running server (no client-side normalisation of ``..``)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data
