"""The run template every extraction and import shares (extract.dist_run): the units a process
does come from its UnitShare, not from the loop; and extract's modules import one another
without circles (lazy imports included)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

import featurestore
from featurestore.errors import MissingChunks
from featurestore.extract.bag_import import BagImport
from featurestore.extract.dense_import import DenseImport
from featurestore.extract.dist_run import run_split
from featurestore.extract.import_types import ImportOptions
from featurestore.extract.slide_files import SlideFiles, find_slides

N, D = 40, 8
ROWS = 10  # --chunk-mb below makes chunks of 10 float16 rows of 8: 4 chunks


class Picked:
    """A share that takes the units whose position is in ``positions``, and records what it saw."""

    def __init__(self, positions: set[int]) -> None:
        self.positions = positions
        self.offered: list[int] = []

    def select(self, units: Iterable[tuple[int, object]]) -> list[object]:
        units = list(units)
        self.offered = [position for position, _ in units]
        return [unit for position, unit in units if position in self.positions]


def options(tmp_path: Path, source: Path, split: str, **kw: object) -> ImportOptions:
    return ImportOptions(source=str(source), store=str(tmp_path / "store"), dataset="ds", encoder_name="enc",
                         split=split, progress=False, chunk_mb=ROWS * D * 2 / (1 << 20), **kw)  # type: ignore[arg-type]


def test_a_dense_import_writes_only_the_chunks_its_share_picks(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((N, D)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    # A worker that takes chunks 0 and 2: the others are left, so the commit refuses.
    first = Picked({0, 2})
    with pytest.raises(MissingChunks, match="2 of 4 chunks are missing"):
        run_split(DenseImport(options(tmp_path, tmp_path / "x.npy", "s")), share=first)
    assert first.offered == [0, 1, 2, 3]
    # A second worker resumes: only chunks 1 and 3 are still offered, and it completes the split.
    second = Picked({1, 3})
    result = run_split(DenseImport(options(tmp_path, tmp_path / "x.npy", "s", resume=True)), share=second)
    assert second.offered == [1, 3] and result.status == "complete" and result.imported == 2 * ROWS
    run_split(DenseImport(options(tmp_path, tmp_path / "x.npy", "whole")))  # one process, every chunk
    store = featurestore.open_store(str(tmp_path / "store"))
    shared, whole = store.open("ds", "enc", "s"), store.open("ds", "enc", "whole")
    assert np.array_equal(shared.read_numpy(np.arange(N)), whole.read_numpy(np.arange(N)))
    assert shared.metadata["quantization"] == whole.metadata["quantization"]


def test_a_bag_import_adds_only_the_slides_its_share_picks(tmp_path: Path) -> None:
    import torch

    slides = tmp_path / "pt_files"
    slides.mkdir()
    for i, name in enumerate(("a", "b", "c")):
        torch.save(torch.full((3 + i, D), float(i)), slides / f"{name}.pt")
    found = find_slides(str(slides))
    assert found is not None
    share = Picked({0, 2})
    result = run_split(BagImport(options(tmp_path, slides, "bags"), SlideFiles(*found)), share=share)
    assert share.offered == [0, 1, 2] and result.imported == 2
    bags = featurestore.open_store(str(tmp_path / "store")).open_bags("ds", "enc", "bags")
    assert list(bags.ids) == ["a", "c"]


def _imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports anywhere (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith(package + "."))
    return found


def test_extract_modules_import_one_another_without_circles() -> None:
    package = "featurestore.extract"
    root = Path(featurestore.__file__).parent / "extract"
    modules = {f"{package}.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    graph = {name: _imports(path, package) & set(modules) - {name} for name, path in modules.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start] - seen:
            seen.add(nxt)
            if nxt == goal or reaches(nxt, goal, seen):
                return True
        return False

    circles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a, set()))
    assert circles == []


def _rank(rank: int, port: int, results: object) -> None:
    import os

    import torch.distributed as dist

    from featurestore.extract.dist import coordinated

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    with coordinated(None) as coord:
        gathered = coord.agree(None, payload=rank)
        alive_inside = dist.is_initialized()
    results.put((rank, gathered, alive_inside, dist.is_initialized()))  # type: ignore[attr-defined]


def test_a_run_that_made_its_own_coordinator_destroys_its_process_group() -> None:
    """Under torchrun, extract/extract_slides/embed called without a coordinator make one from the
    environment: it must be shut down when the run ends (a rank exiting with its gloo group alive
    can abort at exit after a run that succeeded)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in ranks:
        p.start()
    got = sorted(results.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(60)
    assert got == [(0, [0, 1], True, False), (1, [0, 1], True, False)]
    assert [p.exitcode for p in ranks] == [0, 0]


def test_the_runs_take_their_coordinator_through_coordinated() -> None:
    """The library's runs never make a coordinator they would not shut down."""
    package = Path(featurestore.__file__).parent
    makers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                    if "coordinator_from_env()" in path.read_text())
    assert makers == ["extract/dist.py"], makers  # only coordinated() makes one from the environment


def test_a_rank_that_loses_its_peers_says_so_in_one_line() -> None:
    """gloo's "Connection closed by peer" when another rank died (a SIGKILLed node): one RankFailed
    line with the way forward, not gloo's traceback."""
    from types import SimpleNamespace

    from featurestore.extract.dist import RankFailed, TorchrunCoordinator

    def closed(*_: object) -> None:
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:5678\nmore")

    coord = object.__new__(TorchrunCoordinator)
    coord.rank, coord.world_size, coord._dist = 0, 2, SimpleNamespace(all_gather_object=closed)
    with pytest.raises(RankFailed, match=r"rank 0 of 2 lost touch with the other ranks \(.*Connection closed by "
                                         r"peer.*\): another rank stopped.*rerun with --resume"):
        coord.agree(None)
    with pytest.raises(ValueError, match="its own error"):  # a rank's own error wins over the lost peers
        coord.agree(ValueError("its own error"))


def test_a_workers_slides_add_their_seconds_and_ranks_keep_the_slowest() -> None:
    # A --worker process encodes its slides one after another: its closing line's "encoded in"
    # is their sum (it was the longest slide's, a patches/s several times too high); ranks run
    # side by side, so a torchrun run's time is its slowest rank's.
    from featurestore.extract.encode_loop import Progress, gathered
    from featurestore.extract.wsi_run import _SlidesJob

    parts = [Progress(items=1, patches=100, seconds=2.0, waited=0.5), Progress(items=1, patches=300, seconds=3.0)]
    slides = _SlidesJob.merge(None, parts)  # type: ignore[arg-type]  # merge reads nothing of the job
    assert (slides.items, slides.patches, slides.seconds, slides.waited) == (2, 400, 5.0, 0.5)
    ranks = gathered(parts)
    assert (ranks.patches, ranks.seconds, ranks.waited) == (400, 3.0, 0.5)
