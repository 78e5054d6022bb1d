"""``featurestore embed``: slide and patient embeddings of a bag split, their lineage and staleness.

This module: the helpers the other embed tests import (a bag split of five slides of three
patients, ``run_embed``, ``cli``), and the slide encoders themselves: mean and max pooling (bit
for bit against a float64 reference), int8 splits, ``python:`` encoders (what they are given,
per-slide patch sizes, requirements and bad specs refused in one line). Grouping by patient:
tests/test_embed_groups.py; lineage, staleness, options and export: tests/test_embed_lineage.py;
a killed run resumed and torchrun ranks: tests/test_embed_runs.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.embed import pooling
from featurestore.embed.run import EmbedOptions, embed
from featurestore.extract.dist import Coordinator
from featurestore.format import dtypes

TESTS = Path(__file__).resolve().parent
DIM = 8
PATCH = 256
# bag id -> (patches, label, case)
BAGS = {"s-a": (7, 0, "p1"), "s-b": (30, 0, "p1"), "s-c": (1, 1, "p2"), "s-d": (12, 1, "p3"), "s-e": (5, 1, "p3")}


def bag_features(bag_id: str, n: int, dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng([seed, sum(map(ord, bag_id))])
    values = (rng.standard_normal((n, DIM)) * 3).astype(np.float32)
    if dtype == "bfloat16":  # values exact in bfloat16 (what the store keeps)
        return (values.view(np.uint32) & 0xFFFF0000).view(np.float32)
    return values.astype(dtypes.storage_dtype(dtype)).astype(np.float32) if dtype == "float16" else values


def bag_coords(bag_id: str, n: int) -> np.ndarray:
    return np.stack([np.arange(n) * PATCH + 1000 * (ord(bag_id[-1]) - 96), np.full(n, 2 * PATCH)], axis=1).astype(np.int64)


def make_bags(root: Path, dtype: str = "float16", bags: dict[str, tuple[int, Any, str]] | None = None,
              seed: int = 0, split: str = "train", overwrite: bool = False) -> dict[str, np.ndarray]:
    store = featurestore.open_store(str(root), mode="a")
    w = store.create_bag_split("ds", "uni", split, dim=DIM, dtype=dtype, patch_size_level0=PATCH, overwrite=overwrite)
    made = {}
    for bag_id, (n, label, case) in (bags or BAGS).items():
        made[bag_id] = bag_features(bag_id, n, dtype, seed)
        w.add_bag(bag_id, made[bag_id], coords=bag_coords(bag_id, n), label=label, attrs={"case_id": case})
    w.close()
    w.commit()
    return made


def run_embed(root: Path, spec: str = "mean", **kwargs: Any) -> Any:
    opts = EmbedOptions(store=str(root), dataset="ds", encoder="uni", split="train", slide_encoder=spec,
                        encoder_name=kwargs.pop("encoder_name", "slide"), device="cpu", **kwargs)
    return embed(opts, Coordinator())


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "featurestore.cli", *args], capture_output=True, text=True,
                          env=env or cli_env(), timeout=180)


def read_split(root: Path, encoder: str = "slide", split: str = "train") -> tuple[np.ndarray, Any, Any]:
    arr = featurestore.open_store(str(root)).open("ds", encoder, split)
    labels = None if arr.labels is None else arr.labels.read_numpy(np.arange(len(arr)))
    return arr.read_numpy(np.arange(len(arr))), arr.ids, labels


@pytest.mark.parametrize("kernel", ["numba", "numpy"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_mean_is_the_float32_rounding_of_the_float64_mean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          dtype: str, kernel: str) -> None:
    monkeypatch.setattr(pooling, "PIECE_BYTES", 4 * DIM * 2)  # several pieces per bag: the read-ahead path
    monkeypatch.setattr(pooling, "BLOCK_BYTES", 3 * DIM * 8)  # and several blocks per piece (numpy)
    monkeypatch.setenv("FEATURESTORE_EMBED_KERNEL", "1" if kernel == "numba" else "0")
    assert (pooling.kernel_for("mean", dtype) is not None) == (kernel == "numba")
    made = make_bags(tmp_path, dtype)
    result = run_embed(tmp_path)
    assert result.status == "complete" and result.computed == len(BAGS)
    values, ids, labels = read_split(tmp_path)
    assert ids == sorted(BAGS)
    assert labels.tolist() == [BAGS[i][1] for i in ids]
    reference = np.stack([(made[i].astype(np.float64).sum(0) / len(made[i])).astype(np.float32) for i in ids])
    assert values.dtype == np.float32 and np.array_equal(values, reference)


@pytest.mark.parametrize("kernel", ["numba", "numpy"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_max_pooling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str, dtype: str) -> None:
    monkeypatch.setattr(pooling, "PIECE_BYTES", 3 * DIM * 2)
    monkeypatch.setenv("FEATURESTORE_EMBED_KERNEL", "1" if kernel == "numba" else "0")
    made = make_bags(tmp_path, dtype)
    run_embed(tmp_path, "max", encoder_name="slidemax")
    values, ids, _ = read_split(tmp_path, "slidemax")
    assert values.dtype == np.float32 and np.array_equal(values, np.stack([made[i].max(0) for i in ids]))


@pytest.mark.parametrize("kernel", ["numba", "numpy"])
def test_an_int8_split_is_pooled_and_encoded_from_its_values_not_its_codes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          kernel: str) -> None:
    """int8 codes mean nothing without their bag's scale: mean, max and a python slide encoder get
    the stored values (codes x scale, what every reader of the split returns)."""
    monkeypatch.setattr(pooling, "PIECE_BYTES", 4 * DIM * 4)  # several pieces per bag
    monkeypatch.setenv("FEATURESTORE_EMBED_KERNEL", "1" if kernel == "numba" else "0")
    monkeypatch.syspath_prepend(str(TESTS))
    make_bags(tmp_path, "int8")
    bags = featurestore.open_store(str(tmp_path)).open_bags("ds", "uni", "train")
    stored = {i: bags.read_numpy(i, dtype="float32")[0].copy() for i in sorted(BAGS)}
    assert any(np.abs(v).max() < 127 * 0.5 for v in stored.values())  # values, not codes (up to 127)
    run_embed(tmp_path)
    run_embed(tmp_path, "max", encoder_name="slidemax")
    run_embed(tmp_path, "python:_embed_encoders:flat", encoder_name="flat")
    ids = sorted(BAGS)
    assert np.array_equal(read_split(tmp_path)[0], np.stack(
        [(stored[i].astype(np.float64).sum(0) / len(stored[i])).astype(np.float32) for i in ids]))
    assert np.array_equal(read_split(tmp_path, "slidemax")[0], np.stack([stored[i].max(0) for i in ids]))
    np.testing.assert_allclose(read_split(tmp_path, "flat")[0], np.stack([stored[i].mean(0) for i in ids]),
                               rtol=1e-5, atol=1e-6)


def test_python_encoder_gets_float32_features_int64_coords_and_patch_size(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    import _embed_encoders

    made = make_bags(tmp_path, "bfloat16")
    result = run_embed(tmp_path, "python:_embed_encoders:recorder", autocast="bfloat16")
    calls = _embed_encoders.RECORDERS[-1].calls
    # one call for the output size, then one per bag
    assert len(calls) == len(BAGS) + 1
    for call, bag_id in zip(calls[1:], sorted(BAGS), strict=True):
        assert call["features_dtype"] == "torch.float32" and call["coords_dtype"] == "torch.int64"
        assert call["features_shape"] == (1, BAGS[bag_id][0], DIM)
        assert call["patch_size_level0"] == PATCH and call["autocast"] is True
        assert call["coords"] == bag_coords(bag_id, BAGS[bag_id][0]).tolist()
    meta = featurestore.open_store(str(tmp_path)).split_metadata("ds", "slide", "train")
    assert meta["lineage"]["autocast"] == "bfloat16"
    assert len(meta["lineage"]["slide_encoder"]["weights_hash"]) == 64
    values, ids, _ = read_split(tmp_path)
    assert result.num_rows == len(BAGS) and ids == sorted(BAGS)
    # column sums under bfloat16 autocast: the sums of what went in, to bfloat16's precision
    np.testing.assert_allclose(values, np.stack([made[i].sum(0) for i in ids]), rtol=2e-2, atol=0.5)


def test_slides_of_two_magnifications_are_encoded_with_their_own_patch_size(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Slide extraction records each slide's level-0 patch side on its bag, none on the split: each
    call gets its bag's; a patient whose slides differ, or a requirement of one size, is refused."""
    monkeypatch.syspath_prepend(str(TESTS))
    import _embed_encoders

    from featurestore.embed.slide_encoders import SlideEncoderError

    w = featurestore.open_store(str(tmp_path), mode="a").create_bag_split("ds", "uni", "train", dim=DIM,
                                                                          label_dtype="int64")
    for bag_id, size, case in (("s-a", 512, "p1"), ("s-b", 256, "p1"), ("s-c", 256, "p2")):
        w.add_bag(bag_id, bag_features(bag_id, 4, "float32"), coords=bag_coords(bag_id, 4), label=0,
                  attrs={"case_id": case, "patch_size_level0": size})
    w.commit()
    run_embed(tmp_path, "python:_embed_encoders:recorder")
    calls = _embed_encoders.RECORDERS[-1].calls
    assert [c["patch_size_level0"] for c in calls[1:]] == [512, 256, 256]  # s-a, s-b, s-c
    with pytest.raises(SlideEncoderError, match="the slides of 'p1' have level-0 patch sizes 256, 512"):
        run_embed(tmp_path, "python:_embed_encoders:recorder", group_by="case_id", encoder_name="patients")
    assert "patients" not in featurestore.open_store(str(tmp_path)).encoders("ds")
    result = cli("embed", str(tmp_path), "--dataset", "ds", "--encoder", "uni", "--split", "train",
                 "--slide-encoder", "python:_embed_encoders:needy", "--encoder-name", "titan", "--device", "cpu")
    assert result.returncode == 1 and "requires patch_size_level0 512" in result.stderr
    assert "records 256 and 512 (per slide)" in result.stderr, result.stderr


