"""The server side, on a real ``featurestore serve`` process (raw sockets where a client must
misbehave): a changed split is noticed (12.2), resources stay bounded (12.6), malformed Range
headers (12.7), no credential in any message (12.8), the 12.11 server items."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("uvicorn")

import featurestore  # noqa: E402
from client import ClientError, FeatureClient  # noqa: E402
from featurestore import errors as fse  # noqa: E402
from featurestore.testing.serving import serve_subprocess  # noqa: E402
from featurestore.format import wire  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import make_store, values  # noqa: E402

BIG = (256, 384)  # 192 KiB float16 samples: a 32-row batch is 6 MiB


def _write(path: str, split: str, n: int, shape: tuple[int, ...], dtype: str, *, offset: int = 0,
           commit: bool = True) -> None:  # fmt: skip
    store = featurestore.open_store(path, mode="a")
    writer = store.create_split("pannuke", "tiny", split, num_samples=n, sample_shape=shape, dtype=dtype,
                                label_dtype="int64", overwrite=True)  # fmt: skip
    writer.write(0, values(n, shape, offset), labels=np.arange(n, dtype=np.int64))
    if commit:
        writer.commit()
    else:
        writer.close()


def _raw(url: str, request: bytes, *, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` byte for byte on a fresh connection; (status, headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(lines[0].split()[1]), headers, body


def _get(url: str, target: str, extra: str = "") -> tuple[int, dict[str, str], bytes]:
    return _raw(url, f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n".encode())


@pytest.fixture()
def store_path(tmp_path: object) -> str:
    return make_store(str(tmp_path) + "/store")  # type: ignore[operator]


@pytest.fixture()
def served(store_path: str) -> Iterator[str]:
    with serve_subprocess(store_path) as (url, _):
        yield url


# ---------------------------------------------------------------------- 12.2 stale metadata
def test_rewritten_split_is_served_with_its_new_metadata(store_path: str, served: str) -> None:
    _write(store_path, "s", 20, (4, 8), "float16")
    with FeatureClient(served, retries=0) as fc:
        assert fc.open("pannuke", "tiny", "s").dtype == "float16"
        fc.read_numpy("pannuke", "tiny", "s", [3])
    _write(store_path, "s", 30, (4, 8), "float32", offset=100)  # re-extracted: float32, more rows
    with FeatureClient(served, retries=0) as fc:
        arr = fc.open("pannuke", "tiny", "s")
        assert (arr.dtype, arr.shape) == ("float32", (30, 4, 8))
        got = fc.read_numpy("pannuke", "tiny", "s", [25, 3])  # row 25 is past the old length
        np.testing.assert_array_equal(got, values(30, (4, 8), 100)[[25, 3]].astype(np.float32))
        assert fc.info("pannuke", "tiny", "s")["logical_dtype"] == "float32"


def test_split_being_overwritten_is_409_with_what_an_http_user_can_do(store_path: str, served: str) -> None:
    _write(store_path, "s", 20, (4, 8), "float16")
    with FeatureClient(served, retries=0) as fc:
        fc.read_numpy("pannuke", "tiny", "s", [1, 2])  # cached by the server
    _write(store_path, "s", 20, (4, 8), "float16", commit=False)  # an overwrite started (or died)
    body = json.dumps({"indices": [1, 2]}).encode()
    status, _, raw = _raw(served, b"POST /v1/features/pannuke/tiny/s/batch HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nConnection: close\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    assert status == 409, raw
    error = json.loads(raw)
    assert error["error"] == "IncompleteSplit"
    assert "server serves complete splits only" in error["detail"] and "retry" in error["detail"]
    for target in ("/v1/features/pannuke/tiny/s", "/v1/features/pannuke/tiny/s/arrays",
                   "/v1/features/pannuke/tiny/s/items/0"):  # fmt: skip
        status, headers, _ = _get(served, target)
        assert (status, headers.get("retry-after")) == (409, "1"), target  # served before: retry
    # The client retries such a 409 for split_change_wait_s; this writer died, so it gives up.
    with FeatureClient(served, retries=0, split_change_wait_s=0) as fc, pytest.raises(fse.IncompleteSplit):
        fc.open("pannuke", "tiny", "s")


def test_a_split_changed_during_a_read_is_refused_not_mixed(store_path: str) -> None:
    pytest.importorskip("fastapi")
    from server import Settings
    from server.state import StoreState

    _write(store_path, "s", 20, (4, 8), "float16")
    state = StoreState(Settings(store=store_path))
    entry = state.open_split("pannuke", "tiny", "s")
    state.confirm(entry)  # unchanged: fine
    _write(store_path, "s", 20, (4, 8), "float16", offset=7)  # rewritten between gather and send
    with pytest.raises(fse.IncompleteSplit, match="changed on storage while it was read"):
        state.confirm(entry)
    assert state.open_split("pannuke", "tiny", "s") is not entry  # reopened from the new metadata


# ---------------------------------------------------------------------- 12.6 bounded resources
def test_huge_declared_body_is_413_before_it_is_read(served: str) -> None:
    host, port = served.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # Announce 100 MB and send none of it: the answer must come at once, not after a read.
        sock.sendall(b"POST /v1/features/pannuke/tiny/train/batch HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")  # fmt: skip
        started = time.monotonic()
        answer = b""
        while b"}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"FEATURESTORE_MAX_REQUEST_BYTES" in answer
        assert time.monotonic() - started < 5
    status, _, body = _get(served, "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_index_count_is_capped_before_parsing(store_path: str) -> None:
    with serve_subprocess(store_path, env={"FEATURESTORE_MAX_INDICES": "100"}) as (url, _):
        for content_type, body in ((wire.INDICES, np.zeros(101, "<i8").tobytes()),
                                   ("application/json", json.dumps({"indices": [0] * 101}).encode())):  # fmt: skip
            status, _, raw = _raw(url, b"POST /v1/features/pannuke/tiny/train/batch HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Type: %s\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                                  % (content_type.encode(), len(body), body))  # fmt: skip
            assert status == 413, raw
            assert "FEATURESTORE_MAX_INDICES" in json.loads(raw)["detail"]
        with FeatureClient(url, retries=0) as fc:  # 100 still fit
            assert fc.read_numpy("pannuke", "tiny", "train", np.arange(100) % 40).shape == (100, 4, 8)


def test_bytes_in_flight_are_capped_and_healthz_answers(store_path: str) -> None:
    _write(store_path, "big", 32, BIG, "float16")  # one 32-row batch = 6 MiB
    env = {"FEATURESTORE_MAX_INFLIGHT_BYTES": str(13 << 20), "FEATURESTORE_INFLIGHT_WAIT_S": "0.5"}
    body = wire.encode_indices(np.arange(32))
    request = (b"POST /v1/features/pannuke/tiny/big/batch HTTP/1.1\r\nHost: x\r\n"
               b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (wire.INDICES.encode(), len(body), body))  # fmt: skip
    with serve_subprocess(store_path, env=env) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        slow = []
        try:
            for _ in range(4):  # clients that ask for 6 MiB each and never read
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect((host, int(port)))
                sock.sendall(request)
                slow.append(sock)
                time.sleep(0.2)
            statuses = []
            for _ in range(3):
                status, headers, raw = _raw(url, request.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n"))
                statuses.append(status)
                if status == 503:
                    assert headers["retry-after"] == "1"
                    assert "FEATURESTORE_MAX_INFLIGHT_BYTES" in json.loads(raw)["detail"]
            assert 503 in statuses, statuses
            started = time.monotonic()
            assert _get(url, "/healthz")[0] == 200
            assert time.monotonic() - started < 2
        finally:
            for sock in slow:
                sock.close()
        time.sleep(0.5)  # the server notices the closed sockets and gives the bytes back
        with FeatureClient(url, retries=0) as fc:
            assert fc.read_numpy("pannuke", "tiny", "big", np.arange(32)).shape == (32, *BIG)


# ---------------------------------------------------------------------- 12.7 Range
@pytest.mark.parametrize(
    ("range_header", "status"),
    [("bytes=" + "9" * 5000 + "-", 416), ("bytes=0-" + "9" * 5000, 206), ("bytes=-" + "9" * 5000, 206),
     ("bytes=" + "9" * 5000 + "-1", 400), ("bytes=x-", 400), ("bytes=5-2", 400), ("bytes=-", 400)],
)  # fmt: skip
def test_malformed_or_huge_range_is_never_500(served: str, range_header: str, status: int) -> None:
    got, _, raw = _get(served, "/zarr/pannuke/tiny/train/zarr.json", f"Range: {range_header}\r\n")
    assert got == status, raw[:300]


# ---------------------------------------------------------------------- 12.8 credentials
def test_credentials_never_appear_in_client_errors() -> None:
    with pytest.raises(ClientError) as info:
        FeatureClient("http://alice:pw123@127.0.0.1:1", retries=0).datasets()
    error = info.value
    for text in (str(error), repr(error), str(error.detail), error.url,
                 repr(FeatureClient("http://alice:pw123@127.0.0.1:1"))):  # fmt: skip
        assert "pw123" not in text and "alice:" not in text, text
    with pytest.raises(ValueError) as bad:
        FeatureClient("ftp://bob:hunter2@host")
    assert "hunter2" not in str(bad.value)
    assert wire.redact("s3://AKIA:s3cr3t@bucket/x?token=abc&X-Amz-Signature=f00 Bearer tok.en") == (
        "s3://***@bucket/x?token=***&X-Amz-Signature=*** Bearer ***"
    )


def test_credentials_in_urls_are_redacted_in_server_errors(served: str) -> None:
    # A name cannot hold credentials, but a 404 echoing a URL-ish path must not leak them either.
    status, _, raw = _get(served, "/v1/nothing/http://alice:pw123@evil")
    assert status == 404 and b"pw123" not in raw


# ---------------------------------------------------------------------- 12.11 server parts
def test_empty_token_warns_loudly(store_path: str) -> None:
    with serve_subprocess(store_path, env={"FEATURESTORE_TOKEN": ""}) as (url, proc):
        assert _get(url, "/v1/datasets")[0] == 200  # served without auth, as the warning says
        proc.terminate()
        proc.wait(10)
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
    assert "FEATURESTORE_TOKEN is set but empty" in err and "WITHOUT authentication" in err


def test_bad_name_over_http_is_invalid_name_not_404(served: str) -> None:
    for target in ("/v1/features/pannuke/tiny/a%2Fb/items/0", "/v1/features/pannuke/a%2Fb/train/arrays",
                   "/v1/datasets/a%2F..%2Fb/encoders"):  # fmt: skip
        status, _, raw = _get(served, target)
        assert status == 400 and json.loads(raw)["error"] == "InvalidName", (target, raw)
    with FeatureClient(served, retries=0) as fc, pytest.raises(fse.InvalidName):
        fc.open("pannuke", "tiny", "a/b")


def test_upper_case_scheme_works(served: str) -> None:
    with FeatureClient(served.replace("http://", "HTTP://"), retries=0) as fc:
        assert "pannuke" in fc.datasets()
        assert fc.read_numpy("pannuke", "tiny", "train", [1]).shape == (1, 4, 8)


# ---------------------------------------------------------------------- 12.4 damaged chunks
def test_damaged_chunk_is_a_clear_store_error_not_a_bare_500(store_path: str, served: str) -> None:
    chunk = os.path.join(store_path, "pannuke", "tiny", "train", "features", "c", "1", "0", "0")  # rows 5-9
    missing = os.path.join(store_path, "pannuke", "tiny", "train", "features", "c", "3", "0", "0")  # rows 15-19
    with open(chunk, "r+b") as f:
        f.truncate(10)
    os.remove(missing)
    for row, error_class, cls in ((6, "CorruptChunk", fse.CorruptChunk), (16, "MissingChunks", fse.MissingChunks)):
        status, _, raw = _get(served, f"/v1/features/pannuke/tiny/train/items/{row}")
        body = json.loads(raw)
        assert status == 500 and body["error"] == error_class, raw
        assert "store is damaged" in body["detail"] and "featurestore verify" in body["detail"]
        with FeatureClient(served, retries=3, backoff=5.0) as fc:  # a damaged store is not retried
            started = time.monotonic()
            with pytest.raises(cls):
                fc.read_numpy("pannuke", "tiny", "train", [0, row])
            assert time.monotonic() - started < 4
    with FeatureClient(served, retries=0) as fc:  # the intact chunks still read
        assert fc.read_numpy("pannuke", "tiny", "train", [0, 30]).shape == (2, 4, 8)
