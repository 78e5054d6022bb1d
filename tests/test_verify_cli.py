"""``featurestore verify`` / ``ls`` / ``info`` and the CLI's error contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore import cli

SPLIT = ("pannuke", "tiny-vit", "train")


def _make_store(root: Path) -> Path:
    """A complete split with labels (5 chunks), a complete zstd split, an incomplete split."""
    store = featurestore.open_store(str(root), mode="a")
    x = (np.random.default_rng(0).standard_normal((23, 4, 8)) * 2).astype(np.float32)
    w = store.create_split(*SPLIT, num_samples=23, sample_shape=(4, 8), dtype="float16",
                           chunk_bytes=5 * 64, label_dtype="int64")
    w.write(0, x, labels=np.arange(23) % 3)
    w.commit()
    w = store.create_split("pannuke", "tiny-vit", "val", num_samples=23, sample_shape=(4, 8),
                           dtype="bfloat16", chunk_bytes=5 * 64, compressor="zstd")
    w.write(0, x)
    w.commit()
    w = store.create_split("pannuke", "tiny-vit", "test", num_samples=23, sample_shape=(4, 8),
                           dtype="float32", chunk_bytes=5 * 128)
    w.write(0, x[:10])
    w.close()
    return root


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return _make_store(tmp_path / "store")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _chunk(root: Path, split: str, index: int) -> Path:
    return root / "pannuke" / "tiny-vit" / split / "features" / "c" / str(index) / "0" / "0"


def test_verify_good_store(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "verify", str(root))
    assert code == 0, out + err
    assert "pannuke/tiny-vit/train: ok" in out and "pannuke/tiny-vit/val: ok" in out
    # the incomplete split is listed, not counted as damage
    assert "pannuke/tiny-vit/test: incomplete" in out
    assert "2 complete split(s) checked, 0 damaged" in out
    code, out, _ = _cli(capsys, "verify", str(root), *SPLIT)
    assert code == 0 and "pannuke/tiny-vit/train: ok" in out and "val" not in out


@pytest.mark.parametrize("split", ["train", "val"])
def test_verify_flipped_byte(root: Path, capsys: pytest.CaptureFixture[str], split: str) -> None:
    chunk = _chunk(root, split, 2)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0x10
    chunk.write_bytes(bytes(data))
    code, out, _ = _cli(capsys, "verify", str(root))
    assert code == 1
    damaged = [line for line in out.splitlines() if line.startswith("DAMAGED")]
    # train has block seals (its damaged block is named), val is compressed (none)
    named = " in block 0 (rows 10-14)" if split == "train" else ""
    assert damaged == [f"DAMAGED pannuke/tiny-vit/{split}/features/c/2/0/0: crc32c mismatch (flipped or truncated bytes){named}"]
    assert "1 damaged" in out


def test_verify_missing_and_truncated_chunks(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _chunk(root, "train", 4).unlink()
    labels = root / "pannuke" / "tiny-vit" / "train" / "labels" / "c" / "1"
    labels.write_bytes(labels.read_bytes()[:-3])
    code, out, _ = _cli(capsys, "verify", str(root))
    assert code == 1
    assert "DAMAGED pannuke/tiny-vit/train/features/c/4/0/0: missing" in out
    assert "DAMAGED pannuke/tiny-vit/train/labels/c/1: size" in out
    assert "pannuke/tiny-vit/val: ok" in out


def test_verify_incomplete_only_is_not_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    store.create_split("a", "b", "c", num_samples=4, sample_shape=(2,), dtype="float32").close()
    code, out, _ = _cli(capsys, "verify", str(tmp_path / "s"))
    assert code == 0
    assert "a/b/c: incomplete" in out and "0 complete split(s) checked, 0 damaged" in out


def test_ls(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "ls", str(root))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["SPLIT", "STATUS", "SHAPE", "DTYPE", "DATA", "ON", "STORAGE"]
    rows = {line.split()[0]: line.split()[1:4] for line in lines[1:]}
    assert rows == {
        "pannuke/tiny-vit/test": ["writing", "23x4x8", "float32"],
        "pannuke/tiny-vit/train": ["complete", "23x4x8", "float16"],
        "pannuke/tiny-vit/val": ["complete", "23x4x8", "bfloat16"],
    }
    # train: 23 x 32 float16 + 23 int64 labels = 1656 B of data; 5 whole chunks of features,
    # labels and statistics rows on storage (the files, counted)
    train = next(line for line in lines if line.startswith("pannuke/tiny-vit/train"))
    stored = sum(f.stat().st_size for f in (root / "pannuke" / "tiny-vit" / "train").rglob("*")
                 if f.is_file() and f.name != "zarr.json")
    assert train.split()[4:] == [*_bytes(1656).split(), *_bytes(stored).split()]
    empty = featurestore.open_store(str(root.parent / "empty"), mode="a").url
    code, out, _ = _cli(capsys, "ls", empty)
    assert code == 0 and "empty store" in out


def _bytes(n: int) -> str:
    from featurestore.format.sizes import bytes_text

    return bytes_text(n)


def _bag_store(root: Path) -> Path:
    """The demo's small bag split: 2,181 patches of 32 float16 in default (8 MiB) chunks, two named
    classes; and one imported without labels, patch size or provenance."""
    store = featurestore.open_store(str(root), mode="a")
    w = store.create_bag_split("cohort", "uni", "small", dim=32, dtype="float16", label_dtype="int64",
                               metadata={"label_names": ["negative", "positive"]})  # fmt: skip
    for i in range(20):
        n = 110 if i < 19 else 91
        w.add_bag(f"TCGA-{i:02d}", np.ones((n, 32), np.float32), coords=np.zeros((n, 2), np.int64),
                  label=int(i % 4 == 0))  # fmt: skip
    w.commit()
    w = store.create_bag_split("cohort", "uni", "plain", dim=8)
    w.add_bag("a", np.ones((3, 8), np.float32))
    w.commit()
    return root


def test_ls_and_info_of_a_bag_split_name_their_sizes_labels_and_absent_fields(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    root = _bag_store(tmp_path / "bags")
    code, out, _ = _cli(capsys, "ls", str(root))
    assert code == 0
    small = next(line for line in out.splitlines() if line.startswith("cohort/uni/small"))
    # 2181 x (64 B features + 16 B coords) + 20 labels: 170.5 KiB of data; on storage one whole
    # chunk each of features (8 MiB) and coords (2 MiB): 10.0 MiB, not one figure under the other's name
    assert small.split()[-6:] == ["170.5", "KiB", "at", "least", "10.0", "MiB"], small
    code, out, _ = _cli(capsys, "info", str(root), "cohort", "uni", "small")
    assert code == 0
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in out.splitlines()}
    assert fields["bag labels"] == "int64, 2 classes: 0 negative: 15 bags, 1 positive: 5 bags"
    assert fields["data"] == "170.5 KiB"
    assert fields["on storage"] == "at least 10.0 MiB (bag ids and attributes not counted)"
    assert fields["chunks"].startswith("131072 patches per chunk, stored whole")
    labels = root / "cohort" / "uni" / "small" / "labels" / "c" / "0"
    labels.write_bytes(labels.read_bytes()[:-3])  # info still answers on a damaged split, and says so
    code, out, _ = _cli(capsys, "info", str(root), "cohort", "uni", "small")
    assert code == 0 and "bag labels: int64, unreadable: chunk 0 of cohort/uni/small/labels" in out, out
    code, out, _ = _cli(capsys, "info", str(root), "cohort", "uni", "plain")
    assert code == 0 and "None" not in out, out
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in out.splitlines()}
    assert fields["coords"] == "px (int64)"  # no patch size recorded: none said
    assert fields["bag labels"] == fields["token layout"] == fields["cache key"] == "not recorded"


def test_label_counts_of_float_labels_and_many_classes() -> None:
    from featurestore.commands.inspect import label_counts

    assert label_counts(np.array([0.5, 2.0, np.nan]), None) == "float64: 0.5 .. 2 over 3 bags"
    many = label_counts(np.arange(25).repeat(2), [f"c{i}" for i in range(3)], most=4)
    assert many == "int64, 25 classes: 0 c0: 2 bags, 1 c1: 2 bags, 2 c2: 2 bags, 3: 2 bags, ... 21 more classes"


def test_info(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "info", str(root), *SPLIT)
    assert code == 0
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in out.splitlines()}
    assert fields["split"] == "pannuke/tiny-vit/train"
    assert fields["status"] == "complete"
    assert fields["shape"] == "[23, 4, 8]"
    assert fields["dtype"] == "float16 (source float32)"
    assert fields["quantization"].startswith("float32 -> float16: max abs error "), fields["quantization"]
    code, out, _ = _cli(capsys, "info", str(root), *SPLIT, "--json")
    assert code == 0
    meta = json.loads(out)
    assert meta == featurestore.open_store(str(root)).split_metadata(*SPLIT)
    assert meta["status"] == "complete" and meta["labels"] == {"shape": [], "dtype": "int64"}


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "featurestore.cli", *argv], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("case", ["missing-store", "bad-name", "unknown-split", "verify-args"])
def test_errors_are_one_line(root: Path, tmp_path: Path, case: str) -> None:
    argv = {
        "missing-store": ["ls", str(tmp_path / "nowhere")],
        "bad-name": ["info", str(root), "../x", "tiny-vit", "train"],
        "unknown-split": ["info", str(root), "pannuke", "tiny-vit", "nosuch"],
        "verify-args": ["verify", str(root), "pannuke"],
    }[case]
    result = _run(*argv)
    # verify's own status for "nothing checked" is 2 (1 means damage found)
    assert result.returncode == (2 if argv[0] == "verify" else 1)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("featurestore: error: ")
    assert "Traceback" not in result.stderr
    word = {"missing-store": "nowhere", "bad-name": "'../x'", "unknown-split": "'nosuch'",
            "verify-args": "DATASET ENCODER SPLIT"}[case]
    assert word in lines[0]


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = _run("--debug", "ls", str(tmp_path / "nowhere"))
    assert result.returncode != 0 and "Traceback" in result.stderr and "StoreNotFound" in result.stderr


def test_help_lists_every_verb() -> None:
    result = _run("--help")
    assert result.returncode == 0
    verbs = []
    for module in cli.COMMAND_MODULES:
        verbs += {"inspect": ["ls", "info", "verify"], "import_": ["import"]}.get(module, [module])
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("    ")}
    missing = [verb for verb in verbs if verb not in listed]
    assert not missing, f"featurestore --help does not list {missing}:\n{result.stdout}"


def test_verify_object_storage(memory_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = featurestore.open_store(memory_url, mode="a")
    w = store.create_split(*SPLIT, num_samples=9, sample_shape=(4, 8), dtype="float16", chunk_bytes=4 * 64)
    w.write(0, np.ones((9, 4, 8), np.float32))
    w.commit()
    assert _cli(capsys, "verify", memory_url)[0] == 0
    key = "pannuke/tiny-vit/train/features/c/1/0/0"
    data = bytearray(store.storage.read(key))
    data[0] ^= 0x01
    store.storage.write(key, bytes(data))
    code, out, _ = _cli(capsys, "verify", memory_url)
    assert code == 1 and f"DAMAGED {key}: crc32c mismatch" in out


@pytest.mark.parametrize("position", [0, 1, 2], ids=["dataset", "encoder", "split"])
def test_verify_unknown_name_is_an_error_not_a_clean_store(root: Path, position: int) -> None:
    """A typo in the dataset printed "0 complete split(s) checked, 0 damaged" with exit
    0; one in the encoder or split was reported as damage (exit 1). Both are one line naming the
    name and the known ones, with verify's "nothing checked" status 2."""
    names = list(SPLIT)
    names[position] = "typo"
    result = _run("verify", str(root), *names)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    what = ("dataset", "encoder", "split")[position]
    known = {0: "pannuke", 1: "tiny-vit", 2: "test, train, val"}[position]
    assert lines == [f"featurestore: error: no such {what} 'typo'"
                     + ("" if position == 0 else f" in {'/'.join(SPLIT[:position])}")
                     + f" at {root} (known: {known})"], result.stderr


