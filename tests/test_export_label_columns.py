"""labels.csv never has two columns of one name: where the import kept a table column named
``label`` (or ``slide_id``) as a bag attribute, the labels (ids) go out under the column the import
read them from, and a re-import with the import's own --label-column gives the same split back."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from test_export import assert_same_bags, export, import_dir, slide_files

from featurestore import open_store
from featurestore.errors import InvalidOption
from featurestore.extract.bag_export import csv_columns, labels_csv


def test_a_kept_label_column_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slide_files(tmp_path / "features_uni", {"TCGA-00": 5, "TCGA-01": 9, "TCGA-02": 3}, dtype=np.float16,
                coords_dtype=np.int64, attrs={"patch_size_level0": 256})
    (tmp_path / "clinical.csv").write_text("slide_id,case_id,subtype,label,site\nTCGA-00.svs,C0,LUAD,0,A\n"
                                           "TCGA-01.svs,C1,LUSC,1,B\nTCGA-02.svs,C0,LUAD,0,C\n")
    store = tmp_path / "store"
    import_dir(tmp_path / "features_uni", store, "a", "--labels", str(tmp_path / "clinical.csv"),
               "--label-column", "subtype")
    capsys.readouterr()
    assert export(store, "a", "trident", tmp_path / "out") == 0
    out = capsys.readouterr().out
    assert "--label-column subtype" in out, out
    with open(tmp_path / "out" / "labels.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["slide_id", "subtype", "case_id", "label", "site"]
    assert rows[1] == ["TCGA-00", "LUAD", "C0", "0", "A"]
    import_dir(tmp_path / "out", store, "b", "--labels", str(tmp_path / "out" / "labels.csv"),
               "--label-column", "subtype")
    assert_same_bags(store, "a", "b")
    s = open_store(str(store))
    a, b = s.open_bags("ds", "enc", "a"), s.open_bags("ds", "enc", "b")
    assert a.attrs(0)["label"] == b.attrs(0)["label"] == 0 and b.attrs(1)["case_id"] == "C1"
    assert a.metadata["label_names"] == b.metadata["label_names"] == ["LUAD", "LUSC"]
    assert a.metadata["source"]["table_columns"] == b.metadata["source"]["table_columns"] == ["case_id", "label",
                                                                                              "site"]
    # and once more: the second export writes what the first did
    assert export(store, "b", "trident", tmp_path / "again") == 0
    assert (tmp_path / "again" / "labels.csv").read_text() == (tmp_path / "out" / "labels.csv").read_text()


def test_column_names_without_a_collision_stay_slide_id_and_label() -> None:
    meta = {"source": {"table_columns": ["case_id"], "id_column": "sample", "label_column": "grade"}}
    assert csv_columns(meta, ["case_id"]) == ("slide_id", "label", "")


def test_a_kept_slide_id_column_and_a_split_that_recorded_no_names() -> None:
    meta = {"source": {"id_column": "sample", "label_column": "grade"}}
    id_column, label_column, note = csv_columns(meta, ["slide_id", "label"])
    assert (id_column, label_column) == ("sample", "grade") and "--id-column sample --label-column grade" in note
    # imported before the names were recorded: a name no column has, and the note says it
    id_column, label_column, note = csv_columns({}, ["label", "split_label"])
    assert (id_column, label_column) == ("slide_id", "split_split_label")
    assert "--label-column split_split_label" in note


def test_labels_csv_refuses_two_columns_of_one_name() -> None:
    with pytest.raises(InvalidOption, match="two columns named 'label'"):
        labels_csv(["a"], np.array([0]), None, columns={"label": [1]})
