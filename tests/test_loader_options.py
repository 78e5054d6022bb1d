"""Both loaders check their shared options in one place (client/loader_options.py): the same bad
argument is refused by FeatureLoader and BagLoader with the same one-line InvalidOption."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from client import BagDataset, BagLoader, FeatureDataset, FeatureLoader
from featurestore import open_store
from featurestore.errors import InvalidOption

BAD: list[tuple[dict[str, Any], str]] = [
    ({"batch_size": 0}, "`batch_size` must be an integer >= 1"),
    ({"batch_size": True}, "`batch_size` must be an integer >= 1"),
    ({"prefetch": 0}, "`prefetch` must be an integer >= 1"),
    ({"seed": -1}, "`seed` must be an integer >= 0"),
    ({"world_size": 0}, "`world_size` must be an integer >= 1"),
    ({"rank": 2, "world_size": 2}, r"`rank` must be in \[0, world_size=2\)"),
    ({"dtype": torch.int64}, "`dtype` must be a floating torch dtype"),
    ({"dtype": "float32"}, "but got: 'float32': pass torch.float32, not the string"),
    ({"pin_memory": "yes"}, "`pin_memory` must be 'auto', True or False"),
    ({"num_threads": 0}, "`num_threads` must be a positive integer or None"),
    ({"num_threads": True}, "`num_threads` must be a positive integer or None"),  # a bool is no thread count
]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[FeatureDataset, BagDataset]:
    root = str(tmp_path_factory.mktemp("opts") / "store")
    store = open_store(root, mode="a")
    writer = store.create_split("ds", "enc", "dense", num_samples=4, sample_shape=(3,), dtype="float32")
    writer.write(0, np.zeros((4, 3), np.float32))
    writer.commit()
    bags = store.create_bag_split("ds", "enc", "bags", dim=3, dtype="float32")
    bags.add_bag("a", np.zeros((2, 3), np.float32), coords=np.zeros((2, 2), np.int64))
    bags.commit()
    return FeatureDataset(root, "ds", "enc", "dense"), BagDataset(root, "ds", "enc", "bags")


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[next(iter(k)) + "=" + repr(next(iter(k.values()))) for k, _ in BAD])
def test_both_loaders_refuse_a_bad_shared_option_alike(datasets: Any, kwargs: dict[str, Any], message: str) -> None:
    dense, bags = datasets
    errors = []
    for loader, ds in ((FeatureLoader, dense), (BagLoader, bags)):
        with pytest.raises(InvalidOption, match=message) as caught:
            loader(ds, device="cpu", **kwargs)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "\n" not in errors[0]


def test_shared_options_resolve_alike(datasets: Any) -> None:
    dense, bags = datasets
    for loader in (FeatureLoader(dense, device="cpu", dtype=None), BagLoader(bags, device="cpu", dtype=None)):
        assert loader.device == torch.device("cpu") and loader.pin_memory is False and loader.dtype == torch.float32
