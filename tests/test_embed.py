"""``featurestore embed``: slide and patient embeddings of a bag split, their lineage and staleness."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _core_helpers import comparable_chunk_file
from _dist_helpers import torchrun_cli

import featurestore
from featurestore.embed import pooling
from featurestore.embed.run import EmbedOptions, embed
from featurestore.errors import EmptyBag, InvalidLabels, InvalidOption
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


def test_group_by_patients_pools_all_their_patches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    import _embed_encoders

    made = make_bags(tmp_path, "float32")
    run_embed(tmp_path, group_by="case_id", encoder_name="patient")
    values, ids, labels = read_split(tmp_path, "patient")
    cases: dict[str, list[str]] = {}
    for bag_id, (_, _, case) in sorted(BAGS.items()):
        cases.setdefault(case, []).append(bag_id)
    assert ids == ["p1", "p2", "p3"] and labels.tolist() == [0, 1, 1]
    reference = [(np.concatenate([made[b] for b in cases[c]]).astype(np.float64).mean(0)).astype(np.float32) for c in ids]
    assert np.array_equal(values, np.stack(reference))
    # a python encoder gets the group's slides concatenated, later slides shifted in x
    run_embed(tmp_path, "python:_embed_encoders:recorder", group_by="case_id", encoder_name="patient2")
    p1 = _embed_encoders.RECORDERS[-1].calls[1]  # after the output-size call (also p1)
    first, second = bag_coords("s-a", 7), bag_coords("s-b", 30)
    shift = first[:, 0].max() + PATCH
    assert p1["coords"] == np.concatenate([first, second + [shift, 0]]).tolist()
    assert p1["features_shape"] == (1, 37, DIM)


def test_group_with_disagreeing_labels_or_without_the_attribute_is_refused(tmp_path: Path) -> None:
    make_bags(tmp_path, bags={"s-a": (3, 0, "p1"), "s-b": (4, 1, "p1"), "s-c": (2, 1, "p2")})
    with pytest.raises(InvalidLabels, match=r"group case_id='p1' .* different labels \(s-a=0, s-b=1\)"):
        run_embed(tmp_path, group_by="case_id")
    with pytest.raises(InvalidOption, match="bag 's-a' of ds/uni/train has no attribute 'site'"):
        run_embed(tmp_path, group_by="site")


def test_no_labels_leaves_them_out_and_the_task_comes_from_a_table_at_probe_time(tmp_path: Path) -> None:
    # Each patient's two slides disagree on the stored (slide-level) label: a patient row has none.
    bags = {f"s-{p}{k}": (3 + 2 * p + k, k, f"p{p}") for p in range(8) for k in range(2)}
    make_bags(tmp_path, "float32", bags=bags)
    with pytest.raises(InvalidLabels, match=r"different labels .*--no-labels.*--id-column case_id\)$"):
        run_embed(tmp_path, group_by="case_id", encoder_name="patient")
    run_embed(tmp_path, group_by="case_id", encoder_name="patient", no_labels=True)
    values, ids, labels = read_split(tmp_path, "patient")
    assert ids == [f"p{p}" for p in range(8)] and labels is None and values.shape == (8, DIM)
    meta = featurestore.open_store(str(tmp_path)).split_metadata("ds", "patient", "train")
    assert meta["lineage"]["labels"] == "left out"
    assert "grouped by case_id, labels left out" in cli("info", str(tmp_path), "ds", "patient", "train").stdout
    # A run that carries labels records none of this: its lineage (and cache key) is as before.
    run_embed(tmp_path, encoder_name="slide")
    assert "labels" not in featurestore.open_store(str(tmp_path)).split_metadata("ds", "slide", "train")["lineage"]
    table = tmp_path / "patients.csv"
    table.write_text("case_id,grade\n" + "".join(f"p{p},{'high' if p % 2 else 'low'}\n" for p in range(8)))
    probe = cli("probe", str(tmp_path), "--dataset", "ds", "--encoder", "patient", "--train", "train", "--folds", "2",
                "--labels", str(table), "--label-column", "grade", "--id-column", "case_id", "--seeds", "1",
                "--device", "cpu")
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert "8 of 8" in probe.stdout and "labelled" in probe.stdout, probe.stdout


def test_empty_bags_are_refused_naming_them_or_skipped_and_recorded(tmp_path: Path) -> None:
    make_bags(tmp_path, bags={"s-a": (3, 0, "p1"), "s-b": (0, 1, "p1"), "s-c": (2, 1, "p2")})
    with pytest.raises(EmptyBag, match=r"1 bag\(s\) of ds/uni/train have no patches \('s-b'\).*--empty-bags skip"):
        run_embed(tmp_path)
    assert "slide" not in featurestore.open_store(str(tmp_path)).encoders("ds")
    run_embed(tmp_path, empty_bags="skip")
    _, ids, _ = read_split(tmp_path)
    assert ids == ["s-a", "s-c"]
    meta = featurestore.open_store(str(tmp_path)).split_metadata("ds", "slide", "train")
    assert meta["lineage"]["skipped"] == ["s-b"]


def test_group_by_a_column_of_a_table(tmp_path: Path) -> None:
    """--groups CSV gives each slide's group (bags extracted from slides carry no case_id): the rows
    of the table's grouping, recorded in the lineage (another grouping: another cache key)."""
    made = make_bags(tmp_path)
    by_attrs = run_embed(tmp_path, group_by="case_id", encoder_name="attrs")
    table = tmp_path / "cases.csv"
    table.write_text("slide_id,case_id\n" + "".join(f"{b}.svs,{case}\n" for b, (_, _, case) in BAGS.items()))
    by_table = run_embed(tmp_path, group_by="case_id", groups=str(table), encoder_name="table")
    assert by_table.num_rows == by_attrs.num_rows == 3
    assert np.array_equal(read_split(tmp_path, "table")[0], read_split(tmp_path, "attrs")[0])
    doc = featurestore.open_store(str(tmp_path)).split_metadata("ds", "table", "train")["lineage"]
    assert doc["groups"]["table"] == "cases.csv" and doc["groups"]["id_column"] == "slide_id"
    # the table's grouping, not the attributes': p1 and p3 as one patient
    table.write_text("slide_id,case_id\n" + "".join(f"{b},{'p2' if case == 'p2' else 'p13'}\n"
                                                      for b, (_, label, case) in BAGS.items()))
    run_embed(tmp_path, group_by="case_id", groups=str(table), encoder_name="merged", no_labels=True)
    values, ids, _ = read_split(tmp_path, "merged")
    p13 = np.concatenate([made[b] for b in sorted(BAGS) if BAGS[b][2] != "p2"]).astype(np.float64).mean(0)
    assert ids == ["p13", "p2"] and np.array_equal(values[0], p13.astype(np.float32))
    again = featurestore.open_store(str(tmp_path)).split_metadata("ds", "merged", "train")["lineage"]["groups"]
    assert again["sha256"] != doc["groups"]["sha256"]
    table.write_text("slide_id,case_id\ns-a,p1\n")
    with pytest.raises(InvalidLabels, match="cases.csv: bag 's-b' of ds/uni/train has no 'case_id' there"):
        run_embed(tmp_path, group_by="case_id", groups=str(table), encoder_name="short")
    result = cli("embed", str(tmp_path), "--dataset", "ds", "--encoder", "uni", "--split", "train",
                 "--slide-encoder", "mean", "--encoder-name", "x", "--groups", str(table))
    assert result.returncode == 1 and "--groups CSV gives each slide's value of --group-by" in result.stderr


