"""``--worker``: independent processes claim a split's slides on the store (core.claims,
extract.workers_share), against real servers (SeaweedFS, moto) and real processes (SIGKILL,
SIGSTOP past the lease)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from _seaweed_restart import restartable_seaweed
from test_bags_import import trident_dir
from test_extract import cli_env, run_cli

from featurestore.core import claims
from featurestore.core.storage import LocalStorage
from featurestore.errors import ConditionalWritesUnsupported
from featurestore.extract.encoders import TinyViT
from featurestore.format import bags as bag_format
from featurestore.format import chunks

NAME = ("ds", "enc", "train")
CALLS = "FSW_CALLS"  # the file the logging encoder appends a line to per call


class _Logged(TinyViT):
    """tiny-vit that appends a line per call to $FSW_CALLS (its pid, then a digest of each patch
    but the padding rows, constant in each channel), then sleeps $FSW_SLEEP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.detach().float().cpu().numpy()
        flat = rows.reshape(len(rows), rows.shape[1], -1)
        padding = (flat.min(axis=2) == flat.max(axis=2)).all(axis=1)  # zero images, normalised
        digests = [hashlib.sha256(r.tobytes()).hexdigest()[:16] for r, pad in zip(rows, padding) if not pad]
        with open(os.environ[CALLS], "a") as f:
            f.write(f"{os.getpid()} {len(x)} {','.join(digests) or '-'}\n")
        time.sleep(float(os.environ.get("FSW_SLEEP", "0")))
        return super().forward(x)


def logged_vit() -> torch.nn.Module:
    return _Logged()


def other_vit() -> torch.nn.Module:
    """Another encoder: tiny-vit with other weights (so another cache key)."""
    module = TinyViT()
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1.5)
    return module


# ----------------------------------------------------------------------------- helpers
def _store_args(url: str, options: dict[str, Any] | None) -> list[str]:
    return ["--store", url, *(["--storage-options", json.dumps(options)] if options else [])]


def _import_cmd(source: Path, url: str, options: dict[str, Any] | None, *extra: str) -> list[str]:
    return [sys.executable, "-m", "featurestore.cli", "import", str(source), *_store_args(url, options),
            "--dataset", NAME[0], "--encoder-name", NAME[1], "--split", NAME[2], "--no-progress",
            "--chunk-mb", str(16 * 16 * 2 / 2**20), *extra]


def _source_and_reference(tmp_path: Path, lengths: dict[str, int]) -> Path:
    """A TRIDENT directory of bags of ``lengths`` at ``tmp_path/src``, and its one-process import
    at ``tmp_path/single`` (what the workers' split must equal)."""
    source = tmp_path / "src"
    trident_dir(source, lengths)
    single = run_cli(*_import_cmd(source, str(tmp_path / "single"), None)[3:], timeout=240)
    assert single.returncode == 0, single.stderr
    return source


def _wsi_cmd(cohort: Path, url: str, options: dict[str, Any] | None, *extra: str,
             encoder: str = "python:test_workers:logged_vit") -> list[str]:
    return [sys.executable, "-m", "featurestore.cli", "extract", "--images", f"wsi:{cohort}", "--encoder", encoder,
            "--encoder-name", NAME[1], *_store_args(url, options), "--dataset", NAME[0], "--split", NAME[2],
            "--patch-size", "64", "--batch-size", "128", "--threads", "1", "--num-workers", "0",
            "--chunk-mb", str(16 * 128 * 2 / 2**20), "--no-progress", *extra]


# ``python -c`` in place of ``-m featurestore.cli``: the CLI with every claimed slide 0.5 s slower
# (``FS_SLIDE_SECONDS``), the claim held meanwhile.
_SLOW_SLIDES = """
import os, sys, time
from featurestore.extract.workers_share import ClaimShare
one = ClaimShare._one
ClaimShare._one = lambda self, *args: (time.sleep(float(os.environ.get("FS_SLIDE_SECONDS", "0.5"))),
                                       one(self, *args))[1]
from featurestore.cli import main
sys.exit(main())
"""


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen[bytes], log: Path, timeout: float = 240) -> str:
    rc = proc.wait(timeout=timeout)
    text = log.read_text()
    assert rc in (0, 3), text
    return text


