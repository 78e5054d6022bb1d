"""A torchrun slide extraction re-run on a complete split: every rank reports it complete
(ranks but 0 have no writer of their own then; the split's metadata comes from rank 0)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest.importorskip("openslide")
pytest.importorskip("tifffile")

from _dist_helpers import torchrun_cli  # noqa: E402
from test_extract import cli_env  # noqa: E402

from featurestore.demo.slides import write_cohort  # noqa: E402


def _torchrun(cohort: Path, store: Path) -> subprocess.CompletedProcess[str]:
    return torchrun_cli(
        "extract", "--images", f"wsi:{cohort}", "--encoder", "builtin:tiny-vit",
        "--store", str(store), "--dataset", "cohort", "--split", "train", "--patch-size", "64",
        "--batch-size", "16", "--threads", "1", "--num-workers", "0", "--no-progress", env=cli_env())


def test_a_torchrun_rerun_of_a_complete_slide_split_succeeds_on_every_rank(tmp_path: Path) -> None:
    write_cohort(tmp_path / "cohort", 2, width=1024, height=768, mpp=0.5)
    first = _torchrun(tmp_path / "cohort", tmp_path / "store")
    assert first.returncode == 0 and "2 bags of 2 slides" in first.stdout, first.stderr[-3000:]
    again = _torchrun(tmp_path / "cohort", tmp_path / "store")
    assert again.returncode == 0, again.stderr[-3000:]  # rank 1 failed here: its writer was None
    assert again.stdout.count("is already complete") == 1, again.stdout