def test_max_patches_is_a_seeded_sorted_subset(tmp_path: Path) -> None:
    made = make_bags(tmp_path, "float32")
    run_embed(tmp_path, max_patches=4, seed=3)
    values, ids, _ = read_split(tmp_path)
    from featurestore.embed.rows import subset

    for row, bag_id in zip(values, ids, strict=True):
        keep = subset(len(made[bag_id]), 4, 3, bag_id)
        rows = made[bag_id] if keep is None else made[bag_id][keep]
        assert len(rows) == min(4, len(made[bag_id]))
        assert np.array_equal(row, (rows.astype(np.float64).mean(0)).astype(np.float32))
    meta = featurestore.open_store(str(tmp_path)).split_metadata("ds", "slide", "train")
    assert (meta["lineage"]["max_patches"], meta["lineage"]["seed"]) == (4, 3)


def test_lineage_is_recorded_and_shown(tmp_path: Path) -> None:
    make_bags(tmp_path)
    run_embed(tmp_path, group_by="case_id", out_split="patients")
    store = featurestore.open_store(str(tmp_path))
    source = store.split_metadata("ds", "uni", "train")
    lineage = store.split_metadata("ds", "slide", "patients")["lineage"]
    assert lineage["source"] == {"dataset": "ds", "encoder": "uni", "split": "train", "kind": "bags",
                                 "generation": source["generation"], "completed": source["completed"],
                                 "num_bags": len(BAGS), "num_rows": sum(v[0] for v in BAGS.values())}
    assert lineage["slide_encoder"]["spec"] == "mean" and lineage["group_by"] == "case_id"
    info = cli("info", str(tmp_path), "ds", "slide", "patients")
    assert info.returncode == 0
    assert f"ds/uni/train (generation {source['generation']}), slide encoder mean, grouped by case_id" in info.stdout
    assert "current" in info.stdout


