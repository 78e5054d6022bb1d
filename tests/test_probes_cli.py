"""``featurestore probe`` on the command line (tables, JSON, one-line errors) and the comparison
of a local store with its copy over HTTP."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _probe_fixtures import DATASET
from _probe_fixtures import one_torch_thread, store_path  # noqa: F401  (fixtures, used by name)

from featurestore.cli import main
from featurestore.commands.probe import format_report
from featurestore.probes.compare import compare_summaries, run_seeds
from featurestore.probes.run import compare_probes


# ----------------------------------------------------------------------------------------- CLI


def test_cli_compare_prints_the_table_and_writes_json(store_path: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "probe.json"
    code = main(["probe", store_path, "--dataset", DATASET, "--encoder", "lin16", "--compare", "lin32",
                 "--train", "train", "--eval", "val", "--seeds", "2", "--epochs", "2",
                 "--device", "cpu", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0
    assert "A float16" in captured.out and "B float32" in captured.out
    assert "exceeds spread" in captured.out and "2 x pooled std" in captured.out
    assert "seed 1" in captured.err  # per-seed progress goes to stderr
    result = json.loads(out.read_text())
    assert result["a"]["dtype"] == "float16" and result["b"]["dtype"] == "float32"
    assert math.isfinite(result["comparison"]["macro_f1"]["diff"])


def test_cli_single_encoder_json_to_stdout(store_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["probe", store_path, "--dataset", DATASET, "--encoder", "lin32", "--train", "train",
                 "--eval", "val", "--seeds", "1", "--epochs", "1", "--lr", "0.05", "--device", "cpu",
                 "--json", "-", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == ""
    result = json.loads(captured.out)
    assert result["task"] == "linear" and result["metrics"]["macro_f1"]["std"] is None
    assert result["config"]["lr"] == 0.05 and result["config"]["epochs"] == 1


def test_report_warns_when_every_seed_gives_the_same_metric() -> None:
    def run(values: list[float]) -> dict[str, Any]:
        seeds = list(range(len(values)))
        return {
            **run_seeds(lambda seed: {"jaccard": values[seed]}, seeds),
            "task": "seg", "train_split": "train", "eval_split": "val", "num_classes": 6,
            "config": {"epochs": 1, "lr": 1e-3}, "batch_size": 64, "device": "cpu",
            "loader": "stream", "dataset": "d", "encoder": "enc", "dtype": "float16",
            "sample_shape": [4, 8], "train_samples": 8, "eval_samples": 8, "seconds": 0.0,
            "source": "store",
        }

    collapsed, learned = run([0.16, 0.16, 0.16]), run([0.5, 0.6, 0.55])
    text = format_report({"a": collapsed, "b": learned,
                          "comparison": compare_summaries(collapsed, learned)})
    assert "YES" in text  # |diff| = 0.39 > 2 x pooled std
    assert "Warning: enc gave exactly the same jaccard under every seed" in text.replace("\n", " ")
    assert "Warning" not in format_report(learned)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--encoder", "nolab", "--eval", "val"], "has no labels"),
        (["--encoder", "lin32", "--eval", "val", "--task", "seg"], "task seg needs class maps"),
        (["--encoder", "lin32", "--eval", "val", "--compare", "missing"], "missing"),
        (["--encoder", "lin32", "--eval", "nope"], "nope"),
        (["--encoder", "lin32", "--eval", "val", "--compare-store", "/x"], "--compare-store needs --compare"),
        (["--encoder", "lin32", "--eval", "val", "--device", "bogus"], "invalid device"),
        (["--encoder", "lin32", "--eval", "val", "--num-classes", "2"], "is outside [0, 2)"),
        # --pool is the linear head's: a seg task (auto-detected from class maps) took it silently
        (["--encoder", "seg32a", "--eval", "val", "--pool", "cls"], "a seg task predicts every patch"),
        (["--encoder", "seg32a", "--eval", "val", "--head", "abmil", "--pool", "cls"], "pools a bag's patches"),
    ],
)
def test_cli_errors_are_one_line_and_exit_1(store_path: str, argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["probe", store_path, "--dataset", DATASET, "--train", "train", "--quiet",
                 "--epochs", "1", "--seeds", "1", *argv])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("featurestore: error:") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(("where", "message"), [
    ("no/such/dir/r.json", "does not exist"),
    (".", "is a directory"),
])
def test_cli_json_path_is_checked_before_training(store_path: str, tmp_path: Path, where: str, message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # Without --quiet: a run that trained would print per-seed progress before the error.
    code = main(["probe", store_path, "--dataset", DATASET, "--encoder", "lin32", "--train", "train",
                 "--eval", "val", "--seeds", "1", "--epochs", "1", "--device", "cpu",
                 "--json", str(tmp_path / where)])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert f"--json {tmp_path / where}" in captured.err and message in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err


def test_cli_missing_store_and_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--dataset", DATASET, "--encoder", "e", "--train", "train", "--eval", "val"]
    assert main(["probe", str(tmp_path / "absent"), *args]) == 1
    assert "no featurestore" in capsys.readouterr().err
    for bad in (["--seeds", "0"], ["--epochs", "x"], ["--task", "regression"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["probe", str(tmp_path), *args, *bad])
        assert exit_info.value.code == 2  # argparse usage error


# ---------------------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def served(store_path: str) -> Iterator[str]:
    """``featurestore serve`` over the probe store on a free loopback port."""
    from featurestore.testing.serving import serve_subprocess

    with serve_subprocess(store_path) as (url, _):
        yield url


def test_compare_local_store_with_its_copy_over_http(store_path: str, served: str) -> None:
    result = compare_probes(store_path, DATASET, "seg32a", "seg32a", compare_source=served,
                            train_split="train", eval_split="val", seeds=[0], epochs=1,
                            batch_size=32, device="cpu")
    assert result["b"]["source"] == served
    assert result["a"]["runs"] == result["b"]["runs"]
    assert result["comparison"]["jaccard"]["max_abs_paired_diff"] == 0
