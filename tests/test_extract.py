"""Extraction end to end: pannuke/npy sources, precision policy, re-runs, resume, bad input, S3.

The ``*_encoder`` factories below are also used by the CLI tests of this file, of
test_extract_crash.py and of test_extract_dist.py, as ``python:test_extract:NAME`` (the tests put
this directory on PYTHONPATH). Their behaviour is tuned with ``FSX_*`` environment variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import featurestore
from featurestore.demo.synthetic import make_synthetic_pannuke
from featurestore.errors import CacheKeyMismatch, Float16Overflow, SplitExists
from featurestore.extract.dist import Coordinator
from featurestore.extract.encoders import load_encoder
from featurestore.extract.plan import plan_batches
from featurestore.extract.run import ExtractOptions, extract
from featurestore.extract.sources import PreparedImages, Preprocessing, open_source, pannuke_class_map

TESTS = Path(__file__).parent


# ----------------------------------------------------------------------------- test encoders
class _PatchEncoder(torch.nn.Module):
    """Patch embedding + LayerNorm: cheap, deterministic, a CLS token and an 8-px grid."""

    num_prefix_tokens = 1
    patch_size = 8

    def __init__(self, scale: float = 1.0, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Conv2d(3, 16, 8, 8)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(self.proj.weight.shape, generator=generator) * 0.1)
            self.proj.bias.copy_(torch.randn(16, generator=generator))
        self.scale = scale
        self.out_dtype = out_dtype
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        log = os.environ.get("FSX_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{x.shape[0]}\n")
        fail_after = int(os.environ.get("FSX_FAIL_AFTER", "0"))
        if fail_after and self.calls > fail_after:
            raise RuntimeError("injected failure")
        time.sleep(float(os.environ.get("FSX_SLEEP", "0")))
        grid = self.proj(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([grid.mean(1, keepdim=True), grid], 1)
        tokens = torch.nn.functional.layer_norm(tokens, (16,)) * self.scale + 0.25
        if os.environ.get("FSX_BAD_AFTER") and self.calls > int(os.environ["FSX_BAD_AFTER"]):
            tokens = tokens * float(os.environ.get("FSX_BAD_SCALE", "1e6"))
        return tokens if self.out_dtype is None else tokens.to(self.out_dtype)


class _Logged(torch.nn.Module):
    """builtin:tiny-vit, logging each batch size to $FSX_LOG and sleeping $FSX_SLEEP per batch."""

    num_prefix_tokens = 3
    patch_size = 16

    def __init__(self) -> None:
        super().__init__()
        self.inner = load_encoder("builtin:tiny-vit").module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("FSX_LOG"):
            with open(os.environ["FSX_LOG"], "a") as f:
                f.write(f"{x.shape[0]}\n")
        time.sleep(float(os.environ.get("FSX_SLEEP", "0")))
        return self.inner(x)


def logged_tiny_vit() -> torch.nn.Module:
    return _Logged()


def patch_encoder() -> torch.nn.Module:
    return _PatchEncoder()


def overflow_encoder() -> torch.nn.Module:
    return _PatchEncoder(scale=1e5)  # far beyond float16's 65504


def nan_encoder() -> Any:
    return lambda x: torch.full((x.shape[0], 5, 4), float("nan"))


def rank2_encoder() -> Any:
    return lambda x: x.mean((2, 3))


def bf16_encoder() -> torch.nn.Module:
    return _PatchEncoder(out_dtype=torch.bfloat16)


def unseeded_encoder() -> torch.nn.Module:
    """A factory whose weights come from the global RNG: other weights on every run."""
    encoder = _PatchEncoder()
    with torch.no_grad():
        encoder.proj.bias.copy_(torch.randn(16))
    return encoder


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def fold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_synthetic_pannuke(tmp_path_factory.mktemp("fold"), 20, size=32, seed=5))


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    for name in ("FSX_LOG", "FSX_FAIL_AFTER", "FSX_SLEEP", "FSX_BAD_AFTER", "FSX_BAD_SCALE"):
        monkeypatch.delenv(name, raising=False)


def options(fold: Path, store: Path | str, **kw: Any) -> ExtractOptions:
    # A 6-sample float16 target (3 samples as float32), which chunk_rows_for turns into one
    # whole batch of 4 rows per chunk either way.
    base: dict[str, Any] = dict(images=f"pannuke:{fold}", encoder="python:test_extract:patch_encoder",
                                store=str(store), dataset="pannuke", split="fold1", batch_size=4,
                                chunk_mb=6 * 16 * 16 * 2 / 2**20, num_workers=0, progress=False)
    base.update(kw)
    return ExtractOptions(**base)


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "featurestore.cli", *args], capture_output=True, text=True,
                          env=env or cli_env(), timeout=timeout)


def read_all(url: str, name: tuple[str, str, str], **storage: Any) -> np.ndarray:
    arr = featurestore.open_store(url, mode="r", **storage).open(*name)
    return arr.read_numpy(np.arange(len(arr)))


# ----------------------------------------------------------------------------- tests
def test_plan_batches_never_cross_chunks() -> None:
    plan = plan_batches([0, 2], chunk_rows=5, num_samples=13, batch_size=2)
    assert plan == [[0, 1], [2, 3], [4], [10, 11], [12]]
    assert plan_batches([1], chunk_rows=3, num_samples=10, batch_size=64) == [[3, 4, 5]]


def test_pannuke_float32_is_exact_with_labels_ids_and_metadata(fold: Path, tmp_path: Path) -> None:
    result = extract(options(fold, tmp_path, dtype="float32"), Coordinator())
    assert result.status == "complete" and result.encoded == 20
    store = featurestore.open_store(str(tmp_path))
    arr = store.open("pannuke", "patch_encoder", "fold1")
    assert arr.shape == (20, 16, 16) and arr.dtype == "float32" and arr.chunk_rows == 4
    # The same batches through the same encoder give the same bits.
    source = open_source(f"pannuke:{fold}")
    enc = load_encoder("python:test_extract:patch_encoder")
    images = PreparedImages(source, Preprocessing())
    expected = []
    with torch.inference_mode():
        for batch in plan_batches(list(range(7)), 3, 20, 4):
            x = torch.stack([images[i][1] for i in batch])  # type: ignore[index]
            expected.append(enc(x)[:, 1:])
    assert np.array_equal(arr.read_numpy(np.arange(20)), torch.cat(expected).numpy())
    masks = np.load(fold / "masks.npy")
    assert arr.labels is not None and arr.labels.dtype == "uint8"
    assert np.array_equal(arr.labels.read_numpy(np.arange(20)), np.stack([pannuke_class_map(m) for m in masks]))
    assert arr.ids is not None and arr.ids[:2] == source.ids[:2]  # type: ignore[index]
    meta = arr.metadata
    assert meta["status"] == "complete" and meta["encoder"]["weights_hash"] == enc.weights_hash
    assert meta["encoder"]["spec"] == "python:test_extract:patch_encoder"
    assert meta["token_layout"]["grid"] == [4, 4] and meta["token_layout"]["encoder_prefix_tokens"] == 1
    assert meta["preprocessing"]["mean"] == [0.485, 0.456, 0.406] and len(meta["cache_key"]) == 64
    assert meta["quantization"]["exact"] is True and meta["source_dtype"] == "float32"
    assert meta["source"]["labels"]["classes"][0] == "background"


def test_auto_dtype_float16_report_and_bf16_exact(fold: Path, tmp_path: Path) -> None:
    result = extract(options(fold, tmp_path), Coordinator())
    q = result.metadata["quantization"]
    assert result.metadata["logical_dtype"] == "float16" and q["source_dtype"] == "float32"
    assert 0 < q["max_rel_error"] < 1e-3 and q["overflow_count"] == 0
    bf = extract(options(fold, tmp_path, encoder="python:test_extract:bf16_encoder", split="bf"), Coordinator())
    assert bf.metadata["logical_dtype"] == "bfloat16" and bf.metadata["quantization"]["exact"] is True


def test_rerun_is_a_noop_a_changed_input_is_refused_overwrite_redoes(fold: Path, tmp_path: Path) -> None:
    first = extract(options(fold, tmp_path), Coordinator())
    again = extract(options(fold, tmp_path), Coordinator())
    assert again.status == "already-complete" and again.encoded == 0
    assert again.metadata["cache_key"] == first.metadata["cache_key"]
    # The refusal names what changed, from what the split records of its cache key.
    with pytest.raises(CacheKeyMismatch, match=r"changes the preprocessing \(resize: null then, \[16, 16\] now\).*"
                       r"--overwrite"):
        extract(options(fold, tmp_path, resize=(16, 16)), Coordinator())
    with pytest.raises(CacheKeyMismatch,
                       match=r"changes the stored dtype \(float16 then, float32 now\)\. Use") as refused:
        extract(options(fold, tmp_path, dtype="float32", resume=True), Coordinator())
    assert "weights" not in str(refused.value) and "preprocessing" not in str(refused.value)
    redone = extract(options(fold, tmp_path, dtype="float32", overwrite=True), Coordinator())
    assert redone.status == "complete" and redone.metadata["logical_dtype"] == "float32"


def test_an_unseeded_encoder_is_named_as_the_reason_a_rerun_is_refused(fold: Path, tmp_path: Path) -> None:
    spec = "python:test_extract:unseeded_encoder"
    extract(options(fold, tmp_path, encoder=spec), Coordinator())
    with pytest.raises(CacheKeyMismatch, match=r"changes the encoder's weights \([0-9a-f]{12} then, [0-9a-f]{12} now\)"
                       r"\. An encoder factory that draws its weights at random \(unseeded\).*seed it") as refused:
        extract(options(fold, tmp_path, encoder=spec, resume=True), Coordinator())
    assert "preprocessing" not in str(refused.value)  # only what changed


def test_resume_encodes_only_the_missing_chunks(fold: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tmp_path / "ref"
    extract(options(fold, reference), Coordinator())
    log = tmp_path / "log"
    monkeypatch.setenv("FSX_LOG", str(log))
    monkeypatch.setenv("FSX_FAIL_AFTER", "4")  # the probe call + 3 batches, then a crash
    with pytest.raises(Exception, match="injected failure"):
        extract(options(fold, tmp_path / "run"), Coordinator())
    store = featurestore.open_store(str(tmp_path / "run"))
    assert store.split_status("pannuke", "patch_encoder", "fold1") == "writing"
    with pytest.raises(SplitExists, match="--resume"):
        extract(options(fold, tmp_path / "run"), Coordinator())
    monkeypatch.delenv("FSX_FAIL_AFTER")
    log.write_text("")
    result = extract(options(fold, tmp_path / "run", resume=True), Coordinator())
    # Chunks hold one batch of 4: the 3 batches before the crash filled chunks 0-2 (rows 0-11),
    # which are kept; only chunks 3-4 (8 rows) are encoded again.
    assert result.encoded == 8
    assert sum(int(n) for n in log.read_text().split()) == 1 + 8  # the probe sample + the rest
    name = ("pannuke", "patch_encoder", "fold1")
    assert np.array_equal(read_all(str(reference), name), read_all(str(tmp_path / "run"), name))
    assert result.metadata["quantization"] == featurestore.open_store(str(reference)).open(*name).metadata["quantization"]


def test_a_writer_error_stops_the_run_promptly(fold: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "log"
    monkeypatch.setenv("FSX_LOG", str(log))
    monkeypatch.setenv("FSX_BAD_AFTER", "2")  # the second real batch overflows float16
    with pytest.raises(Float16Overflow, match="--dtype bfloat16"):
        extract(options(fold, tmp_path, batch_size=1, chunk_mb=1.0), Coordinator())
    calls = len(log.read_text().split())
    assert calls < 1 + 20  # stopped well before the end (queue of 4 batches in flight at most)
    store = featurestore.open_store(str(tmp_path))
    assert store.split_status("pannuke", "patch_encoder", "fold1") == "writing"


def test_cli_npy_source_prints_report_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", np.arange(6, dtype=np.int64))
    out = run_cli("extract", "--images", f"npy:{tmp_path / 'x.npy'}", "--labels", str(tmp_path / "y.npy"),
                  "--encoder", "builtin:tiny-vit", "--store", str(tmp_path / "s"), "--dataset", "toy",
                  "--split", "train", "--tokens", "cls", "--batch-size", "4", "--num-workers", "1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("quantization: float32 -> float16") and "overflow 0" in lines[0]
    assert lines[-1].startswith("extracted toy/tiny-vit/train: 6x128 float16") and "MB/s" in lines[-1]
    arr = featurestore.open_store(str(tmp_path / "s")).open("toy", "tiny-vit", "train")
    assert arr.labels is not None and arr.labels.read_numpy(np.arange(6)).tolist() == list(range(6))
    from featurestore.cli import main

    again = main(["extract", "--images", f"npy:{tmp_path / 'x.npy'}", "--labels", str(tmp_path / "y.npy"),
                  "--encoder", "builtin:tiny-vit", "--store", str(tmp_path / "s"), "--dataset", "toy",
                  "--split", "train", "--tokens", "cls"])
    assert again == 0 and "already complete" in capsys.readouterr().out


def _bad_input(kind: str, tmp: Path, fold: Path) -> tuple[list[str], dict[str, str]]:
    images, encoder, env = f"pannuke:{fold}", "python:test_extract:patch_encoder", {}
    if kind == "missing-file":
        images = f"npy:{tmp / 'nope.npy'}"
    elif kind == "malformed-npy":
        (tmp / "bad.npy").write_bytes(b"\x93NUMPY garbage")
        images = f"npy:{tmp / 'bad.npy'}"
    elif kind == "broken-image":
        from PIL import Image

        (tmp / "imgs" / "a").mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp / "imgs" / "a" / f"{i}.png")
        (tmp / "imgs" / "a" / "2.png").write_bytes(b"not a png")
        images = f"folder:{tmp / 'imgs'}"
    elif kind == "encoder-import":
        encoder = "python:no_such_encoder_module:make"
    elif kind == "wrong-rank":
        encoder = "python:test_extract:rank2_encoder"
    elif kind == "overflow":
        env["FSX_BAD_AFTER"] = "2"  # passes the probe sample and the first batch, then overflows
    elif kind == "nan":  # NaN from the first sample on: refused before the store is touched
        encoder = "python:test_extract:nan_encoder"
    elif kind == "nan-mid-run":  # NaN from the second batch: the writer refuses it
        env.update(FSX_BAD_AFTER="2", FSX_BAD_SCALE="nan")
    extra = {"bad-compressor": ["--compressor", "zstdx"], "negative-prefix": ["--prefix-tokens", "-1"],
             "prefix-beyond-tokens": ["--prefix-tokens", "500"]}.get(kind, [])
    args = ["extract", "--images", images, "--encoder", encoder, "--store", str(tmp / "s"), "--dataset", "d",
            "--encoder-name", "enc", "--split", "s", "--batch-size", "4", "--num-workers", "1", *extra]
    return args, env


BAD = {
    "missing-file": "does not exist",
    "malformed-npy": "as a .npy array",
    "broken-image": "cannot decode image file",
    "encoder-import": "cannot import module 'no_such_encoder_module'",
    "wrong-rank": r"\[B, T, D\]",
    "overflow": "--dtype bfloat16",
    "nan": "NaN",
    "nan-mid-run": "NaN",
    # Option values are named as given (not "pass --prefix-tokens N" to one who passed it).
    "bad-compressor": "unsupported compressor 'zstdx'.*leave --compressor out",
    "negative-prefix": "--prefix-tokens must be 0 or more.*-1",
    "prefix-beyond-tokens": "--prefix-tokens 500 does not fit .* 17 tokens",
}


def _assert_one_line_failure(code: int, stderr: str, kind: str, tmp: Path) -> None:
    import re

    assert code == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("featurestore: error: ") and re.search(BAD[kind], lines[0]), lines[0]
    assert "Traceback" not in stderr
    if (tmp / "s" / "d" / "enc" / "s").exists():
        assert featurestore.open_store(str(tmp / "s")).split_status("d", "enc", "s") != "complete"


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_is_one_line_exit_1_and_never_complete(kind: str, fold: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capfd: pytest.CaptureFixture[str]) -> None:
    from featurestore.cli import main

    args, env = _bad_input(kind, tmp_path, fold)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = main(args)
    _assert_one_line_failure(code, capfd.readouterr().err, kind, tmp_path)
    if kind in ("missing-file", "malformed-npy", "encoder-import", "wrong-rank", "nan", "bad-compressor",
                "negative-prefix", "prefix-beyond-tokens"):
        assert not (tmp_path / "s").exists()  # found before anything touched the store


def test_cli_process_overflow_exit_1_and_debug_traceback(fold: Path, tmp_path: Path) -> None:
    args, env = _bad_input("overflow", tmp_path, fold)
    out = run_cli(*args, env=cli_env(**env))
    _assert_one_line_failure(out.returncode, out.stderr, "overflow", tmp_path)
    # The split was created before the overflow: it exists and stays incomplete.
    assert featurestore.open_store(str(tmp_path / "s")).split_status("d", "enc", "s") == "writing"
    debug = run_cli(*args, "--resume", "--debug", env=cli_env(**env))
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "Float16Overflow" in debug.stderr


def test_cli_s3_store_through_a_moto_server(fold: Path, tmp_path: Path, s3_bucket: str, s3_endpoint: str,
                                           s3_storage_options: dict[str, Any],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    args = ["extract", "--images", f"pannuke:{fold}", "--encoder", "python:test_extract:patch_encoder",
            "--dataset", "pannuke", "--split", "fold1", "--batch-size", "4", "--num-workers", "0",
                "--chunk-mb", str(6 * 16 * 16 * 2 / 2**20)]
    local = run_cli(*args, "--store", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    url = f"s3://{s3_bucket}/stores/one"
    # The usual fsspec/S3 settings from the environment, nothing passed on the command line.
    env = cli_env(FSSPEC_S3_ENDPOINT_URL=s3_endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    remote = run_cli(*args, "--store", url, env=env)
    assert remote.returncode == 0, remote.stderr
    name = ("pannuke", "patch_encoder", "fold1")
    assert np.array_equal(read_all(url, name, **s3_storage_options), read_all(str(tmp_path / "local"), name))
    # The same store through --storage-options, in this process: a re-run is a no-op.
    from featurestore.cli import main

    assert main([*args, "--store", url, "--storage-options", json.dumps(s3_storage_options)]) == 0
    assert "already complete" in capsys.readouterr().out


def test_bench_extract_reports_ratio_and_write_speed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from featurestore.bench.extract import run
    from featurestore.bench.report import bench_args

    results = run(bench_args("extract", ["--n", "24", "--image-size", "32", "--batch-size", "8", "--chunk-mb", "1",
                                         "--num-workers", "0", "--repeats", "1", "--workdir", str(tmp_path)]))
    assert results["sample_shape"] == [4, 384] and results["bytes"] == 24 * 4 * 384 * 2
    assert results["encode_only_s"] > 0 and results["ratio"] == results["extract_s"] / results["encode_only_s"]
    assert results["extract_write_mb_s"] > 0 and results["write_only_mb_s"] > 0
    assert 0 <= results["writer_wait_s"] < results["extract_s"]
    from featurestore.bench.report import finish

    assert finish("extract", results, None) == 0  # what `featurestore bench extract` prints
    out = capsys.readouterr().out
    assert "encode only" in out and "waited" in out and "tofile" in out
