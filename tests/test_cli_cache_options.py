"""``--cache-bytes`` is checked by the CLI itself: a local store takes no storage options, so a
bad value (``abc``, ``-5``, ``0``) went unnoticed there, and a later switch to s3:// found it."""

from __future__ import annotations

from pathlib import Path

import pytest

from featurestore.cli import main

VERBS = {
    "probe": ("probe", "{store}", "--dataset", "d", "--encoder", "e", "--train", "t", "--eval", "v", "--quiet"),
    "serve": ("serve", "{store}", "--port", "0"),
}


@pytest.mark.parametrize("value", ["abc", "-5", "0"])
@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_bad_cache_bytes_is_one_line_naming_it(verb: str, value: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(store=tmp_path / "store") for a in VERBS[verb]] + [f"--cache-bytes={value}"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"featurestore: error: --cache-bytes={value!r} must be a positive number of bytes"), err
    assert "'20G'" in err
    assert sorted(tmp_path.iterdir()) == []
