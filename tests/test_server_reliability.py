"""Reliability items 4, 12c, 13 and 14 of the server: ``/zarr`` bodies inside the in-flight budget
and clients that stop reading dropped (real ``featurestore serve`` processes, raw sockets, server
RSS); index bodies that are not plain JSON; symlinks out of the store, dotfiles and writers'
temporary files; error bodies that do not show where the store lives."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import featurestore  # noqa: E402
from client import FeatureClient  # noqa: E402
from featurestore import errors as fse  # noqa: E402
from featurestore.testing.serving import serve_subprocess  # noqa: E402
from featurestore.format import wire  # noqa: E402
from server import Settings, create_app  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import make_store, values  # noqa: E402
from test_faults_server import _get, _raw  # noqa: E402

MiB = 1 << 20
BIG_KEY = "/zarr/pannuke/tiny/big/features/c/0/0/0"  # one 32 MiB chunk


@pytest.fixture()
def store_path(tmp_path: Any) -> str:
    return make_store(str(tmp_path / "store"))


@pytest.fixture()
def client(store_path: str) -> Iterator[TestClient]:
    with TestClient(create_app(store_path, Settings())) as test_client:
        yield test_client


def _stalled(url: str, request: bytes) -> socket.socket:
    """A client that sends ``request`` and never reads a byte of the answer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(request)
    return sock


# ---------------------------------------------------------------------- 4: bounded /zarr bodies
def test_zarr_bodies_stay_in_the_budget_and_stalled_clients_are_dropped(store_path: str) -> None:
    store = featurestore.open_store(store_path, mode="a")
    writer = store.create_split("pannuke", "tiny", "big", num_samples=1, sample_shape=(16, MiB),
                                dtype="float16", chunk_rows=1)  # fmt: skip
    writer.write(0, np.full((1, 16, MiB), 0.5, np.float16))
    writer.commit()
    chunk = os.path.join(store_path, *BIG_KEY.split("/")[2:])
    with open(chunk, "rb") as f:
        stored = f.read()
    env = {"FEATURESTORE_MAX_INFLIGHT_BYTES": str(64 * MiB), "FEATURESTORE_INFLIGHT_WAIT_S": "0.5",
           "FEATURESTORE_SEND_TIMEOUT_S": "3", "FEATURESTORE_SEND_CHUNK_BYTES": str(MiB)}  # fmt: skip
    with serve_subprocess(store_path, env=env) as (url, proc):
        server = psutil.Process(proc.pid)
        assert _get(url, "/zarr/zarr.json")[0] == 200
        before = server.memory_info().rss
        request = f"GET {BIG_KEY} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        stalled = [_stalled(url, request) for _ in range(16)]
        try:
            time.sleep(1.5)  # two hold the budget, the rest waited 0.5 s for it and got 503
            grown = server.memory_info().rss - before
            print(f"\nserver RSS +{grown / MiB:.0f} MiB with 16 stalled 32 MiB /zarr reads")
            assert grown < 64 * MiB, f"RSS grew {grown / MiB:.0f} MiB (cap 64 MiB)"
            status, headers, raw = _get(url, BIG_KEY)
            assert status == 503 and headers["retry-after"] == "1", raw[:300]
            assert "FEATURESTORE_MAX_INFLIGHT_BYTES" in json.loads(raw)["detail"]
            time.sleep(3.5)  # past FEATURESTORE_SEND_TIMEOUT_S: the stalled ones were dropped
            status, _, body = _get(url, BIG_KEY)
            assert status == 200 and body == stored
            status, headers, body = _get(url, BIG_KEY, "Range: bytes=100-2097251\r\n")
            assert status == 206 and body == stored[100:2097252]
        finally:
            for sock in stalled:
                sock.close()
        assert proc.poll() is None


