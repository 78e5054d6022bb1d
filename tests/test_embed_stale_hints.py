"""A stale embedding split gets one way forward everywhere (featurestore.core.lineage.stale_fix):
status says STALE as ls, info and verify do; verify, status, info, export and the client's warning
print the same fix; and the fix works, for a rewritten source (the embed command again, --resume)
and for a source that is gone (write it again first, or remove the stale split)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from test_embed import make_bags, run_embed

from featurestore.cli import main
from featurestore.core.lineage import stale_fix, warn_stale
from featurestore.errors import StaleSplitWarning
from featurestore.format.lineage import RECOMPUTE

EMBED = ("--dataset", "ds", "--encoder", "uni", "--split", "train", "--slide-encoder", "mean", "--encoder-name",
         "slide", "--no-progress")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_rewritten_source_one_fix_everywhere_and_it_works(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path)
    make_bags(tmp_path)
    run_embed(tmp_path)
    assert _run(capsys, "status", store, "ds/slide/train")[1] == "split ds/slide/train: complete, 5 samples\n"
    make_bags(tmp_path, seed=1, overwrite=True)
    fix = f"compute it again ({RECOMPUTE})"
    code, out, _ = _run(capsys, "status", store, "ds/slide/train")
    assert code == 0 and out.startswith("split ds/slide/train: complete STALE, 5 samples\n"), out
    assert "STALE: source ds/uni/train generation changed" in out and out.rstrip().endswith(fix)
    code, out, _ = _run(capsys, "verify", store)
    assert code == 1 and f": {fix}\n" in out
    assert out.count("--resume") == 1 and "--overwrite" not in out
    assert _run(capsys, "info", store, "ds/slide/train")[1].rstrip().endswith(fix)
    code, _, err = _run(capsys, "export", store, "--dataset", "ds", "--encoder", "slide", "--split", "train",
                        "--format", "trident", "--out", str(tmp_path / "out"), "--no-progress")
    assert code == 1 and f"; {fix}, then export" in err and "--overwrite" not in err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_stale("ds/slide/train", "source ds/uni/train generation changed (a -> b)", stacklevel=1)
    assert [str(w.message).endswith(fix) for w in caught if issubclass(w.category, StaleSplitWarning)] == [True]
    # the fix: the embed command again (--resume): recomputed whole from the new source
    code, out, err = _run(capsys, "embed", store, *EMBED, "--resume")
    assert code == 0 and "is stale" in err and "recomputing every row" in err
    assert _run(capsys, "verify", store)[0] == 0
    assert _run(capsys, "status", store, "ds/slide/train")[1] == "split ds/slide/train: complete, 5 samples\n"


def test_a_gone_source_is_written_again_or_the_stale_split_removed(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path)
    make_bags(tmp_path)
    run_embed(tmp_path)
    assert _run(capsys, "rm", store, "ds/uni/train", "--yes")[0] == 0
    code, out, _ = _run(capsys, "verify", store)
    fix = stale_fix("source ds/uni/train is gone", "ds/slide/train", store)
    assert code == 1 and f"STALE ds/slide/train: source ds/uni/train is gone: {fix}\n" in out
    assert "write ds/uni/train again" in fix and "--dataset ds --encoder-name uni --split train" in fix
    assert f"featurestore rm {store} ds/slide/train" in fix
    assert fix in _run(capsys, "status", store, "ds/slide/train")[1]
    # the embed command alone cannot: its source is not there
    assert _run(capsys, "embed", store, *EMBED, "--resume")[0] == 1
    # either way out works: the source written again, then the embed command (--resume) ...
    make_bags(tmp_path, seed=2)
    code, _, err = _run(capsys, "embed", store, *EMBED, "--resume")
    assert code == 0 and "recomputing every row" in err
    assert _run(capsys, "verify", store)[0] == 0
    # ... or the stale split removed
    assert _run(capsys, "rm", store, "ds/uni/train", "--yes")[0] == 0
    assert _run(capsys, "verify", store)[0] == 1
    assert _run(capsys, "rm", store, "ds/slide/train", "--yes")[0] == 0
    assert _run(capsys, "verify", store)[0] == 0


def test_a_source_being_written_and_a_damaged_lineage() -> None:
    assert stale_fix("source a/b/c is being rewritten (status writing)").startswith(
        "once its source is complete again, compute this split again (featurestore embed ... --resume")
    assert stale_fix("split a/m/c has a damaged lineage (KeyError: 'source')") == f"compute it again ({RECOMPUTE})"
