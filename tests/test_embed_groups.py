"""``featurestore embed --group-by``: patient embeddings pooled over all their slides' patches
(groups from a bag attribute or a --groups table), disagreeing labels refused or left out with
--no-labels, and empty bags refused by name or skipped and recorded (helpers: tests/test_embed.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_embed import BAGS, DIM, PATCH, TESTS, bag_coords, cli, make_bags, read_split, run_embed

import featurestore
from featurestore.errors import EmptyBag, InvalidLabels, InvalidOption


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
