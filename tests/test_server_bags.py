"""Bag splits over HTTP: ``GET /v1/bags/...`` listing and one bag per request, through
``TestClient(create_app(...))`` and, once, through ``featurestore serve`` (uvicorn) on loopback.

Bag ids are data: every id below (slashes, ``..``, percent signs, spaces, unicode, names of files
that exist inside the store) must round-trip to its own bag and never reach the file system.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import featurestore  # noqa: E402
from client import FeatureClient  # noqa: E402
from featurestore import errors as fse  # noqa: E402
from featurestore.format import wire  # noqa: E402
from featurestore.format.bag_listing import BagsListing
from server import Settings, create_app  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import raw_get, served_store  # noqa: E402

DIM = 8
# Ids a slide name can hold, including every trick a path could play.
IDS = ["TCGA-A1-0001.svs", "a/b", "../../../../etc/passwd", "..", ".", "slide 1 (copy).svs", "é/ü 日本.ndpi",
       "%2e%2e%2fx", "a?b#c&d=e", "back\\slash", "zarr.json", "features/c/0/0", "/leading", "trailing/",
       "a//b", "empty", "TCGA\n02", "\nnewline first", "newline last\n", "cr\rlf\r\n", "tab\there",
       " leading space", "trailing space ", " ", "100%", "%", "nul\x00byte", "line\u2028separator", "a+b"]
LENGTHS = [5, 3, 7, 1, 2, 4, 6, 3, 2, 1, 2, 3, 1, 2, 3, 0,  # "empty": a slide with no tissue
           2, 1, 3, 2, 1, 2, 1, 1, 2, 1, 2, 1, 3]
LONG = "long-one"  # a bag spanning several chunks
LONG_ROWS = 150


def bag_values(i: int, n: int, dim: int = DIM) -> tuple[np.ndarray, np.ndarray]:
    features = (np.arange(n * dim, dtype=np.float32).reshape(n, dim) % 64 / 8 + i).astype(np.float32)
    coords = np.stack([np.arange(n) * 256 + i, np.arange(n) * 512], axis=1).astype(np.int64)
    return features, coords


def make_bag_store(path: str) -> str:
    store = featurestore.open_store(path, mode="a")
    # 16-row chunks: the long bag spans ten of them.
    w = store.create_bag_split("tcga", "uni", "train", dim=DIM, dtype="float16", label_dtype="int64",
                               patch_size_level0=256, chunk_bytes=16 * DIM * 2)
    for i, (bag_id, n) in enumerate(zip([*IDS, LONG], [*LENGTHS, LONG_ROWS])):
        features, coords = bag_values(i, n)
        w.add_bag(bag_id, features, coords=coords, label=i % 3, attrs={"mpp": 0.5, "index": i})
    w.commit()
    w = store.create_bag_split("tcga", "uni", "bf16", dim=DIM, dtype="bfloat16")
    for i in range(3):
        w.add_bag(f"s{i}", *bag_values(i, 4 + i))
    w.commit()
    w = store.create_bag_split("tcga", "uni", "writing", dim=DIM, dtype="float16")
    w.add_bag("only", *bag_values(0, 2))  # never committed
    w = store.create_split("tcga", "uni", "dense", num_samples=4, sample_shape=(DIM,), dtype="float16")
    w.write(0, np.ones((4, DIM), np.float32))
    w.commit()
    return path


def local(path: str, split: str, bag: int | str) -> tuple[np.ndarray, np.ndarray]:
    return featurestore.open_store(path).open_bags("tcga", "uni", split).read_numpy(bag)


store_path, app_client = served_store(make_bag_store, "bags", client="app_client")


@pytest.fixture(scope="module")
def fc(app_client: TestClient) -> FeatureClient:
    return FeatureClient("http://testserver", http_client=app_client)


def _bag(response: Any) -> tuple[np.ndarray, np.ndarray]:
    """Parse one bag response by the framing (features, then coordinates)."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == wire.BAG_MEDIA
    shape = wire.parse_shape(response.headers[wire.SHAPE_HEADER])
    dtype = wire.storage_dtype(response.headers[wire.DTYPE_HEADER])
    cshape = wire.parse_shape(response.headers[wire.COORDS_SHAPE_HEADER])
    cdtype = wire.storage_dtype(response.headers[wire.COORDS_DTYPE_HEADER])
    body = response.content
    assert int(response.headers["content-length"]) == len(body)
    split = int(np.prod(shape)) * dtype.itemsize
    assert len(body) == split + int(np.prod(cshape)) * cdtype.itemsize
    return np.frombuffer(body[:split], dtype).reshape(shape), np.frombuffer(body[split:], cdtype).reshape(cshape)


