"""The HTTP server in-process (``TestClient(create_app(...))``): routes, wire format, status codes,
auth, the raw Zarr key space and metrics."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from featurestore.format import wire  # noqa: E402
from server import Settings, create_app  # noqa: E402
from server.routes_zarr import parse_range, validate_key  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import expected, make_store, served_store  # noqa: E402

BASE = "/v1/features/pannuke/tiny"


store_path, client = served_store(make_store, "server")


def _array(response: Any) -> np.ndarray:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == wire.OCTET_STREAM
    shape = wire.parse_shape(response.headers[wire.SHAPE_HEADER])
    dtype = wire.storage_dtype(response.headers[wire.DTYPE_HEADER])
    assert int(response.headers["content-length"]) == len(response.content)
    return np.frombuffer(response.content, dtype).reshape(shape)


# ---------------------------------------------------------------------- listings and metadata
def test_healthz_and_listings(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/v1/datasets").json() == {"datasets": ["other", "pannuke"]}
    assert client.get("/v1/datasets/pannuke/encoders").json()["encoders"] == ["tiny"]
    body = client.get("/v1/datasets/pannuke/encoders/tiny/splits").json()
    assert body["splits"] == ["f32", "train", "val", "writing"]
    assert body["status"] == {"f32": "complete", "train": "complete", "val": "complete", "writing": "writing"}


def test_a_split_whose_document_is_unreadable_is_listed_beside_the_others(tmp_path: Any) -> None:
    import featurestore

    store = featurestore.open_store(str(tmp_path), mode="a")
    for split in ("a", "b"):
        writer = store.create_split("d", "e", split, num_samples=2, sample_shape=(4,), dtype="float16")
        writer.write(0, np.ones((2, 4), np.float32))
        writer.commit()
    (tmp_path / "d" / "e" / "a" / "zarr.json").write_text('{"garbage')
    with TestClient(create_app(settings=Settings(store=str(tmp_path)))) as client:
        response = client.get("/v1/datasets/d/encoders/e/splits")
        assert response.status_code == 200, response.text  # it was a 500 for the whole encoder
        body = response.json()
        assert body["splits"] == ["a", "b"] and body["status"] == {"a": "unreadable", "b": "complete"}
        assert body["kind"] == {"b": "dense"}
        assert "not valid JSON" in body["unreadable"]["a"] and str(tmp_path) not in body["unreadable"]["a"]
        assert client.get("/v1/features/d/e/b/batch", params={"start": 0, "stop": 2}).status_code == 200


def test_metadata_is_the_split_metadata(client: TestClient, store_path: str) -> None:
    import featurestore

    local = featurestore.open_store(store_path).open("pannuke", "tiny", "val").metadata
    remote = client.get(f"{BASE}/val").json()
    assert remote == json.loads(json.dumps(wire.json_safe(local)))
    assert remote["logical_dtype"] == "bfloat16" and remote["status"] == "complete"


def test_arrays_and_ids(client: TestClient) -> None:
    body = client.get(f"{BASE}/train/arrays").json()
    assert body["features"] == {"shape": [40, 4, 8], "dtype": "float16", "storage_dtype": "float16",
                                "sample_nbytes": 64, "chunk_rows": 5}  # fmt: skip
    assert body["labels"]["shape"] == [40] and body["labels"]["dtype"] == "int64"
    assert body["has_ids"] is True and body["max_response_bytes"] == 268435456
    assert client.get(f"{BASE}/train/ids").json()["ids"][:2] == ["img-000", "img-001"]
    assert client.get(f"{BASE}/val/arrays").json()["labels"] is None
    assert client.get(f"{BASE}/val/ids").status_code == 404


# ---------------------------------------------------------------------- data routes
def test_item(client: TestClient, store_path: str) -> None:
    response = client.get(f"{BASE}/train/items/7")
    assert response.headers[wire.SHAPE_HEADER] == "4,8"
    assert response.headers[wire.DTYPE_HEADER] == "float16"
    np.testing.assert_array_equal(_array(response), expected(store_path, "train", [7])[0])


def test_batch_range_and_post_indices(client: TestClient, store_path: str) -> None:
    got = _array(client.get(f"{BASE}/train/batch", params={"start": 3, "stop": 17}))
    assert got.shape == (14, 4, 8)
    np.testing.assert_array_equal(got, expected(store_path, "train", range(3, 17)))
    indices = [39, 0, 5, 5, 12, 4, 39]  # any order, duplicates, across chunks
    got = _array(client.post(f"{BASE}/train/batch", json={"indices": indices}))
    np.testing.assert_array_equal(got, expected(store_path, "train", indices))
    empty = client.post(f"{BASE}/train/batch", json={"indices": []})
    assert empty.headers[wire.SHAPE_HEADER] == "0,4,8" and empty.content == b""
    assert client.get(f"{BASE}/train/batch?start=4&stop=4").headers[wire.SHAPE_HEADER] == "0,4,8"


def test_labels(client: TestClient, store_path: str) -> None:
    got = _array(client.post(f"{BASE}/train/batch?labels=true", json={"indices": [3, 1]}))
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [30, 10])
    masks = client.get(f"{BASE}/f32/items/2?labels=true")
    assert masks.headers[wire.SHAPE_HEADER] == "2,2" and masks.headers[wire.DTYPE_HEADER] == "uint8"
    np.testing.assert_array_equal(_array(masks), expected(store_path, "f32", [2], labels=True)[0])
    missing = client.get(f"{BASE}/val/items/0?labels=true")
    assert missing.status_code == 404 and "no labels" in missing.json()["detail"]


def test_bfloat16_travels_as_uint16_bits(client: TestClient, store_path: str) -> None:
    response = client.post(f"{BASE}/val/batch", json={"indices": [2, 11]})
    assert response.headers[wire.DTYPE_HEADER] == "bfloat16"
    got = _array(response)
    assert got.dtype == np.dtype("<u2")
    np.testing.assert_array_equal(got, expected(store_path, "val", [2, 11]))
    import ml_dtypes

    np.testing.assert_array_equal(got.view(ml_dtypes.bfloat16).astype(np.float32)[:, 0, 0], [2.0, 11.0])


def test_npy_on_request(client: TestClient, store_path: str) -> None:
    response = client.post(f"{BASE}/train/batch", json={"indices": [1, 2, 3]},
                           headers={"Accept": "application/x-npy"})  # fmt: skip
    assert response.headers["content-type"] == wire.NPY
    assert response.headers[wire.SHAPE_HEADER] == "3,4,8"
    loaded = np.load(io.BytesIO(response.content))
    np.testing.assert_array_equal(loaded, expected(store_path, "train", [1, 2, 3]))
    one = np.load(io.BytesIO(client.get(f"{BASE}/val/items/1", headers={"Accept": wire.NPY}).content))
    assert one.dtype == np.dtype("<u2") and one.shape == (4, 8)


# ---------------------------------------------------------------------- status codes
@pytest.mark.parametrize(
    ("method", "url", "body", "status", "error"),
    [
        ("GET", "/v1/datasets/nope/encoders", None, 404, "DatasetNotFound"),
        ("GET", "/v1/datasets/pannuke/encoders/nope/splits", None, 404, "EncoderNotFound"),
        ("GET", f"{BASE}/nope", None, 404, "SplitNotFound"),
        ("GET", "/v1/features/nope/tiny/train/items/0", None, 404, "DatasetNotFound"),
        ("GET", "/v1/datasets/-bad/encoders", None, 400, "InvalidName"),
        ("GET", "/v1/features/pannuke/tiny/.hidden/items/0", None, 400, "InvalidName"),
        ("GET", "/v1/features/pannuke/ti%20ny/train", None, 400, "InvalidName"),
        ("GET", f"{BASE}/train/items/40", None, 416, "IndexOutOfRange"),
        ("GET", f"{BASE}/train/items/-1", None, 416, "IndexOutOfRange"),
        ("GET", f"{BASE}/train/items/{10**30}", None, 416, "IndexOutOfRange"),
        ("GET", f"{BASE}/train/items/abc", None, 400, "BadRequest"),
        ("GET", f"{BASE}/train/batch?start=0&stop=41", None, 416, "IndexOutOfRange"),
        ("GET", f"{BASE}/train/batch?start=-1&stop=2", None, 416, "IndexOutOfRange"),
        ("GET", f"{BASE}/train/batch?start=5&stop=2", None, 400, "BadRequest"),
        ("GET", f"{BASE}/train/batch?start=1", None, 400, "BadRequest"),
        ("GET", f"{BASE}/train/batch?start=0&stop=2&labels=maybe", None, 400, "BadRequest"),
        ("POST", f"{BASE}/train/batch", {"indices": [0, 40]}, 416, "IndexOutOfRange"),
        ("POST", f"{BASE}/train/batch", {"indices": [10**30]}, 416, "IndexOutOfRange"),
        ("POST", f"{BASE}/train/batch", {"indices": [-(10**30)]}, 416, "IndexOutOfRange"),
        ("POST", f"{BASE}/train/batch", {"indices": ["1"]}, 400, "BadRequest"),
        ("POST", f"{BASE}/train/batch", {"indices": [1.0]}, 400, "BadRequest"),
        ("POST", f"{BASE}/train/batch", {"indices": [True]}, 400, "BadRequest"),
        ("POST", f"{BASE}/train/batch", {"indices": 3}, 400, "BadRequest"),
        ("POST", f"{BASE}/train/batch", {"indices": [1], "extra": 1}, 400, "BadRequest"),
        ("POST", f"{BASE}/train/batch", {}, 400, "BadRequest"),
        ("POST", f"{BASE}/train/batch", [1, 2], 400, "BadRequest"),
        ("GET", f"{BASE}/writing", None, 409, "IncompleteSplit"),
        ("GET", f"{BASE}/writing/items/0", None, 409, "IncompleteSplit"),
        ("POST", f"{BASE}/writing/batch", {"indices": [0]}, 409, "IncompleteSplit"),
    ],
)  # fmt: skip
def test_status_codes(client: TestClient, method: str, url: str, body: Any, status: int, error: str) -> None:
    response = client.request(method, url, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"] == error
    assert isinstance(response.json()["detail"], str) and response.json()["detail"]


def test_malformed_json_body_is_400(client: TestClient) -> None:
    response = client.post(f"{BASE}/train/batch", content=b"{not json",
                           headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 400


def test_unknown_route_and_method(client: TestClient) -> None:
    assert client.get("/v2/nothing").status_code == 404
    assert client.delete(f"{BASE}/train/batch").status_code == 405


def test_byte_cap_is_413_with_advice(store_path: str) -> None:
    # 64 bytes per train sample; a 200-byte cap allows 3 per request.
    with TestClient(create_app(store_path, Settings(max_response_bytes=200))) as small:
        response = small.post(f"{BASE}/train/batch", json={"indices": [0, 1, 2, 3]})
        assert response.status_code == 413
        body = response.json()
        assert body["max_response_bytes"] == 200
        assert "200 bytes" in body["detail"] and "at most 3 samples" in body["detail"]
        assert small.get(f"{BASE}/train/batch?start=0&stop=4").status_code == 413
        assert small.post(f"{BASE}/train/batch", json={"indices": [0, 1, 2]}).status_code == 200
        assert small.get("/zarr/pannuke/tiny/train/features/c/0/0/0").status_code == 413
        assert small.get("/zarr/pannuke/tiny/train/features/c/0/0/0",
                         headers={"Range": "bytes=0-199"}).status_code == 206  # fmt: skip


# ---------------------------------------------------------------------- auth
def test_bearer_token(store_path: str) -> None:
    with TestClient(create_app(store_path, Settings(token="s3cret"))) as secured:
        assert secured.get("/healthz").status_code == 200
        for url in ("/v1/datasets", f"{BASE}/train/items/0", "/metrics", "/docs", "/openapi.json",
                    "/zarr/zarr.json", "/no/such/route"):  # fmt: skip
            response = secured.get(url)
            assert response.status_code == 401, url
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"] == "Unauthorized"
        for header in ("Bearer wrong", "Basic s3cret", "Bearer", "s3cret", "Bearer s3cret2"):
            assert secured.get("/v1/datasets", headers={"Authorization": header}).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert secured.get("/v1/datasets", headers=ok).status_code == 200
        assert secured.get(f"{BASE}/train/items/0", headers=ok).status_code == 200
        assert secured.get("/metrics", headers=ok).status_code == 200


def test_empty_token_means_no_auth(store_path: str) -> None:
    with TestClient(create_app(store_path, Settings(token=""))) as open_app:
        assert open_app.get("/v1/datasets").status_code == 200


# ---------------------------------------------------------------------- raw Zarr key space
def test_zarr_keys_and_ranges(client: TestClient, store_path: str) -> None:
    root = client.get("/zarr/zarr.json")
    assert root.status_code == 200 and root.json()["node_type"] == "group"
    assert root.headers["accept-ranges"] == "bytes"
    key = "pannuke/tiny/train/features/c/0/0/0"
    with open(os.path.join(store_path, key), "rb") as f:
        raw = f.read()
    assert client.get(f"/zarr/{key}").content == raw
    part = client.get(f"/zarr/{key}", headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == raw[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{len(raw)}"
    assert client.get(f"/zarr/{key}", headers={"Range": "bytes=-4"}).content == raw[-4:]
    assert client.get(f"/zarr/{key}", headers={"Range": "bytes=5-"}).content == raw[5:]
    assert client.get(f"/zarr/{key}", headers={"Range": f"bytes=5-{10**9}"}).content == raw[5:]
    beyond = client.get(f"/zarr/{key}", headers={"Range": f"bytes={len(raw)}-"})
    assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{len(raw)}"
    for ignored in ("bytes=0-1,4-5", "items=0-1"):  # RFC 9110: unsupported, send all
        response = client.get(f"/zarr/{key}", headers={"Range": ignored})
        assert response.status_code == 200 and response.content == raw, ignored
    for malformed in ("bytes=9-2", "bytes=x-", "bytes=-", "bytes=1-2-3", "bytes=" + "9" * 5000 + "x"):
        response = client.get(f"/zarr/{key}", headers={"Range": malformed})
        assert response.status_code == 400 and response.json()["error"] == "BadRequest", malformed
    huge = client.get(f"/zarr/{key}", headers={"Range": "bytes=" + "9" * 5000 + "-"})
    assert huge.status_code == 416  # well-formed, past the end; Python's int-digit limit never hit
    assert client.get(f"/zarr/{key}", headers={"Range": "bytes=0-" + "9" * 5000}).content == raw
    head = client.head(f"/zarr/{key}")
    assert head.status_code == 200 and head.headers["content-length"] == str(len(raw)) and head.content == b""
    assert client.head(f"/zarr/{key}", headers={"Range": "bytes=0-9"}).headers["content-length"] == "10"
    assert client.get("/zarr/pannuke/tiny/train/features/c/99/0/0").status_code == 404
    assert client.get("/zarr/pannuke/tiny").status_code == 404  # a directory


@pytest.mark.parametrize(
    "path",
    ["/zarr/%2e%2e/%2e%2e/etc/passwd", "/zarr/..%2f..%2fetc%2fpasswd", "/zarr/pannuke%2fzarr.json",
     "/zarr/%2E%2E/zarr.json", "/zarr/pannuke%5c..%5czarr.json", "/zarr/a/.../b", "/zarr/a//b",
     "/zarr/a%00b"],
)  # fmt: skip
def test_zarr_refuses_escapes(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code in (400, 404), response.text
    assert b"root:" not in response.content


def test_validate_key_directly() -> None:
    for bad in ("..", "a/../b", "./a", "a/./b", "a\\b", "", "a//b", "/a", "a/"):
        with pytest.raises(Exception) as info:
            validate_key(bad, b"/zarr/" + bad.encode())
        assert info.type.__name__ == "BadRequest"
    assert validate_key("ds/enc/split/features/c/0/0/0", b"/zarr/x") == "ds/enc/split/features/c/0/0/0"
    with pytest.raises(Exception):
        validate_key("zarr.json", b"/zarr/zarr%2ejson")


def test_parse_range_edges() -> None:
    assert parse_range(None, 10) is None
    assert parse_range("bytes=0-0", 10) == (0, 1)
    assert parse_range("bytes=-100", 10) == (0, 10)
    with pytest.raises(Exception):
        parse_range("bytes=-0", 10)
    with pytest.raises(Exception):
        parse_range("bytes=0-", 0)


def test_zarr_does_not_follow_symlinks_out_of_the_root(tmp_path: Any) -> None:
    store = make_store(str(tmp_path / "store"))
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    os.symlink(secret, os.path.join(store, "leak.json"))
    os.symlink(tmp_path, os.path.join(store, "up"))
    with TestClient(create_app(store)) as test_client:
        assert test_client.get("/zarr/leak.json").status_code == 404
        assert test_client.get("/zarr/up/secret.txt").status_code == 404
        assert test_client.get("/zarr/zarr.json").status_code == 200


# ---------------------------------------------------------------------- service routes
def test_metrics_count_requests(store_path: str) -> None:
    with TestClient(create_app(store_path)) as fresh:
        fresh.get(f"{BASE}/train/items/1")
        fresh.get(f"{BASE}/train/items/99")
        text = fresh.get("/metrics").text
    assert 'featurestore_http_requests_total{method="GET",route="/v1/features/{dataset}/{encoder}/{split}/items/{index}",status="200"} 1.0' in text
    assert 'status="416"} 1.0' in text
    assert "featurestore_http_request_duration_seconds_bucket" in text
    assert 'featurestore_http_response_bytes_total{route="/v1/features/{dataset}/{encoder}/{split}/items/{index}"} ' in text


def test_openapi_and_docs(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    for path in ("/healthz", "/v1/datasets", "/v1/datasets/{dataset}/encoders",
                 "/v1/datasets/{dataset}/encoders/{encoder}/splits", "/v1/features/{dataset}/{encoder}/{split}",
                 "/v1/features/{dataset}/{encoder}/{split}/items/{index}",
                 "/v1/features/{dataset}/{encoder}/{split}/batch", "/zarr/{key}", "/metrics"):  # fmt: skip
        assert path in spec["paths"], path
    assert set(spec["paths"]["/v1/features/{dataset}/{encoder}/{split}/batch"]) == {"get", "post"}
    assert client.get("/docs").status_code == 200


# ---------------------------------------------------------------------- settings and backends
def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch, store_path: str) -> None:
    monkeypatch.setenv("FEATURESTORE_STORE", store_path)
    monkeypatch.setenv("FEATURESTORE_TOKEN", "zq-secret-41")
    monkeypatch.setenv("FEATURESTORE_MAX_RESPONSE_BYTES", "1234")
    monkeypatch.setenv("FEATURESTORE_STORAGE_OPTIONS", '{"auto_mkdir": false}')
    settings = Settings()
    assert settings.store == store_path and settings.token_value() == "zq-secret-41"
    assert settings.max_response_bytes == 1234 and settings.storage_options == {"auto_mkdir": False}
    assert "zq-secret-41" not in repr(settings)
    with TestClient(create_app()) as from_env:
        assert from_env.get("/v1/datasets").status_code == 401


def test_factory_needs_a_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delenv("FEATURESTORE_STORE", raising=False)
    with pytest.raises(ValueError, match="FEATURESTORE_STORE"):
        create_app()
    from featurestore.errors import StoreNotFound

    with pytest.raises(StoreNotFound):
        create_app(str(tmp_path / "nothing-here"))


def test_serves_an_fsspec_memory_store(memory_url: str) -> None:
    make_store(memory_url)
    with TestClient(create_app(memory_url)) as mem:
        got = _array(mem.post(f"{BASE}/train/batch", json={"indices": [4, 0]}))
        np.testing.assert_array_equal(got, expected(memory_url, "train", [4, 0]))
        assert mem.get("/zarr/zarr.json").json()["zarr_format"] == 3
        assert mem.get("/zarr/pannuke/tiny/train/features/zarr.json", headers={"Range": "bytes=0-0"}).content == b"{"


def test_server_works_without_torch(store_path: str) -> None:
    code = f"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from fastapi.testclient import TestClient
from server import create_app
c = TestClient(create_app({store_path!r}))
assert c.post("/v1/features/pannuke/tiny/val/batch", json={{"indices": [1, 0]}}).status_code == 200
assert c.get("/v1/features/pannuke/tiny/train/batch?start=0&stop=3&labels=true").status_code == 200
assert c.get("/zarr/zarr.json").status_code == 200
assert c.get("/v1/features/pannuke/tiny/train").status_code == 200
print("torch" in sys.modules and sys.modules["torch"] is not None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_data_requests_read_the_split_document_only_when_it_changed(tmp_path: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Locally each request checks the split's document twice (before and after the gather):
    by a stat, its bytes read again only when the stat differs (a writer replaced it)."""
    import builtins

    path = make_store(str(tmp_path / "store"))
    document = os.path.join(path, "pannuke", "tiny", "train", "zarr.json")
    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, str) and os.path.abspath(file) == os.path.abspath(document):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    want = {index: expected(path, "train", [index]) for index in (3, 4, 5)}
    with TestClient(create_app(path, Settings())) as client:
        first = _array(client.get(f"{BASE}/train/items/3"))
        monkeypatch.setattr(builtins, "open", counting_open)
        for index in (3, 4, 5, 3):
            assert np.array_equal(_array(client.get(f"{BASE}/train/items/{index}"))[None], want[index])
        assert opened == []  # before: two reads of the document per request
        # A writer replaces the document (rename, as every write does): the next request sees it.
        with real_open(document, "rb") as f:
            doc = json.loads(f.read())
        old = doc["attributes"]["featurestore"]["generation"]
        new = ("1" if old[0] == "0" else "0") + old[1:]  # another generation, hex like every one
        doc["attributes"]["featurestore"]["generation"] = new
        tmp = document + ".tmp-test"
        with real_open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, document)
        response = client.get(f"{BASE}/train/items/3")
        assert response.status_code == 200 and len(opened) >= 1
        assert response.headers[wire.GENERATION_HEADER] == new
        assert np.array_equal(_array(response), first)


def test_labels_are_never_cast_by_dtype(tmp_path: Any) -> None:
    """?labels=true&dtype=float16 answered the integer labels as float16 (past 2048 they change)."""
    from fastapi.testclient import TestClient

    import featurestore
    from featurestore.format import wire
    from server import Settings, create_app

    writer = featurestore.open_store(str(tmp_path), mode="a").create_split(
        "d", "e", "s", num_samples=4, sample_shape=(2,), dtype="float16", label_dtype="int64")
    writer.write(0, np.zeros((4, 2), np.float32), np.array([0, 1, 2049, 3]))
    writer.commit()
    with TestClient(create_app(str(tmp_path), Settings())) as client:
        item = wire.route(wire.ITEM, dataset="d", encoder="e", split="s", index=2)
        cast = client.get(item, params={"labels": "true", "dtype": "float16"})
        assert cast.status_code == 400 and "labels=true answers the labels in their stored dtype" in cast.text
        plain = client.get(item, params={"labels": "true"})
        assert plain.status_code == 200 and plain.headers[wire.DTYPE_HEADER] == "int64"
