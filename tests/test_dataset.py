"""FeatureDataset: indexing, one gathered read per batch, lazy per-process opening, pickling."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from _loader_fixtures import (  # noqa: F401  (fixtures are used by name)
    DATASET,
    ENCODER,
    NUM_SAMPLES,
    SAMPLE_SHAPE,
    local_store,
    reference,
)

import featurestore
from client import FeatureDataset
from client.dataset import NO_LABEL
from featurestore.errors import IncompleteSplit, IndexOutOfRange, SplitNotFound


@pytest.fixture(scope="module")
def ds(local_store: str) -> FeatureDataset:
    return FeatureDataset(local_store, DATASET, ENCODER, "f32")


def test_getitem_returns_stored_dtype_sample_and_label(local_store: str) -> None:
    x, y = reference()
    ds16 = FeatureDataset(local_store, DATASET, ENCODER, "f16")
    features, label = ds16[5]
    assert features.dtype == torch.float16 and features.shape == SAMPLE_SHAPE
    assert torch.equal(features, torch.from_numpy(x[5]).to(torch.float16))
    assert label.dtype == torch.uint8 and int(label) == y[5]
    last, _ = ds16[-1]
    assert torch.equal(last, torch.from_numpy(x[-1]).to(torch.float16))
    assert len(ds16) == NUM_SAMPLES
    with pytest.raises(IndexOutOfRange):
        ds16[NUM_SAMPLES]


def test_getitems_is_one_gathered_read_and_returns_views(ds: FeatureDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = reference()
    array = ds.array
    calls: list[int] = []
    real = array.read_numpy

    def counting(indices: Any, out: Any = None) -> np.ndarray:
        calls.append(len(indices))
        return real(indices, out)

    monkeypatch.setattr(array, "read_numpy", counting)
    indices = [9, 3, 3, 50, 0]
    samples = ds.__getitems__(indices)
    assert calls == [5]  # one read for the whole batch (labels go through their own array)
    assert len(samples) == 5
    for (features, label), i in zip(samples, indices):
        assert torch.equal(features, torch.from_numpy(x[i])) and int(label) == y[i]
    # Views into one batch tensor, not five copies.
    storage = samples[0][0].untyped_storage().data_ptr()
    assert all(f.untyped_storage().data_ptr() == storage for f, _ in samples)
    batch = torch.utils.data.default_collate(samples)
    assert batch[0].shape == (5, *SAMPLE_SHAPE) and batch[1].tolist() == [y[i] for i in indices]


def test_split_without_labels_gives_placeholder(local_store: str) -> None:
    ds = FeatureDataset(local_store, DATASET, ENCODER, "nolabels")
    _, label = ds[0]
    assert label.dtype == torch.int64 and int(label) == NO_LABEL
    labels = torch.utils.data.default_collate(ds.__getitems__([1, 2]))[1]
    assert labels.tolist() == [NO_LABEL, NO_LABEL]


def test_pickles_without_open_reader_and_reopens_lazily(ds: FeatureDataset) -> None:
    ds[0]  # make sure this process has an open reader with maps
    state = ds.__getstate__()
    assert "_reader" not in state
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000  # metadata and names only, no mapped chunks
    clone = pickle.loads(blob)
    assert clone._reader is None
    features, _ = clone[7]
    assert clone._reader is not None
    assert torch.equal(features, torch.from_numpy(reference()[0][7]))


def test_a_forked_process_reopens_its_reader(ds: FeatureDataset) -> None:
    first = ds.array
    ds._reader_pid = -2  # what a forked child sees: the opener's pid is not its own
    assert ds.array is not first
    assert ds.array is ds.array


def test_open_errors(local_store: str, tmp_path: Any) -> None:
    with pytest.raises(SplitNotFound):
        FeatureDataset(local_store, DATASET, ENCODER, "nope")
    with pytest.raises(TypeError, match="source"):
        FeatureDataset(123, DATASET, ENCODER, "f32")  # type: ignore[arg-type]
    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    writer = store.create_split("d", "e", "half", num_samples=4, sample_shape=(2,), dtype="float32",
                                 chunk_bytes=16)  # 2 rows per chunk: the first chunk lands
    writer.write(0, np.ones((2, 2), np.float32))
    writer.close()
    with pytest.raises(IncompleteSplit):
        FeatureDataset(str(tmp_path / "s"), "d", "e", "half")
    partial = FeatureDataset(str(tmp_path / "s"), "d", "e", "half", allow_incomplete=True)
    assert len(partial) == 4 and torch.equal(partial[1][0], torch.ones(2))


@pytest.mark.parametrize("kind", ["dense", "bags"])
def test_a_dataloader_worker_refuses_a_split_overwritten_since_the_dataset_opened_it(tmp_path: Any, kind: str) -> None:
    """Workers reopen the split by name: after an overwrite they read the new rows under the old
    length and metadata (a walk trained three epochs on three versions), while the main process's
    reader raised SplitChanged. Now a worker raises it too."""
    from client import BagDataset
    from featurestore.errors import SplitChanged

    store = featurestore.open_store(str(tmp_path), mode="a")

    def write(value: float, n: int) -> None:
        if kind == "dense":
            w = store.create_split("d", "e", "s", num_samples=n, sample_shape=(8,), dtype="float16", overwrite=True)
            w.write(0, np.full((n, 8), value, np.float32))
        else:
            w = store.create_bag_split("d", "e", "s", dim=8, overwrite=True)
            for i in range(n):
                w.add_bag(f"b{i}", np.full((3, 8), value, np.float32))
        w.commit()

    write(1.0, 40)
    ds = (FeatureDataset if kind == "dense" else BagDataset)(str(tmp_path), "d", "e", "s")
    reopened = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets
    assert float(reopened[0][0].flatten()[0]) == 1.0
    write(2.0, 60)
    again = pickle.loads(pickle.dumps(ds))
    with pytest.raises(SplitChanged, match="d/e/s: the split was overwritten since this dataset opened it"):
        again[0]
    loader = torch.utils.data.DataLoader(ds, batch_size=10, num_workers=1, collate_fn=lambda items: items)
    with pytest.raises(Exception, match="SplitChanged|overwritten since this dataset opened it"):
        list(loader)
