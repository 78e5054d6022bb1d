"""Bag splits and bag import as a new user and an attacker try them (an adversarial pass).

Each test is one defect that was reproduced on main: a changed slide file kept silently, values
that a writer accepted but its commit could never store, names and attributes that crashed the
import with a traceback, a labels CSV read half-right, damaged index arrays read as data.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from _import_fixtures import writer_after_one_bag

from featurestore import open_store
from featurestore.cli import main
from featurestore.errors import InvalidLabels, ShapeMismatch

DIM = 8


def slide(path: Path | bytes, n: int, value: float = 1.0, **coords_attrs: Any) -> None:
    with h5py.File(path, "w") as f:
        f["features"] = np.full((n, DIM), value, np.float16)
        f["coords"] = np.arange(2 * n, dtype=np.int64).reshape(n, 2)
        f["coords"].attrs.update(coords_attrs)


def run_import(source: Path, store: Path, *extra: str, split: str = "s") -> int:
    return main(["import", str(source), "--store", str(store), "--dataset", "ds", "--encoder-name", "enc",
                 "--split", split, "--no-progress", *extra])


def test_a_slide_rewritten_after_import_is_refused_not_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A slide file rewritten in place (same size, new rows): a re-run said "nothing to do" and a
    # resume kept the old bag; as for dense imports, InputChanged names the file.
    source = tmp_path / "slides"
    source.mkdir()
    for name in "abc":
        slide(source / f"{name}.h5", 4)
    assert run_import(source, tmp_path / "store") == 0
    slide(source / "b.h5", 4, value=7.0)
    later = time.time() + 5
    os.utime(source / "b.h5", (later, later))
    capsys.readouterr()
    assert run_import(source, tmp_path / "store") == 1
    err = capsys.readouterr().err
    assert "b.h5" in err and "--overwrite" in err and "Traceback" not in err
    assert run_import(source, tmp_path / "store", "--overwrite") == 0
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s")
    assert bags.read_numpy("b")[0][0, 0] == 7.0


@pytest.mark.parametrize("label", [float("inf"), float("nan"), np.float32("-inf")])
def test_a_non_finite_label_is_refused_by_add_bag_not_by_every_later_commit(tmp_path: Path, label: Any) -> None:
    # add_bag took it, then commit failed with "Out of range float values are not JSON compliant",
    # and every resume found the bag again in its segment: the split could never be committed.
    store, writer = writer_after_one_bag(tmp_path / "store", DIM, label=1.0)
    with pytest.raises(InvalidLabels, match="'b'.*finite"):
        writer.add_bag("b", np.ones((2, DIM), np.float16), label=label)
    writer.commit()
    assert store.open_bags("ds", "enc", "s").ids == ["a"]


def test_attrs_with_a_lone_surrogate_are_refused_by_add_bag(tmp_path: Path) -> None:
    # accepted by add_bag, then UnicodeEncodeError (a traceback) at every commit
    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=DIM)
    with pytest.raises(ShapeMismatch, match="attrs"):
        writer.add_bag("a", np.ones((2, DIM), np.float16), attrs={"scanner": "Aperio\udcff"})
    writer.add_bag("b", np.ones((2, DIM), np.float16), attrs={"scanner": "Aperio \u00e9"})
    writer.commit()
    assert store.open_bags("ds", "enc", "s").attrs("b") == {"scanner": "Aperio \u00e9"}


def test_h5_attributes_of_any_type_survive_import(tmp_path: Path) -> None:
    # A text attribute that is not UTF-8 (h5py hands it back with surrogates) crashed the import
    # with a UnicodeEncodeError traceback; numpy scalars, arrays and bytes become JSON values.
    source = tmp_path / "slides"
    source.mkdir()
    slide(source / "a.h5", 3, patch_size=np.int32(256), mpp=np.float32(0.5), flag=np.bool_(True),
          levels=np.arange(3), names=np.array([b"x", b"y"]), raw=b"\xff\xfeab", big="x" * 100_000)
    with h5py.File(source / "a.h5", "a") as f:
        f["coords"].attrs["latin1"] = np.bytes_("Cr\xe9teil".encode("latin-1"))
    assert run_import(source, tmp_path / "store") == 0
    attrs = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s").attrs("a")["coords"]
    assert attrs["patch_size"] == 256 and attrs["mpp"] == 0.5 and attrs["flag"] is True
    assert attrs["levels"] == [0, 1, 2] and attrs["names"] == ["x", "y"] and len(attrs["big"]) == 100_000
    assert attrs["raw"] == "\ufffd\ufffdab" and attrs["latin1"] == "Cr\ufffdteil"


def test_a_file_name_that_is_not_utf8_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a Latin-1 name (an old scanner export): UnicodeEncodeError traceback before
    source = tmp_path / "slides"
    source.mkdir()
    slide(source / "a.h5", 2)
    slide(os.fsencode(source) + b"/Cr\xe9teil-01.h5", 2)
    assert run_import(source, tmp_path / "store") == 1
    err = capsys.readouterr().err
    assert "Cr\\xe9teil-01.h5" in err and "UTF-8" in err and "Traceback" not in err


def test_a_directory_mixing_h5_and_pt_files_is_refused_not_half_imported(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # the .pt files (here a duplicate stem a.pt and a slide of its own, c.pt) were silently skipped
    import torch

    source = tmp_path / "slides"
    source.mkdir()
    slide(source / "a.h5", 2)
    slide(source / "b.h5", 2)
    torch.save(torch.zeros(3, DIM), source / "a.pt")
    torch.save(torch.zeros(3, DIM), source / "c.pt")
    assert run_import(source, tmp_path / "store") == 1
    err = capsys.readouterr().err
    assert "mixes h5 files with 2 .pt file(s)" in err and "'a.pt'" in err


def test_labels_csv_header_spaces_and_conflicting_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "slides"
    source.mkdir()
    for name in "abc":
        slide(source / f"{name}.h5", 2)
    labels = tmp_path / "labels.csv"
    # BOM, a space after the comma in the header and in rows, an extra slide: all fine
    labels.write_bytes("\ufeffslide_id, label\n a , 1\nb, 0\nc,1\nnot-here,1\n".encode())
    assert run_import(source, tmp_path / "store", "--labels", str(labels)) == 0
    assert open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s").labels.tolist() == [1, 0, 1]
    # the same slide twice with two labels: the first one was taken silently
    labels.write_text("slide_id,label\na,1\nb,0\nc,1\nb,1\n")
    capsys.readouterr()
    assert run_import(source, tmp_path / "store", "--labels", str(labels), split="t") == 1
    assert "slide 'b' two labels ('0' and '1')" in capsys.readouterr().err
    labels.write_text("slide_id,label\na,1\nb,nan\nc,1\n")  # text "nan" parses as a float: refused
    assert run_import(source, tmp_path / "store", "--labels", str(labels), split="u") == 1
    assert "not a finite number" in capsys.readouterr().err


def _rewrite_index_chunk(path: Path, change: Any) -> None:
    """Rewrite an int64 index chunk with a valid crc32c: damage that checksums cannot see."""
    import crc32c

    values = np.frombuffer(path.read_bytes()[:-4], np.int64).copy()
    change(values)
    payload = values.tobytes()
    path.write_bytes(payload + crc32c.crc32c(payload).to_bytes(4, "little"))


def test_a_damaged_index_is_one_error_at_open_not_a_read_of_other_rows(tmp_path: Path) -> None:
    from featurestore.errors import CorruptChunk

    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=DIM, chunk_bytes=64)
    for i, n in enumerate([3, 0, 9, 5]):
        writer.add_bag(f"b{i}", np.full((n, DIM), i, np.float16))
    writer.commit()
    split = tmp_path / "store" / "ds" / "enc" / "s"
    original = (split / "offsets" / "c" / "0").read_bytes()
    # offsets past the rows: IndexOutOfRange "index 99 ... of features" on reading bag 3 before
    for change, problem in ((lambda v: v.__setitem__(4, 99), "from 0 to 99"),
                            (lambda v: v.__setitem__(2, 1), "decrease at bag 1")):
        (split / "offsets" / "c" / "0").write_bytes(original)
        _rewrite_index_chunk(split / "offsets" / "c" / "0", change)
        with pytest.raises(CorruptChunk, match=problem):
            store.open_bags("ds", "enc", "s")
    (split / "offsets" / "c" / "0").write_bytes(original)
    assert store.open_bags("ds", "enc", "s").read_numpy("b3")[0][0, 0] == 3
    # bag_ids gone: zarr's ArrayNotFoundError (not a FeatureStoreError: a CLI traceback) before
    import shutil

    shutil.rmtree(split / "bag_ids")
    with pytest.raises(CorruptChunk, match="bag_ids is missing or damaged"):
        store.open_bags("ds", "enc", "s")


def test_a_bag_import_of_h5_files_does_not_import_torch() -> None:
    # `featurestore import DIR` of .h5 slides spent ~2.3 s of a CLI run importing torch (through
    # the dense caches' readers and extract.run), which it never uses
    import subprocess
    import sys

    code = ("import sys, featurestore.commands.import_, featurestore.extract.importer, featurestore.extract.bag_import; "
            "print(sorted(m for m in ('torch', 'featurestore.extract.caches', 'featurestore.extract.run') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_coords_that_do_not_fit_advise_a_dtype_the_split_can_have(tmp_path: Path) -> None:
    # the advice was coords_dtype='uint64' (not a coords dtype a split can have)
    from featurestore.errors import DtypeMismatch

    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=DIM)
    # uint64 beyond int64: the advice was coords_dtype='int64', the split's own dtype
    with pytest.raises(DtypeMismatch, match=r"row 0 \(9223372036854775813, 1\) is beyond the split's coords_dtype int64") as caught:
        writer.add_bag("a", np.ones((1, DIM), np.float16), coords=np.array([[2**63 + 5, 1]], np.uint64))
    assert "coords_dtype='int64'" not in str(caught.value)
    writer.add_bag("fits", np.ones((1, DIM), np.float16), coords=np.array([[2**40, 1]], np.uint64))  # converted
    with pytest.raises(DtypeMismatch, match="coords_dtype='float64'"):
        writer.add_bag("a", np.ones((1, DIM), np.float16), coords=np.array([[1.5, 1]], np.float16))
    with pytest.raises(DtypeMismatch, match="coords_dtype='float32'"):
        writer.add_bag("a", np.ones((1, DIM), np.float16), coords=np.array([[1.5, 1]], np.float32))


def test_labels_csv_extension_alias_never_picks_one_of_two_labels(tmp_path: Path) -> None:
    # rows "a.svs" and "a.tif" with two labels both stood for slide a: the first was taken silently;
    # an exact row wins over an alias (before: whichever row came first)
    from featurestore.extract.label_csv import read_label_csv

    csv_file = tmp_path / "labels.csv"
    csv_file.write_text("slide_id,label\na.svs,1\na.tif,0\nb.svs,1\n")
    with pytest.raises(InvalidLabels, match="'a' matches rows 'a.svs' and 'a.tif'"):
        read_label_csv(str(csv_file), ["a", "b"])
    csv_file.write_text("slide_id,label\nb.svs,1\nb,0\nc.d,1\n")
    labels, _, _ = read_label_csv(str(csv_file), ["b", "c", "c.d"])
    assert labels == {"b": 0, "c": 1, "c.d": 1}
