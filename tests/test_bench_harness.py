"""The benches' harness (featurestore/bench/harness.py) and the one synthetic cohort builder: the
repeat loop, its order and warm-up, per-repeat pairs, eviction, the child protocol's failures."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from featurestore.bench import harness
from featurestore.bench.harness import Method, interleaved
from featurestore.demo.synthetic_bags import bag_lengths, io_bags
from featurestore.testing.cgroup import evict


def test_interleaved_runs_every_method_once_per_repeat_in_the_order_given() -> None:
    calls: list[str] = []
    methods = [Method("a", lambda: calls.append("a")), Method("b", lambda: 2.5, teardown=lambda: calls.append("b-"), own=True),
               Method("c", lambda: 7)]
    times = interleaved(methods, 3, warmup=1, order=lambda r, ms: ms[::-1] if r % 2 else ms)
    # warm-up round (-1: reversed), then rounds 0, 1, 2: warm-up values are not kept
    assert calls == ["b-", "a", "a", "b-", "b-", "a", "a", "b-"]
    assert len(times["a"]) == 3 and all(t >= 0 for t in times["a"])
    assert times["b"] == [2.5, 2.5, 2.5]  # a run that returns its own measurement keeps it
    assert all(t < 1 for t in times["c"])  # a return value is not a measurement unless the method says so
    assert times.median("b") == 2.5 and times.pairs("b", "b") == [1.0, 1.0, 1.0]


def test_pairs_are_per_repeat_ratios() -> None:
    times = harness.Times({"x": [1.0, 2.0, 4.0], "y": [2.0, 2.0, 2.0]})
    assert times.pairs("x", "y") == [0.5, 1.0, 2.0]
    assert times.bests()["x"] == 1.0 and times.medians() == {"x": 2.0, "y": 2.0}


def test_evict_and_warm_take_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for name in ("d/a", "b"):
        (tmp_path / name).write_bytes(os.urandom(1 << 16))
    harness.warm(str(tmp_path / "d"), str(tmp_path / "b"))
    evict(str(tmp_path / "d"), str(tmp_path / "b"))  # no error; the pages' residency is the kernel's


def test_a_failing_child_raises_with_its_stderr() -> None:
    with pytest.raises(RuntimeError, match="(?s)bench child nope:missing failed.*ModuleNotFoundError"):
        harness.child("nope:missing", {})


def test_bag_lengths_by_count_and_by_budget() -> None:
    counted = bag_lengths(100, count=50, seed=3)
    assert len(counted) == 50 and counted.min() >= 16 and counted.max() <= 800
    assert np.array_equal(counted, bag_lengths(100, count=50, seed=3))  # deterministic
    budget = bag_lengths(200, gib=0.01, dim=64, sigma=0.8, low=10, high=5000)
    assert budget.sum() >= int(0.01 * (1 << 30)) // 128 and budget.max() == 5000 and budget.min() >= 10
    bags = list(io_bags(np.array([3, 0, 5]), 8))
    assert [b[0] for b in bags] == ["slide-00000", "slide-00001", "slide-00002"]
    assert [b[1].shape for b in bags] == [(3, 8), (0, 8), (5, 8)] and bags[2][2].shape == (5, 2)
    assert [b[3] for b in bags] == [0, 1, 0]


def test_rss_runs_interleave_the_sizes_and_keep_each_number_s_median(monkeypatch: pytest.MonkeyPatch) -> None:
    peaks = iter([56, 70, 76, 68, 68, 69])  # N's first process read low: one run alone said 4N/N = 1.25
    calls: list[str] = []

    def child(function: str, spec: dict[str, str]) -> dict[str, object]:
        calls.append(spec["label"])
        return {"baseline_anon": 24, "peak_anon": next(peaks), "n": spec["label"], "ok": True}
    monkeypatch.setattr(harness, "child", child)
    out = harness.rss_runs("read:rss_epoch", {"N": {"label": "N"}, "4N": {"label": "4N"}}, runs=3)
    assert calls == ["N", "4N"] * 3
    assert out["N"]["peak_anon"] == 68 and out["4N"]["peak_anon"] == 69
    assert out["N"]["n"] == "N" and out["N"]["ok"] is True and [r["peak_anon"] for r in out["N"]["all"]] == [56, 76, 68]
    assert out["loader_bytes"] == {"N": 44, "4N": 45}


def test_flag_lists_parse_or_name_the_flag_in_one_line() -> None:
    from featurestore.errors import InvalidOption

    assert harness.parse_numbers("--batch-sizes", "16,64", int) == [16, 64]
    assert harness.parse_shapes("256x384,8x8") == [(256, 384), (8, 8)]
    with pytest.raises(InvalidOption, match=r"--batch-sizes '16,x': give numbers.*such as 16,64"):
        harness.parse_numbers("--batch-sizes", "16,x", int, "16,64")
    with pytest.raises(InvalidOption, match="bad shape '8y8'"):
        harness.parse_shapes("8y8")


@pytest.mark.parametrize(("argv", "says"), [
    (["read", "--batches", "0"], "argument --batches: 0 must be more than 0"),
    (["web", "--splits", "0"], "argument --splits: 0 must be more than 0"),
    (["web", "--dim", "abc"], "argument --dim: 'abc' is not an integer"),
    (["http", "--load-seconds", "-1"], "argument --load-seconds: -1 must be at least 0"),
])
def test_a_bench_refuses_a_number_out_of_range_in_one_line(argv: list[str], says: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Every numeric flag of a bench is positive, or at least 0 where 0 means "skip it": a zero
    count used to end in a traceback (ZeroDivisionError, a missing file) after minutes of work."""
    from featurestore.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["bench", *argv])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(says)
    assert main(["bench", "web", "--splits", "2", "--dim", "8", "--tokens", "16", "--samples", "2", "--repeats",
                 "1", "--debug"]) == 0  # and --debug after a bench's name, as after every verb
