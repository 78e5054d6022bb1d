"""The obstore backend for s3:// (gs://, az://): option translation, ranged reads, multipart
writes and its errors, against the session's real S3 server (SeaweedFS) and, for a server that
dies mid-epoch, a moto server this module stops itself."""

from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _moto_helpers import own_moto_bucket
from reader_contract import ReaderContract

import featurestore
from featurestore.core.storage.options import translate
from featurestore.errors import BucketNotFound, InvalidStorageOptions, StorageAccessDenied, StorageUnavailable

pytest.importorskip("obstore")


# ---------------------------------------------------------------------- translation (no server)
def test_fsspec_s3_options_translate_to_obstore() -> None:
    settings = translate("s3://b/p", {"key": "K", "secret": "S", "token": "T", "client_kwargs": {
        "endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}, "max_concurrency": 7}, environ={})
    assert settings.kind == "s3" and settings.max_concurrency == 7
    assert settings.credentials == {"access_key_id": "K", "secret_access_key": "S", "token": "T", "expires_at": None}
    assert settings.config["endpoint"] == "http://127.0.0.1:9000" and settings.config["region"] == "eu-west-1"
    assert settings.client_options["allow_http"] is True  # an http:// endpoint needs it in obstore
    assert settings.config["virtual_hosted_style_request"] is False  # buckets in the path, as s3fs
    anon = translate("s3://b", {"anon": True, "endpoint_url": "https://minio:9000"}, environ={})
    assert anon.config["skip_signature"] is True and "allow_http" not in anon.client_options


def test_environment_endpoint_and_fsspec_config(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = translate("s3://b", {}, environ={"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:1"})
    assert settings.endpoint == "http://127.0.0.1:1" and settings.client_options["allow_http"] is True
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": "http://from-fsspec:2"})
    assert translate("s3://b", {}, environ={}).config["endpoint"] == "http://from-fsspec:2"
    # explicit options win over fsspec's config
    assert translate("s3://b", {"endpoint_url": "http://x:3"}, environ={}).config["endpoint"] == "http://x:3"
    assert translate("s3://b", {}, environ={"FEATURESTORE_OBJECT_CONCURRENCY": "5"}).max_concurrency == 5


def test_coalesce_gap_setting() -> None:
    assert translate("s3://b", {}, environ={}).coalesce_gap == 1 << 20  # object_store's own default
    assert translate("s3://b", {"coalesce_gap": 0}, environ={}).coalesce_gap == 0
    assert translate("gs://b", {}, environ={"FEATURESTORE_OBJECT_COALESCE_GAP": "4096"}).coalesce_gap == 4096
    # the option wins over the environment
    assert translate("s3://b", {"coalesce_gap": 7}, environ={"FEATURESTORE_OBJECT_COALESCE_GAP": "9"}).coalesce_gap == 7


@pytest.mark.parametrize("environ, needle", [
    ({"FEATURESTORE_OBJECT_COALESCE_GAP": "lots"}, "FEATURESTORE_OBJECT_COALESCE_GAP='lots' must be an integer >= 0"),
    ({"FEATURESTORE_OBJECT_CONCURRENCY": "0"}, "FEATURESTORE_OBJECT_CONCURRENCY='0' must be an integer >= 1"),
    ({"FEATURESTORE_OBJECT_RETRY_TIMEOUT": "soon"}, "FEATURESTORE_OBJECT_RETRY_TIMEOUT='soon' must be a number"),
])  # fmt: skip
def test_bad_environment_settings_name_the_variable(environ: dict[str, str], needle: str) -> None:
    with pytest.raises(InvalidStorageOptions) as info:
        translate("s3://bucket/p", {}, environ=environ)
    message = str(info.value)
    assert needle in message and "leave it out for the default" in message and "\n" not in message


def test_plan_requests_coalescing_boundaries() -> None:
    from featurestore.core.storage.obstore_client import plan_requests

    def plan(ranges: list[tuple[str, int, int]], gap: int) -> list[tuple[str, int, int, list[int]]]:
        return plan_requests([r[0] for r in ranges], [r[1] for r in ranges], [r[2] for r in ranges], gap)

    # gap 0: touching and overlapping ranges merge, a one-byte hole does not
    assert plan([("a", 0, 10), ("a", 10, 20), ("a", 15, 18), ("a", 21, 30)], 0) == [
        ("a", 0, 20, [0, 1, 2]), ("a", 21, 30, [3])]
    # exactly `gap` bytes between two ranges: one request; gap + 1: two
    assert plan([("a", 0, 10), ("a", 110, 120)], 100) == [("a", 0, 120, [0, 1])]
    assert plan([("a", 0, 10), ("a", 111, 120)], 100) == [("a", 0, 10, [0]), ("a", 111, 120, [1])]
    # never across objects, whatever the gap; input order does not matter (members keep indices)
    assert plan([("b", 50, 60), ("a", 0, 10), ("b", 0, 10), ("a", 5, 6)], 1 << 20) == [
        ("b", 0, 60, [2, 0]), ("a", 0, 10, [1, 3])]
    # a chain of near ranges grows one request
    assert plan([("a", i * 300, i * 300 + 100) for i in range(5)], 200) == [("a", 0, 1300, [0, 1, 2, 3, 4])]


@pytest.mark.parametrize("options, needle", [
    ({"endpoint": "http://x", "colour": "red"}, "'colour'"),
    ({"client_kwargs": {"proxies": {}}}, "'proxies'"),
    ({"max_concurrency": 0}, "max_concurrency=0"),
    ({"max_concurrency": "many"}, "max_concurrency='many'"),
    ({"max_concurrency": True}, "max_concurrency=True"),
    ({"coalesce_gap": -1}, "coalesce_gap=-1 must be an integer >= 0"),
    ({"coalesce_gap": 1.5}, "coalesce_gap=1.5"),
    ({"retry_timeout": -1}, "retry_timeout=-1"),
    ({"key": "only-a-key"}, "both key and secret"),
])  # fmt: skip
def test_bad_options_fail_in_one_line(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidStorageOptions) as info:
        featurestore.open_store("s3://bucket/prefix", **options)
    message = str(info.value)
    assert needle in message and "s3://bucket/prefix" in message and "\n" not in message


def test_gcs_and_azure_options() -> None:
    gcs = translate("gs://b/p", {"token": "/keys/sa.json", "project": "p"}, environ={})
    assert gcs.kind == "gcs" and gcs.config == {"service_account": "/keys/sa.json"}
    assert translate("gs://b", {"token": "anon"}, environ={}).config == {"skip_signature": True}
    az = translate("az://container/p", {"account_name": "acct", "sas_token": "sv=1"}, environ={})
    assert az.kind == "azure" and az.config == {"account_name": "acct", "sas_key": "sv=1"}
    with pytest.raises(InvalidStorageOptions, match="'key'"):
        translate("az://c", {"key": "x"}, environ={})


# ---------------------------------------------------------------------- SeaweedFS
class TestSeaweedReader(ReaderContract):
    """The reader contract on the real S3 server: the obstore ranged path and, for compressed
    arrays, zarr-python's ObjectStore on the same obstore client."""

    def location(self, request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
        return request.getfixturevalue("seaweed_url"), dict(request.getfixturevalue("seaweed").storage_options)


class TestSeaweedReaderCompressed(TestSeaweedReader):
    compressor = "zstd"
    dtypes = ("float16",)


def _storage(url: str, options: dict[str, Any]) -> Any:
    from featurestore.core.storage.obstore import ObjectStorage

    return ObjectStorage(url, options)


def test_ranged_reads_coalesce_and_stay_bounded(seaweed_url: str, seaweed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import obstore

    storage = _storage(seaweed_url, {**seaweed.storage_options, "max_concurrency": 3})
    blobs = {f"obj{i}": np.random.default_rng(i).integers(0, 256, 300_000, dtype=np.uint8).tobytes() for i in range(6)}
    for key, blob in blobs.items():
        storage.write(key, blob)
    storage.gap = 0  # only touching ranges merge here; the gap merge is checked below
    in_flight = peak = calls = 0
    real = obstore.get_range_async

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal in_flight, peak, calls
        in_flight += 1
        calls += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.01)  # hold the slot so overlapping requests show
            return await real(*args, **kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(obstore, "get_range_async", counting)
    keys, starts, ends = [], [], []
    for i in range(6):
        for lo, hi in ((0, 1000), (1000, 5000), (100_000, 100_500), (200_000, 299_999), (250_000, 250_010)):
            keys.append(f"obj{i}")
            starts.append(lo)
            ends.append(hi)
    got = storage.read_ranges(keys, starts, ends)
    assert [bytes(g) for g in got] == [blobs[k][a:b] for k, a, b in zip(keys, starts, ends)]
    assert calls == 6 * 3  # adjacent and overlapping ranges of one object: one request
    assert 1 < peak <= 3  # issued together, never more than max_concurrency at once
    storage.gap = 1 << 20
    calls = 0
    assert [bytes(g) for g in storage.read_ranges(keys, starts, ends)] == [blobs[k][a:b] for k, a, b in zip(keys, starts, ends)]
    assert calls == 6  # within the gap: one request per object
    default = _storage(seaweed_url, seaweed.storage_options)
    assert default.gap == 1 << 20  # the coalesce_gap setting reaches the backend


def test_multipart_write_is_one_object(seaweed_url: str, seaweed: Any) -> None:
    storage = _storage(seaweed_url, seaweed.storage_options)
    storage.multipart_bytes, storage.part_bytes = 6 << 20, 5 << 20  # S3's smallest part size
    payload = np.random.default_rng(0).integers(0, 256, 13 << 20, dtype=np.uint8)
    storage.write("big", memoryview(payload), b"tail")
    assert storage.size("big") == payload.nbytes + 4
    assert storage.read("big") == payload.tobytes() + b"tail"
    clone = pickle.loads(pickle.dumps(storage))  # workers get a fresh client, same root
    assert bytes(clone.read_ranges(["big"], [5], [9])[0]) == payload[5:9].tobytes()


def test_missing_bucket_names_url_and_bucket(seaweed: Any) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/store"
    for mode in ("r", "a"):
        with pytest.raises(BucketNotFound) as info:
            featurestore.open_store(url, mode=mode, **seaweed.storage_options)
        message = str(info.value)
        assert url in message and "bucket 'no-such-bucket-" in message and "does not exist" in message
        assert seaweed.endpoint in message and "\n" not in message


def test_wrong_credentials_name_url_and_bucket(seaweed: Any, seaweed_url: str) -> None:
    featurestore.open_store(seaweed_url, mode="a", **seaweed.storage_options)
    bad = {**seaweed.storage_options, "secret": "not-the-secret", "max_retries": 0}
    with pytest.raises(StorageAccessDenied) as info:
        featurestore.open_store(seaweed_url, **bad)
    message = str(info.value)
    assert seaweed_url in message and "featurestore-tests" in message and "credentials" in message
    assert "not-the-secret" not in message and "\n" not in message


def test_no_credentials_at_all_says_so(seaweed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No key in the options or the environment: obstore asks the instance metadata service (here
    a closed local port), and the error says credentials are missing, not "server down"."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:1")
    with pytest.raises(StorageAccessDenied) as info:
        featurestore.open_store("s3://featurestore-tests/none", endpoint_url=seaweed.endpoint, max_retries=0)
    message = str(info.value)
    assert "no credentials" in message and "'featurestore-tests'" in message and "\n" not in message


# ---------------------------------------------------------------------- a server that goes away
def test_server_gone_mid_epoch_retries_then_one_line(tmp_path: Any) -> None:
    """moto on its own port: read a batch, stop the server, the next batch retries then fails
    with the URL and bucket in one line, within the retry budget."""
    with own_moto_bucket("gone-bucket") as (options, stop):
        url = "s3://gone-bucket/store"
        store = featurestore.open_store(url, mode="a", **options)
        writer = store.create_split("d", "e", "s", num_samples=40, sample_shape=(8,), dtype="float32", chunk_bytes=5 * 32)
        writer.write(0, np.arange(320, dtype=np.float32).reshape(40, 8))
        writer.commit()
        array = featurestore.open_store(url, **options).open("d", "e", "s")
        assert array.read_numpy([3, 1, 39]).sum() > 0
        stop()
        start = time.monotonic()
        with pytest.raises(StorageUnavailable) as info:
            array.read_numpy([5, 20, 30])
        elapsed = time.monotonic() - start
    message = str(info.value)
    assert url in message and "'gone-bucket'" in message and "2 retries" in message and "\n" not in message
    assert elapsed < 20


# ---------------------------------------------------------------------- exit after reads
_READ_AND_EXIT = """
import json, os, sys
from client.dataset import FeatureDataset
from client.loader import FeatureLoader
url, options, rounds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
# The imports (torch's: ~2 s of CPU, nearly all of a fresh reader's cost) are paid once, here,
# before any reader, event loop or tokio thread exists. Each child forked from here is its own
# program that reads and then ends as any does: SystemExit unwinds to the top, then the atexit
# hooks and Py_FinalizeEx run while the child's tokio threads may still hand results over.
failed = 0
for _ in range(rounds):
    pair = []
    for _ in range(2):  # two at a time, as two programs on one host
        pid = os.fork()
        if pid == 0:
            ds = FeatureDataset(url, "ds", "enc", "train", storage_options=options)
            rows = sum(batch[0].shape[0] if isinstance(batch, (tuple, list)) else batch.shape[0]
                       for batch in FeatureLoader(ds, batch_size=16, device="cpu", prefetch=4))
            assert rows == ds.num_samples, rows
            sys.exit(0)
        pair.append(pid)
    for pid in pair:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:
            failed += 1
            print(f"a reader ended with exit status {code}", flush=True)
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
def test_processes_that_read_from_s3_exit_cleanly(seaweed_url: str, seaweed: Any, tmp_path: Any) -> None:
    """A program that read from S3 and ends must exit 0: obstore's tokio threads hand results to
    the event loop up to the last moment, and one that takes the GIL back once the interpreter
    is finalizing aborts the process (exit 134, "Fatal Python error: Aborted"; io_loop). The race
    is narrow (a few runs in a hundred), hence many short processes, two at a time."""
    import json
    import os
    import subprocess
    import sys

    store = featurestore.open_store(seaweed_url, mode="a", **seaweed.storage_options)
    writer = store.create_split("ds", "enc", "train", num_samples=256, sample_shape=(64,), dtype="float32",
                                chunk_rows=32)
    writer.write(0, np.random.default_rng(0).random((256, 64), dtype=np.float32))
    writer.commit()
    script = tmp_path / "read_and_exit.py"
    script.write_text(_READ_AND_EXIT)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(script), seaweed_url, json.dumps(seaweed.storage_options), "20"]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    output = done.stdout.decode(errors="replace")
    failures = output.count("a reader ended with exit status")
    assert done.returncode == 0 and not failures, f"{failures} of 40 processes failed at exit:\n{output[-3000:]}"


def test_a_stopped_seaweedfs_leaves_nothing_in_tmp(tmp_path: Any) -> None:
    """Its logs go to its own directory and its unix sockets are removed when it stops (every run
    left /tmp/seaweedfs-*-PORT.sock and /tmp/weed.* behind: hundreds of files over the suites).
    Only this server's files are checked: other test workers run servers of their own meanwhile."""
    import glob

    from featurestore.testing.seaweedfs import SeaweedUnavailable, seaweed_server

    logs_before = set(glob.glob("/tmp/weed.*"))
    try:
        with seaweed_server(str(tmp_path / "weed")) as server:
            ports = [arg.split("=", 1)[1] for arg in server.process.args if ".port" in arg and "=" in arg]
            assert len(ports) >= 4, server.process.args
    except SeaweedUnavailable as exc:
        pytest.skip(f"SeaweedFS cannot run here: {exc}")
    left = [path for port in ports for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock")]
    assert not left, left
    assert not set(glob.glob("/tmp/weed.*")) - logs_before
    assert glob.glob(str(tmp_path / "weed" / "weed.*")), "its logs are in its own directory"


def test_seaweedfs_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A process running SeaweedFS through ``seaweed_server`` killed with SIGKILL (no ``finally``
    runs) takes the server with it: nothing is left holding its ports and directory."""
    import shutil

    from _orphans import outlives_sigkilled_parent

    if shutil.which("setpriv") is None:
        pytest.skip("util-linux setpriv is not installed: the server cannot be tied to its parent")
    script = ("import sys, time\nfrom featurestore.testing.seaweedfs import seaweed_server\n"
              "with seaweed_server(sys.argv[1]) as server:\n"
              "    print(server.process.pid, flush=True)\n    time.sleep(600)\n")
    try:
        weed, outlived = outlives_sigkilled_parent(script, str(tmp_path))
    except RuntimeError as error:
        if "SeaweedUnavailable" in str(error):  # as the session's fixture skips
            pytest.skip(f"SeaweedFS cannot run here: {str(error).strip().splitlines()[-1]}")
        raise
    assert not outlived, f"weed (pid {weed}) outlived the process that started it"
