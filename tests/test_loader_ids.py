"""``FeatureLoader(return_ids=True)``: each batch says which samples it holds (an embedding split's
slide or patient ids), in batch order, on a store path and over HTTP; a split without ids is
refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import featurestore
from client import FeatureDataset, FeatureLoader
from featurestore.errors import InvalidOption
from featurestore.testing.serving import serve_subprocess

IDS = [f"case-{k:02d}" for k in range(23)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("ids") / "store")
    store = featurestore.open_store(path, mode="a")
    values = np.arange(23 * 4, dtype=np.float32).reshape(23, 4)
    for split, ids in (("with", IDS), ("without", None)):
        writer = store.create_split("d", "e", split, num_samples=23, sample_shape=(4,), dtype="float32",
                                    label_dtype="int64", ids=ids)
        writer.write(0, values, labels=np.arange(23) % 2)
        writer.commit()
    return path


def test_batches_carry_their_sample_ids_in_order(root: str) -> None:
    with serve_subprocess(root) as (url, _):
        for source in (root, url):
            ds = FeatureDataset(source, "d", "e", "with")
            loader = FeatureLoader(ds, batch_size=5, shuffle=True, seed=3, device="cpu", return_ids=True)
            seen = []
            for (features, labels, ids), index in zip(loader, loader.plan(), strict=True):
                assert ids == [IDS[int(i)] for i in index], source
                assert torch.equal(features[:, 0], torch.from_numpy(index.astype(np.float32) * 4))
                assert labels.tolist() == [int(i) % 2 for i in index]
                seen += ids
            assert sorted(seen) == IDS
            plain = next(iter(FeatureLoader(ds, batch_size=5, device="cpu")))
            assert len(plain) == 2  # without return_ids: (features, labels) as before


def test_a_split_without_ids_is_refused(root: str) -> None:
    with pytest.raises(InvalidOption, match="return_ids=True needs sample ids, and d/e/without has none"):
        FeatureLoader(FeatureDataset(root, "d", "e", "without"), device="cpu", return_ids=True)
