"""Ctrl-C is one line and exit status 130: ``featurestore: interrupted``, then what the verb left
and its next step where it has one (commands.parsers.add_verb's ``interrupted``), here for real:
an embed run stopped by SIGINT says --resume, and --resume finishes it."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from test_embed import cli
from test_embed_runs import embed_midway, twin_stores

from featurestore.cli import build_parser
from featurestore.commands.parsers import INTERRUPTED, RESUME_SPLIT

EMBED = ["--dataset", "ds", "--encoder", "uni", "--split", "train", "--slide-encoder", "python:_embed_encoders:recorder",
         "--encoder-name", "rec", "--device", "cpu", "--no-progress"]


def _hint(*argv: str) -> str | None:
    return getattr(build_parser().parse_args(list(argv)), INTERRUPTED)


def test_each_writing_verb_names_its_next_step() -> None:
    assert _hint("import", "d", "--store", "s", "--dataset", "d", "--encoder-name", "e", "--split", "x") == RESUME_SPLIT
    assert _hint("extract", "--images", "d", "--encoder", "e", "--store", "s", "--dataset", "d",
                 "--split", "x") == RESUME_SPLIT
    assert "--resume" in RESUME_SPLIT
    assert "--resume" in (_hint("embed", "s", *EMBED) or "")
    exported = _hint("export", "s", "--dataset", "d", "--encoder", "e", "--split", "x", "--format", "trident",
                     "--out", "o") or ""
    assert "partial" in exported and "--overwrite" in exported and "--resume" not in exported
    assert _hint("ls", "s") is None and _hint("verify", "s") is None  # nothing to go on from


def test_sigint_mid_embed_says_resume_and_resume_finishes(tmp_path: Path) -> None:
    twin_stores(tmp_path, ("store", "unused"), {f"s-{i:02d}": (3 + i, i % 2, f"p{i // 2}") for i in range(10)})
    store = str(tmp_path / "store")
    process = embed_midway(tmp_path / "store", EMBED, 2)
    try:
        process.send_signal(signal.SIGINT)  # as Ctrl-C
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    assert err.splitlines()[-1] == ("featurestore: interrupted: the embedding split, if begun, is left incomplete "
                                    "(status writing): run the same command with --resume to keep the rows written")
    assert "Traceback" not in err
    resumed = cli("embed", store, *EMBED, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert cli("verify", store).returncode == 0


def test_a_worker_stopped_before_it_shares_slides_is_told_to_start_again(
        monkeypatch: Any, capsys: Any) -> None:
    """--worker refuses --resume: a Ctrl-C before the worker shares slides (its own stop line
    comes only once it does) names the worker's next step, not the plain run's."""
    import featurestore.extract.importer as importer
    from featurestore.cli import main

    def stopped(options: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(importer, "import_cache", stopped)
    argv = ["import", "d", "--store", "s", "--dataset", "d", "--encoder-name", "e", "--split", "x"]
    assert main([*argv, "--worker"]) == 130
    assert capsys.readouterr().err.strip() == ("featurestore: interrupted: start the worker again: it attaches to "
                                               "the split and takes the slides not done")
    assert main(argv) == 130
    assert capsys.readouterr().err.strip() == f"featurestore: interrupted: {RESUME_SPLIT}"