def test_requirement_mismatch_is_refused_in_one_line(tmp_path: Path) -> None:
    make_bags(tmp_path)
    result = cli("embed", str(tmp_path), "--dataset", "ds", "--encoder", "uni", "--split", "train",
                 "--slide-encoder", "python:_embed_encoders:needy", "--encoder-name", "titan", "--device", "cpu")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "requires patch_size_level0 512" in lines[0] and "records 256" in lines[0] and "ds/uni/train" in lines[0]
    assert "titan" not in featurestore.open_store(str(tmp_path)).encoders("ds")  # nothing written


@pytest.mark.parametrize("spec, says", [
    ("median", "invalid slide encoder spec 'median'"),
    ("python:only_module", "invalid slide encoder spec 'python:only_module'"),
    ("python:no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("python:_embed_encoders:missing", "has no callable 'missing'"),
    ("python:_embed_encoders:not_a_module", "not a torch.nn.Module"),
])
def test_bad_specs_are_one_line(tmp_path: Path, spec: str, says: str) -> None:
    make_bags(tmp_path)
    result = cli("embed", str(tmp_path), "--dataset", "ds", "--encoder", "uni", "--split", "train",
                 "--slide-encoder", spec, "--encoder-name", "x", "--device", "cpu")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert says in result.stderr