# ---------------------------------------------------------------------- listing
def test_listing(app_client: TestClient, store_path: str) -> None:
    doc = app_client.get("/v1/bags/tcga/uni/train").json()
    bags = featurestore.open_store(store_path).open_bags("tcga", "uni", "train")
    assert doc["ids"] == list(bags.ids) and sorted(doc["ids"]) == sorted([*IDS, LONG])
    assert doc["lengths"] == [int(n) for n in bags.lengths]
    assert doc["labels"] == [int(v) for v in bags.labels]
    assert (doc["dim"], doc["dtype"], doc["coords_dtype"], doc["coords_unit"]) == (DIM, "float16", "int64", "px")
    assert doc["count"] == len(IDS) + 1 and doc["next_offset"] is None and "attrs" not in doc
    assert doc["max_response_bytes"] == Settings().max_response_bytes
    listing = BagsListing.from_json(doc)
    assert listing.lengths.dtype == np.int64 and listing.generation == bags.metadata.get("generation")


def test_listing_pages_and_attrs(app_client: TestClient, fc: FeatureClient, store_path: str) -> None:
    page = app_client.get("/v1/bags/tcga/uni/train", params={"offset": 3, "limit": 5, "attrs": "true"}).json()
    bags = featurestore.open_store(store_path).open_bags("tcga", "uni", "train")
    assert page["ids"] == list(bags.ids[3:8]) and page["offset"] == 3 and page["next_offset"] == 8
    assert page["attrs"] == [bags.attrs(i) for i in range(3, 8)]
    assert app_client.get("/v1/bags/tcga/uni/train", params={"limit": 0}).status_code == 400
    assert app_client.get("/v1/bags/tcga/uni/train", params={"offset": 999}).json()["ids"] == []
    listing = fc.bags("tcga", "uni", "train", attrs=True)
    assert listing.ids == list(bags.ids) and listing.attrs == [bags.attrs(i) for i in range(len(bags))]


def test_splits_listing_says_kind(app_client: TestClient) -> None:
    doc = app_client.get("/v1/datasets/tcga/encoders/uni/splits").json()
    assert doc["kind"] == {"bf16": "bags", "dense": "dense", "train": "bags", "writing": "bags"}
    assert doc["status"]["writing"] == "writing"


# ---------------------------------------------------------------------- one bag
@pytest.mark.parametrize("bag_id", [*IDS, LONG])
def test_every_id_round_trips(app_client: TestClient, fc: FeatureClient, store_path: str, bag_id: str) -> None:
    want_f, want_c = local(store_path, "train", bag_id)
    got_f, got_c = _bag(app_client.get(wire.route(wire.BAG, dataset="tcga", encoder="uni", split="train",
                                                  bag_id=bag_id)))  # fmt: skip
    np.testing.assert_array_equal(got_f, want_f)
    np.testing.assert_array_equal(got_c, want_c)
    features, coords = fc.read_bag("tcga", "uni", "train", bag_id)
    assert features.dtype.__str__() == "torch.float16" and tuple(features.shape) == want_f.shape
    np.testing.assert_array_equal(features.numpy(), want_f)
    np.testing.assert_array_equal(coords.numpy(), want_c)


def test_read_by_position_rows_and_out(fc: FeatureClient, store_path: str) -> None:
    bags = fc.open_bags("tcga", "uni", "train")
    position = bags.index(LONG)
    want_f, want_c = local(store_path, "train", LONG)
    f, c = fc.read_bag_numpy("tcga", "uni", "train", position)
    np.testing.assert_array_equal(f, want_f)
    f, c = bags.read_numpy(LONG, rows=slice(20, 70))  # a row range across chunk boundaries (GET)
    np.testing.assert_array_equal(f, want_f[20:70])
    np.testing.assert_array_equal(c, want_c[20:70])
    rows = [149, 0, 17, 17, 64]  # any order, duplicates (POST)
    out = np.empty((5, DIM), np.float16)
    f, c = bags.read_numpy(LONG, rows=rows, out=out)
    assert f is out
    np.testing.assert_array_equal(f, want_f[rows])
    np.testing.assert_array_equal(c, want_c[rows])
    empty_f, empty_c = bags.read("empty")
    assert tuple(empty_f.shape) == (0, DIM) and tuple(empty_c.shape) == (0, 2)
    assert bags.attrs(LONG) == {"mpp": 0.5, "index": len(IDS)}
    with pytest.raises(fse.IndexOutOfRange):
        bags.read_numpy(LONG, rows=[150])
    with pytest.raises(fse.IndexOutOfRange):
        bags.read(len(bags))


