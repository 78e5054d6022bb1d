"""``featurestore import DIR`` of per-slide files: bad inputs refused in one line naming the file,
the bag and the value (before anything is written where the header pass can see it), and the
labels CSV's columns (``--label-column``, ``--id-column``, the others kept as bag attributes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from _import_fixtures import h5_slides, writer_after_one_bag

from featurestore import open_store
from featurestore.cli import main
from featurestore.errors import DtypeMismatch, Float16Overflow, NonFiniteValues, ShapeMismatch

DIM = 8


def slides(root: Path, lengths: dict[str, int], coords_dtype: Any = np.int64, seed: int = 0) -> dict[str, Any]:
    """One TRIDENT-like h5 per slide (features float16, coords [n, 2])."""
    return h5_slides(root, lengths, DIM, coords_dtype=coords_dtype, seed=seed)


def run_import(source: Path | str, store: Path, *extra: str, split: str = "s") -> int:
    return main(["import", str(source), "--store", str(store), "--dataset", "ds", "--encoder-name", "enc",
                 "--split", split, "--no-progress", *extra])


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def nothing_written(store: Path) -> bool:
    return not (store / "ds" / "enc" / "s").exists()


# ---------------------------------------------------------------------- labels beyond int64
def test_a_csv_label_beyond_int64_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # it passed add_bag, then commit() raised OverflowError: a traceback and a split stuck 'writing'
    slides(tmp_path / "src", {"a": 3, "b": 4})
    (tmp_path / "l.csv").write_text(f"slide_id,label\na,1\nb,{2**63}\n")
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(tmp_path / "l.csv")) == 1
    err = one_line(capsys)
    assert "'b'" in err and str(2**63) in err and "int64" in err
    assert nothing_written(tmp_path / "store")


@pytest.mark.parametrize("label", [2**63, np.uint64(2**63), -(2**63) - 1, 2**70])
def test_add_bag_refuses_an_integer_label_the_commit_cannot_store(tmp_path: Path, label: Any) -> None:
    store, writer = writer_after_one_bag(tmp_path / "store", DIM, label=3)
    with pytest.raises(DtypeMismatch, match="bag 'b': label .* beyond the split's label dtype int64"):
        writer.add_bag("b", np.ones((2, DIM), np.float16), label=label)
    writer.add_bag("c", np.ones((2, DIM), np.float16), label=2**63 - 1)
    writer.commit()
    bags = store.open_bags("ds", "enc", "s")
    assert bags.ids == ["a", "c"] and bags.labels.tolist() == [3, 2**63 - 1]


def test_add_bag_checks_an_integer_label_against_a_declared_label_dtype(tmp_path: Path) -> None:
    # the refusal spoke of "does not fit", without the range
    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=DIM, label_dtype="int8")
    with pytest.raises(DtypeMismatch, match=r"label 200 is beyond the split's label dtype int8 \[-128, 127\]"):
        writer.add_bag("b", np.ones((2, DIM), np.float16), label=200)
    writer.close()


# ---------------------------------------------------------------------- the slide files
@pytest.mark.parametrize("name", ["features", "coords"])
def test_a_group_where_a_dataset_belongs_is_one_line_naming_file_and_dataset(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    slides(tmp_path / "src", {"a": 3, "b": 4})
    with h5py.File(tmp_path / "src" / "b.h5", "w") as f:
        f.create_group(name).create_dataset("x", data=np.zeros((4, 2)))
        if name == "coords":
            f["features"] = np.zeros((4, DIM), np.float16)
    assert run_import(tmp_path / "src", tmp_path / "store") == 1
    err = one_line(capsys)
    assert "b.h5" in err and f"{name!r} is an HDF5 group, not a dataset" in err
    assert nothing_written(tmp_path / "store")


def test_an_attribute_json_cannot_hold_is_found_before_any_slide_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the import stopped at the slide, after the ones before it were written, with
    # "bag attrs are not plain JSON" naming neither the file nor the bag
    slides(tmp_path / "src", {"a": 3, "b": 4, "c": 5})
    with h5py.File(tmp_path / "src" / "c.h5", "a") as f:
        f["coords"].attrs["spacing"] = np.array([1 + 2j, 3 + 0j], np.complex64)
    assert run_import(tmp_path / "src", tmp_path / "store") == 1
    err = one_line(capsys)
    assert "c.h5" in err and "bag 'c'" in err and "'spacing'" in err and "'coords'" in err and "complex" in err
    assert nothing_written(tmp_path / "store")


def test_add_bag_names_the_attribute_that_is_not_json(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=DIM)
    with pytest.raises(ShapeMismatch, match=r"bag 'a': .*attrs\['root'\]\['c'\]\[1\] is a complex"):
        writer.add_bag("a", np.ones((2, DIM), np.float16), attrs={"root": {"ok": 1, "c": [1, 2j]}})
    writer.close()


def test_nan_in_a_slide_names_the_file_and_its_rows_with_import_advice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the advice was --precision fp32 (an extract option) about "samples [0, 1)"
    slides(tmp_path / "src", {"a": 3, "b": 6})
    with h5py.File(tmp_path / "src" / "b.h5", "a") as f:
        f["features"][4, 1] = np.nan
    assert run_import(tmp_path / "src", tmp_path / "store") == 1
    err = one_line(capsys)
    assert "b.h5" in err and "1 NaN and 0 Inf values in 1 of its 6 rows (first: row 4)" in err
    assert "--precision" not in err and "samples [" not in err and "--overwrite" in err
    # the advice holds: with the file out of the way, --overwrite imports the rest
    (tmp_path / "src" / "b.h5").unlink()
    assert run_import(tmp_path / "src", tmp_path / "store", "--overwrite") == 0
    assert open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s").ids == ["a"]


def test_add_bag_speaks_of_the_bag_rows_not_of_samples(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=DIM)
    bad = np.ones((5, DIM), np.float32)
    bad[3, 0] = np.inf
    where = r"bag 'a': 0 NaN and 1 Inf values in 1 of its 5 rows \(first: row 3\)"
    with pytest.raises(NonFiniteValues, match=where) as e:
        writer.add_bag("a", bad)
    assert "--precision" not in str(e.value)
    big = np.ones((5, DIM), np.float32)
    big[2, 2] = 1e6
    with pytest.raises(Float16Overflow, match="bag 'a': .* of its 5 rows exceed float16") as o:
        writer.add_bag("a", big)
    assert "samples [" not in str(o.value)
    writer.close()


def test_uint64_coords_are_converted_when_they_fit_and_refused_naming_the_slide_when_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the advice was "create the split with coords_dtype='int64'", the dtype it already had
    data = slides(tmp_path / "src", {"a": 3, "b": 4}, coords_dtype=np.uint64)
    assert run_import(tmp_path / "src", tmp_path / "store") == 0
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s")
    assert bags.coords_dtype == "int64"
    np.testing.assert_array_equal(bags.read_numpy("b")[1], data["b"][1].astype(np.int64))
    with h5py.File(tmp_path / "src" / "b.h5", "a") as f:
        f["coords"][2, 1] = 2**63 + 7
    capsys.readouterr()
    assert run_import(tmp_path / "src", tmp_path / "store", split="t") == 1
    err = one_line(capsys)
    assert "b.h5" in err and "bag 'b'" in err and "row 2" in err and str(2**63 + 7) in err
    assert "coords_dtype='int64'" not in err


def test_hidden_files_are_left_out_in_one_summary_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slides(tmp_path / "src", {"a": 3, "._a": 2, ".b": 2})
    assert run_import(tmp_path / "src", tmp_path / "store") == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "2 hidden file(s)" in notes[0] and "'._a.h5'" in notes[0]
    assert open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s").ids == ["a"]


def test_the_source_and_labels_are_recorded_as_absolute_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slides(tmp_path / "job" / "features_uni", {"a": 3})
    (tmp_path / "job" / "l.csv").write_text("slide_id,label\na,1\n")
    monkeypatch.chdir(tmp_path)
    assert run_import("job/features_uni", tmp_path / "store", "--labels", "job/l.csv") == 0
    meta = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s").metadata
    assert meta["source"]["spec"] == f"h5-dir:{tmp_path / 'job' / 'features_uni'}"
    assert meta["encoder"]["spec"] == f"import:h5-dir:{tmp_path / 'job' / 'features_uni'}"
    assert meta["source"]["labels"] == str(tmp_path / "job" / "l.csv")


# ---------------------------------------------------------------------- the labels CSV
def test_a_latin1_csv_is_one_line_naming_the_line_and_a_bom_is_fine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slides(tmp_path / "src", {"a": 3, "b": 4})
    labels = tmp_path / "l.csv"
    labels.write_bytes("slide_id,label\na,tumeur\nb,b\u00e9nin\n".encode("latin-1"))
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(labels)) == 1
    err = one_line(capsys)
    assert "not UTF-8" in err and "byte 0xe9 on line 3" in err and "iconv" in err
    assert nothing_written(tmp_path / "store")
    # After a byte-order mark (a spreadsheet's "CSV UTF-8" edited in a Latin-1 editor): the same
    # byte and line, not the ones three bytes earlier.
    labels.write_bytes(b"\xef\xbb\xbf" + "slide_id,label\na,tumeur\nb,b\u00e9nin\n".encode("latin-1"))
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(labels)) == 1
    assert "byte 0xe9 on line 3" in one_line(capsys)
    labels.write_bytes("\ufeffslide_id,label\na,tumeur\nb,b\u00e9nin\n".encode())
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(labels)) == 0
    assert open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s").metadata["label_names"] == [
        "b\u00e9nin", "tumeur"]


def test_a_tsv_labels_table_is_tab_separated_and_a_misnamed_one_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slides(tmp_path / "src", {"a": 3, "b": 4})
    for name, text, hint in (
            ("l.csv", "slide_id\tlabel\na\t1\nb\t0\n",
             "the header looks tab-separated: save it as comma-separated text or name it .tsv"),
            ("l2.csv", "slide_id;label\na;1\nb;0\n", "the header looks semicolon-separated: save it as "
                                                     "comma-separated text")):
        (tmp_path / name).write_text(text)
        assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(tmp_path / name)) == 1
        err = one_line(capsys)
        assert "has no column 'slide_id'" in err and hint in err, err
        assert nothing_written(tmp_path / "store")
    # A .tsv was split on commas: "has no column 'slide_id' (it has: slide_id<TAB>case_id ...)".
    (tmp_path / "l.tsv").write_text("slide_id\tcase_id\tlabel\na\tP1, left\t1\nb\tP2\t0\n")
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(tmp_path / "l.tsv")) == 0
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s")
    assert bags.labels.tolist() == [1, 0] and bags.attrs("a")["case_id"] == "P1, left"


def test_integer_labels_are_ascii_digits_only(tmp_path: Path) -> None:
    # "1_000" and Arabic-Indic digits were read as the integers 1000 and 3
    slides(tmp_path / "src", {"a": 3, "b": 4, "c": 2})
    (tmp_path / "l.csv").write_text("slide_id,label\na,1_000\nb,\u0663\nc,7\n")
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(tmp_path / "l.csv")) == 0
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s")
    assert bags.metadata["label_names"] == ["1_000", "7", "\u0663"] and bags.labels.tolist() == [0, 2, 1]


@pytest.mark.parametrize("label", ["nan", "NaN", "-inf", "1e999"])
def test_a_non_finite_csv_label_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], label: str) -> None:
    slides(tmp_path / "src", {"a": 3, "b": 4})
    (tmp_path / "l.csv").write_text(f"slide_id,label\na,0.5\nb,{label}\n")
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(tmp_path / "l.csv")) == 1
    assert "'b'" in one_line(capsys)
    assert nothing_written(tmp_path / "store")


def test_a_duplicated_column_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the last 'label' column was taken silently
    slides(tmp_path / "src", {"a": 3})
    (tmp_path / "l.csv").write_text("slide_id,label, label\na,1,2\n")
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(tmp_path / "l.csv")) == 1
    assert "two columns named 'label'" in one_line(capsys)


def test_label_and_id_columns_and_the_other_columns_as_bag_attributes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slides(tmp_path / "src", {"TCGA-01": 3, "TCGA-02": 4, "TCGA-03": 2})
    table = tmp_path / "cohort.csv"
    table.write_text("slide,case_id,site,age,subtype,score,note,huge\n"
                     "TCGA-01.svs,P1,05,61,LUAD,0.5,,1\n"
                     "TCGA-02,P1,05,61,LUSC,1,x,1e999\n"
                     "TCGA-03,P2,A2,70,LUAD,2e3,,2\n"
                     "TCGA-99,P9,01,50,LUAD,1,,3\n")
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(table), "--label-column", "subtype",
                      "--id-column", "slide") == 0
    out = capsys.readouterr().out
    assert "note: labels CSV: 1 row(s) name no slide" in out and "'TCGA-99'" in out
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s")
    assert bags.metadata["label_names"] == ["LUAD", "LUSC"] and bags.labels.tolist() == [0, 1, 0]
    first = bags.attrs("TCGA-01")
    assert {k: first[k] for k in ("case_id", "site", "age", "score", "note")} == {
        "case_id": "P1", "site": "05", "age": 61, "score": 0.5, "note": None}
    assert "subtype" not in first and "slide" not in first and first["source_file"] == "TCGA-01.h5"
    assert bags.attrs("TCGA-03")["site"] == "A2" and bags.attrs("TCGA-03")["score"] == 2000.0
    assert bags.attrs("TCGA-02")["note"] == "x"
    assert bags.attrs("TCGA-02")["huge"] == "1e999" and bags.attrs("TCGA-01")["huge"] == "1"  # not a number JSON holds
    # another label column over the same split is another cache, not a no-op
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(table), "--label-column", "age",
                      "--id-column", "slide") == 1
    assert "cache key" in one_line(capsys).lower()
    assert run_import(tmp_path / "src", tmp_path / "store", "--labels", str(table), "--label-column", "age",
                      "--id-column", "slide", split="age") == 0
    assert open_store(str(tmp_path / "store")).open_bags("ds", "enc", "age").labels.tolist() == [61, 61, 70]


@pytest.mark.parametrize("case", ["no-column", "missing-slide", "no-labels", "reserved", "rows-differ"])
def test_label_table_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    slides(tmp_path / "src", {"a": 3, "b": 4})
    table = tmp_path / "l.csv"
    table.write_text({"no-column": "slide_id,label\na,1\nb,0\n",
                      "missing-slide": "slide_id,dx\na,1\n",
                      "no-labels": "",
                      "reserved": "slide_id,dx,coords\na,1,x\nb,0,y\n",
                      "rows-differ": "slide_id,dx,case_id\na,1,P1\nb,0,P2\na,1,P3\n"}[case])
    extra = ["--label-column", "dx" if case != "no-column" else "subtype"]
    if case != "no-labels":
        extra += ["--labels", str(table)]
    assert run_import(tmp_path / "src", tmp_path / "store", *extra) == 1
    err = one_line(capsys)
    assert {"no-column": "no column 'subtype' (it has: slide_id, label): name the column with --label-column",
            "missing-slide": "no row, or an empty 'dx', for slide 'b': add a slide_id,dx row",
            "no-labels": "pass --labels too",
            "reserved": "column 'coords'",
            "rows-differ": "two rows for slide 'a' that differ (case_id 'P1' and 'P3')"}[case] in err
    assert nothing_written(tmp_path / "store")


def test_label_columns_are_refused_for_a_dense_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.ones((4, DIM), np.float32))
    assert run_import(tmp_path / "x.npy", tmp_path / "store", "--label-column", "dx") == 1
    assert "not a directory of per-slide files" in one_line(capsys)


def test_a_closed_writer_names_the_cli_flag(tmp_path: Path) -> None:
    from featurestore.errors import WriterClosed

    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=DIM)
    writer.close()
    with pytest.raises(WriterClosed, match="--resume"):
        writer.add_bag("a", np.ones((1, DIM), np.float16))


def test_a_closed_dense_writer_names_the_cli_flag(tmp_path: Path) -> None:
    from featurestore.errors import WriterClosed

    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_split("ds", "enc", "s", num_samples=4, sample_shape=(DIM,), dtype="float16")
    writer.close()
    with pytest.raises(WriterClosed, match=r"create_split\(\.\.\., resume=True\) \(on the command line: --resume\)"):
        writer.write(0, np.ones((4, DIM), np.float32))


def test_um_coords_in_float64_are_stored_as_float32(tmp_path: Path) -> None:
    source = tmp_path / "stamp"
    source.mkdir()
    coords = np.array([[0.1, 2.3], [1e4 / 3, 7.0]], np.float64)
    with h5py.File(source / "s.h5", "w") as f:
        f["feats"], f["coords"] = np.ones((2, DIM), np.float16), coords
        f.attrs["unit"] = "um"
    assert run_import(source, tmp_path / "store") == 0
    got = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s").read_numpy("s")[1]
    np.testing.assert_array_equal(got, coords.astype(np.float32))


def test_dtype_mismatch_names_the_dtype_to_create(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=DIM, coords_dtype="int32")
    with pytest.raises(DtypeMismatch, match="create the split with coords_dtype='int64'"):
        writer.add_bag("a", np.ones((1, DIM), np.float16), coords=np.array([[2**40, 1]], np.int64))
    writer.close()


def test_a_dense_import_records_absolute_source_and_labels_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    np.save(tmp_path / "x.npy", np.ones((4, DIM), np.float32))
    np.save(tmp_path / "y.npy", np.arange(4))
    monkeypatch.chdir(tmp_path)  # the paths as a user in that directory types them
    assert run_import("x.npy", tmp_path / "store", "--labels", "y.npy") == 0
    meta = open_store(str(tmp_path / "store")).split_info("ds", "enc", "s")
    source = meta.extra["source"]
    assert source["spec"] == f"npy:{tmp_path / 'x.npy'}" and source["labels"] == str(tmp_path / "y.npy")
    assert meta.encoder["spec"] == f"import:npy:{tmp_path / 'x.npy'}"
