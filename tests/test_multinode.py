"""Two "nodes" on loopback: two separate ``torchrun --nnodes 2`` launches meeting at a c10d
rendezvous, each with its own chunk cache directory, against SeaweedFS over s3://.

* ``featurestore extract`` into one split, of images and of slides: the chunks are the bytes a
  single process writes.
* ``examples/ddp_abmil.py``: DDP ABMIL from s3:// through the chunk cache; each rank sees its
  shard of bags, the shards of an epoch are disjoint and cover every bag, and the ranks end with
  the same weights.
* Two bag writer sessions committing on s3:// with a chunk cache configured (core, no torchrun).

Each test with two torchrun launches takes tens of seconds on a small machine: marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_extract import cli_env

import featurestore
from featurestore.testing.seaweedfs import free_ports
from featurestore.core.storage import LocalStorage
from featurestore.core.storage.obstore import ObjectStorage
from featurestore.demo.synthetic import make_synthetic_pannuke
from featurestore.extract.dist import Coordinator
from featurestore.extract.run import ExtractOptions, extract

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ("pannuke", "logged_tiny_vit", "fold1")


def two_nodes(args: list[str], tmp_path: Path, env: dict[str, str], timeout: float = 300) -> list[str]:
    """Run ``args`` under two torchrun launches (one process each) that rendezvous over c10d on a
    free loopback port, as two machines would; node i caches chunks in ``tmp_path/node{i}-cache``.
    Returns each launch's stdout; fails with both stderr tails when either exits non-zero."""
    port = free_ports(1)[0]
    run_id = uuid.uuid4().hex[:8]
    procs, logs = [], []
    for node in range(2):
        cache = tmp_path / f"node{node}-cache"
        cache.mkdir()
        # Output to files, not pipes: a launch blocked on a full pipe would stall the other at
        # its next collective. A new session per launch, so a hang can be killed whole.
        out, err = (tmp_path / f"node{node}.out").open("w+"), (tmp_path / f"node{node}.err").open("w+")
        logs.append((out, err))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, *args],
            env={**env, "FEATURESTORE_CACHE_DIR": str(cache)}, stdout=out, stderr=err, text=True,
            start_new_session=True))
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outputs = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        outputs.append((out.read(), err.read()))
        out.close()
        err.close()
    assert all(proc.returncode == 0 for proc in procs), "\n---\n".join(err[-2500:] for _, err in outputs)
    return [stdout for stdout, _ in outputs]


