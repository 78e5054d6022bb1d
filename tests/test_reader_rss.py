"""The process's RSS (VmRSS: anonymous + mapped file pages, what ``top``, SLURM and Kubernetes
count) stays bounded while the mmap gather reads a split several times larger than the bound of
mapped chunk bytes (``FEATURESTORE_MAPPED_MIB``): bags read whole and dense rows read in order,
and shuffled, page-cached, in a fresh process whose peak (``VmHWM``, reset at the baseline) is read
after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import featurestore
from featurestore.core import chunk_maps, map_budget
from featurestore.errors import InvalidOption

DIM = 1024  # float16: 2 KiB rows
BAGS, BAG_ROWS = 16, 1536  # 3 MiB per bag, 48 MiB in all
BOUND_MIB, SLACK_MIB = 8, 16

_READER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import featurestore

    def status():
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) << 10 for k, _, v in (line.partition(":") for line in f)
                    if k in ("VmRSS", "VmHWM")}

    root = sys.argv[1]
    for d, _, files in os.walk(root):  # page-cached, so reads take the mmap gather
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                while f.read(1 << 22):
                    pass
    store = featurestore.open_store(root)
    bags = store.open_bags("ds", "enc", "bags")
    dense = store.open("ds", "enc", "dense")
    out = np.empty((int(bags.lengths.max()), bags.dim), np.float16)
    batch = np.empty((512, *dense.sample_shape), np.float16)
    out.fill(0), batch.fill(0)  # faulted in before the baseline
    shuffled = np.random.default_rng(0).permutation(len(dense))
    base = status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    for _ in range(2):
        for i in range(len(bags)):
            n = int(bags.lengths[i])
            bags.read_numpy(i, out=out[:n])
        for start in range(0, len(dense) - 511, 512):
            dense.read_numpy(np.arange(start, start + 512), out=batch)
        for start in range(0, len(dense) - 63, 64):  # shuffled small rows: pread, as the bound is set
            dense.read_numpy(shuffled[start:start + 64], out=batch[:64])
    print(json.dumps({"growth": status()["VmHWM"] - base, "bags_mmap": bags.features.read_counts["mmap"],
                      "dense_mmap": dense.read_counts["mmap"]}))
""")


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("rss") / "store")
    store = featurestore.open_store(root, mode="a")
    rng = np.random.default_rng(0)
    block = rng.standard_normal((BAG_ROWS, DIM)).astype(np.float16)
    writer = store.create_bag_split("ds", "enc", "bags", dim=DIM, chunk_bytes=2 << 20)
    for i in range(BAGS):
        writer.add_bag(f"slide-{i}", block + np.float16(i), coords=np.zeros((BAG_ROWS, 2), np.int64))
    writer.commit()
    dense = store.create_split("ds", "enc", "dense", num_samples=BAGS * BAG_ROWS, sample_shape=(DIM,),
                               chunk_bytes=2 << 20)
    for i in range(BAGS):
        dense.write(i * BAG_ROWS, block + np.float16(i))
    dense.commit()
    return root