def test_bfloat16_bag(fc: FeatureClient, store_path: str) -> None:
    features, coords = fc.read_bag("tcga", "uni", "bf16", "s2")
    want_f, want_c = local(store_path, "bf16", "s2")
    assert str(features.dtype) == "torch.bfloat16"
    np.testing.assert_array_equal(features.view(dtype=__import__("torch").uint16).numpy(), want_f)
    np.testing.assert_array_equal(coords.numpy(), want_c)


def test_empty_bag_on_the_wire(app_client: TestClient) -> None:
    f, c = _bag(app_client.get("/v1/bags/tcga/uni/train/empty"))
    assert f.shape == (0, DIM) and c.shape == (0, 2)


# ---------------------------------------------------------------------- refusals
def test_unknown_id_is_404(app_client: TestClient, fc: FeatureClient) -> None:
    for bag_id in ("nope", "TCGA-A1-0001", "a", "etc/passwd", "../store/zarr.json"):
        response = app_client.get(wire.route(wire.BAG, dataset="tcga", encoder="uni", split="train", bag_id=bag_id))
        assert response.status_code == 404, response.text
        assert response.json()["error"] == "BagNotFound"
    with pytest.raises(fse.BagNotFound):
        fc.read_bag("tcga", "uni", "train", "nope")
    with pytest.raises(fse.BagNotFound):  # the server's 404, raised as the same class
        fc.fetch_bag(wire.route(wire.BAG, dataset="tcga", encoder="uni", split="train", bag_id="nope"),
                     np.empty((0, DIM), np.float16), np.empty((0, 2), np.int64), "float16", "int64")


def test_unencoded_traversal_reaches_no_file(app_client: TestClient) -> None:
    # Sent raw (not percent-encoded): the rest of the path is one bag id, looked up, never opened.
    for path in ("/v1/bags/tcga/uni/train/../../../../etc/passwd", "/v1/bags/tcga/uni/train/zarr.json",
                 "/v1/bags/tcga/uni/train/features/c/0/0"):
        response = app_client.get(path)
        assert response.status_code in (200, 404), response.text
        if response.status_code == 200:  # only when that exact string is a bag id of the split
            bag_id = path.split("/v1/bags/tcga/uni/train/", 1)[1]
            assert bag_id in IDS
            assert b"root:" not in response.content


def test_rows_out_of_range_and_bad_range(app_client: TestClient) -> None:
    assert app_client.get("/v1/bags/tcga/uni/train/empty", params={"start": 0, "stop": 1}).status_code == 416
    assert app_client.get(f"/v1/bags/tcga/uni/train/{LONG}", params={"start": 5, "stop": 2}).status_code == 400
    response = app_client.post(f"/v1/bags/tcga/uni/train/{LONG}", json={"indices": [0, 150]})
    assert response.status_code == 416 and LONG in response.json()["detail"]


def test_kinds_do_not_mix(app_client: TestClient, fc: FeatureClient) -> None:
    response = app_client.get("/v1/bags/tcga/uni/dense")
    assert response.status_code == 404 and response.json()["error"] == "WrongSplitKind"
    response = app_client.get("/v1/features/tcga/uni/train/arrays")
    assert response.status_code == 404 and response.json()["error"] == "WrongSplitKind"
    with pytest.raises(fse.WrongSplitKind, match=r"a bag split, not a dense split: .*HTTP: FeatureClient.read_bag"):
        fc.open("tcga", "uni", "train")
    # the dense split itself is served as before
    assert app_client.get("/v1/features/tcga/uni/dense/batch", params={"start": 0, "stop": 4}).status_code == 200


def test_incomplete_bag_split_is_409(app_client: TestClient) -> None:
    for path in ("/v1/bags/tcga/uni/writing", "/v1/bags/tcga/uni/writing/only"):
        response = app_client.get(path)
        assert response.status_code == 409 and response.json()["error"] == "IncompleteSplit"


def test_byte_cap_413_and_client_reads_in_ranges(store_path: str) -> None:
    cap = 40 * (DIM * 2 + 16)  # 40 patches per response
    with TestClient(create_app(store_path, Settings(max_response_bytes=cap))) as small:
        response = small.get(f"/v1/bags/tcga/uni/train/{LONG}")
        assert response.status_code == 413
        body = response.json()
        assert body["max_response_bytes"] == cap
        assert f"{LONG_ROWS} patches" in body["detail"] and "at most 40 patches" in body["detail"]
        fc = FeatureClient("http://testserver", http_client=small)
        features, coords = fc.read_bag("tcga", "uni", "train", LONG)  # four requests, one tensor
        want_f, want_c = local(store_path, "train", LONG)
        np.testing.assert_array_equal(features.numpy(), want_f)
        np.testing.assert_array_equal(coords.numpy(), want_c)
        state = small.app.state.featurestore
        assert state.inflight_bytes == 0  # every reservation given back


