"""BagDataset and BagLoader over object storage and HTTP (the same batches as the local store),
and the loader's return_ids, normalize and pad_to_max_patches options."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from client import BagDataset, BagLoader
from _bag_loader_fixtures import expected, quiet, resumed_from, state_after
from _bag_loader_fixtures import bag_store  # noqa: F401  (a fixture, used by name)
from featurestore.errors import InvalidOption

# ------------------------------------------------------------------------------- object storage


def test_object_storage_source_gives_the_local_batches(bag_store: str, s3_storage_options: dict[str, Any]) -> None:
    # The same store's keys in a bucket of the session's moto server (conftest): ranged reads.
    import uuid

    import s3fs

    bucket = f"fs-bags-{uuid.uuid4().hex[:10]}"
    fs = s3fs.S3FileSystem(**s3_storage_options)
    fs.mkdir(bucket)
    fs.put(bag_store, f"{bucket}/store", recursive=True)
    fs.invalidate_cache()
    local = BagDataset(bag_store, "cohort", "enc-float16", "all")
    remote = BagDataset(f"s3://{bucket}/store", "cohort", "enc-float16", "all", storage_options=s3_storage_options)
    assert remote.ids == local.ids and remote.read_path == "ranges"
    options: dict[str, Any] = dict(batch_size=2, seed=8, device="cpu", max_patches=12)
    for x, y in zip(quiet(BagLoader(local, **options)), quiet(BagLoader(remote, **options))):
        assert all(torch.equal(p, q) for p, q in zip(x, y))


# --------------------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def bag_server(bag_store: str) -> Any:
    """``featurestore serve`` (uvicorn subprocess on a free loopback port) over the bag store."""
    from featurestore.testing.serving import serve_subprocess

    with serve_subprocess(bag_store) as (url, _):
        yield url


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_http_source_gives_the_local_bags_and_batches(bag_store: str, bag_server: str, dtype: str) -> None:
    local = BagDataset(bag_store, "cohort", f"enc-{dtype}", "all", max_patches=20, seed=1)
    remote = BagDataset(bag_server, "cohort", f"enc-{dtype}", "all", max_patches=20, seed=1)
    assert remote.ids == local.ids and np.array_equal(remote.lengths, local.lengths)
    assert np.array_equal(remote.labels, local.labels) and remote.read_path == "http"
    for i in range(len(local)):
        assert all(torch.equal(a, b) for a, b in zip(local[i], remote[i]))
    options: dict[str, Any] = dict(batch_size=3, seed=6, device="cpu", max_patches=25, bucket=True)
    a, b = quiet(BagLoader(local, **options), 2), quiet(BagLoader(remote, **options), 2)
    assert len(a) == len(b) == len(BagLoader(local, **options))
    for x, y in zip(a, b):
        assert all(torch.equal(p, q) for p, q in zip(x, y))
    # A bag larger than a read piece, over HTTP: several requests, the same rows.
    piece = 4 * remote.row_nbytes / 2**20
    whole = quiet(BagLoader(local, batch_size=1, seed=3, device="cpu"))
    pieces = quiet(BagLoader(remote, batch_size=1, seed=3, device="cpu", piece_mib=piece))
    assert all(torch.equal(p, q) for x, y in zip(whole, pieces) for p, q in zip(x, y))


# ------------------------------------------------------------------------ ids, normalize, pad_to


@pytest.mark.parametrize(("batch_size", "bucket", "shuffle"), [(1, False, True), (3, True, True), (4, False, False)])
def test_return_ids_names_each_batch_s_bags_in_order(bag_store: str, batch_size: int, bucket: bool,
                                                     shuffle: bool) -> None:
    ds = BagDataset(bag_store, "cohort", "enc-float16", "all")
    options: dict[str, Any] = dict(batch_size=batch_size, seed=5, device="cpu", max_patches=20, bucket=bucket,
                                   shuffle=shuffle)
    plain = quiet(BagLoader(ds, **options), epoch=1)
    named = quiet(BagLoader(ds, return_ids=True, **options), epoch=1)
    plan = BagLoader(ds, **options).plan(1)
    assert len(named) == len(plan) == len(plain)
    for batch, without, index in zip(named, plain, plan):
        assert len(batch) == 5
        *tensors, ids = batch
        assert ids == [ds.ids[int(i)] for i in index] and all(type(i) is str for i in ids)
        assert all(torch.equal(x, y) for x, y in zip(tensors, without))
        # The ids name the rows: each bag's features are the written slide's.
        for b, bag_id in enumerate(ids):
            n = int(tensors[1][b].sum())
            rows = ds.rows(ds.ids.index(bag_id), max_patches=20, seed=5, epoch=1)
            assert torch.equal(tensors[0][b, :n], expected(ds, ds.ids.index(bag_id), rows)[0])


def test_return_ids_survive_a_resume(bag_store: str) -> None:
    ds = BagDataset(bag_store, "cohort", "enc-float32", "all")
    options: dict[str, Any] = dict(batch_size=2, seed=4, device="cpu", bucket=True, return_ids=True)
    full = quiet(BagLoader(ds, **options), epoch=2)
    rest = resumed_from(ds, options, state_after(ds, options, epoch=2, batches=1))
    assert [b[-1] for b in rest] == [b[-1] for b in full[1:]]


def test_return_ids_over_http(bag_store: str, bag_server: str) -> None:
    local = BagDataset(bag_store, "cohort", "enc-float16", "all")
    remote = BagDataset(bag_server, "cohort", "enc-float16", "all")
    options: dict[str, Any] = dict(batch_size=3, seed=6, device="cpu", return_ids=True)
    a, b = quiet(BagLoader(local, **options)), quiet(BagLoader(remote, **options))
    assert [x[-1] for x in a] == [y[-1] for y in b] and len(a) == len(b) > 0
    assert all(torch.equal(p, q) for x, y in zip(a, b) for p, q in zip(x[:4], y[:4]))


def test_normalize_uses_the_split_s_channel_stats_and_keeps_padding_zero(bag_store: str) -> None:
    ds = BagDataset(bag_store, "cohort", "enc-float32", "all")
    stats = ds.metadata["channel_stats"]
    mean, std = (torch.tensor(stats[k], dtype=torch.float32) for k in ("mean", "std"))
    plain = quiet(BagLoader(ds, batch_size=3, seed=1, device="cpu"))
    normed = quiet(BagLoader(ds, batch_size=3, seed=1, device="cpu", normalize=True))
    assert len(plain) == len(normed)
    for (f, m, c, lab), (g, m2, c2, lab2) in zip(plain, normed):
        assert torch.equal(m, m2) and torch.equal(c, c2) and torch.equal(lab, lab2)
        want = torch.where(m[..., None], (f - mean) / std, torch.zeros(()))
        assert torch.allclose(g, want, atol=1e-5)
        assert not g[~m].any()  # padding stays zeros
    no_stats = BagDataset(bag_store, "cohort", "enc-float32", "all")
    no_stats.metadata = {k: v for k, v in no_stats.metadata.items() if k != "channel_stats"}
    with pytest.raises(InvalidOption, match="channel_stats"):
        BagLoader(no_stats, device="cpu", normalize=True)


def test_pad_to_max_patches_needs_max_patches(bag_store: str) -> None:
    ds = BagDataset(bag_store, "cohort", "enc-float32", "all")
    with pytest.raises(InvalidOption, match="pad_to='max_patches' needs max_patches"):
        BagLoader(ds, batch_size=2, device="cpu", pad_to="max_patches")
    BagLoader(BagDataset(bag_store, "cohort", "enc-float32", "all", max_patches=8), batch_size=2, device="cpu",
              pad_to="max_patches")  # the dataset's max_patches counts
