"""``FeatureClient`` / ``RemoteFeatureArray`` against a real ``featurestore serve`` process, plus
the transport's edge cases against scripted loopback servers (no mocks)."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import featurestore  # noqa: E402
from client import ClientError, FeatureClient  # noqa: E402
from client.http import RemoteFeatureArray  # noqa: E402
from featurestore import errors as fse  # noqa: E402
from featurestore.testing.serving import serve_subprocess  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import ScriptedHTTPServer, expected, make_store, response  # noqa: E402

KEY = ("pannuke", "tiny", "train")


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_store(str(tmp_path_factory.mktemp("client") / "store"))


@pytest.fixture(scope="module")
def server_url(store_path: str) -> Iterator[str]:
    with serve_subprocess(store_path) as (url, _):
        yield url


@pytest.fixture
def fc(server_url: str) -> Iterator[FeatureClient]:
    with FeatureClient(server_url, retries=1, backoff=0.01) as client:
        yield client


def test_import_client_does_not_import_the_server_stack() -> None:
    code = ("import sys, client; client.FeatureClient; client.ClientError; "
            "print(sorted({'fastapi', 'starlette', 'uvicorn', 'server', 'torch', 'pydantic_settings'} "
            "& set(sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_listings_and_info(fc: FeatureClient, store_path: str) -> None:
    assert fc.healthy()
    assert fc.datasets() == ["other", "pannuke"]
    assert fc.encoders("pannuke") == ["tiny"]
    assert fc.splits("pannuke", "tiny") == ["f32", "train", "val", "writing"]
    local = featurestore.open_store(store_path).open(*KEY)
    assert fc.info(*KEY) == json.loads(json.dumps(local.metadata))


def test_remote_array_mirrors_feature_array(fc: FeatureClient, store_path: str) -> None:
    local = featurestore.open_store(store_path).open(*KEY)
    remote = fc.open(*KEY)
    assert isinstance(remote, RemoteFeatureArray)
    for name in ("shape", "sample_shape", "dtype", "numpy_dtype", "sample_nbytes", "chunk_rows", "nbytes", "ids"):
        assert getattr(remote, name) == getattr(local, name), name
    assert len(remote) == len(local) and remote.metadata == json.loads(json.dumps(local.metadata))
    assert remote.labels is not None and local.labels is not None
    assert (remote.labels.shape, remote.labels.dtype) == (local.labels.shape, local.labels.dtype)
    assert fc.open("pannuke", "tiny", "val").labels is None
    assert fc.open(*KEY) is remote  # layouts are cached


def test_reads_match_the_local_reader(fc: FeatureClient, store_path: str) -> None:
    remote = fc.open(*KEY)
    rng = np.random.default_rng(0)
    for _ in range(5):
        index = rng.integers(0, 40, size=int(rng.integers(1, 30)))
        np.testing.assert_array_equal(remote.read_numpy(index), expected(store_path, "train", index))
    np.testing.assert_array_equal(remote.read_numpy([]), np.empty((0, 4, 8), np.float16))
    np.testing.assert_array_equal(remote.read_range(5, 25), expected(store_path, "train", range(5, 25)))
    np.testing.assert_array_equal(remote.read_numpy(7), expected(store_path, "train", [7]))
    out = np.zeros((3, 4, 8), np.float16)
    assert remote.read_numpy([3, 2, 1], out=out) is out
    np.testing.assert_array_equal(out, expected(store_path, "train", [3, 2, 1]))
    with pytest.raises(fse.ShapeMismatch):
        remote.read_numpy([1, 2], out=out)
    np.testing.assert_array_equal(fc.item(*KEY, 9), expected(store_path, "train", [9])[0])
    np.testing.assert_array_equal(fc.read_numpy(*KEY, [4, 4], labels=True), [40, 40])
    np.testing.assert_array_equal(fc.read_range("pannuke", "tiny", "f32", 1, 3, labels=True),
                                  expected(store_path, "f32", [1, 2], labels=True))  # fmt: skip


def test_read_returns_torch_tensors_of_the_stored_dtype(fc: FeatureClient, store_path: str) -> None:
    torch = pytest.importorskip("torch")
    tensor = fc.read(*KEY, torch.tensor([2, 0]))
    assert tensor.dtype == torch.float16 and tuple(tensor.shape) == (2, 4, 8)
    np.testing.assert_array_equal(tensor.numpy(), expected(store_path, "train", [2, 0]))
    bf16 = fc.read("pannuke", "tiny", "val", [3])
    assert bf16.dtype == torch.bfloat16
    assert bf16.float()[0, 0, 0].item() == 3.0
    local = featurestore.open_store(store_path).open("pannuke", "tiny", "val").read([3])
    assert torch.equal(bf16, local)


def test_errors_carry_status_detail_url_and_domain_class(fc: FeatureClient, server_url: str) -> None:
    with pytest.raises(fse.SplitNotFound) as info:
        fc.open("pannuke", "tiny", "nope")
    error = info.value
    assert isinstance(error, ClientError) and isinstance(error, LookupError)
    assert error.status == 404 and "nope" in str(error.detail)
    assert error.url == f"{server_url}/v1/features/pannuke/tiny/nope/arrays"
    with pytest.raises(fse.DatasetNotFound):
        fc.encoders("missing")
    with pytest.raises(fse.InvalidName):  # refused by the client, before any request
        fc.info("pannuke", "tiny", ".x")
    with pytest.raises(fse.InvalidName) as bad:  # and by the server (400), e.g. a raw request
        fc.get_json("/v1/features/pannuke/tiny/.x")
    assert bad.value.status == 400
    with pytest.raises(fse.IncompleteSplit) as incomplete:
        fc.read_numpy("pannuke", "tiny", "writing", [0])
    assert incomplete.value.status == 409
    with pytest.raises(fse.IndexOutOfRange):
        fc.open(*KEY).read_numpy([40])
    with pytest.raises(fse.IndexOutOfRange):
        fc.item(*KEY, 40)  # the server's 416, as the same class
    with pytest.raises(ClientError, match="no labels"):
        fc.read_numpy("pannuke", "tiny", "val", [0], labels=True)


def test_token(store_path: str) -> None:
    with serve_subprocess(store_path, env={"MY_TOKEN": "t0k3n"}, args=("--token-env", "MY_TOKEN")) as (url, _):
        with pytest.raises(ClientError) as info:
            FeatureClient(url, retries=0).datasets()
        assert info.value.status == 401
        with pytest.raises(ClientError):
            FeatureClient(url, token="wrong", retries=0).datasets()
        with FeatureClient(url, token="t0k3n") as authed:
            assert authed.datasets() == ["other", "pannuke"]
            np.testing.assert_array_equal(authed.open(*KEY).read_numpy([1]),
                                          expected(store_path, "train", [1]))  # fmt: skip


def test_token_from_the_environment(store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without token=, the client (and the datasets over http) read FEATURESTORE_TOKEN, as
    `featurestore probe` does; token= wins, and token="" sends none."""
    from client import FeatureDataset

    with serve_subprocess(store_path, env={"FEATURESTORE_TOKEN": "t0k3n"}) as (url, _):
        monkeypatch.setenv("FEATURESTORE_TOKEN", "t0k3n")
        with FeatureClient(url, retries=0) as from_env:
            assert from_env.datasets() == ["other", "pannuke"]
        assert len(FeatureDataset(url, *KEY)) == 40
        for token in ("wrong", ""):
            with pytest.raises(ClientError) as info:
                FeatureClient(url, token=token, retries=0).datasets()
            assert info.value.status == 401
            assert "missing or wrong bearer token: send 'Authorization: Bearer <token>'" in str(info.value)
            assert "FeatureDataset and BagDataset take token=, else read $FEATURESTORE_TOKEN" in str(info.value)
        monkeypatch.setenv("FEATURESTORE_TOKEN", "wrong")
        with FeatureClient(url, token="t0k3n", retries=0) as explicit:
            assert explicit.datasets() == ["other", "pannuke"]


