"""``--worker``: independent processes claim a split's slides on the store (core.claims,
extract.workers_share), against real servers (SeaweedFS, moto) and real processes (SIGKILL,
SIGSTOP past the lease).

This module: the claim primitive (conditional writes enforced on local storage, SeaweedFS and moto;
expired claims taken over by one worker only; claim names; a store without conditional writes
refused), and the helpers the other ``test_workers_*`` modules import. Runs killed, stopped or
whose server restarts: tests/test_workers_interrupted.py; slide extraction by workers:
tests/test_workers_slides.py; what status, the web page and failures report:
tests/test_workers_status.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
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
    # The records read back together (status, a commit's failed slides), whatever buffers the backend hands back.
    board = claims.ClaimBoard(storage, "split", lease=600, max_attempts=3)
    for unit in ("b", "a"):
        assert board.claim(unit)[0] is not None
    records = claims.read_records(storage, "split")
    assert sorted(records) == ["a", "b"] and all(r["state"] == claims.WORKING for r in records.values())


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


def test_a_claim_whose_worker_was_killed_on_this_machine_is_free_at_once(tmp_path: Path) -> None:
    """A worker SIGKILLed (or OOM-killed) left its slide claimed for its whole lease (minutes) even
    where the next worker runs in the same pid namespace and can see the process is gone. A
    record from another namespace (another machine or container) still waits for its lease."""
    storage = LocalStorage(str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from featurestore.core import claims\n"
        "from featurestore.core.storage import LocalStorage\n"
        f"board = claims.ClaimBoard(LocalStorage({str(tmp_path)!r}), 's', lease=600, max_attempts=3)\n"
        "assert board.claim('slide-1')[0] is not None\n"
        "print('claimed', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True, env=cli_env())
    assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
    board = claims.ClaimBoard(storage, "s", lease=600, max_attempts=3)
    taken, record = board.claim("slide-1")
    assert taken is None and record is not None and record["pid"] == holder.pid  # alive: held
    assert record["pid_space"] is not None and record["pid_space"] == board.worker.pid_space
    holder.kill()
    holder.wait()  # reaped: a zombie still answers kill(pid, 0)
    key = "s/segments/.claims/slide-1.json"
    elsewhere = {**json.loads(storage.read(key)), "pid_space": "another-boot/4026531836"}
    storage.write(key, json.dumps(elsewhere).encode())
    assert board.claim("slide-1")[0] is None  # the same dead pid in another namespace: its lease decides
    storage.write(key, json.dumps({**elsewhere, "pid_space": record["pid_space"]}).encode())
    taken, _ = board.claim("slide-1")
    assert taken is not None and taken.record["attempts"] == 2 and taken.record["taken_from"] == record["worker"]
    assert taken.record["errors"] == [f"{record['worker']}: its process {holder.pid} is gone"]
    # An id naming another process (a test's, a record's) vouches for no namespace.
    assert claims.WorkerId(pid=holder.pid).pid_space is None and claims.WorkerId(host="node7").pid_space is None


def test_an_idle_worker_looks_again_less_and_less_often() -> None:
    """At the end of a run every idle worker asked for every slide another still held every 2 s
    (W workers: ~W * W * 3 requests each time); now 2 s, growing by half per idle pass up to a third
    of the lease, jittered so the workers' passes spread out."""
    from featurestore.extract.workers_share import idle_wait

    waits = [[idle_wait(idle, 120.0) for _ in range(50)] for idle in range(1, 12)]
    assert 1.5 <= min(waits[0]) and max(waits[0]) <= 2.0  # the first idle pass as before
    assert all(min(later) > max(earlier) * 0.99 for earlier, later in zip(waits[:4], waits[1:5]))  # grows
    assert max(waits[-1]) <= 40.0 and min(waits[-1]) >= 30.0  # a third of the lease at most
    assert len({round(w, 6) for w in waits[3]}) > 1  # jittered
    assert max(idle_wait(5, 0.3) for _ in range(20)) <= 0.1  # a short lease keeps its short wait
