"""``featurestore demo``: the small size runs end to end (data, extraction, server, probes, table),
cleans up after itself, and fails with one clear line on bad input."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from featurestore.cli import main  # noqa: E402
from featurestore.commands.demo import format_table  # noqa: E402
from featurestore.demo.run import ENCODERS, run_demo  # noqa: E402
from featurestore.errors import FeatureStoreError  # noqa: E402
from server.web.png import decode_png  # noqa: E402

# How far above the constant predictor the probe must land: the small demo measures ~0.04-0.08
# above it; a probe that learned nothing sits at +0.00.
MARGIN = 0.02


def test_small_demo_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "mine.txt").write_text("not the demo's")  # a user's file must survive the clean-up
    import torch

    threads = torch.get_num_threads()
    result = run_demo(str(workdir), size="small")
    assert torch.get_num_threads() == threads  # the demo's thread choice does not leak out
    progress = capsys.readouterr().out
    for step in range(1, 9):
        assert f"[{step}/8]" in progress

    # Both dtypes extracted; float16 is the smaller store and carries a real quantization error.
    e32, e16 = result["extract"]["float32"], result["extract"]["float16"]
    assert e32["encoder"] == ENCODERS["float32"] and e16["encoder"] == ENCODERS["float16"]
    assert e32["images"] == e16["images"] == result["plan"]["train"] + result["plan"]["val"]
    assert 0 < e16["store_bytes"] < e32["store_bytes"]
    assert e32["quantization"].get("max_rel_error", 0) == 0
    assert 0 < e16["quantization"]["max_rel_error"] < 1e-3
    # int8 beside them: the smallest store, its error (rel RMS, the report's) within the 1 % target.
    e8 = result["extract"]["int8"]
    assert e8["encoder"] == ENCODERS["int8"] and e8["images"] == e16["images"]
    assert 0 < e8["store_bytes"] < e16["store_bytes"]
    assert e16["quantization"]["rel_rms_error"] < e8["quantization"]["rel_rms_error"] < 0.01
    assert e8["quantization"]["saturation_count"] == 0
    assert e16["images_per_s"] > 0 and result["loader"]["local"]["gb_per_s"] > 0
    assert result["loader"]["http"]["gb_per_s"] > 0
    assert result["memory"]["ram_cache_bytes"] > 0

    # The probe learned: every dtype's mean Jaccard beats the constant predictor by a margin.
    compare = result["compare"]
    assert {compare["a"]["dtype"], compare["b"]["dtype"]} == {"float16", "float32"}
    baseline = result["baseline_jaccard"]["jaccard"]
    assert 0 < baseline < 1
    for side in ("a", "b"):
        summary = compare[side]["metrics"]["jaccard"]
        assert len(summary["values"]) == result["plan"]["seeds"]
        assert summary["std"] is not None
        assert summary["mean"] > baseline + MARGIN, (side, summary, baseline)
    # int8 against float32 through the same check (compare_probes): the column's mean ± std and verdict.
    int8 = result["compare_int8"]
    assert (int8["a"]["dtype"], int8["b"]["dtype"]) == ("int8", "float32")
    assert len(int8["a"]["metrics"]["jaccard"]["values"]) == result["plan"]["seeds"]
    assert int8["a"]["metrics"]["jaccard"]["mean"] > baseline + MARGIN, int8["a"]["metrics"]
    assert "exceeds_spread" in int8["comparison"]["jaccard"]
    # Streaming over HTTP trained the same probe as from disk (same seed, same bytes).
    assert result["http_probe"]["identical"], result["http_probe"]

    # Slide bags: streamed from disk and over HTTP, the ABMIL head learned the slide label, and the
    # float32 store trained the same head as the same bags held in RAM.
    bags = result["bags"]
    assert bags["loader"]["local"]["patches"] == bags["loader"]["http"]["patches"] > 0
    for side in ("a", "b"):
        assert bags["compare"][side]["metrics"]["auc"]["mean"] > 0.75, bags["compare"][side]["metrics"]
    assert bags["parity"]["identical"], bags["parity"]
    mil8 = bags["compare_int8"]
    assert (mil8["a"]["dtype"], mil8["b"]["dtype"]) == ("int8", "float32")
    assert mil8["a"]["metrics"]["auc"]["mean"] > 0.75, mil8["a"]["metrics"]
    # The cohort workflow: the demo's own table is the ABMIL probe's task, one attention map is a
    # PNG in the workdir, and mean embeddings of both dtypes go through the linear probe.
    cohort = bags["cohort"]
    assert cohort["task"]["metrics"]["auc"]["mean"] > 0.75, cohort["task"]["metrics"]
    picture = Path(cohort["attention"]["path"])
    assert picture.parent == workdir and picture.name == f"attention_{cohort['attention']['slide']}.png"
    image = decode_png(picture.read_bytes())
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and image.shape[0] > 8
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 2  # patches coloured by rank, not a blank picture
    linear = cohort["linear"]
    assert {linear["a"]["dtype"], linear["b"]["dtype"]} == {"float16", "float32"}
    for side in ("a", "b"):
        assert len(linear[side]["metrics"]["auc"]["values"]) == 3
        assert linear[side]["metrics"]["auc"]["mean"] > 0.6, linear[side]["metrics"]

    table = format_table(result)
    assert "ABMIL slide AUC, 2 seeds" in table and re.search(r"ABMIL from store = from RAM \(seed 0\)\s+yes", table)
    assert re.search(r"mean embedding \+ linear probe AUC, 3 seeds\s+0\.\d{4} ± 0\.\d{4}\s+0\.\d{4} ± 0\.\d{4}",
                     table), table
    assert re.search(r"ABMIL AUC, clinical\.csv grade \(seed 0\)\s+0\.\d{4}", table), table
    assert f"attention map: {picture}" in table
    assert "float32" in table and "float16" in table
    ms = r"0\.\d{4} ± 0\.\d{4}"
    assert re.search(rf"Jaccard, 2 seeds, local\s+{ms}\s+{ms}\s+{ms}", table), table  # float32, float16, int8
    assert re.search(rf"ABMIL slide AUC, 2 seeds\s+{ms}\s+{ms}\s+{ms}", table), table
    assert re.search(r"^\s+float32\s+float16\s+int8$", table, re.MULTILINE), table
    assert re.search(r"quantization rel RMS error\s+0 \(exact\)\s+\S+\s+\S+", table), table
    verdicts = r"(no: within seed noise|identical|YES: the storage dtype moved the metric)"
    assert re.search(rf"exceeds run-to-run spread\?\s+{verdicts}\s+{verdicts}", table), table
    assert "MiB" in table and "img/s" in table and "GB/s" in table

    # Cleaned: the demo's data and store are gone, its outputs and the user's file are not.
    assert sorted(os.listdir(workdir)) == sorted([picture.name, "clinical.csv", "mine.txt"])
    assert not result["kept"]


def test_keep_leaves_data_and_store_even_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import featurestore.demo.run as demo

    def broken(*args: object, **kwargs: object) -> None:
        raise FeatureStoreError("extraction broke")

    monkeypatch.setattr(demo, "_extract", broken)
    kept = tmp_path / "kept"
    with pytest.raises(FeatureStoreError, match="extraction broke"):
        run_demo(str(kept), size="small", keep=True, log=lambda line: None)
    assert (kept / "data" / "train" / "images.npy").is_file()

    # Without --keep a directory the demo created is removed when the demo fails (a finished one
    # keeps its outputs there: the clinical table and the attention picture).
    gone = tmp_path / "gone"
    with pytest.raises(FeatureStoreError):
        run_demo(str(gone), size="small", log=lambda line: None)
    assert not gone.exists()


def test_refuses_to_clobber_an_existing_store(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "precious").write_text("x")
    with pytest.raises(FeatureStoreError, match="already exists"):
        run_demo(str(tmp_path), size="small", log=lambda line: None)
    assert (tmp_path / "store" / "precious").read_text() == "x"


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert main(["demo", "--size", "small", "--workdir", str(not_a_dir)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("featurestore: error:") and "not a directory" in err and "\n" not in err
    with pytest.raises(SystemExit) as excinfo:  # argparse: unknown size
        main(["demo", "--size", "huge"])
    assert excinfo.value.code == 2
