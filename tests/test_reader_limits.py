"""The local reader's own limits, with real processes.

* Descriptors and memory maps stay bounded whatever the chunk count: splits of one-row chunks
  (what ``featurestore import`` makes for ``[1024, 3072]`` float16) are read in full, shuffled and
  sequentially, by ``FeatureLoader`` and by single gathers over every chunk, in a subprocess whose
  ``RLIMIT_NOFILE`` is lowered to 256; ``/proc/self/fd`` and ``/proc/self/maps`` are counted there.
  Before the shared map cache every chunk kept a map and its descriptor: ``EMFILE`` after ~250.
* A chunk file truncated in place while mapped is ``CorruptChunk`` naming the file (a 500 naming it
  over HTTP), never SIGBUS: a reader subprocess and a real ``featurestore serve`` stay alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

import featurestore
from featurestore.testing.serving import serve_subprocess

ONE_ROW = (1024,)  # float16: 2 KiB rows, one per chunk file
ONE_ROW_N = 1500  # per split; two splits, so 3000 chunk files against a limit of 256 descriptors
WIDE = (4096,)  # float16: 8 KiB rows, two pages each, so a truncated chunk's rows lie past its end


def _rows(n: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape), dtype=np.float32).astype(np.float16)


def _write(root: str, split: str, data: np.ndarray, chunk_rows: int) -> None:
    store = featurestore.open_store(root, mode="a")
    writer = store.create_split("ds", "enc", split, num_samples=len(data), sample_shape=data.shape[1:],
                                dtype="float16", chunk_rows=chunk_rows)
    writer.write(0, data)
    writer.commit()


@pytest.fixture(scope="module")
def one_row_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("limits") / "store")
    for seed, split in enumerate(("a", "b")):
        _write(root, split, _rows(ONE_ROW_N, ONE_ROW, seed), chunk_rows=1)
    return root


_BOUNDED_READER = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np
    import torch  # loaded before the baseline counts: its libraries' maps are not the reader's
    from client import FeatureDataset, FeatureLoader

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    root, n, shape = sys.argv[1], int(sys.argv[2]), (1024,)

    def counts():
        with open("/proc/self/maps") as f:
            return len(os.listdir("/proc/self/fd")), sum(1 for _ in f)

    expected = {s: np.random.default_rng(seed).standard_normal((n, *shape), dtype=np.float32).astype(np.float16)
                for seed, s in enumerate(("a", "b"))}
    datasets = {s: FeatureDataset(root, "ds", "enc", s) for s in expected}
    base = counts()
    peak = base
    for order in ("shuffle", "sequential"):
        loaders = {s: iter(FeatureLoader(ds, batch_size=16, device="cpu", order=order, seed=1, num_threads=2))
                   for s, ds in datasets.items()}
        plans = {s: [] for s in expected}
        for _ in range(-(-n // 16)):  # the two splits interleaved, as a server holding both reads them
            for s, it in loaders.items():
                features, _ = next(it)
                plans[s].append(features.numpy().astype(np.float16))  # the loader yields float32
                peak = max(peak, counts(), key=sum)
        for s, batches in plans.items():
            got = np.concatenate(batches)
            assert sorted(map(bytes, got)) == sorted(map(bytes, expected[s])), (order, s)
    for s, ds in datasets.items():  # one gather over every chunk file of the split
        assert np.array_equal(ds.array.read_numpy(np.arange(n)[::-1]), expected[s][::-1])
        peak = max(peak, counts(), key=sum)
    print(json.dumps({"base": base, "end": counts(), "peak": peak}))
""")


@pytest.mark.parametrize("local_read", ["auto", "mmap", "pread"])
def test_descriptors_and_maps_stay_bounded_over_thousands_of_one_row_chunks(one_row_store: str, local_read: str) -> None:
    env = {**os.environ, "FEATURESTORE_LOCAL_READ": local_read}
    done = subprocess.run([sys.executable, "-c", _BOUNDED_READER, one_row_store, str(ONE_ROW_N)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    (base_fds, base_maps), (end_fds, end_maps), (peak_fds, peak_maps) = counts["base"], counts["end"], counts["peak"]
    # A quarter of the 256 descriptors for maps, a quarter for pread gathers (open_files); a few
    # more for the read threads' and the loaders' own needs. Without a bound: thousands.
    assert end_fds - base_fds <= 64 + 8 and peak_fds - base_fds <= 128 + 16, counts
    assert end_maps - base_maps <= 64 + 64 and peak_maps - base_maps <= 128 + 64, counts


@pytest.fixture
def wide_store(tmp_path: Any) -> str:
    root = str(tmp_path / "store")
    _write(root, "w", _rows(16, WIDE, 7), chunk_rows=4)
    return root


def _chunk_file(root: str, chunk: int) -> str:
    return os.path.join(root, "ds", "enc", "w", "features", "c", str(chunk), "0")


_TRUNCATED_READER = textwrap.dedent("""
    import sys
    import numpy as np
    import featurestore
    from featurestore.errors import CorruptChunk

    arr = featurestore.open_store(sys.argv[1]).open("ds", "enc", "w")
    arr.read_numpy([2, 3])  # chunk 0, pages 2-3 of its file: mapped (and found page-cached)
    print("mapped", flush=True)
    sys.stdin.readline()  # the chunk file is truncated in place now, under the live map
    try:
        arr.read_numpy([3, 2])
    except CorruptChunk as error:
        print("CorruptChunk:", error, flush=True)
    print("other chunk ok", bool(np.isfinite(arr.read_numpy([5, 12]).astype(np.float32)).all()), flush=True)
""")


@pytest.mark.parametrize("local_read", ["auto", "mmap"])
def test_chunk_truncated_under_a_live_map_is_corrupt_chunk_not_sigbus(wide_store: str, local_read: str) -> None:
    env = {**os.environ, "FEATURESTORE_LOCAL_READ": local_read}
    proc = subprocess.Popen([sys.executable, "-c", _TRUNCATED_READER, wide_store], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "mapped"
        victim = _chunk_file(wide_store, 0)
        os.truncate(victim, 100)  # in place: the same inode, now shorter than the map
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (proc.returncode, err[-3000:])  # SIGBUS: -7 (a shell says 135)
    assert f"CorruptChunk: chunk file {victim} has 100 bytes" in out, out
    assert "other chunk ok True" in out


@pytest.fixture
def served(wide_store: str, request: pytest.FixtureRequest) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with serve_subprocess(wide_store, env={"FEATURESTORE_LOCAL_READ": request.param}) as running:
        yield running


@pytest.mark.parametrize("served", ["auto", "mmap"], indirect=True)
def test_server_answers_500_naming_a_chunk_truncated_under_its_map_and_stays_up(
        wide_store: str, served: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, proc = served
    item = f"{url}/v1/features/ds/enc/w/items/3"
    assert httpx.get(item, timeout=30).status_code == 200  # chunk 0 mapped by the server
    victim = _chunk_file(wide_store, 0)
    os.truncate(victim, 100)
    for _ in range(2):  # and again: the damaged chunk is not served later either
        answer = httpx.get(item, timeout=30)
        assert answer.status_code == 500 and answer.json()["error"] == "CorruptChunk", answer.text
        # Named relative to the store: error bodies never show the server's own paths.
        detail = answer.json()["detail"]
        assert os.path.relpath(victim, wide_store) in detail and wide_store not in detail, detail
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200 and proc.poll() is None
    assert httpx.get(f"{url}/v1/features/ds/enc/w/items/9", timeout=30).status_code == 200
