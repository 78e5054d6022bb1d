"""``FeatureClient``'s transport against scripted loopback servers (no mocks; the real server:
tests/test_client_http.py): retries with backoff on connection errors and 5xx, a split being
rewritten (409) retried within its bound, 4xx not retried, stale keep-alive connections, chunked
and close-delimited bodies, truncated bodies, bad arguments; and the direct request path sending
and decoding what httpx's client does."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from client import ClientError, FeatureClient  # noqa: E402
from featurestore import errors as fse  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import ScriptedHTTPServer, response  # noqa: E402

KEY = ("pannuke", "tiny", "train")


# ---------------------------------------------------------------------- transport edge cases
def test_connection_errors_are_retried_with_backoff() -> None:
    from featurestore.testing.serving import free_port

    client = FeatureClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff=0.05)
    started = time.monotonic()
    with pytest.raises(ClientError) as info:
        client.datasets()
    assert "3 attempts" in str(info.value) and info.value.status is None
    assert time.monotonic() - started >= 0.05 * (0.5 + 1.0)  # two jittered sleeps
    assert not client.healthy()


def test_5xx_is_retried_then_succeeds() -> None:
    ok = json.dumps({"datasets": ["a"]}).encode()
    busy = response(503, b'{"detail": "busy"}')
    with ScriptedHTTPServer([busy, response(500, b"oops"), response(200, ok)]) as server:
        assert FeatureClient(server.url, retries=2, backoff=0.01).datasets() == ["a"]
        assert len(server.requests) == 3


def test_5xx_after_all_retries_is_a_client_error() -> None:
    with ScriptedHTTPServer([response(503, b'{"detail": "busy"}')] * 2) as server:
        with pytest.raises(ClientError) as info:
            FeatureClient(server.url, retries=1, backoff=0.01).datasets()
        assert info.value.status == 503 and info.value.detail == "busy"


def test_split_being_rewritten_409_is_retried_within_its_bound() -> None:
    ok = json.dumps({"datasets": ["a"]}).encode()
    changed = response(409, b'{"detail": "split a/b/c is being rewritten: retry", "error": "IncompleteSplit"}',
                       {"Retry-After": "1"})  # fmt: skip
    # retries=0: a rewrite is not a failure, it has its own bound
    with ScriptedHTTPServer([changed, changed, response(200, ok)]) as server:
        assert FeatureClient(server.url, retries=0, backoff=0.01).datasets() == ["a"]
        assert len(server.requests) == 3
    with ScriptedHTTPServer([changed] * 50) as server:  # the bound: then the 409 itself
        with pytest.raises(fse.IncompleteSplit) as info:
            FeatureClient(server.url, backoff=0.01, split_change_wait_s=0.2).datasets()
        assert info.value.status == 409 and info.value.retry_after == 1.0
        assert 2 <= len(server.requests) < 50
    # no Retry-After (a split that never was complete here): raised at once
    not_complete = response(409, b'{"detail": "not complete", "error": "IncompleteSplit"}')
    with ScriptedHTTPServer([not_complete] * 3) as server:
        with pytest.raises(fse.IncompleteSplit):
            FeatureClient(server.url, backoff=0.01).datasets()
        assert len(server.requests) == 1


def test_4xx_is_not_retried() -> None:
    with ScriptedHTTPServer([response(404, b'{"detail": "gone", "error": "DatasetNotFound"}')] * 3) as server:
        with pytest.raises(fse.DatasetNotFound):
            FeatureClient(server.url, retries=3, backoff=0.01).encoders("x")
        assert len(server.requests) == 1


def test_stale_keep_alive_connection_is_replaced() -> None:
    ok = json.dumps({"datasets": ["a"]}).encode()
    with ScriptedHTTPServer([response(200, ok)] * 3, close_after=True) as server:
        client = FeatureClient(server.url, retries=0)
        for _ in range(3):  # each pooled socket was closed by the server after its answer
            assert client.datasets() == ["a"]


def test_chunked_and_close_delimited_bodies() -> None:
    body = json.dumps({"datasets": ["x", "y"]}).encode()
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
               + b"%x\r\n" % 5 + body[:5] + b"\r\n" + b"%x;ext=1\r\n" % (len(body) - 5) + body[5:]
               + b"\r\n0\r\n\r\n")  # fmt: skip
    close_delimited = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + response(200, body)
    with ScriptedHTTPServer([chunked, interim, close_delimited], close_after=False) as server:
        client = FeatureClient(server.url, retries=0)
        assert client.datasets() == ["x", "y"]
        assert client.datasets() == ["x", "y"]
    with ScriptedHTTPServer([close_delimited], close_after=True) as server:
        assert FeatureClient(server.url, retries=0).datasets() == ["x", "y"]


def test_truncated_data_body_is_an_error_not_garbage() -> None:
    headers = {"X-Shape": "1,4,8", "X-Dtype": "float16", "Content-Length": "64"}
    head = "HTTP/1.1 200 OK\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    layout = {"features": {"shape": [40, 4, 8], "dtype": "float16", "storage_dtype": "float16",
                           "sample_nbytes": 64, "chunk_rows": 5},
              "labels": None, "has_ids": False, "max_response_bytes": 1 << 20, "metadata": {}}  # fmt: skip
    with ScriptedHTTPServer(  # one request opens the split, the next reads
        [response(200, json.dumps(layout).encode()), head.encode() + b"\x00" * 10],
        close_after=True,
    ) as server:
        with pytest.raises(ClientError, match="attempts"):
            FeatureClient(server.url, retries=0).open(*KEY).read_numpy([1])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="http"):
        FeatureClient("ftp://x")
    with pytest.raises(ValueError, match="retries"):
        FeatureClient("http://x", retries=-1)
    assert "secret" not in repr(FeatureClient("http://x", token="secret"))


def test_direct_requests_send_what_httpx_sends() -> None:
    """A URL prefix, query values that need quoting, a token: the request line and headers that
    matter are those httpx's client sends for the same call."""
    import httpx

    ok = json.dumps({"ok": 1}).encode()
    heads = []
    for transport in (None, httpx.HTTPTransport()):  # direct, then through httpx
        with ScriptedHTTPServer([response(200, ok)]) as server:
            with FeatureClient(server.url + "/fs/", token="t0k", retries=0, transport=transport) as client:
                assert client.get_json("/v1/x", {"a": "1", "b": "x y&z/é"}) == {"ok": 1}
            heads.append(server.requests[0].split(b"\r\n"))
    direct, via_httpx = heads
    assert direct[0] == via_httpx[0] == b"GET /fs/v1/x?a=1&b=x+y%26z%2F%C3%A9 HTTP/1.1"
    assert b"Authorization: Bearer t0k" in direct and b"Authorization: Bearer t0k" in via_httpx


def test_credentials_in_the_url_still_go_through_httpx() -> None:
    """httpx turns ``user:password@`` into basic auth; such a client keeps httpx's client."""
    ok = json.dumps({"datasets": ["p"]}).encode()
    with ScriptedHTTPServer([response(200, ok)]) as server:
        url = server.url.replace("http://", "http://alice:pw@")
        assert FeatureClient(url, retries=0).datasets() == ["p"]
        assert b"Authorization: Basic YWxpY2U6cHc=" in server.requests[0].split(b"\r\n")


def test_direct_responses_decode_and_report_as_httpx_ones() -> None:
    """The direct path's lighter response hands an encoded body and a non-JSON error to httpx."""
    import gzip

    body = gzip.compress(json.dumps({"datasets": ["z"]}).encode())
    encoded = response(200, body, {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    plain_error = response(404, "nicht gefunden: é".encode("latin-1"), {"Content-Type": "text/plain; charset=latin-1"})
    with ScriptedHTTPServer([encoded, plain_error]) as server:
        client = FeatureClient(server.url, retries=0)
        assert client.datasets() == ["z"]
        with pytest.raises(ClientError) as info:
            client.datasets()
        assert info.value.status == 404 and info.value.detail == "nicht gefunden: é"
