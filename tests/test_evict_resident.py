"""``testing.cgroup.evict`` and ``resident_bytes``: the cold-cache primitive the benches trust. A page
some process still maps survives the eviction, which is why ``bench cold`` closes its maps first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from featurestore.testing.cgroup import evict, resident_bytes

SIZE = 8 << 20


@pytest.fixture
def data(tmp_path: Path) -> Path:
    if _on_tmpfs(tmp_path):
        pytest.skip(f"{tmp_path} is on a tmpfs, whose pages are the file's only copy: nothing to evict to")
    path = tmp_path / "data"
    np.arange(SIZE // 8, dtype=np.int64).tofile(path)
    with open(path, "rb") as f:
        f.read()
    return path


def _on_tmpfs(path: Path) -> bool:
    best, kind = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            point, fstype = line.split()[1:3]
            if str(path).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    return kind in ("tmpfs", "ramfs")


def test_a_read_file_is_resident_and_eviction_drops_it(data: Path) -> None:
    assert resident_bytes(str(data)) == SIZE
    evict(str(data))
    assert resident_bytes(str(data)) == 0
    # Asking does not fault pages in, and a directory counts its files.
    assert resident_bytes(str(data.parent)) == 0


def test_a_page_still_mapped_survives_eviction(data: Path) -> None:
    evict(str(data))
    mapped = np.memmap(data, dtype=np.int64, mode="r")
    assert int(mapped[: SIZE // 16].sum()) > 0  # faults the first half in
    evict(str(data))
    assert resident_bytes(str(data)) >= SIZE // 2
    del mapped
    evict(str(data))
    assert resident_bytes(str(data)) == 0


def test_an_empty_file_and_an_absent_path_hold_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").touch()
    assert resident_bytes(str(tmp_path / "empty"), str(tmp_path / "absent")) == 0


def test_a_file_whose_mincore_answer_is_untruthful_is_refused(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mincore reports every page of a file the caller neither owns nor may write as cached: asking
    it there would read a cold store as warm, so the question is refused by name."""
    from featurestore.testing import cgroup

    monkeypatch.setattr(cgroup, "mincore_truthful", lambda path, owner: False)
    with pytest.raises(PermissionError, match=f"{data}: mincore reports every page"):
        cgroup.resident_bytes(str(data))
