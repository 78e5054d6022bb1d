"""A stale embedding is recomputed only as what it was: the same slide encoder, grouping and dtype
on the new bags. Another recipe under its name replaces a computation, which takes --overwrite,
as for a current split (it was recomputed silently, exit 0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_embed import cli, make_bags, read_split

import featurestore

EMBED = ["embed", "--dataset", "ds", "--encoder", "uni", "--split", "train", "--encoder-name", "slide",
         "--no-progress"]


def _embed(root: Path, *more: str) -> object:
    return cli(EMBED[0], str(root), *EMBED[1:], *more)


def test_a_stale_embedding_is_not_replaced_by_another_recipe(tmp_path: Path) -> None:
    make_bags(tmp_path)
    assert _embed(tmp_path, "--slide-encoder", "max").returncode == 0  # type: ignore[attr-defined]
    new = make_bags(tmp_path, seed=1, overwrite=True)  # the source rewritten: the embedding is stale
    for other in (["--slide-encoder", "mean"], ["--slide-encoder", "max", "--dtype", "float16"],
                  ["--slide-encoder", "max", "--group-by", "case_id"]):
        refused = _embed(tmp_path, *other)
        assert refused.returncode == 1, refused.stdout  # type: ignore[attr-defined]
        err = refused.stderr.strip()  # type: ignore[attr-defined]
        assert len(err.splitlines()) == 1 and "ds/slide/train is stale (" in err, err
        assert "was computed with another" in err and "pass --overwrite to replace it" in err, err
    meta = featurestore.open_store(str(tmp_path)).split_metadata("ds", "slide", "train")
    assert meta["lineage"]["slide_encoder"]["spec"] == "max" and meta["logical_dtype"] == "float32"
    # The same recipe is recomputed on the new bags; --overwrite replaces it with another.
    assert _embed(tmp_path, "--slide-encoder", "max").returncode == 0  # type: ignore[attr-defined]
    values, ids, _ = read_split(tmp_path)
    assert np.array_equal(values, np.stack([new[i].max(0) for i in ids]))
    make_bags(tmp_path, seed=2, overwrite=True)
    assert _embed(tmp_path, "--slide-encoder", "mean", "--overwrite").returncode == 0  # type: ignore[attr-defined]
    meta = featurestore.open_store(str(tmp_path)).split_metadata("ds", "slide", "train")
    assert meta["lineage"]["slide_encoder"]["spec"] == "mean"


def test_a_slide_encoder_that_fails_is_named_with_its_slide(tmp_path: Path) -> None:
    """A python: slide encoder that raises, or returns NaN: one line naming the slide and a fix
    embed has (a traceback naming no slide; a row range and extract's --precision before)."""
    from test_embed import cli_env

    make_bags(tmp_path)
    spec = ["--slide-encoder", "python:_embed_encoders:faulty", "--device", "cpu"]
    raised = cli(EMBED[0], str(tmp_path), *EMBED[1:], *spec, env=cli_env(FS_EMBED_FAULT="raise"))
    err = raised.stderr.strip()
    assert raised.returncode == 1 and len(err.splitlines()) == 1, err
    assert "failed on 's-b' (RuntimeError: CUDA out of memory (simulated))" in err and "--resume" in err, err
    nan = cli(EMBED[0], str(tmp_path), *EMBED[1:], *spec, "--resume", env=cli_env(FS_EMBED_FAULT="nan"))
    err = nan.stderr.strip()
    assert nan.returncode == 1 and "returned 8 NaN/Inf values for 's-b'" in err and "--autocast" in err, err
    assert "--precision" not in err, err
