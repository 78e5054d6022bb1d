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

from featurestore import open_store
from featurestore.cli import main
from featurestore.errors import FeatureStoreError, InvalidLabels, ShapeMismatch

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
