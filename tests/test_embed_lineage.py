"""``featurestore embed`` outputs as the rest of the store sees them (helpers: tests/test_embed.py):
lineage recorded and shown by info, ls, verify and the server (and STALE once the source is
rewritten, recomputed on --resume), --max-patches subsets, output shapes and option checks, a
split of the other kind refused with the verb's own fix, and the embedding export (never stale)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_embed import BAGS, DIM, TESTS, cli, make_bags, read_split, run_embed

import featurestore
from featurestore.errors import InvalidOption


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


def test_info_json_and_help(tmp_path: Path) -> None:
    out = cli("embed", "--help")
    assert out.returncode == 0 and "--slide-encoder" in out.stdout and "--group-by" in out.stdout
    make_bags(tmp_path)
    run_embed(tmp_path)
    meta = json.loads(cli("info", str(tmp_path), "ds", "slide", "train", "--json").stdout)
    assert meta["ids"] is True and meta["lineage"]["source"]["split"] == "train"
    # the labels as a bag split shows them (they printed as a raw dict, {'shape': [], 'dtype': 'int64'})
    text = cli("info", str(tmp_path), "ds", "slide", "train").stdout
    assert "        labels: int64, 2 classes: 0: 2 samples, 1: 3 samples\n" in text, text


def test_a_split_of_the_other_kind_is_refused_with_the_verbs_own_fix(tmp_path: Path) -> None:
    """embed takes bag splits: a dense one is named as such, with what the verb does (not the
    library's "open it with store.open(...)"); a target name held by a bag split keeps the
    writer's own fix. (export takes both kinds: tests/test_embed_lineage.py, the embedding export.)"""
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


def test_a_negative_seed_and_an_empty_out_split_are_refused_in_one_line(tmp_path: Path) -> None:
    """--seed -1 --max-patches K was numpy's traceback; --out-split '' silently wrote the --split name."""
    from featurestore.errors import InvalidName

    make_bags(tmp_path, "float32")
    with pytest.raises(InvalidOption, match=r"--seed must be an integer >= 0 .*got -1: pass e.g. --seed 0"):
        run_embed(tmp_path, "mean", max_patches=2, seed=-1, encoder_name="neg")
    with pytest.raises(InvalidName, match="invalid --out-split ''"):
        run_embed(tmp_path, "mean", out_split="", encoder_name="empty")
    assert not {"neg", "empty"} & set(featurestore.open_store(str(tmp_path)).encoders("ds"))  # nothing written
    result = cli("embed", str(tmp_path), "--dataset", "ds", "--encoder", "uni", "--split", "train", "--slide-encoder",
                 "mean", "--encoder-name", "neg", "--seed", "-1", "--max-patches", "2", "--no-progress")
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "featurestore: error: --seed must be an integer >= 0 (it seeds the --max-patches subsets), got -1: "
        "pass e.g. --seed 0"], result.stderr


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