def test_stale_after_the_source_is_overwritten(tmp_path: Path) -> None:
    make_bags(tmp_path)
    run_embed(tmp_path)
    assert cli("verify", str(tmp_path)).returncode == 0
    new = make_bags(tmp_path, seed=1, overwrite=True)  # the source rewritten: another generation
    verify = cli("verify", str(tmp_path))
    assert verify.returncode == 1
    assert "STALE ds/slide/train: source ds/uni/train generation changed" in verify.stdout
    listing = cli("ls", str(tmp_path))
    assert "STALE" in [line for line in listing.stdout.splitlines() if line.startswith("ds/slide/train")][0]
    # the server says so on every data response
    from fastapi.testclient import TestClient

    from server.app import create_app

    with TestClient(create_app(str(tmp_path))) as client:
        response = client.get("/v1/features/ds/slide/train/batch", params={"start": 0, "stop": 2})
        assert response.status_code == 200
        assert response.headers["X-Featurestore-Stale"].startswith("source ds/uni/train generation changed")
        page = client.get("/ui/splits/ds/slide/train")
        assert page.status_code == 200
        assert "derived from" in page.text and "STALE: source ds/uni/train generation changed" in page.text
        assert '(<a href="/ui/splits/ds/uni/train">the source split</a>)' in page.text
        assert "<h2>Pictures</h2>" not in page.text  # [N, D] embeddings are no patch grid
    # --resume recomputes every row from the new source (a stale row is never kept)
    result = cli("embed", str(tmp_path), "--dataset", "ds", "--encoder", "uni", "--split", "train",
                 "--slide-encoder", "mean", "--encoder-name", "slide", "--resume")
    assert result.returncode == 0, result.stderr
    assert "ds/slide/train is stale (source ds/uni/train generation changed" in result.stderr
    values, ids, _ = read_split(tmp_path)
    assert np.array_equal(values, np.stack([(new[i].astype(np.float64).mean(0)).astype(np.float32) for i in ids]))
    assert cli("verify", str(tmp_path)).returncode == 0
    with TestClient(create_app(str(tmp_path))) as client:
        response = client.get("/v1/features/ds/slide/train/batch", params={"start": 0, "stop": 2})
        assert response.status_code == 200 and "X-Featurestore-Stale" not in response.headers
        assert "(current)" in client.get("/ui/splits/ds/slide/train").text


def twin_stores(tmp_path: Path, names: tuple[str, str], bags: dict[str, tuple[int, Any, str]]) -> list[str]:
    """The same bags in two stores under tmp_path, and the `embed` arguments of the recorder encoder
    that each test runs on both (one store as the reference, the other as the run under test)."""
    for name in names:
        make_bags(tmp_path / name, bags=bags)
    return ["--dataset", "ds", "--encoder", "uni", "--split", "train", "--slide-encoder",
            "python:_embed_encoders:recorder", "--encoder-name", "rec", "--device", "cpu"]


