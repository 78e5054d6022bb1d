"""``FeatureClient`` / ``RemoteFeatureArray`` against a real ``featurestore serve`` process: reads,
errors, tokens, byte caps, pickling and fork, requests counted per read and per loader batch, the
direct (no httpx client) request path, and store commands given a server's URL. The transport's
edge cases against scripted loopback servers (no mocks): tests/test_client_http_transport.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
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
from _server_fixtures import expected, make_store  # noqa: E402

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