@pytest.mark.slow
def test_two_node_extraction_into_s3_equals_one_process(seaweed_url: str, seaweed: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.delenv("FSX_LOG", raising=False)
    monkeypatch.delenv("FSX_SLEEP", raising=False)
    fold = make_synthetic_pannuke(tmp_path / "fold", 14, size=32, seed=5)
    chunk_mb = 3 * 4 * 128 * 2 / 2**20  # a few samples per chunk: several chunks for each rank
    single = tmp_path / "single"
    # torchrun gives each rank one torch thread; the reference must sum floats the same way.
    extract(ExtractOptions(images=f"pannuke:{fold}", encoder="python:test_extract:logged_tiny_vit",
                           store=str(single), dataset=SPLIT[0], split=SPLIT[2], batch_size=2,
                           chunk_mb=chunk_mb, num_workers=0, progress=False, threads=1), Coordinator())

    log = tmp_path / "encoded.log"
    options = dict(seaweed.storage_options)
    stdouts = two_nodes(
        ["--module", "featurestore.cli", "extract", "--images", f"pannuke:{fold}",
         "--encoder", "python:test_extract:logged_tiny_vit", "--store", seaweed_url, "--dataset", SPLIT[0],
         "--split", SPLIT[2], "--batch-size", "2", "--num-workers", "0", "--chunk-mb", str(chunk_mb)],
        tmp_path, cli_env(FSX_LOG=str(log), FEATURESTORE_STORAGE_OPTIONS=json.dumps(options)))
    # One report (global rank 0's, on whichever node it landed); each sample encoded once over the
    # two nodes (plus one probe sample per rank).
    assert sum(out.count("extracted pannuke/") for out in stdouts) == 1
    assert sum(int(n) for n in log.read_text().split()) == 14 + 2

    a = featurestore.open_store(str(single)).open(*SPLIT)
    b = featurestore.open_store(seaweed_url, mode="r", **options).open(*SPLIT)
    idx = np.arange(14)
    assert b.metadata["status"] == "complete"
    assert a.labels is not None and b.labels is not None
    assert np.array_equal(a.labels.read_numpy(idx), b.labels.read_numpy(idx))
    for field in ("quantization", "channel_stats", "cache_key", "encoder", "chunk_rows"):
        assert a.metadata[field] == b.metadata[field], field
    remote = ObjectStorage(seaweed_url, options)
    # chunk_stats rows end with the split's own generation seal, and chunk_seals rows carry it,
    # so both differ between any two splits: the stats' fold (quantization, channel_stats) is
    # compared above, the seals' places and crc32c values below.
    chunks = sorted(p for p in (single / Path(*SPLIT)).rglob("*")
                    if p.is_file() and "c" in p.parts and not {"chunk_stats", "chunk_seals"} & set(p.parts))
    from featurestore.core.seals import read_table

    seals_a = read_table(LocalStorage(str(single)), "/".join(SPLIT))
    seals_b = read_table(remote, "/".join(SPLIT))
    assert seals_a is not None and seals_b is not None
    assert np.array_equal(seals_a[:, :3], seals_b[:, :3])  # array, chunk, crc32c; not the generation
    rows = a.metadata["chunk_rows"]
    assert len([p for p in chunks if "features" in p.parts]) == -(-14 // rows) >= 4
    for path in chunks:  # every features, labels and ids chunk, byte for byte
        key = path.relative_to(single).as_posix()
        assert remote.read(key) == path.read_bytes(), key



def download(remote: ObjectStorage, prefix: str, dest: Path) -> None:
    """Copy every object under ``prefix`` to ``dest`` (a local store to compare file by file)."""
    for name in remote.listdir(prefix):
        key = f"{prefix}/{name}" if prefix else name
        if remote.listdir(key):
            download(remote, key, dest / name)
            continue
        try:
            data = remote.read(key)
        except FileNotFoundError:
            continue  # SeaweedFS lists the directories of deleted objects (the committed segments)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)


def test_two_writer_sessions_commit_a_bag_split_on_s3_with_a_chunk_cache(seaweed_url: str, seaweed: Any,
                                                                           tmp_path: Path) -> None:
    """Two writers of one bag split (two ranks, on two nodes) with a chunk cache configured, as
    ``FEATURESTORE_CACHE_DIR`` on a node sets it: the commit copies the rows of bags interleaved
    between the segments and reads them back exactly. It used to read the segments through the
    chunk cache, which wants a split's metadata, and failed with "segments/... is not a
    featurestore split"."""
    options = {**seaweed.storage_options, "cache_dir": str(tmp_path / "cache")}
    store = featurestore.open_store(seaweed_url, mode="a", **options)
    rng = np.random.default_rng(0)
    bags = {f"b{i}": rng.standard_normal((int(rng.integers(3, 20)), 4)).astype(np.float32) for i in range(6)}
    first = store.create_bag_split("d", "e", "s", dim=4, dtype="float32", chunk_bytes=8 * 4 * 4)
    second = store.create_bag_split("d", "e", "s", dim=4, dtype="float32", chunk_bytes=8 * 4 * 4, resume=True)
    for i, (bag_id, features) in enumerate(bags.items()):  # b0, b2, b4 in one segment, the others in the other
        (first if i % 2 == 0 else second).add_bag(bag_id, features, coords=np.zeros((len(features), 2), np.int64))
    second.close()
    first.commit()
    split = featurestore.open_store(seaweed_url, mode="r", **options).open_bags("d", "e", "s")
    assert list(split.ids) == sorted(bags)
    for i, bag_id in enumerate(split.ids):
        assert np.array_equal(split.read_numpy(bag_id)[0], bags[bag_id]), bag_id


@pytest.mark.slow
def test_two_node_slide_extraction_into_s3_equals_one_process(seaweed_url: str, seaweed: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Slide i goes to global rank i % 2, whichever node holds it: the bag split is one process's."""
    pytest.importorskip("openslide")
    pytest.importorskip("tifffile")
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.delenv("FSX_SLEEP", raising=False)
    from test_wsi_extract import _common, _opts, _same_split

    from featurestore.demo.slides import write_cohort, write_slide
    from featurestore.extract.wsi_run import extract_slides

    cohort = tmp_path / "cohort"
    write_cohort(cohort, 2, width=2048, height=1536, mpp=0.5)
    write_slide(cohort / "blank.tiff", width=1024, height=768, blobs=0)  # an empty bag
    reference = tmp_path / "reference"
    assert extract_slides(_opts(cohort, reference), Coordinator()).status == "complete"

    options = dict(seaweed.storage_options)
    stdouts = two_nodes(["--module", "featurestore.cli", "extract", *_common(cohort), "--store", seaweed_url,
                         "--num-workers", "0", "--storage-options", json.dumps(options)], tmp_path, cli_env())
    assert sum(out.count("extracted cohort/") for out in stdouts) == 1
    assert sum("3 bags of 3 slides" in out for out in stdouts) == 1
    copy = tmp_path / "copy"
    download(ObjectStorage(seaweed_url, options), "", copy)
    _same_split(reference, copy)  # every file, byte for byte (the generation seals masked), and metadata


NUM_BAGS, DIM = 10, 8


def write_bags(url: str, options: dict[str, Any]) -> dict[str, int]:
    rng = np.random.default_rng(3)
    writer = featurestore.open_store(url, mode="a", **options).create_bag_split(
        "cohort", "enc", "all", dim=DIM, dtype="float16", chunk_bytes=16 * DIM * 2)  # bags span chunks
    labels = {}
    for i in range(NUM_BAGS):
        n = int(rng.integers(5, 40))
        labels[f"slide-{i:02d}"] = i % 2
        features = rng.standard_normal((n, DIM)).astype(np.float32) + (i % 2)
        writer.add_bag(f"slide-{i:02d}", features, coords=rng.integers(0, 9999, (n, 2)), label=i % 2)
    writer.commit()
    return labels


@pytest.mark.slow
def test_ddp_abmil_over_two_nodes_shards_bags_and_agrees(seaweed_url: str, seaweed: Any, tmp_path: Path) -> None:
    options = dict(seaweed.storage_options)
    labels = write_bags(seaweed_url, options)
    ids_dir, save = tmp_path / "ids", tmp_path / "weights"
    ids_dir.mkdir()
    save.mkdir()
    epochs = 2
    stdouts = two_nodes(
        [str(ROOT / "examples" / "ddp_abmil.py"), seaweed_url, "cohort", "enc", "all", "--epochs", str(epochs),
         "--ids-dir", str(ids_dir), "--save", str(save), "--storage-options", json.dumps(options)],
        tmp_path, cli_env())

    summaries = sorted((json.loads(out.strip().splitlines()[-1]) for out in stdouts), key=lambda s: s["rank"])
    assert [s["rank"] for s in summaries] == [0, 1] and all(s["world_size"] == 2 for s in summaries)
    assert all(s["finite"] and len(s["losses"]) == epochs for s in summaries)
    orders = []
    for epoch in range(epochs):
        seen = [(ids_dir / f"rank{r}-epoch{epoch}.txt").read_text().split() for r in range(2)]
        assert all(len(s) == NUM_BAGS // 2 for s in seen)  # each rank its equal shard
        assert not set(seen[0]) & set(seen[1])  # disjoint
        assert sorted(seen[0] + seen[1]) == sorted(labels)  # every bag once per epoch
        orders.append(seen[0] + seen[1])
    assert orders[0] != orders[1]  # shuffled anew each epoch
    weights = [torch.load(save / f"rank{r}.pt") for r in range(2)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    # Each node read through its own chunk cache: both hold features chunks.
    for node in range(2):
        cached = [p for p in (tmp_path / f"node{node}-cache").rglob("*")
                  if p.is_file() and p.parent.name == "features" and not p.name.endswith(".lock")]
        assert cached, node


def test_ddp_abmil_takes_the_task_from_a_table_and_refuses_a_split_without_labels(tmp_path: Path) -> None:
    """A bag split without labels (slides extracted from WSIs): the example trains on the slides a
    clinical table labels, each rank its share of them; without a table it stops in one line."""
    from _dist_helpers import torchrun

    store = tmp_path / "store"
    writer = featurestore.open_store(str(store), mode="a").create_bag_split("cohort", "enc", "all", dim=DIM)
    rng = np.random.default_rng(0)
    for i in range(NUM_BAGS):
        writer.add_bag(f"slide-{i:02d}", rng.standard_normal((5 + i, DIM)).astype(np.float32),
                       coords=rng.integers(0, 9999, (5 + i, 2)))
    writer.commit()
    listed = [f"slide-{i:02d}" for i in range(NUM_BAGS - 2)]  # two slides the table leaves out
    table = tmp_path / "clinical.csv"
    table.write_text("slide_id,subtype\n" + "".join(f"{s},{'AB'[k % 2]}\n" for k, s in enumerate(listed)))
    script = str(ROOT / "examples" / "ddp_abmil.py")
    ids = tmp_path / "ids" / "new"  # made by the script
    done = torchrun(script, str(store), "cohort", "enc", "all", "--epochs", "1", "--labels", str(table),
                    "--label-column", "subtype", "--ids-dir", str(ids), env=cli_env())
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [(ids / f"rank{r}-epoch0.txt").read_text().split() for r in range(2)]
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == listed
    bare = torchrun(script, str(store), "cohort", "enc", "all", "--epochs", "1", env=cli_env())
    errors = [line for line in bare.stderr.splitlines() if line.startswith("ddp_abmil.py: error:")]
    assert bare.returncode != 0 and errors and "has no labels" in errors[0] and "--labels CSV" in errors[0], bare.stderr