# Sealed with the split's generation (random per creation): they differ between any two runs.
_GENERATION_SEALED = ("/bag_stats/", "/chunk_seals/")


def _split_files(storage: Any, key: str) -> dict[str, bytes]:
    """Every object of a committed split but its zarr.json (which holds times and a generation)
    and the generation-sealed arrays."""
    out: dict[str, bytes] = {}

    def walk(prefix: str) -> None:
        for name in storage.listdir(prefix):
            path = f"{prefix}/{name}"
            if storage.listdir(path):
                walk(path)
            elif name != "zarr.json":
                if any(sealed in path for sealed in _GENERATION_SEALED):
                    continue
                try:
                    out[path[len(key):]] = bytes(storage.read(path))
                except FileNotFoundError:  # SeaweedFS lists a removed prefix's empty directory
                    continue

    walk(key)
    return out


def _assert_same_split(got: Any, want: Any, key: str) -> None:
    """Every object of the one-process split ``want`` (but its zarr.json and the generation-sealed
    arrays) has the same bytes in ``got``, read by name; and ``got`` has no other bags."""
    wanted = _split_files(want, key)
    differ = [k for k, v in wanted.items() if bytes(got.read(key + k)) != v]
    assert differ == []
    assert json.loads(got.read(f"{key}/zarr.json"))["attributes"]["featurestore"]["bags"]["count"] == \
        json.loads(want.read(f"{key}/zarr.json"))["attributes"]["featurestore"]["bags"]["count"]


def _storage(url: str, options: dict[str, Any] | None) -> Any:
    from featurestore.core.storage import open_storage

    return open_storage(url, options or {})


def _calls(path: Path) -> list[tuple[int, list[str]]]:
    """(pid, patch digests) of each encoder call, but the white patch every process starts with."""
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(p), d.split(",")) for p, n, d in rows if int(n) > 1 and d != "-"]


def _bag_ids_in_segments(storage: Any, key: str) -> list[str]:
    """Every bag record in every segment (a bag added twice appears twice)."""
    ids = []
    base = f"{key}/{bag_format.SEGMENTS}"
    for segment in storage.listdir(base):
        if segment.startswith("."):
            continue
        for index in storage.listdir(f"{base}/{segment}/{bag_format.RECORDS}/c"):
            raw = storage.read(f"{base}/{segment}/{bag_format.RECORDS}/c/{index}")
            assert chunks.check(raw, None) is None
            ids += [r.bag_id for r in bag_format.decode_records(raw[:-4])[1]]
    return ids


