"""A store path where there is no store (a typo) is refused in one line by every verb that needs an
existing store, and nothing is created there: embed and rm as the read-only verbs (export, status,
info, ls, verify). import and extract create a store where there is none (tests/test_import*.py); ls of a
store with one unreadable split document lists the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from featurestore.cli import main

SPLIT = ("--dataset", "d", "--encoder", "uni", "--split", "all")
VERBS = {
    "embed": ("embed", "{store}", *SPLIT, "--slide-encoder", "mean", "--encoder-name", "m", "--no-progress"),
    "rm": ("rm", "{store}", "d/uni/all", "--yes"),
    "export": ("export", "{store}", *SPLIT, "--format", "trident", "--out", "{out}", "--no-progress"),
    "status": ("status", "{store}", "d/uni/all"),
    "info": ("info", "{store}", "d/uni/all"),
    "ls": ("ls", "{store}"),
    "verify": ("verify", "{store}"),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_mistyped_store_path_is_one_line_and_creates_nothing(verb: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    store, out = tmp_path / "stor", tmp_path / "out"
    argv = [a.format(store=store, out=out) for a in VERBS[verb]]
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    assert err.count("\n") == 1 and err.startswith(f"featurestore: error: no featurestore at '{store}': check the URL"), err
    assert not store.exists() and not out.exists()
    assert sorted(tmp_path.iterdir()) == []


def test_ls_lists_the_other_splits_beside_one_whose_document_is_unreadable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    import featurestore

    store = featurestore.open_store(str(tmp_path), mode="a")
    for split in ("a", "b"):
        writer = store.create_split("d", "e", split, num_samples=4, sample_shape=(2, 8), dtype="float16")
        writer.write(0, np.ones((4, 2, 8), np.float32))
        writer.commit()
    document = tmp_path / "d" / "e" / "a" / "zarr.json"
    document.write_text('{"garbage')
    assert main(["ls", str(tmp_path)]) == 1  # damage is not a clean listing
    captured = capsys.readouterr()
    rows = {line.split()[0]: line.split()[1] for line in captured.out.splitlines()[1:]}
    assert rows == {"d/e/a": "UNREADABLE", "d/e/b": "complete"}
    assert captured.err.count("\n") == 1 and captured.err.startswith("featurestore: error: d/e/a: ")
    assert "not valid JSON" in captured.err and "verify" in captured.err
    assert document.read_text() == '{"garbage'  # a read-only view changes nothing