def test_no_server_at_the_url_says_so() -> None:
    from featurestore.testing.serving import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ClientError, match=rf"failed after 1 attempts: .*: is a server running at {url}\?"):
        FeatureClient(url, retries=0).datasets()


def test_reads_over_the_byte_cap_are_split(store_path: str) -> None:
    # 64 bytes per sample and a 200-byte cap: at most 3 samples per request.
    with serve_subprocess(store_path, args=("--max-response-bytes", "200")) as (url, _):
        with FeatureClient(url) as small:
            remote = small.open(*KEY)
            assert remote.max_response_bytes == 200
            index = np.random.default_rng(1).permutation(40)
            np.testing.assert_array_equal(remote.read_numpy(index), expected(store_path, "train", index))
            np.testing.assert_array_equal(remote.read_range(0, 40), expected(store_path, "train", range(40)))
            metrics = small.http.get(url + "/metrics").text
        served = [line for line in metrics.splitlines()
                  if line.startswith("featurestore_http_requests_total") and "/batch" in line]  # fmt: skip
        assert sum(float(line.rsplit(" ", 1)[1]) for line in served) >= 2 * 14


def test_pickle_and_fork(fc: FeatureClient, store_path: str) -> None:
    remote = fc.open(*KEY)
    remote.read_numpy([0])  # open a pooled connection in this process
    clone = pickle.loads(pickle.dumps(remote))
    np.testing.assert_array_equal(clone.read_numpy([5, 6]), expected(store_path, "train", [5, 6]))
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        results = pool.map(_read_in_child, [(remote, [i, 39 - i]) for i in range(4)])
    for i, got in enumerate(results):
        np.testing.assert_array_equal(got, expected(store_path, "train", [i, 39 - i]))
    np.testing.assert_array_equal(remote.read_numpy([1]), expected(store_path, "train", [1]))


