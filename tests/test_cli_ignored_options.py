"""Options typed on the command line that the store would ignore are refused in one line naming the
value and the fix: ``--storage-options`` and ``--cache-dir``/``--cache-bytes`` with a local store (a
bucket whose s3:// was forgotten), ``probe --token`` with a store that is no server, ``embed
--device cuda`` with mean or max pooling. Their environment variables, set once for all of a
user's stores, are not refused, nor is ``--storage-options '{}'``; an object-storage URL still
takes them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.cli import main
from featurestore.commands.storeargs import add_cache_options, add_storage_options, options_from_args

SECRET = "sekrit-do-not-print"
OPTIONS = json.dumps({"endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": SECRET})
SPLIT = ("--dataset", "d", "--encoder", "uni", "--split", "all")
PROBE = ("probe", "{store}", "--dataset", "d", "--encoder", "e", "--train", "t", "--eval", "v", "--quiet")
VERBS = {  # every verb that takes --storage-options
    "ls": ("ls", "{store}"),
    "info": ("info", "{store}", "d/uni/all"),
    "verify": ("verify", "{store}"),
    "status": ("status", "{store}", "d/uni/all"),
    "rm": ("rm", "{store}", "d/uni/all", "--yes"),
    "commit": ("commit", "{store}", "d/uni/all"),
    "export": ("export", "{store}", *SPLIT, "--format", "trident", "--out", "out", "--no-progress"),
    "embed": ("embed", "{store}", *SPLIT, "--slide-encoder", "mean", "--encoder-name", "m", "--no-progress"),
    "extract": ("extract", "--images", "npy:x.npy", "--encoder", "builtin:tiny-vit", "--store", "{store}",
                "--dataset", "d", "--split", "s", "--no-progress"),
    "import": ("import", "x.npy", "--store", "{store}", "--dataset", "d", "--encoder-name", "e", "--split", "s",
               "--no-progress"),
    "probe": PROBE,
    "serve": ("serve", "{store}", "--port", "0"),
}
CACHED = {"probe": PROBE, "serve": VERBS["serve"]}  # the verbs that take --cache-dir/--cache-bytes


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == (2 if argv[0] == "verify" else 1)  # verify: 2, "not checked"
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_storage_options_with_a_local_path_are_refused_by_every_verb(
        verb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [a.format(store="mybucket/prefix") for a in VERBS[verb]] + ["--storage-options", OPTIONS]
    err = _error(argv, capsys)
    assert err == ("featurestore: error: --storage-options is for object-storage URLs (s3://, gs://, az://, other "
                   "fsspec URLs); 'mybucket/prefix' is a local path, which takes none: drop the flag, or write the "
                   "store as s3://mybucket/prefix if it is a bucket\n")
    assert SECRET not in err
    assert sorted(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.parametrize("store", ["{tmp}/store", "file://{tmp}/store", "./store"])
def test_an_absolute_or_file_url_store_gets_no_bucket_hint(store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    url = store.format(tmp=tmp_path)
    err = _error(["ls", url, "--storage-options", OPTIONS], capsys)
    assert err.endswith(f"; {url!r} is a local path, which takes none: drop the flag\n"), err


def _store_with_a_split(root: Path) -> str:
    store = featurestore.open_store(str(root), mode="a")
    writer = store.create_split("d", "uni", "all", num_samples=4, sample_shape=(2, 8), dtype="float16")
    writer.write(0, np.ones((4, 2, 8), np.float32))
    writer.commit()
    return str(root)


def test_empty_options_and_the_environment_are_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    url = _store_with_a_split(tmp_path / "store")
    assert main(["ls", url, "--storage-options", "{}"]) == 0
    monkeypatch.setenv("FEATURESTORE_STORAGE_OPTIONS", OPTIONS)  # set once for the user's S3 work
    monkeypatch.setenv("FEATURESTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FEATURESTORE_CACHE_BYTES", "1G")
    monkeypatch.setenv("FEATURESTORE_TOKEN", SECRET)
    assert main(["ls", url]) == 0
    assert main(["info", url, "d/uni/all"]) == 0
    assert "d/uni/all" in capsys.readouterr().out
    # probe: past the checks (to the missing split), with the cache and token variables set
    err = _error([a.format(store=url) for a in PROBE], capsys)
    assert "is for object" not in err and "encoder 'e' not found" in err, err
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("flag", ["--cache-dir", "--cache-bytes"])
@pytest.mark.parametrize("verb", sorted(CACHED))
def test_the_chunk_cache_with_a_local_path_is_refused(verb: str, flag: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    value = str(tmp_path / "cache") if flag == "--cache-dir" else "5G"
    store = str(tmp_path / "store")
    err = _error([a.format(store=store) for a in CACHED[verb]] + [flag, value], capsys)
    assert err == (f"featurestore: error: {flag} {value} is for object-storage URLs (s3://, gs://, az://), whose "
                   f"chunks it keeps on local disk; {store!r} is a local path, which takes none: drop the flag\n")
    assert sorted(tmp_path.iterdir()) == []


def test_the_chunk_cache_of_another_fsspec_url_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(["serve", "memory://nowhere", "--cache-dir", "/nvme/cache"], capsys)
    assert "--cache-dir /nvme/cache is for object-storage URLs" in err
    assert "'memory://nowhere' is a memory:// URL, which takes none: drop the flag" in err


@pytest.mark.parametrize("store", ["{tmp}/store", "s3://bucket/store"])
def test_probe_token_without_a_server_is_refused(store: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    url = store.format(tmp=tmp_path)
    err = _error([a.format(store=url) for a in PROBE] + ["--token", SECRET], capsys)
    assert err.startswith("featurestore: error: --token is for a featurestore server's http(s):// URL; "
                          f"{url!r} is "), err
    assert err.rstrip().endswith("which takes none: drop the flag" if "://" not in url else
                                 "(its credentials go in --storage-options)"), err
    assert SECRET not in err
    assert sorted(tmp_path.iterdir()) == []


def test_probe_token_for_a_compare_store_on_a_server_is_taken(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(store=tmp_path / "store") for a in PROBE]
    err = _error([*argv, "--compare", "e2", "--compare-store", "http://127.0.0.1:1", "--token", "t"], capsys)
    assert "no featurestore at" in err, err  # past the check: the local A store is missing


def test_probe_storage_options_for_a_server_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(store="http://127.0.0.1:1") for a in PROBE]
    err = _error([*argv, "--storage-options", OPTIONS], capsys)
    assert "--storage-options is for object-storage URLs" in err
    assert "'http://127.0.0.1:1' is a featurestore server's URL, which takes none: drop the flag" in err
    assert "featurestore serve STORE --storage-options JSON" in err and SECRET not in err


@pytest.mark.parametrize("pooling", ["mean", "max"])
def test_embed_device_with_pooling_is_refused(pooling: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["embed", str(tmp_path / "store"), *SPLIT, "--slide-encoder", pooling, "--encoder-name", "m"]
    err = _error([*argv, "--device", "cuda:1"], capsys)
    assert err == (f"featurestore: error: --device cuda:1 applies to python: slide encoders; {pooling} pooling runs "
                   "in float32/float64 on the CPU: drop --device\n")
    for device in ("cpu", "auto"):  # what pooling does: past the check, to the missing store
        assert "no featurestore at" in _error([*argv, "--device", device], capsys)


def _parsed(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_storage_options(parser)
    add_cache_options(parser)
    return parser.parse_args(argv)


def test_object_storage_takes_the_flags() -> None:
    args = _parsed(["--storage-options", OPTIONS, "--cache-dir", "/c", "--cache-bytes", "5G"])
    options = {**json.loads(OPTIONS), "cache_dir": "/c", "cache_bytes": "5G"}
    for url in ("s3://mybucket/prefix", "gs://b/p", "az://c/p"):
        assert options_from_args(args, url) == options
    # one store of several that takes them is enough (extract --coords-store, probe --compare-store)
    assert options_from_args(args, "/local/store", "s3://b/p") == options
    storage_only = _parsed(["--storage-options", OPTIONS])
    assert options_from_args(storage_only, "memory://x") == json.loads(OPTIONS)
    assert options_from_args(storage_only, "http://host/store") == json.loads(OPTIONS)  # fsspec's http


def test_the_python_api_is_unchanged(tmp_path: Path) -> None:
    """Only the CLI refuses: a local store opened with storage options, or a pooling embed with a
    device, is accepted as before."""
    from featurestore.embed.run import EmbedOptions

    store: Any = featurestore.open_store(str(tmp_path), mode="a", endpoint_url="http://127.0.0.1:9000")
    assert store.url == str(tmp_path)
    EmbedOptions(store=str(tmp_path), dataset="d", encoder="e", split="s", slide_encoder="mean",
                 encoder_name="m", device="cuda").check()


def test_an_s3_store_takes_the_flags_on_the_command_line(seaweed_url: str, seaweed: Any,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    options = dict(seaweed.storage_options)
    writer = featurestore.open_store(seaweed_url, mode="a", **options).create_split(
        "d", "uni", "all", num_samples=2, sample_shape=(4,), dtype="float16")
    writer.write(0, np.ones((2, 4), np.float32))
    writer.commit()
    assert main(["ls", seaweed_url, "--storage-options", json.dumps(options)]) == 0
    assert "d/uni/all" in capsys.readouterr().out
