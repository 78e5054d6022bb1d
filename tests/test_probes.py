"""Reference probes (linear and segmentation), the multi-seed comparison and ``featurestore probe``.

Data is synthetic and small: class information is planted in the features (one prototype per
class, plus noise), so a probe that learns must score far above chance, and a broken one cannot.
Store-level tests write the same features twice under two encoder names with the core API and
check that the comparison reports them as identical, through the streaming loader, the in-RAM
loader, and (when the server stack is installed) HTTP.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _probe_fixtures import DATASET, GRID, LIN_CLASSES, SEG_CLASSES, linear_data, seg_data
from _probe_fixtures import one_torch_thread, store_path  # noqa: F401  (fixtures, used by name)

from featurestore.errors import (
    DeviceUnavailable,
    EmptySplit,
    FeatureStoreError,
    InvalidLabels,
    InvalidOption,
    MissingLabels,
)
from featurestore.probes.compare import compare_summaries, run_seeds, summarize
from featurestore.probes.linear import (
    LinearProbeConfig,
    balanced_accuracy,
    confusion_matrix,
    macro_f1,
    pool_tokens,
    train_linear_probe,
)
from featurestore.probes.run import (
    SplitInfo,
    compare_probes,
    describe_split,
    detect_task,
    run_probe,
    token_layout,
)
from featurestore.probes.seg import SegProbeConfig, dice_loss, per_image_jaccard, train_seg_probe
from featurestore.probes.train import TensorLoader

SMALL_SEG = SegProbeConfig(epochs=4, dim=32, depth=1, heads=2)


# -------------------------------------------------------------------------------------- metrics


def test_classification_metrics_match_hand_computed_values() -> None:
    target = torch.tensor([0, 0, 1, 1, 2, 2])
    pred = torch.tensor([0, 1, 1, 1, 2, 0])
    confusion = confusion_matrix(target, pred, 4)  # class 3: absent from target and prediction
    assert confusion[:3, :3].tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    # F1: class 0 = 2/(2+1+1) = 0.5, class 1 = 4/(4+1+0) = 0.8, class 2 = 2/(2+0+1) = 2/3.
    assert macro_f1(confusion) == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)
    # Recall: 1/2, 2/2, 1/2; class 3 has no support and is not averaged in.
    assert balanced_accuracy(confusion) == pytest.approx((0.5 + 1.0 + 0.5) / 3)
    with pytest.raises(ValueError, match="labels must lie in"):
        confusion_matrix(torch.tensor([5]), torch.tensor([0]), 4)


def test_per_image_jaccard_averages_classes_present_per_image() -> None:
    target = torch.tensor([[[0, 0], [1, 1]], [[2, 2], [2, 2]]])
    pred = torch.tensor([[[0, 1], [1, 1]], [[2, 2], [2, 2]]])
    scores = per_image_jaccard(pred, target, num_classes=4)
    # Image 0: class 0 IoU 1/2, class 1 IoU 2/3; classes 2 and 3 absent from both, skipped.
    # Image 1: only class 2, IoU 1.
    assert scores.tolist() == pytest.approx([(0.5 + 2 / 3) / 2, 1.0])
    # A class predicted but absent from the target counts as IoU 0 for that image.
    assert per_image_jaccard(torch.full((1, 2, 2), 3), target[:1], 4).item() == 0.0


def test_dice_loss_matches_the_one_hot_formula_and_its_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 4, (3, 9, 7), generator=g)
    logits = torch.randn(3, 5, 9, 7, generator=g, requires_grad=True)  # class 4 never in target
    probs = logits.softmax(1)
    onehot = torch.nn.functional.one_hot(target, 5).permute(0, 3, 1, 2).float()
    dims = (0, 2, 3)
    expected = 1 - ((2 * (probs * onehot).sum(dims) + 1) / (probs.sum(dims) + onehot.sum(dims) + 1)).mean()
    got = dice_loss(logits, target)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    (grad_got,) = torch.autograd.grad(got, logits, retain_graph=True)
    (grad_expected,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(grad_got, grad_expected, atol=1e-7)
    perfect = torch.nn.functional.one_hot(target, 4).permute(0, 3, 1, 2).float() * 50
    assert dice_loss(perfect, target).item() < 1e-3
    assert dice_loss(-perfect, target).item() > 0.9


def test_pool_tokens_mean_skips_prefix_and_cls_needs_one() -> None:
    features = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    assert torch.equal(pool_tokens(features, "mean", prefix_tokens=1), features[:, 1:].mean(1))
    assert torch.equal(pool_tokens(features, "cls", prefix_tokens=1), features[:, 0])
    with pytest.raises(ValueError, match="no prefix tokens"):
        pool_tokens(features, "cls", prefix_tokens=0)


# ------------------------------------------------------------------------------------- learning


def test_linear_probe_learns_a_separable_set_from_float16_batches() -> None:
    train_x, train_y = linear_data(256, seed=0)
    eval_x, eval_y = linear_data(128, seed=1)
    # float16 inputs: the probe upcasts on its device, as it must for a float16 store.
    train = TensorLoader(train_x.half(), train_y, batch_size=32, shuffle=True, seed=0,
                         device="cpu", dtype=torch.float16)
    evaluate = TensorLoader(eval_x.half(), eval_y, batch_size=64, device="cpu", dtype=torch.float16)
    metrics = train_linear_probe(train, evaluate, num_classes=LIN_CLASSES, seed=0, device="cpu",
                                 config=LinearProbeConfig(epochs=5))
    assert metrics["macro_f1"] > 0.9
    assert metrics["balanced_accuracy"] > 0.9


def test_linear_probe_is_deterministic_and_takes_any_iterable_of_batches() -> None:
    x, y = linear_data(96, seed=2)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 96, 32)]  # a plain list
    config = LinearProbeConfig(epochs=2)
    first = train_linear_probe(batches, batches, num_classes=LIN_CLASSES, seed=3, device="cpu", config=config)
    second = train_linear_probe(batches, batches, num_classes=LIN_CLASSES, seed=3, device="cpu", config=config)
    assert first == second
    with pytest.raises(ValueError, match="yielded no batches"):
        train_linear_probe([], batches, num_classes=LIN_CLASSES, device="cpu", config=config)


def test_seg_probe_learns_classes_encoded_in_tokens_and_drops_prefix_tokens() -> None:
    train_x, train_y = seg_data(128, seed=0, prefix=1)
    eval_x, eval_y = seg_data(48, seed=1, prefix=1)
    train = TensorLoader(train_x, train_y, batch_size=32, shuffle=True, seed=0, device="cpu")
    evaluate = TensorLoader(eval_x, eval_y, batch_size=48, device="cpu")
    metrics = train_seg_probe(train, evaluate, num_classes=SEG_CLASSES, grid=GRID, prefix_tokens=1,
                              seed=0, device="cpu", config=SMALL_SEG)
    constant = per_image_jaccard(torch.zeros_like(eval_y), eval_y, SEG_CLASSES).mean().item()
    assert constant < 0.35  # ~1/3 of each image is class 0: IoU 1/3 on one of ~3 present classes
    assert metrics["jaccard"] > 0.8
    again = train_seg_probe(train, evaluate, num_classes=SEG_CLASSES, grid=GRID, prefix_tokens=1,
                            seed=0, device="cpu", config=SMALL_SEG)
    assert again == metrics  # fixed seed, CPU: bit-identical


def test_each_probe_refuses_the_other_probes_labels_in_one_line() -> None:
    x, _ = linear_data(8, seed=0)
    masks = [(x, torch.zeros(8, 2, 2, dtype=torch.int64))]
    with pytest.raises(InvalidLabels, match=r"linear probe needs one class id per sample, but got labels of shape "
                       r"\(8, 2, 2\); use the seg probe for masks"):
        train_linear_probe(masks, masks, num_classes=LIN_CLASSES, device="cpu", config=LinearProbeConfig(epochs=1))
    x, y = seg_data(8, seed=0)
    ids = [(x, y[:, 0, 0])]
    with pytest.raises(InvalidLabels, match=r"seg probe needs class maps \[B, H, W\], but got labels of shape "
                       r"\(8,\); use the linear probe"):
        train_seg_probe(ids, ids, num_classes=SEG_CLASSES, grid=GRID, device="cpu", config=SMALL_SEG)
    column = [(x, y.unsqueeze(1))]  # [B, 1, H, W]: the singleton dimension is dropped
    assert "jaccard" in train_seg_probe(column, column, num_classes=SEG_CLASSES, grid=GRID, device="cpu",
                                        config=SegProbeConfig(epochs=1, dim=32, depth=1, heads=2))


def test_seg_probe_rejects_a_grid_that_does_not_match_the_tokens() -> None:
    x, y = seg_data(8, seed=0)
    batches = [(x, y)]
    with pytest.raises(ValueError, match="token grid 3x3"):
        train_seg_probe(batches, batches, num_classes=SEG_CLASSES, grid=(3, 3), device="cpu", config=SMALL_SEG)


# ------------------------------------------------------------------------------ seeds and spread


def test_summaries_and_the_spread_rule() -> None:
    summary = summarize([0.70, 0.72, 0.74])
    assert summary["mean"] == pytest.approx(0.72)
    assert summary["std"] == pytest.approx(0.02)  # sample std, ddof = 1
    assert summarize([0.5])["std"] is None

    def metrics_at(offset: float) -> Any:
        return lambda seed: {"m": 0.70 + 0.02 * seed + offset}

    base = run_seeds(metrics_at(0.0), [0, 1, 2])
    close = compare_summaries(run_seeds(metrics_at(0.01), [0, 1, 2]), base)["m"]
    far = compare_summaries(run_seeds(metrics_at(0.05), [0, 1, 2]), base)["m"]
    same = compare_summaries(base, base)["m"]
    assert close["pooled_std"] == pytest.approx(0.02) and close["threshold"] == pytest.approx(0.04)
    assert close["diff"] == pytest.approx(0.01) and close["exceeds_spread"] is False
    assert far["exceeds_spread"] is True
    assert same["diff"] == 0 and same["exceeds_spread"] is False and same["max_abs_paired_diff"] == 0
    single = compare_summaries(run_seeds(metrics_at(0.05), [0]), run_seeds(metrics_at(0), [0]))["m"]
    assert single["exceeds_spread"] is None and single["pooled_std"] is None


# ------------------------------------------------------------------------------- through a store


def test_split_description_task_and_token_layout(store_path: str) -> None:
    seg = describe_split(store_path, DATASET, "seg16", "train")
    assert isinstance(seg, SplitInfo) and seg.dtype == "float16" and seg.label_shape == (16, 16)
    assert detect_task(seg) == "seg" and token_layout(seg) == (GRID, 1)  # CLS still stored
    assert token_layout(describe_split(store_path, DATASET, "seg32a", "train")) == (GRID, 0)
    lin = describe_split(store_path, DATASET, "lin32", "train")
    assert detect_task(lin) == "linear"
    with pytest.raises(InvalidLabels, match="task seg needs class maps"):
        detect_task(lin, "seg")
    with pytest.raises(MissingLabels, match="has no labels"):
        detect_task(describe_split(store_path, DATASET, "nolab", "train"))
    with pytest.raises(InvalidOption, match="task must be one of"):
        detect_task(lin, "regression")


def test_probe_errors_are_featurestore_errors_by_meaning() -> None:
    from featurestore.core.device import resolve_device

    # Every probe error is a FeatureStoreError (one CLI line); bugs stay plain exceptions.
    for cls in (InvalidOption, InvalidLabels, MissingLabels, EmptySplit, DeviceUnavailable):
        assert issubclass(cls, FeatureStoreError)
    with pytest.raises(EmptySplit, match="yielded no batches"):
        train_linear_probe([], [], num_classes=2, device="cpu")
    with pytest.raises(InvalidLabels, match="label 5 is outside"):
        train_linear_probe([(torch.randn(4, 8), torch.tensor([0, 1, 5, 1]))], [], num_classes=3, device="cpu")
    with pytest.raises(InvalidOption, match="invalid device 'gpu0'"):
        resolve_device("gpu0")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable, match="CUDA is not available"):
            resolve_device("cuda")


def test_compare_reports_identical_metrics_for_identical_stores(store_path: str) -> None:
    result = compare_probes(store_path, DATASET, "seg32a", "seg32b", train_split="train",
                            eval_split="val", seeds=2, epochs=2, batch_size=32, device="cpu")
    a, b = result["a"], result["b"]
    assert a["task"] == "seg" and a["num_classes"] == SEG_CLASSES and a["seeds"] == [0, 1]
    assert a["runs"] == b["runs"]  # same seeds, same batches, same bytes: bit-identical
    jaccard = result["comparison"]["jaccard"]
    assert jaccard["diff"] == 0 and jaccard["max_abs_paired_diff"] == 0
    assert jaccard["exceeds_spread"] is False
    assert a["runs"][0] != a["runs"][1]  # the seed does change the run, so the spread is real


def test_streaming_trains_the_same_probe_as_the_in_ram_cache(store_path: str) -> None:
    common: dict[str, Any] = dict(train_split="train", eval_split="val", seeds=[1], epochs=2,
                                  batch_size=32, device="cpu")
    streamed = run_probe(store_path, DATASET, "seg32a", loader="stream", **common)
    in_ram = run_probe(store_path, DATASET, "seg32a", loader="ram", **common)
    assert streamed["runs"] == in_ram["runs"]


def test_compare_float16_with_cls_token_against_float32(store_path: str) -> None:
    # A float16 store that still carries a CLS token vs the float32 one without: the prefix is
    # dropped from token_layout, and the seg probe learns on both.
    result = compare_probes(store_path, DATASET, "seg16", "seg32a", train_split="train",
                            eval_split="val", seeds=2, epochs=3, device="cpu")
    assert result["a"]["prefix_tokens_dropped"] == 1 and result["b"]["prefix_tokens_dropped"] == 0
    assert result["a"]["metrics"]["jaccard"]["mean"] > 0.5
    assert result["b"]["metrics"]["jaccard"]["mean"] > 0.5


def test_bfloat16_store_is_upcast_and_probed(store_path: str) -> None:
    result = run_probe(store_path, DATASET, "segbf", train_split="train", eval_split="val",
                       seeds=[0], epochs=3, batch_size=16, device="cpu")
    assert result["dtype"] == "bfloat16" and result["metrics"]["jaccard"]["mean"] > 0.5


def test_linear_task_is_detected_and_learns_through_the_store(store_path: str) -> None:
    result = compare_probes(store_path, DATASET, "lin16", "lin32", train_split="train",
                            eval_split="val", seeds=2, epochs=5, batch_size=32, device="cpu")
    assert result["a"]["task"] == "linear" and result["a"]["num_classes"] == LIN_CLASSES
    assert set(result["comparison"]) == {"auc", "balanced_accuracy", "macro_f1"}
    for side in ("a", "b"):
        assert result[side]["metrics"]["macro_f1"]["mean"] > 0.9


def test_compare_refuses_mismatched_inputs(store_path: str) -> None:
    with pytest.raises(ValueError, match="disagree on the task"):
        compare_probes(store_path, DATASET, "seg32a", "lin32", train_split="train", eval_split="val")
    with pytest.raises(ValueError, match="seeds must be a positive integer"):
        run_probe(store_path, DATASET, "lin32", train_split="train", eval_split="val", seeds=0)
    with pytest.raises(ValueError, match="loader must be one of"):
        run_probe(store_path, DATASET, "lin32", train_split="train", eval_split="val", loader="disk")


def test_save_predictions_is_for_the_slide_level_heads(store_path: str, tmp_path: Any) -> None:
    with pytest.raises(InvalidOption, match="--save-predictions applies to the linear and abmil heads, not to "
                                            "task seg"):
        run_probe(store_path, DATASET, "seg32a", train_split="train", eval_split="val", seeds=1, epochs=1,
                  device="cpu", save_predictions=str(tmp_path / "p.csv"))
    assert not (tmp_path / "p.csv").exists()
    # A dense split without ids: its rows are named by position
    result = run_probe(store_path, DATASET, "lin32", train_split="train", eval_split="val", seeds=1, epochs=2,
                       batch_size=32, device="cpu", save_predictions=str(tmp_path / "p.csv"))
    lines = (tmp_path / "p.csv").read_text().splitlines()
    assert result["predictions"]["rows"] == len(lines) - 1 == result["eval_samples"]
    assert [line.split(",")[2] for line in lines[1:4]] == ["0", "1", "2"]