def _read_in_child(job: tuple[RemoteFeatureArray, list[int]]) -> np.ndarray:
    remote, index = job
    return remote.read_numpy(index)


def test_in_process_test_client_path(store_path: str) -> None:
    from fastapi.testclient import TestClient

    from server import create_app

    with TestClient(create_app(store_path)) as test_client:
        fc = FeatureClient("http://testserver", http_client=test_client)
        index = [9, 1, 1]
        np.testing.assert_array_equal(fc.read_numpy(*KEY, index), expected(store_path, "train", index))


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


def _requests_by_route(url: str) -> dict[str, float]:
    import httpx

    counts: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("featurestore_http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            route = labels.split('route="')[1].split('"')[0]
            if route != "/metrics":  # the scrape itself
                counts[route] = counts.get(route, 0) + float(value)
    return counts


def test_features_and_labels_in_one_request(fc: FeatureClient, store_path: str, server_url: str) -> None:
    index = [7, 3, 3, 39, 0]
    fc.open(*KEY)  # the split's structure: one request, cached
    before = _requests_by_route(server_url)
    features, labels = fc.read_samples(*KEY, index)
    after = _requests_by_route(server_url)
    np.testing.assert_array_equal(features, expected(store_path, "train", index))
    assert labels is not None
    np.testing.assert_array_equal(labels, expected(store_path, "train", index, labels=True))
    samples = "/v1/features/{dataset}/{encoder}/{split}/samples"
    assert after.get(samples, 0) - before.get(samples, 0) == 1
    assert sum(after.values()) - sum(before.values()) == 1
    features, no_labels = fc.read_samples("pannuke", "tiny", "val", [2, 1])
    assert no_labels is None
    np.testing.assert_array_equal(features, expected(store_path, "val", [2, 1]))
    # Pieces over the server's byte cap: still one request per piece, rows in order.
    arr = fc.open(*KEY)
    out = np.empty((40, 4, 8), np.float16)
    lab = np.empty(40, np.int64)
    arr.read_into(np.arange(40)[::-1], out, lab)
    np.testing.assert_array_equal(out, expected(store_path, "train", np.arange(40)[::-1]))
    np.testing.assert_array_equal(lab, expected(store_path, "train", np.arange(40)[::-1], labels=True))


def test_loader_over_http_makes_one_request_per_batch(store_path: str, server_url: str) -> None:
    pytest.importorskip("torch")
    from client import FeatureDataset, FeatureLoader

    ds = FeatureDataset(server_url, *KEY)
    loader = FeatureLoader(ds, batch_size=8, shuffle=True, seed=3, num_threads=2, device="cpu")
    ds.array  # opened (one /arrays request) before counting
    before = _requests_by_route(server_url)
    got = [(f.numpy().copy(), y.numpy().copy()) for f, y in loader]
    after = _requests_by_route(server_url)
    assert len(got) == 5
    assert sum(after.values()) - sum(before.values()) == 5  # one per batch: features with labels
    for features, labels in got:
        rows = labels // 10  # labels are 10 x the row index
        np.testing.assert_array_equal(features, expected(store_path, "train", rows))


def test_a_new_client_of_an_http_server_builds_no_tls_transport(server_url: str, store_path: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx's transport builds an SSL context and loads the CA bundle when made (~25 ms quiet,
    150 ms on a busy host): a client of a plain http:// server, a FeatureDataset or a loader per
    fold, must not pay it before its first read; an https:// URL still gets it, when first asked."""
    import httpx

    made: list[object] = []
    real = httpx.HTTPTransport

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(httpx, "HTTPTransport", Counting)
    with FeatureClient(server_url) as client:
        got = client.open(*KEY).read_numpy(np.array([3, 1]))
        assert np.array_equal(got, expected(store_path, "train", [3, 1]))
    assert made == []  # before: one per client, made with the client
    with FeatureClient("https://127.0.0.1:9", retries=0, timeout=2) as tls:
        with pytest.raises(ClientError):
            tls.datasets()  # nothing listens there; what matters is that the TLS transport served it
    assert len(made) == 1


def test_plain_http_requests_skip_httpx_client(server_url: str, store_path: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx's client (URL parsing, header merging, cookies, auth and redirect hooks) was about a
    third of a single item's client time: where httpx would route a request to the default
    transport anyway, the request goes to it straight."""
    import httpx

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("went through httpx.Client.send")

    monkeypatch.setattr(httpx.Client, "send", refuse)
    with FeatureClient(server_url, retries=0) as client:
        assert "pannuke" in client.datasets()
        np.testing.assert_array_equal(client.item(*KEY, 3), expected(store_path, "train", [3])[0])
        np.testing.assert_array_equal(client.open(*KEY).read_numpy([4, 2]), expected(store_path, "train", [4, 2]))


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


def test_a_server_url_given_to_a_store_command_says_what_reads_a_server(server_url: str, tmp_path: Any) -> None:
    """ls/info on ``featurestore serve``'s address, and any write to an http:// store: one line each,
    naming the doors that read a server and where writes go, nothing attempted on the server."""
    with pytest.raises(fse.StoreNotFound, match="a featurestore server .* is read with FeatureClient"):
        featurestore.open_store(server_url)
    with pytest.raises(fse.ReadOnlyStore, match="is read-only: HTTP serves reads"):
        featurestore.open_store(server_url, mode="a")
    cli = [sys.executable, "-m", "featurestore.cli"]
    ls = subprocess.run([*cli, "ls", server_url], capture_output=True, text=True, timeout=120)
    assert ls.returncode != 0 and "featurestore probe URL" in ls.stderr and "Traceback" not in ls.stderr, ls.stderr
    images = tmp_path / "images.npy"
    np.save(images, np.zeros((2, 32, 32, 3), np.uint8))
    extract = subprocess.run([*cli, "extract", "--images", f"npy:{images}", "--encoder", "builtin:tiny-vit",
                              "--store", server_url, "--dataset", "d", "--split", "s", "--no-progress"],
                             capture_output=True, text=True, timeout=120)
    assert extract.returncode != 0 and "Traceback" not in extract.stderr, extract.stderr
    assert extract.stderr.strip().splitlines()[-1].endswith("write to the store's own path or s3:// URL")
