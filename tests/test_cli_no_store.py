"""A store path where there is no store (a typo) is refused in one line by every verb that needs an
existing store, and nothing is created there: embed and rm as the read-only verbs (export, status,
info, ls, verify). import and extract create a store where there is none (tests/test_import*.py)."""

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