def test_sigkill_then_resume_is_byte_identical(tmp_path: Path) -> None:
    args = twin_stores(tmp_path, ("reference", "store"), {f"s-{i:02d}": (3 + i, i % 2, f"p{i // 2}") for i in range(10)})
    assert cli("embed", str(tmp_path / "reference"), *args).returncode == 0
    chunks = tmp_path / "store" / "ds" / "rec" / "train" / "features" / "c"
    process = subprocess.Popen([sys.executable, "-m", "featurestore.cli", "embed", str(tmp_path / "store"), *args],
                               env=cli_env(FS_EMBED_SLEEP="0.3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if sum((chunks / str(i) / "0").is_file() for i in range(10)) >= 3:
                break
            time.sleep(0.02)
        assert process.poll() is None, "the run ended before it could be killed"
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    kept = sum((chunks / str(i) / "0").is_file() for i in range(10))
    assert 3 <= kept < 10
    assert featurestore.open_store(str(tmp_path / "store")).split_status("ds", "rec", "train") == "writing"
    log = tmp_path / "calls.log"
    resumed = cli("embed", str(tmp_path / "store"), *args, "--resume", env=cli_env(FS_EMBED_LOG=str(log)))
    assert resumed.returncode == 0, resumed.stderr
    assert len(log.read_text().splitlines()) == 1 + 10 - kept  # the output-size call, then only missing rows

    def files(root: Path) -> dict[str, bytes]:
        split = root / "ds" / "rec" / "train"
        return {str(p.relative_to(split)): comparable_chunk_file(str(p.relative_to(split)), p.read_bytes())
                for p in sorted(split.rglob("*")) if p.is_file() and p.name != "zarr.json" and not p.name.endswith(".tmp")}

    assert files(tmp_path / "store") == files(tmp_path / "reference")
    assert cli("verify", str(tmp_path / "store")).returncode == 0


def test_info_json_and_help(tmp_path: Path) -> None:
    out = cli("embed", "--help")
    assert out.returncode == 0 and "--slide-encoder" in out.stdout and "--group-by" in out.stdout
    make_bags(tmp_path)
    run_embed(tmp_path)
    meta = json.loads(cli("info", str(tmp_path), "ds", "slide", "train", "--json").stdout)
    assert meta["ids"] is True and meta["lineage"]["source"]["split"] == "train"


def test_a_split_of_the_other_kind_is_refused_with_the_verbs_own_fix(tmp_path: Path) -> None:
    """embed takes bag splits: a dense one is named as such, with what the verb does (not the
    library's "open it with store.open(...)"); a target name held by a bag split keeps the
    writer's own fix. (export takes both kinds: tests/test_embed.py, the embedding export.)"""
    make_bags(tmp_path)
    run_embed(tmp_path, encoder_name="slide")  # a dense split: ds/slide/train
    for verb in (["embed", str(tmp_path), "--dataset", "ds", "--encoder", "slide", "--split", "train",
                  "--slide-encoder", "mean", "--encoder-name", "again"],):
        done = cli(*verb)
        err = done.stderr.strip()
        assert done.returncode == 1 and len(err.splitlines()) == 1, err
        assert "split ds/slide/train is a dense split, not a bag split: featurestore " + verb[0] in err, err
        assert "open it with" not in err
    taken = cli("embed", str(tmp_path), "--dataset", "ds", "--encoder", "uni", "--split", "train", "--slide-encoder",
                "mean", "--encoder-name", "uni", "--out-split", "train")
    assert "would replace the bag split itself" in taken.stderr, taken.stderr
    held = featurestore.open_store(str(tmp_path), mode="a").create_bag_split("ds", "held", "train", dim=DIM)
    held.commit()
    taken = cli("embed", str(tmp_path), "--dataset", "ds", "--encoder", "uni", "--split", "train", "--slide-encoder",
                "mean", "--encoder-name", "held")
    assert "is a bag split, not a dense split: use another split name, or overwrite" in taken.stderr, taken.stderr


def test_torchrun_two_ranks_equal_one_process(tmp_path: Path) -> None:
    args = twin_stores(tmp_path, ("single", "multi"), {f"s-{i:02d}": (2 + i, i % 2, f"p{i // 3}") for i in range(7)})
    assert cli("embed", str(tmp_path / "single"), *args).returncode == 0
    log = tmp_path / "calls.log"
    process = torchrun_cli("embed", str(tmp_path / "multi"), *args, env=cli_env(FS_EMBED_LOG=str(log)))
    stdout = process.stdout
    assert process.returncode == 0, process.stderr[-3000:]
    assert stdout.count("ds/rec/train: 7 rows (7 computed by this run)") == 1  # rank 0 reports
    assert len(log.read_text().splitlines()) == 7 + 2  # every row once, plus one size probe per rank
    for root in ("single", "multi"):
        assert featurestore.open_store(str(tmp_path / root)).split_status("ds", "rec", "train") == "complete"
    for chunk in range(7):
        rel = Path("ds", "rec", "train", "features", "c", str(chunk), "0")
        assert (tmp_path / "single" / rel).read_bytes() == (tmp_path / "multi" / rel).read_bytes()


def test_output_shapes_and_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    made = make_bags(tmp_path, "float32")
    run_embed(tmp_path, "python:_embed_encoders:flat", encoder_name="flat")  # [E] is accepted
    values, ids, _ = read_split(tmp_path, "flat")
    np.testing.assert_allclose(values, np.stack([made[i].mean(0) for i in ids]), rtol=1e-6, atol=1e-6)
    meta = featurestore.open_store(str(tmp_path)).split_metadata("ds", "flat", "train")
    assert meta["lineage"]["slide_encoder"]["weights_hash"] is None  # no weights, nothing to hash
    with pytest.raises(InvalidOption, match="--autocast bfloat16 applies to python: slide encoders"):
        run_embed(tmp_path, "mean", autocast="bfloat16", encoder_name="m2")
    with pytest.raises(InvalidOption, match="--max-patches must be a positive integer, got 0"):
        run_embed(tmp_path, "mean", max_patches=0, encoder_name="m2")
    with pytest.raises(InvalidOption, match="would replace the bag split itself"):
        run_embed(tmp_path, "mean", encoder_name="uni")
    # a re-run of a complete, current split is a no-op; another spec under its name is refused
    assert run_embed(tmp_path, "python:_embed_encoders:flat", encoder_name="flat").status == "already-complete"
    from featurestore.errors import CacheKeyMismatch

    with pytest.raises(CacheKeyMismatch, match=r"changes the encoder \(python:_embed_encoders:flat then, max now\); "
                       r"the lineage \(slide_encoder\.spec: python:_embed_encoders:flat then, max now"):
        run_embed(tmp_path, "max", encoder_name="flat")



def test_embeddings_export_as_one_h5_per_slide_or_patient_and_never_when_stale(tmp_path: Path) -> None:
    import h5py

    made = make_bags(tmp_path)
    run_embed(tmp_path, encoder_name="slide")
    run_embed(tmp_path, group_by="case_id", encoder_name="patient", out_split="patients")
    values, ids, _ = read_split(tmp_path)
    out = tmp_path / "out"
    args = ["--dataset", "ds", "--encoder", "slide", "--split", "train", "--no-progress"]
    done = cli("export", str(tmp_path), *args, "--format", "trident", "--out", str(out / "trident"))
    assert done.returncode == 0, done.stderr
    assert "exported ds/slide/train: 5 embeddings as trident, 6 files" in done.stdout
    for i, slide in enumerate(ids):  # TRIDENT's slide embedding: one (E,) vector per h5
        with h5py.File(out / "trident" / f"{slide}.h5") as f:
            assert f["features"].shape == (DIM,) and np.array_equal(f["features"][:], values[i])
    assert (out / "trident" / "labels.csv").read_text().splitlines()[:2] == ["slide_id,label", "s-a,0"]
    done = cli("export", str(tmp_path), "--dataset", "ds", "--encoder", "patient", "--split", "patients",
               "--format", "stamp", "--out", str(out / "stamp"), "--no-progress")
    assert done.returncode == 0, done.stderr
    with h5py.File(out / "stamp" / "p1.h5") as f:  # STAMP's patient-level features
        assert dict(f.attrs) == {"feat_type": "patient", "encoder": "patient"}
        want = np.concatenate([made["s-a"], made["s-b"]]).astype(np.float64).mean(0).astype(np.float32)
        np.testing.assert_allclose(f["feats"][:], want, rtol=1e-6)
    assert (out / "stamp" / "labels.csv").read_text().splitlines()[0] == "case_id,label"
    refused = cli("export", str(tmp_path), *args, "--format", "clam-pt", "--out", str(out / "clam"))
    assert refused.returncode == 1 and "export it with --format trident or stamp" in refused.stderr
    make_bags(tmp_path, seed=1, overwrite=True)  # the bags change: the embeddings are stale now
    refused = cli("export", str(tmp_path), *args, "--format", "trident", "--out", str(out / "stale"))
    err = refused.stderr.strip()
    assert refused.returncode == 1 and len(err.splitlines()) == 1 and "is stale (source ds/uni/train" in err, err
    assert not (out / "stale").exists()
