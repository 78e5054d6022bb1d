"""A stale embedding split (its source bags rewritten or removed since ``featurestore embed``) is
read, never as current: ``FeatureDataset`` sets ``ds.stale`` and warns, and a probe's report says so
(``result["stale"]``, a WARNING line), on a store path and over HTTP, as ``ls``/``info``/``verify``
and the server's header do (featurestore.core.lineage)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from _probe_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread per test)

import featurestore
from client import FeatureClient, FeatureDataset
from featurestore.cli import main
from featurestore.errors import StaleSplitWarning
from featurestore.probes.run import run_probe
from featurestore.testing.serving import serve_subprocess

DIM = 8


def _bags(root: str, shift: float = 0.0) -> None:
    rng = np.random.default_rng(0)
    writer = featurestore.open_store(root, mode="a").create_bag_split(
        "c", "bags", "all", dim=DIM, dtype="float32", label_dtype="int64", overwrite=True)
    for k in range(24):
        label = k % 2
        writer.add_bag(f"s{k:02d}", rng.normal(label + shift, 1, (10, DIM)).astype(np.float32), label=label)
    writer.commit()


def test_a_probe_on_a_stale_embedding_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "store")
    _bags(root)
    assert main(["embed", root, "--dataset", "c", "--encoder", "bags", "--split", "all", "--slide-encoder", "mean",
                 "--encoder-name", "mean"]) == 0
    options = dict(train_split="all", folds=3, seeds=1, epochs=2, device="cpu")
    assert run_probe(root, "c", "mean", **options)["stale"] == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleSplitWarning)
        assert FeatureDataset(root, "c", "mean", "all").stale is None  # current: no warning
    _bags(root, shift=1.0)  # the bags rewritten: a new generation of the source
    reason = run_probe(root, "c", "mean", **options)["stale"]["c/mean/all"]
    assert reason.startswith("source c/bags/all generation changed"), reason
    with serve_subprocess(root) as (url, _):
        assert run_probe(url, "c", "mean", **options)["stale"] == {"c/mean/all": reason}
        for source in (root, url):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ds = FeatureDataset(source, "c", "mean", "all")
                ds.array.read_numpy([0, 1])  # the reader it opens does not warn a second time
            assert ds.stale == reason
            said = [str(w.message) for w in caught if issubclass(w.category, StaleSplitWarning)]
            assert len(said) == 1 and said[0].startswith("c/mean/all is stale: " + reason), said
        # A plain FeatureClient: the array it opens says so (arr.stale) and warns, once per split.
        with FeatureClient(url) as fc, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            arr = fc.open("c", "mean", "all")
            fc.read_numpy("c", "mean", "all", [0])
            assert arr.stale == reason
        said = [str(w.message) for w in caught if issubclass(w.category, StaleSplitWarning)]
        assert len(said) == 1 and said[0].startswith("c/mean/all is stale: " + reason), said
    assert main(["rm", root, "c", "bags", "all", "--yes"]) == 0
    with serve_subprocess(root) as (url, _):
        gone = {"c/mean/all": "source c/bags/all is gone"}
        assert run_probe(url, "c", "mean", **options)["stale"] == gone
    assert run_probe(root, "c", "mean", **options)["stale"] == gone
    capsys.readouterr()
    assert main(["probe", root, "--dataset", "c", "--encoder", "mean", "--train", "all", "--folds", "3",
                 "--seeds", "1", "--epochs", "2", "--device", "cpu"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "WARNING: STALE: c/mean/all was computed from a source that has changed since (source c/bags/all is gone)" \
        in printed
    # the gone source's own fix (the one verify and status give), not a recompute that would fail
    assert "write c/bags/all again" in printed and "featurestore rm" in printed and "c/mean/all" in printed
