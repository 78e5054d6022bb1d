"""int8 splits through the datasets and loaders: every batch equals the store's own dequantizing
read (``read_numpy(dtype="float32")``, ``"float16"``) bit for bit, dense and bags, shuffled and
sequential, locally and on SeaweedFS (ranged reads and the chunk cache), on the CPU and on CUDA;
and over HTTP (codes and their scales rows on the wire, dequantized as they arrive)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import featurestore
from client import BagDataset, BagLoader, FeatureDataset, FeatureLoader, dequantize
from featurestore.errors import DtypeMismatch

SPLIT = ("ds", "enc", "train")
pytestmark = pytest.mark.filterwarnings("ignore:1 empty bag")  # s-02, left out of each BagLoader epoch
N, SHAPE, CHUNK_ROWS = 150, (4, 16), 16  # 10 chunks: a shuffled batch of 32 spans most of them
CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
NUMBA = importlib.util.find_spec("numba") is not None
TORCH_TO_READ = {torch.float32: "float32", torch.float16: "float16"}


def dense_values() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, *SHAPE)).astype(np.float32)
    x[:, :, 3] *= 100.0  # a channel with massive activations
    x[:, 0] *= 20.0  # a high-norm prefix token
    x[:, :, 5] = 0.0
    return x, rng.integers(0, 5, N).astype(np.int64)


def bag_values() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(8)
    out = {}
    for name, n in (("s-03", 50), ("s-01", 7), ("s-02", 0), ("s-04", 300), ("s-00", 1), ("s-05", 33)):
        x = rng.standard_normal((n, 16)).astype(np.float32)
        x[:, 2] *= 100.0
        out[name] = x, rng.integers(0, 10_000, (n, 2)).astype(np.int64)
    return out


def write_store(url: str, **options: Any) -> None:
    store = featurestore.open_store(url, mode="a", **options)
    x, y = dense_values()
    writer = store.create_split(*SPLIT, num_samples=N, sample_shape=SHAPE, dtype="int8", chunk_rows=CHUNK_ROWS,
                                label_dtype="int64")
    for lo in range(0, N, 40):
        writer.write(lo, x[lo:lo + 40], labels=y[lo:lo + 40])
    writer.commit()
    bags = store.create_bag_split("ds", "enc", "bags", dim=16, dtype="int8", chunk_bytes=64 * 16)
    for i, (name, (features, coords)) in enumerate(bag_values().items()):
        bags.add_bag(name, features, coords, label=i % 2)
    bags.commit()


@pytest.fixture(scope="module")
def local_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("int8") / "store")
    write_store(path)
    return path


@pytest.fixture(params=["local", "seaweedfs", "seaweedfs-cached"])
def source(request: pytest.FixtureRequest, local_store: str, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """Where the int8 splits are read from: ``(url, storage_options)``."""
    if request.param == "local":
        return local_store, {}
    seaweed = request.getfixturevalue("seaweed")
    url = request.getfixturevalue("seaweed_url")
    write_store(url, **seaweed.storage_options)
    options = dict(seaweed.storage_options)
    if request.param == "seaweedfs-cached":
        options["cache_dir"] = str(tmp_path / "cache")
    return url, options


def expected_rows(local_store: str, index: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """What the store's own read gives for ``index``, in ``dtype`` (float32, then one rounding)."""
    array = featurestore.open_store(local_store).open(*SPLIT)
    if dtype in TORCH_TO_READ:
        return torch.from_numpy(array.read_numpy(index, dtype=TORCH_TO_READ[dtype]))
    return torch.from_numpy(array.read_numpy(index, dtype="float32")).to(dtype)


