"""int8 splits over HTTP: the same values from the store on disk, on SeaweedFS (with and without
the chunk cache) and through the server (TestClient and ``featurestore serve``), codes with their
scales on the wire where they weigh less than the values, and one 400 line for a bad ``?dtype=``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

import featurestore
from client import FeatureClient
from featurestore import errors as fse
from featurestore.format import wire
from server import Settings, create_app

sys.path.insert(0, os.path.dirname(__file__))
from test_int8 import bag_values, vit_like

DENSE = ("ds", "enc", "i8")
BAGS = ("ds", "enc", "i8bags")
HALF = ("ds", "enc", "f16")
X = vit_like(75, seed=3)
DTYPES = (None, "float32", "float16")
LABELLED = ("ds", "enc", "i8labels")  # int8 with labels and sample ids
IDS = [f"slide-{i:03d}" for i in range(len(X))]


def write_all(url: str, **options: Any) -> None:
    """An int8 dense split (5 chunks), an int8 bag split and a float16 split at ``url``."""
    store = featurestore.open_store(url, mode="a", **options)
    for key, dtype in ((DENSE, "int8"), (HALF, "float16")):
        writer = store.create_split(*key, num_samples=len(X), sample_shape=X.shape[1:], dtype=dtype, chunk_rows=16)
        for lo in range(0, len(X), 7):
            writer.write(lo, X[lo:lo + 7])
        writer.commit()
    bags = store.create_bag_split(*BAGS, dim=16, dtype="int8", chunk_bytes=64 * 16)
    for name, values in bag_values(4).items():
        bags.add_bag(name, values)
    bags.commit()


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("int8http") / "store")
    write_all(root)
    writer = featurestore.open_store(root, mode="a").create_split(
        *LABELLED, num_samples=len(X), sample_shape=X.shape[1:], dtype="int8", chunk_rows=16,
        label_shape=(), label_dtype="int64", ids=IDS)
    writer.write(0, X, np.arange(len(X), dtype=np.int64) % 3)
    writer.commit()
    return root


@pytest.fixture(scope="module")
def served(local: str) -> Iterator[str]:
    from featurestore.testing.serving import serve_subprocess

    with serve_subprocess(local) as (url, _):
        yield url


@pytest.fixture
def testclient(local: str) -> Iterator[TestClient]:
    with TestClient(create_app(local, Settings())) as client:
        yield client


def dense_reads(reader: Any) -> list[np.ndarray]:
    """What a user reads: shuffled rows (every chunk), a contiguous run, one row; each dtype."""
    shuffled = np.random.default_rng(5).permutation(len(X))
    out = []
    for dtype in DTYPES:
        for index in (shuffled, np.arange(10, 40), [33], np.array([], np.int64)):
            out.append(reader.read_numpy(index, dtype=dtype))
    return out


def bag_reads(reader: Any) -> list[np.ndarray]:
    out = []
    for name in bag_values(4):
        length = int(reader.lengths[reader.position(name)])
        for rows in (None, slice(0, length // 2), [length - 1, 0, 0] if length else []):
            for dtype in DTYPES:
                features, coords = reader.read_numpy(name, rows=rows, dtype=dtype)
                out += [features, coords]
    return out


def same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def test_int8_dense_and_bag_splits_read_the_same_from_every_source(
        local: str, served: str, testclient: TestClient, tmp_path: Path, seaweed_url: str, seaweed: Any) -> None:
    store = featurestore.open_store(local)
    want_dense, want_bags = dense_reads(store.open(*DENSE)), bag_reads(store.open_bags(*BAGS))
    assert want_dense[0].dtype == np.int8 and want_dense[4].dtype == np.float32  # codes, then values
    write_all(seaweed_url, **seaweed.storage_options)
    for path, options in (("ranges", {}), ("cached", {"cache_dir": str(tmp_path / "cache")})):
        source = featurestore.open_store(seaweed_url, **options, **seaweed.storage_options)
        assert source.open(*DENSE).path == path  # ranged GETs, or chunks through the chunk cache
        same(dense_reads(source.open(*DENSE)), want_dense)
        same(bag_reads(source.open_bags(*BAGS)), want_bags)
    for client in (FeatureClient("http://testserver", http_client=testclient), FeatureClient(served)):
        same(dense_reads(client.open(*DENSE)), want_dense)
        same(bag_reads(client.open_bags(*BAGS)), want_bags)
        # the facade's reads, and torch reads of values (as locally: float32 for int8)
        index = [70, 3, 3, 41]
        same([client.read_numpy(*DENSE, index, dtype="float16"), client.item(*DENSE, 9),
              client.item(*DENSE, 9, dtype="float32"), client.read_bag_numpy(*BAGS, "s-03", dtype="float32")[0]],
             [store.open(*DENSE).read_numpy(index, dtype="float16"), store.open(*DENSE).read_numpy([9])[0],
              store.open(*DENSE).read_numpy([9], dtype="float32")[0],
              store.open_bags(*BAGS).read_numpy("s-03", dtype="float32")[0]])
        assert np.array_equal(client.read(*DENSE, index).numpy(), store.open(*DENSE).read(index).numpy())
        assert np.array_equal(client.read_bag(*BAGS, "s-04")[0].numpy(), store.open_bags(*BAGS).read("s-04")[0].numpy())
        features, labels = client.read_samples(*DENSE, index)
        assert labels is None and np.array_equal(features, store.open(*DENSE).read_numpy(index))


def test_codes_travel_with_their_scales_where_they_weigh_less(local: str) -> None:
    """A contiguous float32 read of an int8 split moves its codes and one scales row per chunk
    (here 0.32x the values' bytes, at 16 rows a chunk); a read of one row per chunk takes the
    server's values (codes and scales would weigh more); a bag takes codes and its one scales
    row. All equal local reads."""
    sent: list[tuple[str, int]] = []
    store = featurestore.open_store(local)
    with TestClient(create_app(local, Settings())) as testclient:
        testclient.event_hooks["response"].append(
            lambda response: sent.append((response.headers.get(wire.DTYPE_HEADER, ""),
                                          int(response.headers.get("content-length", 0)))))
        client = FeatureClient("http://testserver", http_client=testclient)
        rows = client.read_numpy(*DENSE, np.arange(75), dtype="float32")
        assert np.array_equal(rows, store.open(*DENSE).read_numpy(np.arange(75), dtype="float32"))
        assert sent[-1][0] == "int8" and sent[-1][1] == X.size + 5 * X[0].size * 4 <= 0.32 * X.nbytes
        sparse = np.arange(0, 75, 16)  # one row in each chunk
        assert np.array_equal(client.read_numpy(*DENSE, sparse, dtype="float16"),
                              store.open(*DENSE).read_numpy(sparse, dtype="float16"))
        assert sent[-1] == ("float16", len(sparse) * X[0].size * 2)
        features, _ = client.read_bag_numpy(*BAGS, "s-04", dtype="float32")
        assert np.array_equal(features, store.open_bags(*BAGS).read_numpy("s-04", dtype="float32")[0])
        assert sent[-1][0] == "int8" and sent[-1][1] == 300 * 16 + 300 * 2 * 8 + 16 * 4


def test_a_small_response_cap_splits_codes_and_scales_into_pieces(local: str) -> None:
    """Pieces of codes plus their scales rows stay under the server's cap (no 413) and are
    dequantized into the one output."""
    store = featurestore.open_store(local)
    sample = X[0].size
    with TestClient(create_app(local, Settings(max_response_bytes=20 * sample + 2 * 4 * sample))) as testclient:
        client = FeatureClient("http://testserver", http_client=testclient)
        for index in (np.arange(75), np.random.default_rng(1).permutation(75)[:40]):
            for dtype in DTYPES:
                assert np.array_equal(client.read_numpy(*DENSE, index, dtype=dtype),
                                      store.open(*DENSE).read_numpy(index, dtype=dtype))
        for name in bag_values(4):
            assert np.array_equal(client.read_bag_numpy(*BAGS, name, dtype="float32")[0],
                                  store.open_bags(*BAGS).read_numpy(name, dtype="float32")[0])


def test_the_routes_answer_values_by_default_and_refuse_a_bad_dtype_in_one_line(testclient: TestClient,
                                                                                local: str) -> None:
    store = featurestore.open_store(local)
    dense = "/v1/features/" + "/".join(DENSE)
    # no ?dtype=: float32 values, so a client that knows nothing of scales never takes codes for values
    answer = testclient.get(dense + "/batch", params={"start": 3, "stop": 9})
    assert answer.status_code == 200 and answer.headers[wire.DTYPE_HEADER] == "float32"
    assert wire.SCALES_SHAPE_HEADER not in answer.headers
    assert np.array_equal(np.frombuffer(answer.content, np.float32).reshape(6, *X.shape[1:]),
                          store.open(*DENSE).read_numpy(np.arange(3, 9), dtype="float32"))
    npy = testclient.get(dense + "/items/4", params={"dtype": "float16"}, headers={"Accept": wire.NPY})
    assert npy.status_code == 200 and npy.headers["content-type"] == wire.NPY
    # codes: rows of chunks 0 and 4 -> two scales rows, in chunk order
    codes = testclient.post(dense + "/batch", params={"dtype": "int8"}, json={"indices": [70, 2]})
    assert codes.headers[wire.DTYPE_HEADER] == "int8" and codes.headers[wire.SCALES_SHAPE_HEADER] == "2,6,32"
    table = store.open(*DENSE).scales.table()
    body = np.frombuffer(codes.content, np.uint8)
    assert np.array_equal(body[2 * X[0].size:].view(np.float32).reshape(2, 6, 32), table[[0, 4]])
    # a split other than int8 without ?dtype= answers as it always did
    half = testclient.get("/v1/features/" + "/".join(HALF) + "/items/1")
    assert half.headers[wire.DTYPE_HEADER] == "float16" and len(half.content) == X[0].size * 2
    bad = [(dense + "/items/0", {"dtype": "float64"}, {}), (dense + "/items/0", {"dtype": "int8"}, {"Accept": wire.NPY}),
           ("/v1/features/" + "/".join(HALF) + "/batch", {"dtype": "int8", "start": 0, "stop": 2}, {}),
           ("/v1/bags/" + "/".join(BAGS) + "/s-01", {"dtype": "bfloat16"}, {})]
    for path, params, headers in bad:
        answer = testclient.get(path, params=params, headers=headers)
        assert answer.status_code == 400, (path, params, answer.text)
        detail = answer.json()["detail"]
        assert "\n" not in detail and "dtype" in detail and params["dtype"] in detail
    client = FeatureClient("http://testserver", http_client=testclient)
    with pytest.raises(fse.DtypeMismatch, match="float64"):  # the local reader's error, before any request
        client.open(*DENSE).read_numpy([0], dtype="float64")
    with pytest.raises(fse.DtypeMismatch, match="float64"):
        client.open_bags(*BAGS).read_numpy("s-01", dtype="float64")


def test_features_and_labels_and_reads_by_id_of_an_int8_split(testclient: TestClient, local: str) -> None:
    """``read_samples`` (features and labels in one request: the codes' scales ride along) and
    ``read_ids`` answer the stored codes and the labels, as a local read of those rows does."""
    array = featurestore.open_store(local).open(*LABELLED)
    client = FeatureClient("http://testserver", http_client=testclient)
    index = np.array([74, 0, 31, 31, 16])
    features, labels = client.read_samples(*LABELLED, index)
    assert features.dtype == np.int8 and np.array_equal(features, array.read_numpy(index))
    assert labels is not None and np.array_equal(labels, array.labels.read_numpy(index))
    features, labels = client.read_ids(*LABELLED, [IDS[i] for i in index])
    assert np.array_equal(features, array.read_numpy(index)) and np.array_equal(labels, array.labels.read_numpy(index))
    assert np.array_equal(client.open(*LABELLED).read_numpy(index, dtype="float32"), array.read_numpy(index, dtype="float32"))