@pytest.mark.parametrize("local_read", ["auto", "mmap"])
def test_rss_stays_within_the_mapped_bound_over_a_split_six_times_larger(store_root: str, local_read: str) -> None:
    # Checked reads (off here) lease up to 64 MiB of anonymous buffers on a chunk's first read,
    # bounded on their own: this measures what the maps add.
    env = {**os.environ, "FEATURESTORE_MAPPED_MIB": str(BOUND_MIB), "FEATURESTORE_LOCAL_READ": local_read,
           "FEATURESTORE_VERIFY_READS": "off"}
    done = subprocess.run([sys.executable, "-c", _READER, store_root], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bags_mmap"] > 0 and result["dense_mmap"] > 0, result  # the mapped path was the one read
    assert result["growth"] <= (BOUND_MIB + SLACK_MIB) << 20, (
        f"VmRSS grew by {result['growth'] / 2**20:.0f} MiB reading two splits of "
        f"{BAGS * BAG_ROWS * DIM * 2 / 2**20:.0f} MiB twice, page-cached, under FEATURESTORE_MAPPED_MIB={BOUND_MIB}")


# The default mode (no FEATURESTORE_MAPPED_MIB), its budget made small so that a small split is
# many times larger than it; the store page-cached.
_SMALL_BUDGET = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import featurestore
    from featurestore.core import chunk_maps, open_files

    chunk_maps._SHARED = chunk_maps.ChunkMaps(open_files.max_maps(), 1 << 40, int(sys.argv[2]) << 20)
    root = sys.argv[1]
    for d, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                while f.read(1 << 22):
                    pass
""")


def _small_budget_run(script: str, root: str, **env: str) -> dict[str, int]:
    """``script`` (one of the ``_SMALL_BUDGET`` ones) in a fresh process over ``root``: its JSON."""
    done = subprocess.run([sys.executable, "-c", script, root, str(BOUND_MIB)],
                          env={**{k: v for k, v in os.environ.items() if k != "FEATURESTORE_MAPPED_MIB"}, **env},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_DEFAULT_MODE = _SMALL_BUDGET + textwrap.dedent("""
    bags = featurestore.open_store(root).open_bags("ds", "enc", "straddling")
    out = np.empty((int(bags.lengths.max()), bags.dim), np.float16)
    out.fill(0)
    order = np.random.default_rng(1).permutation(len(bags))
    base = int([line for line in open("/proc/self/status") if line.startswith("VmRSS")][0].split()[1]) << 10
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for i in order.tolist():  # a fresh process: each chunk's first read checked, the rest from the maps
        bags.read_numpy(i, out=out[: int(bags.lengths[i])])
    peak = int([line for line in open("/proc/self/status") if line.startswith("VmHWM")][0].split()[1]) << 10
    print(json.dumps({"growth": peak - base, "bags_mmap": bags.features.read_counts["mmap"]}))
""")


def test_bags_across_chunk_bounds_stay_within_the_default_bound(tmp_path: Path) -> None:
    """Bags of 1.4 MiB in 2 MiB chunks, most straddling two chunks, read once each in shuffled order
    with the first-read check on (what a BagLoader epoch does): every piece the maps copy is counted,
    so the peak stays near the bound. Counted as scattered rows before, they kept ~all of the split
    mapped in a fresh process's first epoch."""
    root = str(tmp_path / "store")
    rows = 700  # 1.4 MiB: less than half a folio per chunk when split across two
    writer = featurestore.open_store(root, mode="a").create_bag_split("ds", "enc", "straddling", dim=DIM,
                                                                      chunk_bytes=2 << 20)
    block = np.random.default_rng(0).standard_normal((rows, DIM)).astype(np.float16)
    for i in range(64):  # 90 MiB
        writer.add_bag(f"slide-{i:02d}", block + np.float16(i % 7))
    writer.commit()
    result = _small_budget_run(_DEFAULT_MODE, root)
    assert result["bags_mmap"] > 0, result
    assert result["growth"] <= (BOUND_MIB + SLACK_MIB) << 20, (
        f"VmRSS grew by {result['growth'] / 2**20:.0f} MiB reading 90 MiB of bags once under a bound of {BOUND_MIB} MiB")


def test_mapped_budget_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEATURESTORE_MAPPED_MIB", "1.5")
    assert map_budget.resident_budget() == 3 << 19
    monkeypatch.delenv("FEATURESTORE_MAPPED_MIB")
    assert map_budget.resident_budget() == map_budget.DEFAULT_MAPPED_MIB << 20
    monkeypatch.setenv("FEATURESTORE_MAPPED_MIB", "Unbounded")  # an earlier setting: the default now, said so
    with pytest.warns(FutureWarning, match="FEATURESTORE_MAPPED_MIB=Unbounded no longer changes reads"):
        assert map_budget.resident_budget() == map_budget.DEFAULT_MAPPED_MIB << 20
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv("FEATURESTORE_MAPPED_MIB", bad)
        with pytest.raises(InvalidOption, match="FEATURESTORE_MAPPED_MIB"):
            map_budget.resident_budget()


_SHUFFLED = _SMALL_BUDGET + textwrap.dedent("""
    dense = featurestore.open_store(root).open("ds", "enc", "wide")
    batch = np.zeros((64, *dense.sample_shape), np.float16)
    order = np.random.default_rng(2).permutation(len(dense))
    dense.read_numpy(order[:64], out=batch)  # the first-read checks (whole chunks, counted) before the baseline
    base = int([line for line in open("/proc/self/status") if line.startswith("VmRSS")][0].split()[1]) << 10
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    wrong = 0
    for start in range(0, len(order) - 63, 64):
        rows = order[start:start + 64]
        dense.read_numpy(rows, out=batch)
        wrong += int((batch[:, 0, 0] != (rows % 1000).astype(np.float16)).sum())
    peak = int([line for line in open("/proc/self/status") if line.startswith("VmHWM")][0].split()[1]) << 10
    print(json.dumps({"growth": peak - base, "mmap": dense.read_counts["mmap"], "wrong": wrong}))
""")


def _numbered_split(tmp_path: Path, n: int, tokens: int) -> str:
    """A float16 split ds/enc/wide of ``n`` samples [tokens, DIM] in 2 MiB chunks, each sample's
    first value its own number (mod 1000), as _SHUFFLED checks; the store's root."""
    root = str(tmp_path / "store")
    writer = featurestore.open_store(root, mode="a").create_split("ds", "enc", "wide", num_samples=n,
                                                                  sample_shape=(tokens, DIM), chunk_bytes=2 << 20)
    step = max(1, (10 << 20) // (tokens * DIM * 4))
    block = np.zeros((step, tokens, DIM), np.float32)
    for start in range(0, n, step):
        rows = min(step, n - start)
        block[:rows, 0, 0] = np.arange(start, start + rows) % 1000  # each row says which it is
        writer.write(start, block[:rows])
    writer.commit()
    return root


def test_shuffled_wide_rows_add_nothing_to_rss_by_default(tmp_path: Path) -> None:
    """Shuffled 64 KiB rows (FeatureLoader's batches of [32, 1024] float16 samples) from a split
    eleven times the bound, page-cached, default mode: read through the maps' descriptors, they map
    nothing in, so the process's peak RSS stays near the bound. Copied out of the maps uncounted
    before, they left the whole split mapped in (~90 MiB here)."""
    root = _numbered_split(tmp_path, 1440, 32)  # 90 MiB
    result = _small_budget_run(_SHUFFLED, root)
    assert result["mmap"] > 0 and result["wrong"] == 0, result
    assert result["growth"] <= (BOUND_MIB + SLACK_MIB) << 20, (
        f"VmRSS grew by {result['growth'] / 2**20:.0f} MiB over a shuffled epoch of a 90 MiB split, bound {BOUND_MIB} MiB")


def test_shuffled_small_rows_add_nothing_to_rss_by_default(tmp_path: Path) -> None:
    """Shuffled 2 KiB rows (embeddings, class tokens: a linear probe's split) from a split eleven
    times the bound: mapped, they left the whole split in RSS (a walk: 2.0 GB of a 2 GB split);
    read through descriptors, the peak stays near the bound."""
    root = _numbered_split(tmp_path, 45_000, 1)  # 90 MiB of [1024] float16 rows
    result = _small_budget_run(_SHUFFLED, root)
    assert result["mmap"] > 0 and result["wrong"] == 0, result
    assert result["growth"] <= (BOUND_MIB + SLACK_MIB) << 20, (
        f"VmRSS grew by {result['growth'] / 2**20:.0f} MiB, bound {BOUND_MIB}")


def test_large_rows_past_the_budget_are_read_through_descriptors(tmp_path: Path) -> None:
    """Rows of DIRECT_ROW or more, shuffled or in runs, from an array past the budget: a preadv each
    (a map's copy paid the release and mapping back of its pages: 1.4x slower warm). Long runs of
    small rows (a bag) are not scattered: they are read a run at a time (the test after next); an
    array within the budget keeps its maps."""
    budget, big = chunk_maps.shared().max_resident, map_budget.DIRECT_ROW
    assert map_budget.scattered(64 * big, 60, 8 << 20, 4 * budget, budget, runs=64, rows=64)
    assert map_budget.scattered(64 * big, 8, 8 << 20, 4 * budget, budget, runs=8, rows=64)  # in runs too
    assert not map_budget.scattered(64 * big, 8, 8 << 20, 4 * budget, budget, runs=8, rows=64 * big // 2048)
    assert not map_budget.scattered(64 * big, 60, 8 << 20, budget // 2, budget, runs=64, rows=64)
    root = _numbered_split(tmp_path, 180, 256)  # 90 MiB of 512 KiB rows
    result = _small_budget_run(_SHUFFLED, root)
    assert result["mmap"] > 0 and result["wrong"] == 0, result
    assert result["growth"] <= (BOUND_MIB + SLACK_MIB) << 20, result


def test_a_range_of_large_rows_past_the_budget_is_not_copied_out_of_the_maps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequential read of 512 KiB rows (a loader in order, read_range) from an array past a 1 MiB
    budget: through descriptors too (1.3x the maps' copy, warm), the same values."""
    from featurestore.core import open_files

    root = _numbered_split(tmp_path, 40, 256)  # 20 MiB of 512 KiB rows
    for path in Path(root).rglob("*"):
        if path.is_file():
            path.read_bytes()  # page-cached: the mmap gather
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(open_files.max_maps(), 1 << 40, 1 << 20))
    copied: list[int] = []
    copy = chunk_maps.ArrayMaps._copy
    monkeypatch.setattr(chunk_maps.ArrayMaps, "_copy",
                        lambda self, runs, rows, populate: copied.append(len(runs)) or copy(self, runs, rows, populate))
    dense = featurestore.open_store(root).open("ds", "enc", "wide")
    dense.read_numpy(np.arange(len(dense)))  # the first-read checks
    copied.clear()
    got = dense.read_numpy(np.arange(8, 24))
    assert got[:, 0, 0].tolist() == list(range(8, 24)) and dense.read_counts["mmap"] > 0
    assert copied == []


def test_long_runs_of_small_rows_past_the_budget_are_read_a_run_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole bags and row ranges of 2 KiB rows from arrays past a 1 MiB budget: a ``preadv`` per
    piece of each run, not a copy out of the maps (which mapped the pages back in after each
    release: 11 GB/s against 17 for 8 MiB chunks, warm), over chunk bounds and pieces shared with
    helpers; the same values, and a chunk truncated in place is refused by name."""
    from featurestore.core import descriptor_reads, open_files
    from featurestore.errors import CorruptChunk

    root = _numbered_split(tmp_path, 3000, 1)  # 6 MiB of 2 KiB rows in 2 MiB chunks
    writer = featurestore.open_store(root, mode="a").create_bag_split("ds", "enc", "bags", dim=DIM,
                                                                      chunk_bytes=2 << 20)
    rng = np.random.default_rng(0)
    written = [rng.standard_normal((n, DIM)).astype(np.float16) for n in (700, 1500, 90, 2100)]
    for i, block in enumerate(written):
        writer.add_bag(f"slide-{i}", block)
    writer.commit()
    for path in Path(root).rglob("*"):
        if path.is_file():
            path.read_bytes()  # page-cached: the mmap gather
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(open_files.max_maps(), 1 << 40, 1 << 20))
    monkeypatch.setattr(descriptor_reads, "PIECE_BYTES", 64 << 10)  # several pieces a run
    monkeypatch.setattr(descriptor_reads, "cores", lambda: 3)
    copied: list[int] = []
    copy = chunk_maps.ArrayMaps._copy
    monkeypatch.setattr(chunk_maps.ArrayMaps, "_copy",
                        lambda self, runs, rows, populate: copied.append(self._shape[1]) or copy(self, runs, rows, populate))
    dense = featurestore.open_store(root).open("ds", "enc", "wide")
    bags = featurestore.open_store(root).open_bags("ds", "enc", "bags")
    dense.read_numpy(np.arange(len(dense)))  # the first-read checks
    for i in range(len(written)):
        bags.read_numpy(i)
    copied.clear()
    got = dense.read_numpy(np.arange(500, 2900))  # over two chunk bounds
    assert got[:, 0, 0].tolist() == (np.arange(500, 2900) % 1000).astype(np.float16).tolist()
    for i, block in enumerate(written):
        assert np.array_equal(bags.read_numpy(i)[0], block)
    # Only the coords (16-byte rows, an array within the budget) are copied out of their maps.
    assert dense.read_counts["mmap"] > 0 and copied and DIM * 2 not in copied, copied
    chunk = sorted(Path(root, "ds", "enc", "wide").rglob("c/*/0/0"))[1]
    os.truncate(chunk, 4096)
    with pytest.raises(CorruptChunk, match=str(chunk)):
        dense.read_numpy(np.arange(500, 2900))


def test_a_file_truncated_under_a_descriptor_read_is_refused_by_name(tmp_path: Path) -> None:
    """A read through a map's descriptor of a file truncated in place since it was mapped names the
    file (a copy out of the map would have raised SIGBUS); a descriptor is only ever opened on the
    file that was mapped, as it was mapped."""
    from featurestore.core.mapped_file import map_file, open_descriptor, read_into
    from featurestore.errors import CorruptChunk

    path = str(tmp_path / "chunk")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 64)

    def check_size(where: str, size: int) -> None:
        if size != 256 * 64:
            raise CorruptChunk(f"chunk file {where} has {size} bytes")

    entry = map_file(path, (64, 256), check_size, populate=False)
    descriptor = open_descriptor(entry)
    assert descriptor is not None
    target = np.empty(256, np.uint8)
    read_into(descriptor, target, 256 * 3, path, check_size)
    assert bytes(target) == bytes(range(256))
    os.truncate(path, 256 * 2)
    with pytest.raises(CorruptChunk, match="chunk file .*chunk has 512 bytes"):
        read_into(descriptor, target, 256 * 3, path, check_size)
    assert open_descriptor(entry) is None  # no longer the size it was mapped with: copied from the map
    os.replace(path, str(tmp_path / "old"))
    with open(path, "wb") as f:  # another file at the same path, of the mapped size
        f.write(bytes(256 * 64))
    os.truncate(str(tmp_path / "old"), 256 * 64)
    assert open_descriptor(entry) is None  # another inode: never read for the mapped one
    entry.close()
    assert open_descriptor(entry) is None


def test_descriptors_for_reads_count_against_the_maps_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each map read through a descriptor holds one more: maps and those descriptors together
    stay within ``max_descriptors``, whatever the chunk count, and the rows are right."""
    root = str(tmp_path / "store")
    n = 640  # 40 chunks of 16 rows of 64 KiB
    writer = featurestore.open_store(root, mode="a").create_split("ds", "enc", "wide", num_samples=n,
                                                                  sample_shape=(32, DIM), chunk_bytes=1 << 20)
    values = np.zeros((n, 32, DIM), np.float32)
    values[:, 0, 0] = np.arange(n)
    writer.write(0, values)
    writer.commit()
    monkeypatch.setattr(chunk_maps, "_SHARED", chunk_maps.ChunkMaps(64, 1 << 40, 1 << 20, max_descriptors=8))
    maps = chunk_maps.shared()
    dense = featurestore.open_store(root).open("ds", "enc", "wide")
    dense.verify_reads = "off"
    order = np.random.default_rng(3).permutation(n)
    for start in range(0, n, 16):
        got = dense.read_numpy(order[start:start + 16])
        assert np.array_equal(got[:, 0, 0].astype(np.int64), order[start:start + 16])
        assert len(maps) + maps._descriptors <= 8, (len(maps), maps._descriptors)
    assert dense.read_counts["mmap"] > 0 and maps._descriptors > 0
    maps.clear()


def test_a_replaced_file_is_asked_for_a_descriptor_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A map whose file was replaced since (a resume rewrote the chunk) cannot be read through a
    descriptor: its rows come out of the map, and the open is not retried on every later read."""
    from featurestore.core import mapped_file

    path = str(tmp_path / "chunk")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 64)
    maps = chunk_maps.ChunkMaps(8, 1 << 30)
    entry, _ = maps.entry("a", 0, lambda _: path, shape=(64, 256), check_size=lambda *_: None, populate=False)
    os.replace(path, str(tmp_path / "old"))
    with open(path, "wb") as f:
        f.write(bytes(256 * 64))
    opened: list[object] = []
    real = mapped_file.open_descriptor
    monkeypatch.setattr(chunk_maps, "open_descriptor", lambda e: opened.append(e) or real(e))
    assert [maps.descriptor(entry) for _ in range(5)] == [None] * 5 and len(opened) == 1
    assert maps._descriptors == 0
    maps.clear()