# ---------------------------------------------------------------------- dense
@pytest.mark.parametrize("order", ["shuffle", "sequential", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_feature_loader_batches_equal_the_stores_dequantized_read(source: tuple[str, dict[str, Any]], local_store: str,
                                                                   order: str, dtype: torch.dtype) -> None:
    url, options = source
    ds = FeatureDataset(url, *SPLIT, storage_options=options)
    assert ds.quantized and ds.dtype == "int8" and ds.torch_dtype == torch.float32
    loader = FeatureLoader(ds, batch_size=32, order=order, seed=3, device="cpu", dtype=dtype)
    plan = loader.plan()
    _, labels = dense_values()
    batches = list(loader)
    assert len(batches) == len(plan) == 5
    for k, (features, y) in enumerate(batches):
        index = plan.batch(k)
        assert features.dtype == dtype and features.shape == (len(index), *SHAPE)
        assert torch.equal(features, expected_rows(local_store, index, dtype))
        assert torch.equal(y, torch.from_numpy(labels[index]))


@pytest.mark.parametrize("block_bytes", [dequantize.BLOCK_BYTES, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_and_small_blocks_round_the_float32_values_once(local_store: str, monkeypatch: pytest.MonkeyPatch,
                                                                     block_bytes: int, dtype: torch.dtype) -> None:
    monkeypatch.setattr(dequantize, "BLOCK_BYTES", block_bytes)  # 200: one row per block
    ds = FeatureDataset(local_store, *SPLIT)
    loader = FeatureLoader(ds, batch_size=64, shuffle=True, seed=1, device="cpu", dtype=dtype)
    for k, (features, _) in enumerate(loader):
        assert torch.equal(features, expected_rows(local_store, loader.plan().batch(k), dtype))


def test_dataset_items_dtype_none_and_normalize(local_store: str) -> None:
    ds = FeatureDataset(local_store, *SPLIT)
    array = featurestore.open_store(local_store).open(*SPLIT)
    features, _ = ds[17]
    assert features.dtype == torch.float32
    assert torch.equal(features, torch.from_numpy(array.read_numpy([17], dtype="float32")[0]))
    items = ds.__getitems__([5, 140, 5])
    want = torch.from_numpy(array.read_numpy([5, 140, 5], dtype="float32"))
    assert torch.equal(torch.stack([f for f, _ in items]), want)
    default = next(iter(FeatureLoader(ds, batch_size=8, shuffle=False, device="cpu", dtype=None)))[0]
    assert default.dtype == torch.float32  # dtype=None: the values' dtype, not int8 codes
    mean, std = ds.channel_stats()  # type: ignore[misc]
    inv = torch.from_numpy(np.where(std > 0, 1.0 / np.where(std > 0, std, 1.0), 1.0).astype(np.float32))
    loader = FeatureLoader(ds, batch_size=32, shuffle=True, seed=2, device="cpu", normalize=True)
    for k, (f, _) in enumerate(loader):
        want = expected_rows(local_store, loader.plan().batch(k), torch.float32).sub_(torch.from_numpy(mean)).mul_(inv)
        assert torch.equal(f, want)
    with pytest.raises(DtypeMismatch, match="read dtype 'int16' is not offered"):
        ds.read_into(np.arange(2), np.empty((2, *SHAPE), np.int16))


def test_a_dataloader_with_workers_reads_values(local_store: str) -> None:
    ds = FeatureDataset(local_store, *SPLIT)
    loader = torch.utils.data.DataLoader(ds, batch_size=50, num_workers=2)
    features = torch.cat([f for f, _ in loader])
    assert torch.equal(features, expected_rows(local_store, np.arange(N), torch.float32))


# ---------------------------------------------------------------------- bags
def expected_bag(local_store: str, bag: str, rows: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor:
    split = featurestore.open_store(local_store).open_bags("ds", "enc", "bags")
    return torch.from_numpy(split.read_numpy(bag, rows=rows, dtype=TORCH_TO_READ[dtype])[0])


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("max_patches", [None, 20])
def test_bag_loader_batches_equal_the_stores_dequantized_read(source: tuple[str, dict[str, Any]], local_store: str,
                                                              shuffle: bool, dtype: torch.dtype,
                                                              max_patches: int | None) -> None:
    url, options = source
    ds = BagDataset(url, "ds", "enc", "bags", storage_options=options)
    assert ds.quantized and ds.torch_dtype == torch.float32
    loader = BagLoader(ds, batch_size=3, shuffle=shuffle, seed=5, device="cpu", dtype=dtype, max_patches=max_patches,
                       return_ids=True)
    seen = 0
    for features, mask, coords, labels, ids in loader:
        assert features.dtype == dtype
        for j, bag in enumerate(ids):
            i = ds.ids.index(bag)
            rows = ds.rows(i, max_patches=max_patches, seed=5, epoch=0)
            want = expected_bag(local_store, bag, rows, dtype)
            n = len(want)
            assert torch.equal(features[j, :n], want) and bool(mask[j, :n].all()) and not bool(mask[j, n:].any())
            assert not bool(features[j, n:].any())  # padding: zeros
            stored = bag_values()[bag][1]
            assert torch.equal(coords[j, :n], torch.from_numpy(stored if rows is None else stored[rows]))
            assert int(labels[j]) == list(bag_values()).index(bag) % 2  # labels as added
            seen += 1
    assert seen == 5  # the empty bag is skipped


@pytest.mark.skipif(not NUMBA, reason="numba is not installed: no kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_loaders_with_the_dequantize_kernel_give_the_same_bits(local_store: str, monkeypatch: pytest.MonkeyPatch,
                                                                  dtype: torch.dtype) -> None:
    assert dequantize.wait_warm(120)

    def refuse(*args: Any) -> None:
        raise AssertionError("the loader fell back to numpy's formula")

    monkeypatch.setattr(dequantize, "numpy_into", refuse)  # every batch below is the kernel's
    loader = FeatureLoader(FeatureDataset(local_store, *SPLIT), batch_size=32, shuffle=True, seed=2, device="cpu",
                           dtype=dtype)
    for k, (features, _) in enumerate(loader):
        assert torch.equal(features, expected_rows(local_store, loader.plan().batch(k), dtype))
    ds = BagDataset(local_store, "ds", "enc", "bags")
    for features, mask, _, _, ids in BagLoader(ds, batch_size=2, seed=1, device="cpu", dtype=dtype, return_ids=True):
        for j, bag in enumerate(ids):
            want = expected_bag(local_store, bag, None, dtype)
            assert torch.equal(features[j, :len(want)], want)


def test_bag_dataset_items_and_normalize(local_store: str) -> None:
    ds = BagDataset(local_store, "ds", "enc", "bags")
    features, _, _ = ds[ds.ids.index("s-04")]
    assert features.dtype == torch.float32
    assert torch.equal(features, expected_bag(local_store, "s-04", None, torch.float32))
    assert ds[ds.ids.index("s-02")][0].shape == (0, 16)
    mean, std = ds.channel_stats()  # type: ignore[misc]
    inv = torch.from_numpy(np.where(std > 0, 1.0 / np.where(std > 0, std, 1.0), 1.0).astype(np.float32))
    for features, mask, _, _, ids in BagLoader(ds, batch_size=2, shuffle=False, device="cpu", normalize=True,
                                               return_ids=True):
        for j, bag in enumerate(ids):
            want = expected_bag(local_store, bag, None, torch.float32).sub_(torch.from_numpy(mean)).mul_(inv)
            assert torch.equal(features[j, :len(want)], want) and not bool(features[j, len(want):].any())


def test_bag_probe_reads_values_not_codes(local_store: str) -> None:
    from featurestore.probes.bag_ram import read_bags

    ds = BagDataset(local_store, "ds", "enc", "bags")
    features, _, _ = read_bags(ds)
    for i, bag in enumerate(ds.ids):
        assert torch.equal(features[i], expected_bag(local_store, bag, None, torch.float32))


# ---------------------------------------------------------------------- HTTP: refused until it carries scales
def test_http_datasets_and_loaders_read_the_values_the_store_reads(local_store: str) -> None:
    """Over HTTP the codes travel with their scales rows and are dequantized as they arrive: every
    batch equals the store's own loader's, dense and bags, float32 and float16 out."""
    from featurestore.testing.serving import serve_subprocess

    with serve_subprocess(local_store) as (url, _):
        remote, local = FeatureDataset(url, *SPLIT), FeatureDataset(local_store, *SPLIT)
        assert remote.dtype == "float32" and not remote.quantized and "\n" not in repr(remote.array)
        assert torch.equal(remote[3][0], local[3][0])
        for dtype in (torch.float32, torch.float16):
            a = list(FeatureLoader(remote, batch_size=32, shuffle=True, seed=1, device="cpu", dtype=dtype))
            b = list(FeatureLoader(local, batch_size=32, shuffle=True, seed=1, device="cpu", dtype=dtype))
            assert len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                            for x, y in zip(a, b))
            bags = [BagLoader(BagDataset(s, "ds", "enc", "bags"), batch_size=2, shuffle=True, seed=2, device="cpu", dtype=dtype)
                    for s in (url, local_store)]
            c, d = (list(loader) for loader in bags)
            assert len(c) == len(d) > 0
            for x, y in zip(c, d):
                assert all(torch.equal(p, q) for p, q in zip(x, y) if isinstance(p, torch.Tensor))


# ---------------------------------------------------------------------- CUDA
def same(gpu: torch.Tensor, cpu: torch.Tensor, normalized: bool) -> bool:
    """Dequantized batches are equal bit for bit; normalised ones (two more kernels on each side)
    within the dtype's rounding, as tests/test_loader.py's CUDA normalisation test allows."""
    if not normalized:
        return torch.equal(gpu, cpu)
    eps = torch.finfo(cpu.dtype).eps
    return torch.allclose(gpu.float(), cpu.float(), rtol=eps, atol=eps)


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("order", ["shuffle", "sequential"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("table_on_device", [True, False])
def test_cuda_int8_feature_batches_equal_the_stores_read(local_store: str, monkeypatch: pytest.MonkeyPatch, order: str,
                                                          dtype: torch.dtype, table_on_device: bool) -> None:
    if not table_on_device:  # the scale rows each batch needs cross in its host slot instead
        monkeypatch.setattr(dequantize, "DEVICE_TABLE_BYTES", 0)
    ds = FeatureDataset(local_store, *SPLIT)
    for normalize in (False, True):
        gpu = FeatureLoader(ds, batch_size=32, order=order, seed=4, device="cuda", dtype=dtype, prefetch=3,
                            normalize=normalize)
        cpu = list(FeatureLoader(ds, batch_size=32, order=order, seed=4, device="cpu", dtype=dtype,
                                 normalize=normalize))
        for k, (f, y) in enumerate(gpu):
            assert f.is_cuda and f.dtype == dtype and y.dtype == torch.int64
            f.mul_(1)  # consumer work on the current stream, ordered after the copy by the event
            if not normalize:
                assert torch.equal(f.cpu(), expected_rows(local_store, gpu.plan().batch(k), dtype))
            assert same(f.cpu(), cpu[k][0], normalize) and torch.equal(y.cpu(), cpu[k][1])
        assert all(slot.scales.is_pinned() for slot in list(gpu._transfer.slots.queue))  # type: ignore[union-attr]
        assert (gpu._transfer._scales.device_table is not None) == table_on_device  # type: ignore[union-attr]


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_int8_bag_batches_equal_the_stores_read(local_store: str, dtype: torch.dtype) -> None:
    ds = BagDataset(local_store, "ds", "enc", "bags")
    for normalize, piece_mib in ((False, 64.0), (True, 100 * 16 / 2**20)):  # 100-row pieces: a bag spans slots
        options: dict[str, Any] = {"batch_size": 3, "shuffle": True, "seed": 6, "dtype": dtype, "normalize": normalize,
                                   "return_ids": True, "piece_mib": piece_mib}
        cpu = list(BagLoader(ds, device="cpu", **options))
        gpu = list(BagLoader(ds, device="cuda", **options))
        assert len(gpu) == len(cpu) == 2
        for (f, m, c, y, ids), (cf, cm, cc, cy, cids) in zip(gpu, cpu):
            assert f.is_cuda and f.dtype == dtype and ids == cids
            assert same(f.cpu(), cf, normalize) and torch.equal(m.cpu(), cm) and torch.equal(c.cpu(), cc)
            assert torch.equal(y.cpu(), cy)
            if not normalize:
                for j, bag in enumerate(ids):
                    want = expected_bag(local_store, bag, None, dtype)
                    assert torch.equal(f[j, :len(want)].cpu(), want) and not bool(f[j, len(want):].any())


def test_an_int8_split_read_to_the_cpu_gets_a_third_read_thread(local_store: str) -> None:
    # Its read threads dequantize too: a third overlaps one batch's reads with two dequantizes.
    ds = FeatureDataset(local_store, *SPLIT)
    assert FeatureLoader(ds, batch_size=8, device="cpu", prefetch=4).num_threads == 3
    assert FeatureLoader(ds, batch_size=8, device="cpu", prefetch=2).num_threads == 2  # never above prefetch
    assert FeatureLoader(ds, batch_size=8, device="cpu", prefetch=4, num_threads=1).num_threads == 1