# ----------------------------------------------------------------------------- the primitive
@pytest.mark.parametrize("backend", ["local", "seaweedfs", "moto"])
def test_conditional_writes_enforced(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if backend == "local":
        storage: Any = LocalStorage(str(tmp_path))
    elif backend == "seaweedfs":
        storage = _storage(request.getfixturevalue("seaweed_url"), request.getfixturevalue("seaweed").storage_options)
    else:
        from featurestore.core.storage.obstore import ObjectStorage

        bucket = request.getfixturevalue("s3_bucket")
        storage = ObjectStorage(f"s3://{bucket}/x", dict(request.getfixturevalue("s3_storage_options")))
    first = storage.put_if_absent("c/a.json", b"one")
    assert first is not None and storage.put_if_absent("c/a.json", b"two") is None
    data, token = storage.read_versioned("c/a.json")
    assert data == b"one" and token == first
    second = storage.replace_if("c/a.json", b"three", token)
    assert second is not None and second != token
    assert storage.replace_if("c/a.json", b"four", token) is None  # a stale token loses
    assert storage.read_versioned("c/a.json")[0] == b"three"
    claims.probe(storage, "split")  # the probe passes on a server that enforces them


def test_the_probe_refuses_a_server_that_ignores_if_match(tmp_path: Path) -> None:
    """It tested create-if-absent only: behind a server ignoring If-Match, a worker frozen past its
    lease renewed a slide another had taken over and encoded it again."""
    class IgnoresIfMatch(LocalStorage):
        def replace_if(self, key: str, data: bytes, token: Any) -> Any:
            self.write(key, data)
            return self.read_versioned(key)[1]

    with pytest.raises(ConditionalWritesUnsupported, match="stale version .*ignores If-Match"):
        claims.probe(IgnoresIfMatch(str(tmp_path)), "split")


def test_two_takers_of_an_expired_claim_one_wins(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    a = claims.ClaimBoard(storage, "s", lease=1, max_attempts=3, worker=claims.WorkerId(pid=1))
    b = claims.ClaimBoard(storage, "s", lease=1, max_attempts=3, worker=claims.WorkerId(pid=2))
    c = claims.ClaimBoard(storage, "s", lease=1, max_attempts=3, worker=claims.WorkerId(pid=3))
    held, _ = a.claim("x")
    assert held is not None and b.claim("x")[0] is None
    time.sleep(1.2)  # a's lease runs out
    # b and c both read the same expired record; only the first replace can win.
    _, token = storage.read_versioned("s/segments/.claims/x.json")
    won_b, _ = b.claim("x")
    assert won_b is not None and won_b.record["taken_from"] == a.worker.name
    assert storage.replace_if("s/segments/.claims/x.json", b"{}", token) is None
    assert c.claim("x")[0] is None
    assert not a.renew(held)  # the stale holder cannot renew



def test_ids_that_start_with_an_underscore_or_are_long_have_claims_of_their_own(tmp_path: Path) -> None:
    """A slide "_junk" was claimed under a name read as the run's own objects (never seen as
    claimed: a skipped one blocked the commit), and an id of 32 CJK characters made a claim name
    too long for the file system (every worker died on it)."""
    storage = LocalStorage(str(tmp_path))
    board = claims.ClaimBoard(storage, "s", lease=60, max_attempts=3)
    units = ["_junk", "病理切片" * 8, "x" * 300, "plain", "%%not-a-hash"]
    for unit in units:
        held, _ = board.claim(unit)
        assert held is not None, unit
        assert board.finish(held)
    assert sorted(claims.read_records(storage, "s")) == sorted(units)
    assert all(r["state"] == claims.DONE for r in claims.read_records(storage, "s").values())
    assert board.claim("_junk")[0] is None  # the same object: taken


def test_a_committer_that_died_never_makes_the_commit_step_failed(tmp_path: Path) -> None:
    """`featurestore commit` (max_attempts 1) after the committing worker's lease ran out recorded
    the _commit step "failed", and nothing could ever commit the split; a step is taken over."""
    storage = LocalStorage(str(tmp_path))
    dead = claims.ClaimBoard(storage, "s", lease=0.2, max_attempts=1, worker=claims.WorkerId(pid=1))
    assert dead.claim("_commit", special=True)[0] is not None
    time.sleep(0.3)  # its lease runs out
    command = claims.ClaimBoard(storage, "s", lease=120, max_attempts=1, worker=claims.WorkerId(pid=2))
    held, _ = command.claim("_commit", special=True)
    assert held is not None and held.record["taken_from"] == dead.worker.name
    # one an older version recorded failed is taken over too
    storage.write(claims.special_key("s", "_commit"), json.dumps({"unit": "_commit", "state": claims.FAILED}).encode())
    assert claims.ClaimBoard(storage, "s", lease=120, max_attempts=1).claim("_commit", special=True)[0] is not None


def test_worker_refused_where_conditional_writes_are_missing(tmp_path: Path) -> None:
    source = tmp_path / "src"
    trident_dir(source, {"a": 3, "b": 4})
    proc = subprocess.run(_import_cmd(source, "memory://fsw-none", None, "--worker"), env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "create-if-absent" in lines[0], proc.stderr
    with pytest.raises(ConditionalWritesUnsupported):
        from featurestore.core.storage import open_storage

        claims.probe(open_storage("memory://fsw-none2"), "s")


# ----------------------------------------------------------------------------- imports
def _kill_holding_a_claim(worker: subprocess.Popen[bytes], storage: Any, key: str, timeout: float = 120) -> str:
    """SIGKILL ``worker`` while it holds a slide's claim; return that slide. The worker is frozen
    (SIGSTOP) first and its claim read back while it cannot move: a claim seen a moment earlier
    may be finished by the time a kill lands. Fails when the run ends before such a moment."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert worker.poll() is None, "the worker ended before it could be killed holding a claim"
        records = claims.read_records(storage, key) if storage.size(f"{key}/zarr.json") else {}
        if any(r.get("pid") == worker.pid and r.get("state") == claims.WORKING for r in records.values()):
            worker.send_signal(signal.SIGSTOP)
            held = [unit for unit, r in claims.read_records(storage, key).items()
                    if r.get("pid") == worker.pid and r.get("state") == claims.WORKING]
            if held:
                worker.send_signal(signal.SIGKILL)
                worker.wait()
                return held[0]
            worker.send_signal(signal.SIGCONT)  # it finished that slide meanwhile: look again
        time.sleep(0.02)
    raise AssertionError(f"the worker held no claim within {timeout} s")


def test_import_workers_killed_and_late_match_one_process(tmp_path: Path, seaweed: Any, seaweed_url: str) -> None:
    source = _source_and_reference(tmp_path, {f"s{i:02d}": 20 + 7 * i for i in range(24)})
    options = dict(seaweed.storage_options)
    env = cli_env()
    cmd = _import_cmd(source, seaweed_url, options, "--worker", "--lease-seconds", "3")
    w1 = _start(cmd, env, tmp_path / "w1.log")
    w2 = _start(cmd, env, tmp_path / "w2.log")
    storage = _storage(seaweed_url, options)
    key = "/".join(NAME)
    held = _kill_holding_a_claim(w1, storage, key)  # its slide's claim outlives it, for its lease
    w3 = _start(cmd, env, tmp_path / "w3.log")  # started late
    outs = [_wait(w2, tmp_path / "w2.log"), _wait(w3, tmp_path / "w3.log")]
    assert sum("imported ds/enc/train: 24 bags" in o for o in outs) == 1, outs  # exactly one commit
    _assert_same_split(storage, LocalStorage(str(tmp_path / "single")), key)
    # Each worker's log has a line per slide it did: together, every slide once (the killed
    # worker's slide by whoever took it over; only a bag it completed just before the kill is in
    # no log, its taker finding it complete).
    done = re.findall(r"featurestore worker \S+: slide '(s\d\d)' done \(",
                      (tmp_path / "w1.log").read_text() + "".join(outs))
    assert len(done) == len(set(done)) and set(done) >= {f"s{i:02d}" for i in range(24)} - {held}, done


# ----------------------------------------------------------------------------- slides
@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("openslide")
    from featurestore.demo.slides import write_cohort

    root = tmp_path_factory.mktemp("fsw-cohort")
    write_cohort(root, 5, width=768, height=512, mpp=0.5)
    return root


def test_extract_workers_killed_mid_slide_and_late(tmp_path: Path, cohort: Path, seaweed: Any,
                                                   seaweed_url: str) -> None:
    options = dict(seaweed.storage_options)
    calls = tmp_path / "calls.txt"
    env = cli_env(**{CALLS: str(calls), "FSW_SLEEP": "1.5"})
    single = run_cli(*_wsi_cmd(cohort, str(tmp_path / "single"), None)[3:],
                     env=cli_env(**{CALLS: str(tmp_path / "single-calls.txt")}), timeout=300)
    assert single.returncode == 0, single.stdout + single.stderr
    patches = [d for _, ds in _calls(tmp_path / "single-calls.txt") for d in ds]
    assert len(patches) > 5
    cmd = _wsi_cmd(cohort, seaweed_url, options, "--worker", "--lease-seconds", "4")
    w1 = _start(cmd, env, tmp_path / "w1.log")
    w2 = _start(cmd, env, tmp_path / "w2.log")
    deadline = time.time() + 180
    while time.time() < deadline and not any(p == w1.pid for p, _ in _calls(calls)):
        time.sleep(0.05)
    w1.send_signal(signal.SIGKILL)  # mid-slide: its encoder call has begun and sleeps
    w1.wait()
    w3 = _start(cmd, env, tmp_path / "w3.log")
    outs = [_wait(w2, tmp_path / "w2.log", 300), _wait(w3, tmp_path / "w3.log", 300)]
    assert sum("extracted ds/enc/train" in o for o in outs) == 1, outs  # exactly one commit
    storage = _storage(seaweed_url, options)
    key = "/".join(NAME)
    _assert_same_split(storage, LocalStorage(str(tmp_path / "single")), key)
    made = _calls(calls)
    encoded = Counter(d for _, ds in made for d in ds)
    killed = [Counter(ds) for p, ds in made if p == w1.pid]
    assert len(killed) == 1  # (killed inside its first slide)
    # Every patch of the cohort encoded once (patches may repeat in a synthetic slide: counted as
    # many times as one process encodes them), but the killed worker's in-flight slide twice.
    assert not Counter(patches) - encoded
    assert not (encoded - Counter(patches)) - killed[0]


def test_sigstop_past_lease_adds_no_second_copy(tmp_path: Path, cohort: Path, seaweed: Any, seaweed_url: str) -> None:
    options = dict(seaweed.storage_options)
    calls = tmp_path / "calls.txt"
    env = cli_env(**{CALLS: str(calls), "FSW_SLEEP": "1"})
    cmd = _wsi_cmd(cohort, seaweed_url, options, "--worker", "--lease-seconds", "3", "--no-commit")
    w1 = _start(cmd, env, tmp_path / "w1.log")
    deadline = time.time() + 180
    while time.time() < deadline and not _calls(calls):
        assert w1.poll() is None, "the worker ended before its first encoder call"
        time.sleep(0.02)
    assert _calls(calls), "the worker made no encoder call within 180 s"
    w1.send_signal(signal.SIGSTOP)  # inside its first slide's encoder call
    time.sleep(4.5)  # past the lease
    w2 = _start(cmd, env, tmp_path / "w2.log")
    _wait(w2, tmp_path / "w2.log", 300)  # it takes the stopped worker's slide over and does them all
    w1.send_signal(signal.SIGCONT)
    _wait(w1, tmp_path / "w1.log", 120)
    storage = _storage(seaweed_url, options)
    key = "/".join(NAME)
    ids = _bag_ids_in_segments(storage, key)
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 5, ids
    status = subprocess.run([sys.executable, "-m", "featurestore.cli", "status", seaweed_url, *NAME,
                             "--storage-options", json.dumps(options)], env=env, capture_output=True, text=True)
    assert "slides done 5, claimed 0, failed 0, left 0 (of 5)" in status.stdout, status.stdout + status.stderr
    commit = subprocess.run([sys.executable, "-m", "featurestore.cli", "commit", seaweed_url, *NAME,
                             "--storage-options", json.dumps(options)], env=env, capture_output=True, text=True)
    assert commit.returncode == 0 and "committed ds/enc/train: 5 bags" in commit.stdout, commit.stderr


def test_other_encoder_spec_refused_in_one_line(tmp_path: Path, cohort: Path) -> None:
    store = tmp_path / "store"
    env = cli_env(**{CALLS: str(tmp_path / "calls.txt")})
    first = run_cli(*_wsi_cmd(cohort, str(store), None, "--worker", "--no-commit", "--limit", "1")[3:], env=env,
                    timeout=300)
    assert first.returncode == 0, first.stderr
    other = run_cli(*_wsi_cmd(cohort, str(store), None, "--worker", "--limit", "1",
                              encoder="python:test_workers:other_vit")[3:], env=env, timeout=300)
    assert other.returncode != 0
    lines = other.stderr.strip().splitlines()
    assert len(lines) == 1 and "cache key" in lines[0].lower(), other.stderr


def test_failing_slide_recorded_failed_after_k_attempts(tmp_path: Path) -> None:
    source = tmp_path / "src"
    data = trident_dir(source, {"a": 30, "b": 30, "c": 30})
    # A file whose header reads but whose rows do not: garbage in one gzip chunk fails its inflate.
    bad = source / "b.h5"
    with h5py.File(bad, "w") as f:
        f.create_dataset("features", data=data["b"][0], chunks=(1, 16), compression="gzip")
        f["coords"] = data["b"][1]
    with h5py.File(bad, "r") as f:
        info = f["features"].id.get_chunk_info(15)
    raw = bytearray(bad.read_bytes())
    raw[info.byte_offset : info.byte_offset + info.size] = b"\xff" * info.size
    bad.write_bytes(bytes(raw))
    store = tmp_path / "store"
    proc = run_cli(*_import_cmd(source, str(store), None, "--worker", "--max-attempts", "2")[3:], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("slide 'b' failed") == 2, proc.stdout
    import featurestore

    meta = featurestore.open_store(str(store)).split_info(*NAME)
    assert meta.complete and [f["id"] for f in meta.extra["failed"]] == ["b"]
    assert meta.extra["failed"][0]["attempts"] == 2
    assert featurestore.open_store(str(store)).open_bags(*NAME).ids == ["a", "c"]
    np.testing.assert_equal(len(meta.extra["failed"][0]["errors"]), 2)
    # A late worker (an array task, a requeue) and a plain re-run find the split complete: its
    # failed slide is left out on purpose, not missing (they were refused as "two runs at once")
    for extra in (("--worker",), ()):
        again = run_cli(*_import_cmd(source, str(store), None, *extra)[3:], timeout=240)
        assert again.returncode == 0 and "lacks" not in again.stderr, again.stdout + again.stderr


def test_object_server_restarted_mid_run_workers_retry_and_finish(tmp_path: Path) -> None:
    """SeaweedFS stopped (SIGTERM) while two workers import, started again on the same ports and
    directory a few seconds later: the workers wait it out and the split is whole."""
    from featurestore.testing import stop_process

    source = _source_and_reference(tmp_path, {f"s{i:02d}": 20 + i for i in range(16)})
    with restartable_seaweed(tmp_path) as (server, restart):
        server.create_bucket("fsw-restart")
        url, options = "s3://fsw-restart/store", dict(server.storage_options)
        storage = _storage(url, options)
        key = "/".join(NAME)
        # two workers with short leases; the server goes while they are mid-run
        cmd = _import_cmd(source, url, options, "--worker", "--lease-seconds", "6", "--debug")
        # Each slide takes 0.5 s, as a real one takes seconds: a worker that started first cannot
        # import all 16 before the other has claimed one, however slow the machine starts either.
        cmd[1:3] = ["-c", _SLOW_SLIDES]
        workers = [_start(cmd, cli_env(), tmp_path / f"w{i}.log") for i in range(2)]
        # Stopped once a slide is done and both workers hold claims: both are mid-run (a worker
        # still starting meets the outage at its first open of the store: tests/test_workers_outage.py).
        deadline = time.time() + 120
        while time.time() < deadline:
            records = claims.read_records(storage, key) if storage.size(f"{key}/zarr.json") else {}
            if (any(r.get("state") == claims.DONE for r in records.values())
                    and {w.pid for w in workers} <= {r.get("pid") for r in records.values()}):
                break
            assert all(w.poll() is None for w in workers), "a worker ended before the server was stopped"
            time.sleep(0.05)
        else:
            raise AssertionError("the two workers were not both mid-run within 120 s")
        stop_process(server.process, grace=5)
        time.sleep(3)
        restart()
        outs = [_wait(w, tmp_path / f"w{i}.log", 300) for i, w in enumerate(workers)]
        assert sum("imported ds/enc/train: 16 bags" in o for o in outs) == 1, outs
        assert any("storage unavailable" in o for o in outs), outs  # the outage was met, and waited out
        _assert_same_split(storage, LocalStorage(str(tmp_path / "single")), key)


def test_status_and_web_page_show_a_split_being_written(tmp_path: Path) -> None:
    """Two slides done by a worker that ran with --no-commit, one held by a worker that died (its
    lease not yet out), one failed: `featurestore status` and the split's web page say so."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from server import Settings, create_app

    source = tmp_path / "src"
    trident_dir(source, {"a": 5, "b": 6, "c": 7, "d": 8})
    store = tmp_path / "store"
    key = "/".join(NAME)
    storage = LocalStorage(str(store))
    # A worker elsewhere holds "c" (live lease), and "d" failed its attempts: the worker below does a and b.
    board = claims.ClaimBoard(storage, key, lease=600, max_attempts=1, worker=claims.WorkerId(host="node7", pid=42))
    held, _ = board.claim("c")
    failed, _ = board.claim("d")
    assert held is not None and failed is not None and board.fail(failed, "corrupt") == claims.FAILED
    proc = subprocess.Popen(_import_cmd(source, str(store), None, "--worker", "--no-commit"), env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    done = lambda: sum(r.get("state") == claims.DONE for r in claims.read_records(storage, key).values())  # noqa: E731
    while time.time() < deadline and done() < 2:
        time.sleep(0.1)
    proc.kill()  # it would wait for "c" to be done
    proc.wait()
    status = run_cli("status", str(store), *NAME)
    assert status.returncode == 0, status.stderr
    assert "slides done 2, claimed 1, failed 1, left 1 (of 4)" in status.stdout, status.stdout
    assert "claimed 'c' by node7 pid 42" in status.stdout and "failed: d" in status.stdout
    refused = run_cli("commit", str(store), *NAME)
    assert refused.returncode != 0 and "still claimed by live workers" in refused.stderr
    with TestClient(create_app(str(store), Settings())) as client:
        page = client.get("/ui/splits/" + key)
    assert page.status_code == 200
    assert "slides done 2, claimed 1, failed 1, left 1" in page.text and "node7" in page.text


def test_a_worker_logs_each_slide_it_did_and_why_one_was_skipped(tmp_path: Path) -> None:
    """One worker on a local store: its log has the attach line, a line per slide, and for a file
    that is not a slide, that it was skipped and why (the run then exits 3, as without --worker)."""
    pytest.importorskip("openslide")
    from featurestore.demo.slides import write_cohort

    cohort = tmp_path / "cohort"
    write_cohort(cohort, 2, width=768, height=512, mpp=0.5)
    (cohort / "junk.svs").write_text("not a slide")
    done = run_cli(*_wsi_cmd(cohort, str(tmp_path / "store"), None, "--worker")[3:],
                   env=cli_env(**{CALLS: str(tmp_path / "calls.txt")}), timeout=240)
    assert done.returncode == 3, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("featurestore worker ")]
    assert lines[0].endswith(f": split {'/'.join(NAME)}, 3 slides, 0 done before, 3 to share"), lines
    slides = {line.split(": slide ")[1].split(" ")[0]: line.split(": slide ")[1] for line in lines[1:]}
    assert sorted(slides) == ["'junk'", "'slide-000'", "'slide-001'"], lines
    assert slides["'junk'"].startswith("'junk' skipped: ") and "is not a slide OpenSlide can read" in slides["'junk'"]
    assert slides["'slide-000'"].startswith("'slide-000' done (")
    # The skipped slide has no bag by design: the worker commits (it used to wait for that bag,
    # retrying as if the store listed too little, until its patience ran out)
    assert "storage unavailable" not in done.stdout and "extracted ds/enc/train: 2 bags of 3 slides" in done.stdout
    from featurestore import open_store

    assert [s["id"] for s in open_store(str(tmp_path / "store")).split_metadata(*NAME)["skipped"]] == ["junk"]
    status = run_cli("status", str(tmp_path / "store"), *NAME, env=cli_env())
    assert status.stdout.strip() == f"split {'/'.join(NAME)}: complete, 2 bags, 1 skipped: junk", status.stdout
    # Before a commit (--no-commit), status counts the skipped slide among the done ones, and says so
    held = run_cli(*_wsi_cmd(cohort, str(tmp_path / "held"), None, "--worker", "--no-commit")[3:],
                   env=cli_env(**{CALLS: str(tmp_path / "calls.txt")}), timeout=240)
    assert held.returncode == 0, held.stdout + held.stderr
    status = run_cli("status", str(tmp_path / "held"), *NAME, env=cli_env())
    assert "slides done 3 (1 skipped), claimed 0, failed 0, left 0 (of 3)" in status.stdout, status.stdout
    from fastapi.testclient import TestClient  # and the split's web page

    from server import Settings, create_app

    with TestClient(create_app(str(tmp_path / "held"), Settings())) as client:
        assert "slides done 3 (1 skipped), claimed 0" in client.get("/ui/splits/" + "/".join(NAME)).text
    commit = run_cli("commit", str(tmp_path / "held"), *NAME, env=cli_env())
    assert commit.stdout.strip() == f"committed {'/'.join(NAME)}: 2 bags, 1 skipped: junk", commit.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_worker_gives_its_slide_back_at_once_uncounted(tmp_path: Path, signum: int) -> None:
    """A spot instance reclaimed, a preempted job, a pod's end: SIGTERM (or Ctrl-C) mid-slide. The
    worker gives the slide back (not counted as an attempt) and exits 128 + the signal; the next
    worker takes it at once, not after the 600 s lease, and the split is the one-process import's."""
    source = _source_and_reference(tmp_path, {f"s{i}": 10 + i for i in range(4)})
    store, key = tmp_path / "store", "/".join(NAME)
    cmd = _import_cmd(source, str(store), None, "--worker", "--lease-seconds", "600")
    slow = [*cmd[:1], "-c", _SLOW_SLIDES, *cmd[3:]]
    worker = _start(slow, {**cli_env(), "FS_SLIDE_SECONDS": "60"}, tmp_path / "stopped.log")
    deadline = time.time() + 120
    while time.time() < deadline and not any(
            r.get("pid") == worker.pid and r.get("state") == claims.WORKING
            for r in claims.read_records(LocalStorage(str(store)), key).values()):
        assert worker.poll() is None, (tmp_path / "stopped.log").read_text()
        time.sleep(0.1)
    worker.send_signal(signum)
    assert worker.wait(timeout=30) == 128 + signum
    log = (tmp_path / "stopped.log").read_text()
    assert f"stopped by {signal.Signals(signum).name}; slide 's0' given back" in log, log
    record = claims.read_records(LocalStorage(str(store)), key)["s0"]
    assert record["state"] == claims.RELEASED and record["attempts"] == 0, record
    status = run_cli("status", str(store), *NAME, timeout=60)
    assert "given back by stopped workers, for the next worker: s0" in status.stdout, status.stdout
    done = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "imported ds/enc/train: 4 bags" in done.stdout, done.stdout + done.stderr
    _assert_same_split(LocalStorage(str(store)), LocalStorage(str(tmp_path / "single")), key)


def test_a_signal_inside_a_claim_write_is_raised_when_the_write_is_over() -> None:
    """A claim record's write is never cut in two: a SIGTERM inside ``deferred()`` is noted and
    raised once the block ends, once; the previous handlers come back."""
    from featurestore.errors import Stopped
    from featurestore.extract.worker_stop import StopOnSignal

    before = signal.getsignal(signal.SIGTERM)
    steps: list[str] = []
    with pytest.raises(Stopped) as stopped:
        with StopOnSignal() as stop:
            with stop.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler has run by now: noted only
                steps.append("write whole")
            steps.append("not reached")
    assert steps == ["write whole"] and stopped.value.signum == signal.SIGTERM and stop.received == signal.SIGTERM
    stop.check()  # raised once: the clean-up after it runs undisturbed
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_time_to_finish_counts_from_the_runs_first_claim(tmp_path: Path) -> None:
    """Three workers started together finish their first slides within milliseconds: the pace
    between the first and last slide done said 0 s to finish with 21 of 24 left."""
    from featurestore.core.claim_status import progress

    storage = LocalStorage(str(tmp_path))
    for i in range(3):
        board = claims.ClaimBoard(storage, "s", lease=120, max_attempts=3, worker=claims.WorkerId(pid=i + 1))
        held, _ = board.claim(f"slide{i}")
        assert held is not None and board.finish(held)
    start = min(r["claimed"] for r in claims.read_records(storage, "s").values())
    eta = progress(storage, "s", 24, now=start + 30.0)["eta_seconds"]  # 3 done in 30 s: 21 left take 210 s
    assert eta is not None and abs(eta - 210.0) < 1.0, eta


def test_status_of_a_split_a_plain_run_left_counts_what_is_on_storage(tmp_path: Path) -> None:
    """An interrupted plain import said "slides done 0 ... left 24; 0 worker(s) seen" with all 24
    bags on storage (status read claims only); a dense split got slides and workers too."""
    from featurestore import open_store

    store = open_store(str(tmp_path), mode="a")
    bags = store.create_bag_split("d", "e", "b", dim=4)
    for i in range(3):
        bags.add_bag(f"s{i}", np.ones((2, 4), np.float32))
    bags.close()
    dense = store.create_split("d", "e", "x", num_samples=8, sample_shape=(4,), dtype="float16", chunk_rows=2)
    dense.write(0, np.zeros((4, 4), np.float32))
    dense.close()
    got = run_cli("status", str(tmp_path), "d", "e", "b", env=cli_env())
    assert got.returncode == 0 and "writing; 3 bag(s) complete on storage; no --worker claims" in got.stdout, got
    got = run_cli("status", str(tmp_path), "d", "e", "x", env=cli_env())
    assert got.returncode == 0 and "writing; 2 of 4 chunks on storage (2 samples each)" in got.stdout, got
