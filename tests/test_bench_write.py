"""``featurestore bench write``: every timing a fresh process's write, the first write the gated figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from featurestore.bench import reading, report, write


def test_write_bench_times_each_write_in_a_fresh_process(tmp_path: Path) -> None:
    args = report.bench_args("write", ["--shapes", "8x16", "--mb", "0.004,0.008", "--min-batches", "1",
                                       "--batch-size", "4", "--repeats", "1", "--workdir", str(tmp_path)])
    result = write.run(args)
    small, large = result["shapes"]  # two sizes of one shape, smaller first
    assert (small["num_samples"], large["num_samples"]) == (15, 31)
    assert (small["label"], large["label"]) == ("8x16 0.00384MB", "8x16")
    for s in (small, large):
        assert set(s["repeats_s"]) == set(write.METHODS)
        assert s["processes"] == len(write.METHODS)  # one new process per timing, none of them this one
    found = reading.bench_figures("write", result)
    # The gated figures are the first writes; a process's second write is reported beside them.
    assert {"float16_vs_tofile[8x16]", "float32_vs_tofile[8x16 0.00384MB]", "float16_second_vs_tofile[8x16]"} <= set(found)
    assert found["float16_vs_tofile[8x16]"]["value"] == large["writer_float16_ratio"]
    assert list(tmp_path.iterdir()) == []  # every written file removed


def test_write_bench_bad_size_is_one_clear_error(tmp_path: Path) -> None:
    from featurestore.errors import InvalidOption

    args = report.bench_args("write", ["--shapes", "8x16", "--mb", "250,big", "--workdir", str(tmp_path)])
    with pytest.raises(InvalidOption, match=r"--mb '250,big'.*such as 250,384"):
        write.run(args)
