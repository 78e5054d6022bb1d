"""A quiet install: building featurestore's metadata raises no setuptools warnings.

Runs setuptools' own PEP 517 metadata hook (what pip calls in its isolated build) in a
subprocess with every warning recorded. With the old ``license = { text = ... }`` table this
records "`project.license` as a TOML table is deprecated"; the SPDX string records nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HOOK = r"""
import tempfile, warnings
import setuptools.build_meta as backend
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backend.prepare_metadata_for_build_wheel(tempfile.mkdtemp())
for w in caught:
    print("WARNING", w.category.__name__, str(w.message).splitlines()[0])
"""


def test_metadata_builds_without_warnings(tmp_path: Path) -> None:
    setuptools = pytest.importorskip("setuptools")  # torch depends on it: present wherever torch is
    major = int(setuptools.__version__.split(".")[0])
    if major < 77:  # pip's isolated build fetches the newest; this venv's copy may be older
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license strings (77)")
    result = subprocess.run([sys.executable, "-c", HOOK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stdout.splitlines() if line.startswith("WARNING")]
    assert not warnings, warnings


def test_license_is_an_spdx_string() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]
