"""Slide embeddings ``[n, E]`` read by id: ``FeatureArray.positions_of`` in the store, the server's
by-id route and ``FeatureClient.read_ids`` over real uvicorn, and ``FeatureDataset`` /
``FeatureLoader`` epochs over such a split locally and over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import featurestore  # noqa: E402
from client import FeatureClient, FeatureDataset, FeatureLoader  # noqa: E402
from featurestore import errors as fse  # noqa: E402
from featurestore.testing.serving import serve_subprocess  # noqa: E402

E = 12
IDS = [f"TCGA-{k:02d}-DX{k % 3}" for k in range(21)]


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("byid") / "store")
    store = featurestore.open_store(root, mode="a")
    features = np.arange(len(IDS) * E, dtype=np.float32).reshape(len(IDS), E)
    w = store.create_split("cohort", "slide-mean", "all", num_samples=len(IDS), sample_shape=(E,), dtype="float32",
                           label_shape=(), label_dtype="int64", ids=IDS, chunk_rows=4)
    w.write(0, features, np.arange(len(IDS), dtype=np.int64) % 2)
    w.commit()
    w = store.create_split("cohort", "noids", "all", num_samples=3, sample_shape=(E,), dtype="float32")
    w.write(0, np.zeros((3, E), np.float32))
    w.commit()
    return root


@pytest.fixture(scope="module")
def server_url(store_path: str) -> Iterator[str]:
    with serve_subprocess(store_path) as (url, _):
        yield url


def test_positions_of_in_the_store(store_path: str) -> None:
    arr = featurestore.open_store(store_path).open("cohort", "slide-mean", "all")
    assert arr.positions_of([IDS[5], IDS[0], IDS[5]]).tolist() == [5, 0, 5]
    with pytest.raises(fse.SampleNotFound, match=r"no sample 'TCGA-99' in split .*check the id"):
        arr.positions_of([IDS[1], "TCGA-99"])
    with pytest.raises(fse.InvalidIndices, match="not one str"):
        arr.positions_of(IDS[1])
    with pytest.raises(fse.SampleNotFound, match="has no sample ids"):
        featurestore.open_store(store_path).open("cohort", "noids", "all").positions_of(["a"])


def test_read_ids_over_http(store_path: str, server_url: str) -> None:
    arr = featurestore.open_store(store_path).open("cohort", "slide-mean", "all")
    wanted = [IDS[7], IDS[2], IDS[20], IDS[7]]
    with FeatureClient(server_url, retries=0) as fc:
        features, labels = fc.read_ids("cohort", "slide-mean", "all", wanted)
        assert np.array_equal(features, arr.read_numpy([7, 2, 20, 7]))
        assert labels is not None and labels.tolist() == [1, 0, 0, 1]
        with pytest.raises(fse.SampleNotFound, match="no sample 'nope'"):
            fc.read_ids("cohort", "slide-mean", "all", [IDS[0], "nope"])
        with pytest.raises(fse.SampleNotFound, match="has no sample ids"):
            fc.read_ids("cohort", "noids", "all", ["a"])
        remote = fc.open("cohort", "slide-mean", "all")  # the local reader's helper, over HTTP
        assert remote.positions_of([IDS[3], IDS[1]]).tolist() == [3, 1]
        with pytest.raises(fse.SampleNotFound, match="no sample 'nope'"):
            remote.positions_of(["nope"])
        empty, no_labels = fc.read_ids("cohort", "slide-mean", "all", [])
        assert empty.shape == (0, E) and no_labels is not None and no_labels.shape == (0,)
        response = fc.http.post(server_url + "/v1/features/cohort/slide-mean/all/by-id", content=b'{"ids": [1]}',
                                headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and "list of strings" in response.text


def _by_id_requests(fc: FeatureClient, url: str) -> float:
    lines = [line for line in fc.http.get(url + "/metrics").text.splitlines()
             if line.startswith("featurestore_http_requests_total") and "/by-id" in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_read_ids_is_one_request_and_pieces_over_the_byte_cap(store_path: str) -> None:
    arr = featurestore.open_store(store_path).open("cohort", "slide-mean", "all")
    wanted = IDS[::-1]
    # 48 + 8 bytes per sample and a 200-byte cap: 3 samples per answer, so 7 requests for 21 ids.
    for cap, requests in (("1048576", 1), ("200", 7)):
        with serve_subprocess(store_path, args=("--max-response-bytes", cap)) as (url, _):
            with FeatureClient(url, retries=0) as fc:
                features, labels = fc.read_ids("cohort", "slide-mean", "all", wanted)
                assert _by_id_requests(fc, url) == requests
        assert np.array_equal(features, arr.read_numpy(list(range(len(IDS)))[::-1]))
        assert labels is not None and labels.tolist() == [k % 2 for k in range(len(IDS))][::-1]


@pytest.mark.parametrize("where", ["local", "http"])
def test_a_loader_epoch_over_an_embedding_split(where: str, store_path: str, server_url: str) -> None:
    source = store_path if where == "local" else server_url
    ds = FeatureDataset(source, "cohort", "slide-mean", "all")
    assert ds.num_samples == len(IDS) and tuple(ds.sample_shape) == (E,)
    seen = []
    for features, labels in FeatureLoader(ds, batch_size=5, shuffle=True, seed=1, device="cpu",
                                          dtype=torch.float32):
        assert features.shape[1:] == (E,)
        assert torch.equal(labels, (features[:, 0] // E).long() % 2)
        seen += (features[:, 0] // E).long().tolist()
    assert sorted(seen) == list(range(len(IDS)))
    rows = []
    for features, labels in torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True):
        assert features.shape[1:] == (E,) and labels.dtype == torch.int64
        rows += (features[:, 0] // E).long().tolist()
    assert sorted(rows) == list(range(len(IDS)))
