"""One split named three ways on every verb that takes one: ``DATASET ENCODER SPLIT``,
``DATASET/ENCODER/SPLIT`` as ``ls`` prints it, or ``--dataset/--encoder/--split`` as embed, export
and probe take it; a split named twice, or by some of the flags, is one error line."""

from __future__ import annotations

from pathlib import Path

import pytest

from featurestore.cli import main
from featurestore.demo.synthetic_splits import write_split

FORMS = (["ds", "enc", "train"], ["ds/enc/train"], ["--dataset", "ds", "--encoder", "enc", "--split", "train"],
         ["--split", "train", "--encoder", "enc", "--dataset", "ds"])


@pytest.fixture()
def store(tmp_path: Path) -> str:
    write_split(str(tmp_path), 8, (2, 4), names=("ds", "enc", "train"))
    write_split(str(tmp_path), 4, (2, 4), names=("ds", "enc", "val"))
    return str(tmp_path)


@pytest.mark.parametrize("names", FORMS)
def test_every_form_names_the_split(store: str, names: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", store, *names]) == 0
    assert "split: ds/enc/train" in capsys.readouterr().out
    assert main(["status", store, *names]) == 0
    assert "ds/enc/train: complete" in capsys.readouterr().out.replace("split ", "")
    assert main(["verify", store, *names]) == 0
    out = capsys.readouterr().out
    assert "ds/enc/train: ok" in out and "ds/enc/val" not in out  # that split alone


def test_rm_by_flags_removes_that_split_alone(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rm", store, "--dataset", "ds", "--encoder", "enc", "--split", "val", "--yes"]) == 0
    capsys.readouterr()
    assert main(["ls", store]) == 0
    out = capsys.readouterr().out
    assert "ds/enc/train" in out and "ds/enc/val" not in out


@pytest.mark.parametrize(("verb", "names", "message"), [
    ("info", ["--dataset", "ds", "--split", "train"], "--dataset, --encoder and --split go together, but got only "
                                                      "--dataset, --split: give all three"),
    ("verify", ["--encoder", "enc"], "got only --encoder: give all three"),
    ("status", ["ds/enc/train", "--dataset", "ds", "--encoder", "enc", "--split", "train"], "name the split once"),
    ("verify", ["ds/enc/train", "--dataset", "ds", "--encoder", "enc", "--split", "train"], "name the split once"),
    ("info", [], "name a split: DATASET ENCODER SPLIT, DATASET/ENCODER/SPLIT"),
    ("verify", ["ds", "enc"], "verify takes one split, DATASET ENCODER SPLIT or DATASET/ENCODER/SPLIT, or none"),
    ("verify", ["ds/enc"], "but got 'ds/enc'")])
def test_a_split_named_badly_is_one_line(store: str, verb: str, names: list[str], message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main([verb, store, *names]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert main(["verify", store]) == 0  # nothing was touched
    assert "2 complete split(s) checked, 0 damaged" in capsys.readouterr().out
