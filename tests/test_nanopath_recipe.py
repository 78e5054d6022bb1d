"""The nanopath recipe (examples/nanopath_seg_probe.py) against the reference in-RAM loop.

The reference keeps the features in RAM and draws ``torch.randperm(n)`` on the global generator
every epoch (NANOPATH.md). The recipe streams the same features out of a store through
``FeatureLoader(batch_sampler=...)``. On small synthetic data, float32 on the CPU, both must see the
same batch membership in every epoch, the same validation losses and the same final metric, bit
for bit. The printed lines (``pytest -s``) are the parity report.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

import featurestore

ROOT = Path(__file__).resolve().parents[1]
GRID, DIM, CLASSES, LABEL_HW = 4, 32, 3, 16
N_TRAIN, N_VAL, EPOCHS, SEED = 150, 70, 3, 1337  # 150 = 2 full batches of 64 + a partial one
HEAD = {"n_layers": 2, "n_heads": 8, "d_model": 64, "d_ff": 128}  # the reference's shape, smaller


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nanopath_seg_probe", ROOT / "examples" / "nanopath_seg_probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


recipe = _load_example()


def synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch tokens ``[n, 16, 32]`` whose first channels decide each patch's class, and the
    ``[n, 16, 16]`` uint8 class maps (patch classes upsampled 4x); every 8th image background-only."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, GRID * GRID, DIM, generator=g)
    patch_cls = feats[:, :, :CLASSES].argmax(-1).reshape(n, GRID, GRID)
    labels = patch_cls.repeat_interleave(LABEL_HW // GRID, 1).repeat_interleave(LABEL_HW // GRID, 2)
    labels[::8] = 0
    return feats, labels.to(torch.uint8)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = str(tmp_path_factory.mktemp("nanopath") / "store")
    store = featurestore.open_store(path, mode="a")
    out: dict[str, Any] = {"path": path}
    meta = {"token_layout": {"tokens": "patch", "prefix_tokens": 0, "grid": [GRID, GRID]}}
    for split, n, seed in (("train", N_TRAIN, 0), ("val", N_VAL, 1)):
        feats, labels = synthetic(n, seed)
        writer = store.create_split("toy", "enc", split, num_samples=n, sample_shape=(GRID * GRID, DIM),
                                    dtype="float32", label_shape=(LABEL_HW, LABEL_HW), label_dtype="uint8",
                                    metadata=meta, chunk_bytes=32 * GRID * GRID * DIM * 4)
        writer.write(0, feats.numpy(), labels=labels.numpy())
        writer.commit()
        out[split] = (feats, labels)
    return out


def reference_in_ram(train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor],
                     record: list[Any], device: torch.device) -> tuple[float, float]:
    """The reference loop as NANOPATH.md describes it: the whole cache in RAM, feats[idx].to(device)."""
    feats, labels = train[0], train[1].long()
    val_feats, val_labels = val[0].to(device), val[1].long().to(device)
    torch.manual_seed(SEED)
    head = recipe.MaskTransformer(CLASSES, DIM, **HEAD).to(device)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-3, weight_decay=1e-4)
    n = len(feats)
    best, best_state = math.inf, None
    for _ in range(EPOCHS):
        perm = torch.randperm(n)
        batches = []
        head.train()
        for i in range(0, n, 64):
            idx = perm[i : i + 64]
            batches.append(idx.tolist())
            logits = recipe.upsampled_logits(head, feats[idx].to(device).float(), (LABEL_HW, LABEL_HW))
            loss = recipe.multiclass_dice_loss(logits, labels[idx].to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        head.eval()
        with torch.no_grad():
            losses = [float(recipe.multiclass_dice_loss(
                recipe.upsampled_logits(head, val_feats[i : i + 64], (LABEL_HW, LABEL_HW)), val_labels[i : i + 64]))
                for i in range(0, len(val_feats), 64)]
        val_loss = float(np.mean(losses))
        record.append((batches, val_loss))
        if val_loss < best:
            best, best_state = val_loss, {k: v.clone() for k, v in head.state_dict().items()}
    assert best_state is not None
    head.load_state_dict(best_state)
    head.eval()
    with torch.no_grad():
        preds = torch.cat([recipe.upsampled_logits(head, val_feats[i : i + 64], (LABEL_HW, LABEL_HW)).argmax(1)
                           for i in range(0, len(val_feats), 64)])
    return best, recipe.weighted_jaccard(val_labels.cpu().numpy(), preds.cpu().numpy())


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_recipe_matches_the_in_ram_reference(data: dict[str, Any], device: str) -> None:
    """CPU: bit-identical. CUDA: the same batches; scores within a tolerance, because the CUDA
    backward of upsample_bilinear2d is not deterministic (in the reference too)."""
    ref_record: list[Any] = []
    ref_best, ref_metric = reference_in_ram(data["train"], data["val"], ref_record, torch.device(device))
    exact = device == "cpu"

    def close(a: float, b: float, tol: float) -> bool:
        return a == b if exact else abs(a - b) <= tol

    store_record: list[Any] = []
    result = recipe.train_from_store(data["path"], "toy", "enc", "train", "val", epochs=EPOCHS, seed=SEED,
                                     device=device, num_classes=CLASSES, head_kwargs=HEAD,
                                     on_epoch=lambda e, b, v: store_record.append((b, v)))
    assert len(store_record) == len(ref_record) == EPOCHS
    for epoch, ((ref_batches, ref_loss), (fs_batches, fs_loss), given) in enumerate(
            zip(ref_record, store_record, result["loader_batches"])):
        same = ref_batches == fs_batches == given
        print(f"[{device}] epoch {epoch + 1}: batches {[len(b) for b in ref_batches]}, membership identical: {same}; "
              f"val dice loss in RAM {ref_loss:.8f}, featurestore {fs_loss:.8f}")
        assert same, f"epoch {epoch + 1}: the loader read other batches than the reference"
        assert close(fs_loss, ref_loss, 1e-3), (fs_loss, ref_loss)
    print(f"[{device}] best val dice loss: in RAM {ref_best:.8f}, featurestore {result['best_val_dice_loss']:.8f}")
    print(f"[{device}] weighted Jaccard: in RAM {ref_metric:.8f}, featurestore {result['weighted_jaccard']:.8f}")
    assert close(result["best_val_dice_loss"], ref_best, 1e-3)
    assert close(result["weighted_jaccard"], ref_metric, 1e-2)
    assert 0.0 < ref_metric <= 1.0


def test_feature_loader_never_draws_from_the_global_stream(data: dict[str, Any]) -> None:
    from client import FeatureDataset, FeatureLoader

    ds = FeatureDataset(data["path"], "toy", "enc", "train")
    for kwargs in ({"batch_sampler": [[3, 1, 2], [0, 149]]}, {"shuffle": True}, {"shuffle": False}):
        torch.manual_seed(5)
        np.random.seed(5)
        state, np_state = torch.get_rng_state(), np.random.get_state()
        loader = FeatureLoader(ds, batch_size=64, device="cpu", **kwargs)  # type: ignore[arg-type]
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sum(len(f) for f, _ in loader) > 0
        assert torch.equal(torch.get_rng_state(), state), kwargs
        assert np.array_equal(np.random.get_state()[1], np_state[1]), kwargs


def test_weighted_jaccard_definition() -> None:
    t = np.array([[[0, 1], [1, 2]], [[0, 0], [0, 0]]])
    p = np.array([[[0, 1], [2, 2]], [[0, 0], [0, 1]]])
    # image 0: classes 0 (1/1), 1 (1/2), 2 (1/2) -> 2/3; image 1: classes 0 (3/4), 1 (0/1) -> 3/8
    # half the images are background-only: weight max(1, 16 * 0.5) = 8 for image 0, 1 for image 1
    assert recipe.weighted_jaccard(t, p) == pytest.approx((8 * 2 / 3 + 3 / 8) / 9)


def test_head_init_follows_the_seed() -> None:
    torch.manual_seed(SEED)
    a = recipe.MaskTransformer(CLASSES, DIM, **HEAD)
    after = torch.rand(1)
    torch.manual_seed(SEED)
    b = recipe.MaskTransformer(CLASSES, DIM, **HEAD)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(torch.rand(1), after)  # the same number of draws: the next randperm matches
    out = a(torch.randn(2, GRID * GRID, DIM))
    assert out.shape == (2, CLASSES, GRID, GRID)