def test_v1_clients_that_stop_reading_give_the_budget_back(store_path: str) -> None:
    shape = (256, 384)  # 192 KiB float16 rows: 32 rows = 6 MiB
    store = featurestore.open_store(store_path, mode="a")
    writer = store.create_split("pannuke", "tiny", "big", num_samples=32, sample_shape=shape, dtype="float16")
    writer.write(0, values(32, shape))
    writer.commit()
    env = {"FEATURESTORE_MAX_INFLIGHT_BYTES": str(13 * MiB), "FEATURESTORE_INFLIGHT_WAIT_S": "0.5",
           "FEATURESTORE_SEND_TIMEOUT_S": "2"}  # fmt: skip
    body = wire.encode_indices(np.arange(32))
    request = (b"POST /v1/features/pannuke/tiny/big/batch HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (wire.INDICES.encode(), len(body), body))  # fmt: skip
    with serve_subprocess(store_path, env=env) as (url, _):
        stalled = [_stalled(url, request) for _ in range(2)]  # 12 MiB of the 13 MiB budget
        try:
            time.sleep(0.5)
            with FeatureClient(url, retries=0) as fc:
                with pytest.raises(fse.FeatureStoreError, match="FEATURESTORE_MAX_INFLIGHT_BYTES"):
                    fc.read_numpy("pannuke", "tiny", "big", np.arange(32))
                time.sleep(3)  # the stalled clients are still connected, but were dropped
                got = fc.read_numpy("pannuke", "tiny", "big", np.arange(32))
                np.testing.assert_array_equal(got, values(32, shape).astype(np.float16))
        finally:
            for sock in stalled:
                sock.close()


# ---------------------------------------------------------------------- 12c, 14c: index bodies
@pytest.mark.parametrize(
    ("body", "needle"),
    [(b'{"indices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
     (b'{"indices": [0], "indices": [5]}', "'indices' more than once")],
)  # fmt: skip
def test_index_json_that_is_not_plain_is_one_400_line(client: TestClient, body: bytes, needle: str) -> None:
    response = client.post("/v1/features/pannuke/tiny/train/batch", content=body,
                           headers={"Content-Type": "application/json"})  # fmt: skip
    assert response.status_code == 400, response.text[:300]
    detail = response.json()["detail"]
    assert needle in detail and "\n" not in detail
    assert client.get("/healthz").status_code == 200


def test_deep_index_json_over_the_wire_is_400_not_a_reset(store_path: str) -> None:
    body = b'{"indices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with serve_subprocess(store_path) as (url, _):
        status, _, raw = _raw(url, b"POST /v1/features/pannuke/tiny/train/batch HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nConnection: close\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        assert status == 400, raw[:300]


# ---------------------------------------------------------------------- 13: what is not the store
def test_symlinks_out_of_the_store_are_neither_listed_nor_served(store_path: str, tmp_path: Any,
                                                                 client: TestClient) -> None:  # fmt: skip
    other = make_store(str(tmp_path / "other"))
    os.symlink(os.path.join(other, "pannuke"), os.path.join(store_path, "linked"))
    os.symlink(os.path.join(other, "pannuke", "tiny", "val"), os.path.join(store_path, "pannuke", "tiny", "lval"))
    features = os.path.join(store_path, "pannuke", "tiny", "f32", "features")
    os.rename(features, features + "-moved")  # the split's features array points elsewhere
    os.symlink(os.path.join(other, "pannuke", "tiny", "f32", "features"), features)
    store = featurestore.open_store(store_path)
    assert store.datasets() == ["other", "pannuke"]
    assert "lval" not in store.splits("pannuke", "tiny")
    with pytest.raises(fse.DatasetNotFound, match="leads out of the store"):
        store.open("linked", "tiny", "train")
    with pytest.raises(fse.SplitNotFound, match="split pannuke/tiny/lval .*leads out of the store"):
        store.open("pannuke", "tiny", "lval")
    with pytest.raises(fse.SplitNotFound, match="array pannuke/tiny/f32/features .*leads out"):
        store.open("pannuke", "tiny", "f32")
    assert client.get("/v1/datasets").json()["datasets"] == ["other", "pannuke"]
    for target in ("/v1/features/linked/tiny/train/items/0", "/v1/features/pannuke/tiny/lval/batch?start=0&stop=2",
                   "/v1/features/pannuke/tiny/f32/items/0",
                   "/v1/datasets/linked/encoders", "/zarr/linked/tiny/train/zarr.json"):  # fmt: skip
        response = client.get(target)
        assert response.status_code == 404, (target, response.text[:300])
        assert str(tmp_path) not in response.text


def test_zarr_does_not_serve_dotfiles_or_temporary_files(store_path: str, client: TestClient) -> None:
    chunks = os.path.join(store_path, "pannuke", "tiny", "train", "features", "c")
    for path in (os.path.join(store_path, ".secret"), os.path.join(chunks, ".9.123.abcdef01.tmp"),
                 os.path.join(chunks, "9.tmp")):  # fmt: skip
        with open(path, "wb") as f:
            f.write(b"not a key")
    for key in (".secret", "pannuke/tiny/train/features/c/.9.123.abcdef01.tmp", "pannuke/tiny/train/features/c/9.tmp"):
        assert client.get(f"/zarr/{key}").status_code == 404, key
        assert client.head(f"/zarr/{key}").status_code == 404, key
    assert client.get("/zarr/pannuke/tiny/train/zarr.json").status_code == 200


# ---------------------------------------------------------------------- 14b: no server paths
def test_error_bodies_do_not_show_the_store_path(store_path: str, client: TestClient) -> None:
    os.remove(os.path.join(store_path, "pannuke", "tiny", "f32", "features", "c", "0", "0"))
    answers = {
        "/v1/features/pannuke/tiny/nope": (404, "pannuke/tiny"),
        "/v1/datasets/nope/encoders": (404, "'nope'"),
        "/v1/features/pannuke/tiny/writing/items/0": (409, "pannuke/tiny/writing"),
        "/v1/features/pannuke/tiny/f32/items/0": (500, "pannuke/tiny/f32"),
    }
    real = os.path.realpath(store_path)
    for target, (status, names) in answers.items():
        response = client.get(target)
        assert response.status_code == status, (target, response.text[:300])
        detail = response.json()["detail"]
        assert names in detail, detail
        assert store_path not in detail and real not in detail, detail


def test_an_object_store_outage_is_a_retryable_503(tmp_path: Any) -> None:
    """The S3 server behind `featurestore serve` goes away: the answer is 503 with Retry-After
    (it was a 500: clients and load balancers do not retry those), and reads work again once the
    object store is back, without restarting the server."""
    from _seaweed_restart import restartable_seaweed

    from featurestore.testing import stop_process

    with restartable_seaweed(tmp_path) as (server, restart):
        server.create_bucket("srv-outage")
        url, options = "s3://srv-outage/store", dict(server.storage_options)
        writer = featurestore.open_store(url, mode="a", **options).create_split(
            "d", "e", "s", num_samples=8, sample_shape=(4, 8), dtype="float16")
        data = np.arange(8 * 4 * 8, dtype=np.float32).reshape(8, 4, 8)
        writer.write(0, data)
        writer.commit()
        item = wire.route(wire.ITEM, dataset="d", encoder="e", split="s", index=3)
        with TestClient(create_app(url, Settings(storage_options=options))) as client:
            assert client.get(item).status_code == 200
            stop_process(server.process, grace=5)
            gone = client.get(wire.route(wire.ITEM, dataset="d", encoder="e", split="s", index=5))
            assert gone.status_code == 503 and gone.headers.get("Retry-After") == "5", gone.text
            assert gone.json()["error"] in ("StorageUnavailable", "StoreUnreachable"), gone.text
            restart()
            deadline = time.time() + 60  # the restarted server answers 5xx until its volumes are up
            while (back := client.get(item)).status_code != 200 and time.time() < deadline:
                assert back.status_code == 503, back.text
                time.sleep(1)
            assert back.status_code == 200, back.text


def test_a_damaged_split_document_is_a_500_not_the_stores_503(tmp_path: Any) -> None:
    """A split's zarr.json that is not JSON: one damaged part of the store, answered 500 as a
    damaged chunk is (it was 503 NotAFeatureStore, the answer for a missing store); the other
    splits are served."""
    root = make_store(str(tmp_path / "store"))
    (tmp_path / "store" / "pannuke" / "tiny" / "val" / "zarr.json").write_text("{not json")
    with TestClient(create_app(root, Settings())) as client:
        bad = client.get(wire.route(wire.ITEM, dataset="pannuke", encoder="tiny", split="val", index=0))
        assert bad.status_code == 500 and bad.json()["error"] == "InvalidMetadata", bad.text
        assert "is not valid JSON" in bad.json()["detail"] and "featurestore verify" in bad.json()["detail"]
        good = client.get(wire.route(wire.ITEM, dataset="pannuke", encoder="tiny", split="train", index=0))
        assert good.status_code == 200