def test_token(store_path: str) -> None:
    with TestClient(create_app(store_path, Settings(token="s3cret"))) as secured:
        assert secured.get("/v1/bags/tcga/uni/train").status_code == 401
        assert secured.get("/v1/bags/tcga/uni/train/a%2Fb").status_code == 401
        with pytest.raises(fse.FeatureStoreError) as info:
            FeatureClient("http://testserver", http_client=secured).read_bag("tcga", "uni", "train", "a/b")
        assert getattr(info.value, "status", None) == 401
        fc = FeatureClient("http://testserver", token="s3cret", http_client=secured)
        features, _ = fc.read_bag("tcga", "uni", "train", "a/b")
        np.testing.assert_array_equal(features.numpy(), local(store_path, "train", "a/b")[0])


# ---------------------------------------------------------------------- real uvicorn
def test_uvicorn_round_trip(store_path: str) -> None:
    pytest.importorskip("uvicorn")
    from featurestore.testing.serving import serve_subprocess

    with serve_subprocess(store_path) as (url, _):
        with FeatureClient(url) as fc:
            assert fc.split_kinds("tcga", "uni")["train"] == "bags"
            bags = fc.open_bags("tcga", "uni", "train")
            for bag_id in [*IDS, LONG]:
                features, coords = bags.read_numpy(bag_id)
                want_f, want_c = local(store_path, "train", bag_id)
                np.testing.assert_array_equal(features, want_f)
                np.testing.assert_array_equal(coords, want_c)
            with pytest.raises(fse.BagNotFound):
                fc.read_bag("tcga", "uni", "train", "../../zarr.json")
        # Byte for byte on the wire, no client normalisation: a raw "..", then encoded forms.
        for target in ("/v1/bags/tcga/uni/train/../../../../etc/passwd",
                       "/v1/bags/tcga/uni/train/%2E%2E%2F%2E%2E%2F%2E%2E%2F%2E%2E%2Fetc%2Fpasswd",
                       "/v1/bags/tcga/uni/../../../etc/passwd"):
            answer = raw_get(url, target)
            assert b"root:" not in answer
            status = int(answer.split(b" ", 2)[1])
            assert status in (200, 400, 404), answer[:300]
            if status == 200:  # only the bag whose id is exactly that string
                want_f, _ = local(store_path, "train", "../../../../etc/passwd")
                assert answer.split(b"\r\n\r\n", 1)[1][: want_f.nbytes] == want_f.tobytes()


def test_bag_loader_epoch_over_http_reads_every_id_with_the_token_from_the_environment(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A whole epoch of ``BagLoader`` over ``featurestore serve``: every bag, odd ids included
    (newlines), delivered in order; the dataset's client finds its token in FEATURESTORE_TOKEN."""
    pytest.importorskip("uvicorn")
    torch = pytest.importorskip("torch")
    from client import BagDataset, BagLoader
    from featurestore.testing.serving import serve_subprocess

    with serve_subprocess(store_path, env={"FEATURESTORE_TOKEN": "env-t0ken"}) as (url, _):
        monkeypatch.setenv("FEATURESTORE_TOKEN", "env-t0ken")
        ds = BagDataset(url, "tcga", "uni", "train")  # no token=: read from the environment
        bags = featurestore.open_store(store_path).open_bags("tcga", "uni", "train")
        loader = BagLoader(ds, batch_size=1, shuffle=False, device="cpu", dtype=None)
        with pytest.warns(UserWarning, match=r"1 empty bag\(s\) of tcga/uni/train left out of epoch 0"):
            seen = [features[0] for features, _, _, _ in loader]  # the empty bag is skipped, and said
        loader.close()
        want = [i for i in range(len(bags)) if bags.lengths[i] > 0]
        assert len(seen) == len(want)
        for got, i in zip(seen, want, strict=True):
            np.testing.assert_array_equal(got.numpy(), bags.read_numpy(i)[0])
        assert torch.is_tensor(seen[0])
        monkeypatch.delenv("FEATURESTORE_TOKEN")
        with pytest.raises(fse.FeatureStoreError) as info:
            BagDataset(url, "tcga", "uni", "train")
        assert getattr(info.value, "status", None) == 401 and "bearer token" in str(info.value)
