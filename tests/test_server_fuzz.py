"""Property-based fuzz of every route (hypothesis, in-process): whatever the path, query, headers
or body, the server answers a 2xx/4xx, never a 5xx, and its 200 data answers are well formed."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from featurestore.format import wire  # noqa: E402
from server import Settings, create_app  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import make_store  # noqa: E402

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

names = st.one_of(
    st.sampled_from(["pannuke", "tiny", "train", "val", "f32", "writing", "other", "enc2", "test"]),
    st.sampled_from(["..", ".", "-x", "a" * 129, "%2e%2e", "a b", "zarr.json", "\x00", "é"]),
    st.text(min_size=1, max_size=12),
)
indices = st.one_of(st.integers(-(2**70), 2**70), st.integers(-3, 45), st.text(max_size=6))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
bodies = st.one_of(
    st.fixed_dictionaries({"indices": st.lists(st.integers(-5, 45), max_size=50)}),
    st.fixed_dictionaries({"indices": st.lists(json_values, max_size=5)}),
    json_values,
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Accept": st.sampled_from(["application/x-npy", "*/*", "application/x-npy;q=0", "text/html", "\t;q=x"]),
        "Range": st.one_of(st.sampled_from(["bytes=0-3", "bytes=-2", "bytes=5-", "bytes=9-1", "bytes=0-0,2-3",
                                            f"bytes={2**70}-", "bytes=-0", "items=0-1"]),
                           st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=10)),
    },
)  # fmt: skip


# A bag split beside the dense ones, with ids a path could trip over.
BAG_IDS = ["s0", "a/b", "..", "é x", "%2e", "empty"]


def _add_bags(path: str) -> None:
    import featurestore

    w = featurestore.open_store(path, mode="a").create_bag_split("pannuke", "tiny", "bags", dim=4,
                                                                 label_dtype="int64", chunk_bytes=3 * 4 * 2)
    for i, bag_id in enumerate(BAG_IDS):
        n = 0 if bag_id == "empty" else i + 2
        w.add_bag(bag_id, np.full((n, 4), i, np.float32), coords=np.zeros((n, 2), np.int64), label=i)
    w.commit()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    store = make_store(str(tmp_path_factory.mktemp("fuzz") / "store"))
    _add_bags(store)
    app = create_app(store, Settings(max_response_bytes=1024))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def _seg(value: str) -> str:
    return quote(value, safe="")


def _check(response: Any) -> None:
    assert response.status_code < 500, (response.request.method, response.request.url, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body.get("detail"), (str, list)), body
    elif response.headers.get("content-type") in (wire.SAMPLES_MEDIA, wire.BAG_MEDIA):
        total = 0
        for shape_h, dtype_h in ((wire.SHAPE_HEADER, wire.DTYPE_HEADER),
                                 (wire.LABELS_SHAPE_HEADER, wire.LABELS_DTYPE_HEADER),
                                 (wire.COORDS_SHAPE_HEADER, wire.COORDS_DTYPE_HEADER)):  # fmt: skip
            if shape_h in response.headers:
                shape = wire.parse_shape(response.headers[shape_h])
                total += int(np.prod(shape)) * wire.storage_dtype(response.headers[dtype_h]).itemsize
        assert len(response.content) == total
    elif wire.SHAPE_HEADER in response.headers and response.headers["content-type"] == wire.OCTET_STREAM:
        shape = wire.parse_shape(response.headers[wire.SHAPE_HEADER])
        dtype = wire.storage_dtype(response.headers[wire.DTYPE_HEADER])
        assert len(response.content) == int(np.prod(shape)) * dtype.itemsize


@FUZZ
@given(ds=names, enc=names, split=names, route=st.sampled_from(["", "/arrays", "/ids", "/items/{i}", "/batch"]),
       index=indices, start=indices, stop=indices, labels=st.sampled_from([None, "true", "false", "1", "x"]),
       hdrs=headers)  # fmt: skip
def test_get_routes_never_fail(client: TestClient, ds: str, enc: str, split: str, route: str, index: Any,
                               start: Any, stop: Any, labels: str | None, hdrs: dict[str, str]) -> None:  # fmt: skip
    path = f"/v1/features/{_seg(ds)}/{_seg(enc)}/{_seg(split)}" + route.replace("{i}", _seg(str(index)))
    params = {"start": str(start), "stop": str(stop)} if route == "/batch" else {}
    if labels is not None:
        params["labels"] = labels
    _check(client.get(path, params=params, headers=hdrs))


@FUZZ
@given(ds=st.sampled_from(["pannuke", "nope", ".."]), split=names, body=bodies, labels=st.sampled_from([None, "true"]),
       hdrs=headers, raw=st.one_of(st.none(), st.binary(max_size=30)), route=st.sampled_from(["batch", "samples"]),
       ctype=st.sampled_from(["application/json", wire.INDICES]))  # fmt: skip
def test_post_batch_never_fails(client: TestClient, ds: str, split: str, body: Any, labels: str | None,
                                hdrs: dict[str, str], raw: bytes | None, route: str, ctype: str) -> None:  # fmt: skip
    path = f"/v1/features/{_seg(ds)}/tiny/{_seg(split)}/{route}"
    params = {"labels": labels} if labels else {}
    if raw is not None:
        response = client.post(path, params=params, content=raw, headers={**hdrs, "content-type": ctype})
    else:
        response = client.post(path, params=params, content=json.dumps(body, allow_nan=True),
                               headers={**hdrs, "content-type": "application/json"})  # fmt: skip
    _check(response)


sample_ids = st.one_of(st.sampled_from(["img-000", "img-001", "img-039", "img-999", "", "é"]), st.text(max_size=8))
id_bodies = st.one_of(st.fixed_dictionaries({"ids": st.lists(sample_ids, max_size=60)}),
                      st.fixed_dictionaries({"ids": st.lists(json_values, max_size=5)}), json_values)


@FUZZ
@given(ds=st.sampled_from(["pannuke", "nope", ".."]), split=st.one_of(st.sampled_from(["train", "bags"]), names),
       body=id_bodies, raw=st.one_of(st.none(), st.binary(max_size=30)))  # fmt: skip
def test_post_by_id_never_fails(client: TestClient, ds: str, split: str, body: Any, raw: bytes | None) -> None:
    path = f"/v1/features/{_seg(ds)}/tiny/{_seg(split)}/by-id"
    content = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
    _check(client.post(path, content=content, headers={"content-type": "application/json"}))


@FUZZ
@given(parts=st.lists(names, min_size=0, max_size=6), hdrs=headers,
       prefix=st.sampled_from(["", "pannuke/tiny/train/features/", "pannuke/tiny/train/features/c/"]))  # fmt: skip
def test_zarr_route_never_fails_or_escapes(client: TestClient, parts: list[str], hdrs: dict[str, str], prefix: str) -> None:
    path = "/zarr/" + prefix + "/".join(_seg(p) for p in parts)
    response = client.get(path, headers=hdrs)
    _check(response)
    assert b"root:" not in response.content


@FUZZ
@given(ds=names, enc=names)
def test_listing_routes_never_fail(client: TestClient, ds: str, enc: str) -> None:
    _check(client.get(f"/v1/datasets/{_seg(ds)}/encoders"))
    _check(client.get(f"/v1/datasets/{_seg(ds)}/encoders/{_seg(enc)}/splits"))


bag_ids = st.one_of(st.sampled_from([*BAG_IDS, "nope", "", "../../zarr.json"]), st.text(max_size=12))


@FUZZ
@given(ds=st.one_of(st.sampled_from(["pannuke"]), names), split=st.sampled_from(["bags", "train", "writing", "nope"]),
       bag=bag_ids, start=st.one_of(st.none(), indices), stop=st.one_of(st.none(), indices),
       offset=indices, limit=indices, attrs=st.sampled_from([None, "true", "x"]), body=bodies,
       raw=st.one_of(st.none(), st.binary(max_size=30)), encoded=st.booleans())  # fmt: skip
def test_bag_routes_never_fail(client: TestClient, ds: str, split: str, bag: str, start: Any, stop: Any,
                               offset: Any, limit: Any, attrs: str | None, body: Any, raw: bytes | None,
                               encoded: bool) -> None:  # fmt: skip
    base = f"/v1/bags/{_seg(ds)}/tiny/{_seg(split)}"
    params = {k: str(v) for k, v in (("offset", offset), ("limit", limit), ("attrs", attrs)) if v is not None}
    _check(client.get(base, params=params))
    # encoded: as FeatureClient sends it; else slashes and dots raw (other clients', proxies' form)
    path = f"{base}/{wire.quote_bag_id(bag) if encoded else quote(bag, safe='/')}"
    rows = {k: str(v) for k, v in (("start", start), ("stop", stop)) if v is not None}
    response = client.get(path, params=rows)
    _check(response)
    assert b"root:" not in response.content
    if raw is not None:
        _check(client.post(path, content=raw, headers={"content-type": wire.INDICES}))
    else:
        _check(client.post(path, content=json.dumps(body, allow_nan=True),
                           headers={"content-type": "application/json"}))  # fmt: skip


def test_every_openapi_route_is_covered(client: TestClient) -> None:
    # If a route is added, this fuzz module must learn about it.
    known = {"/healthz", "/v1/datasets", "/v1/datasets/{dataset}/encoders",
             "/v1/datasets/{dataset}/encoders/{encoder}/splits", "/v1/features/{dataset}/{encoder}/{split}",
             "/v1/features/{dataset}/{encoder}/{split}/arrays", "/v1/features/{dataset}/{encoder}/{split}/ids",
             "/v1/features/{dataset}/{encoder}/{split}/items/{index}",
             "/v1/features/{dataset}/{encoder}/{split}/batch", "/v1/features/{dataset}/{encoder}/{split}/samples",
             "/v1/features/{dataset}/{encoder}/{split}/by-id", "/zarr/{key}", "/metrics", "/v1/bags/{dataset}/{encoder}/{split}",
             "/v1/bags/{dataset}/{encoder}/{split}/{bag_id}"}  # fmt: skip
    assert set(client.get("/openapi.json").json()["paths"]) == known