def test_verify_damage_and_not_checked_exit_differently(root: Path, tmp_path: Path) -> None:
    _chunk(root, "train", 1).unlink()
    assert _run("verify", str(root), *SPLIT).returncode == 1
    assert _run("verify", str(tmp_path / "nowhere")).returncode == 2
    assert _run("verify", str(root), "pannuke", "tiny-vit", "zarr.json").returncode == 2


def test_verify_names_a_split_without_its_group_document(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A named split whose zarr.json is gone is there (in the listing) and damaged, not unknown."""
    (root / "pannuke" / "tiny-vit" / "train" / "zarr.json").unlink()
    code, out, _ = _cli(capsys, "verify", str(root), *SPLIT)
    assert code == 1 and "DAMAGED pannuke/tiny-vit/train/zarr.json" in out


def test_verify_reports_a_reserved_name_directory_on_object_storage(seaweed: Any, seaweed_url: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """On S3 a split called zarr.json was written (beside its encoder's document) and
    served, but verify skipped it. The name is refused now; one an older version wrote is
    reported, since readers never see it."""
    options = json.dumps(seaweed.storage_options)
    store = featurestore.open_store(seaweed_url, mode="a", **seaweed.storage_options)
    with pytest.raises(featurestore.errors.InvalidName, match="reserved"):
        store.create_split("pannuke", "tiny-vit", "zarr.json", num_samples=4, sample_shape=(2, 8))
    w = store.create_split(*SPLIT, num_samples=4, sample_shape=(2, 8), dtype="float32")
    w.write(0, np.ones((4, 2, 8), np.float32))
    w.commit()
    assert _cli(capsys, "verify", seaweed_url, "--storage-options", options)[0] == 0
    # what an older featurestore wrote: the split's documents under .../tiny-vit/zarr.json/
    store.storage.write("pannuke/tiny-vit/zarr.json/zarr.json", store.storage.read("pannuke/tiny-vit/train/zarr.json"))
    code, out, _ = _cli(capsys, "verify", seaweed_url, "--storage-options", options)
    assert code == 1, out
    assert "DAMAGED pannuke/tiny-vit/zarr.json/: a directory under a reserved name" in out


def test_a_report_figure_stored_as_null_prints_as_n_a() -> None:
    """A figure the report could not represent is JSON null (FORMAT.md): info, extract and import
    print it as n/a instead of failing on the format spec."""
    from featurestore.commands.report_line import quantization_line

    line = quantization_line({"source_dtype": "float32", "stored_dtype": "bfloat16", "max_abs_error": None,
                              "max_rel_error": 0.002, "rel_rms_error": None, "abs_max": 3e38})
    assert line == ("float32 -> bfloat16: max abs error n/a, max rel error 0.002, rel rms error n/a, "
                    "abs max 3e+38, overflow 0, NaN 0, Inf 0")
    line = quantization_line({"source_dtype": "float32", "stored_dtype": "int8", "max_abs_error": 0.0186,
                              "max_rel_error": 1.0, "rel_rms_error": 0.00693, "abs_max": 4.7, "saturation_count": 0})
    assert line == ("float32 -> int8: max abs error 0.0186, max rel error 1 (a value under half its scale's step "
                    "stores as 0), rel rms error 0.00693, abs max 4.7, overflow 0, NaN 0, Inf 0, saturation 0")
