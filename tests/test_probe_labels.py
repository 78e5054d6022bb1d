"""A task's labels from a table at probe time (``probe --labels CSV --label-column COL``), and the
chance baselines of the dense probes: table rules, ABMIL on bag splits, linear on dense splits
with ids, one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _probe_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread per test)

import featurestore
from featurestore.cli import main
from featurestore.demo.synthetic_bags import synthetic_slides
from featurestore.errors import InvalidLabels, MissingLabels
from featurestore.probes.labels import read_label_table
from featurestore.probes.mil_run import run_mil_probe
from featurestore.probes.run import run_probe

DIM = 8


def table(tmp_path: Path, text: str, name: str = "labels.csv", encoding: str = "utf-8") -> str:
    path = tmp_path / name
    path.write_bytes(text.encode(encoding))
    return str(path)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Bag splits ``bags/train`` (24 slides) and ``bags/val`` (12); dense splits with the slides'
    ids ``emb/train`` and ``emb/val`` (mean of each bag, stored labels), ``emb-noids/train``, and
    ``flat/train|val`` (every sample the same features: a probe can only predict a constant)."""
    root = str(tmp_path_factory.mktemp("labels") / "store")
    splits = {"train": {"num": 24, "seed": 0, "min_patches": 8, "max_patches": 30},
              "val": {"num": 12, "seed": 1, "min_patches": 8, "max_patches": 30}}
    store = featurestore.open_store(root, mode="a")
    for split, options in splits.items():
        # One cohort: ids unique across the splits, as a cohort's table lists each slide once.
        slides = [(f"{split}-{bag}", *rest) for bag, *rest in synthetic_slides(dim=DIM, tumour_share=0.5, **options)]
        writer = store.create_bag_split("cohort", "bags", split, dim=DIM, dtype="float32", label_dtype="int64",
                                        chunk_bytes=64 * DIM * 4)
        for bag, features, coords, label in slides:
            writer.add_bag(bag, features, coords=coords, label=label)
        writer.commit()
        ids = [s[0] for s in slides]
        features = np.stack([s[1].mean(0) + 3 * s[3] for s in slides]).astype(np.float32)
        labels = np.array([s[3] for s in slides], np.int64)
        for encoder, with_ids, values in (("emb", True, features), ("emb-noids", False, features),
                                          ("flat", True, np.ones_like(features))):
            writer = store.create_split("cohort", encoder, split, num_samples=len(ids), sample_shape=(DIM,),
                                        dtype="float32", label_shape=(), label_dtype="int64",
                                        ids=ids if with_ids else None)
            writer.write(0, values, labels=labels)
            writer.commit()
    return root


def stored_table(tmp_path: Path, root: str, splits: tuple[str, ...] = ("train", "val"), names: bool = False,
                 skip: int = 0) -> str:
    """A table repeating the bag splits' stored labels (as names 'neg'/'pos' when ``names``),
    leaving out every ``skip``-th slide of each split."""
    rows = ["case,slide_id,task"]
    for split in splits:
        bags = featurestore.open_store(root).open_bags("cohort", "bags", split)
        for k, (bag, label) in enumerate(zip(bags.ids, bags.labels)):
            if skip and k % skip == 0:
                continue
            rows.append(f"case-{bag},{bag},{('neg', 'pos')[int(label)] if names else int(label)}")
    return table(tmp_path, "\n".join(rows) + "\n", name=f"stored-{names}-{skip}.csv")


# ------------------------------------------------------------------------------------ table rules


def test_integer_labels_are_ascii_digits_only(tmp_path: Path) -> None:
    digits = read_label_table(table(tmp_path, "slide_id,y\na,0\nb,2\nc,1\n"), "y")
    assert digits.classes is None and digits.values == {"a": 0, "b": 2, "c": 1} and digits.num_classes == 3
    for odd in ("1.0", "-1", "+1", "\u0661"):  # a float, signs, an Arabic-Indic digit: names, not numbers
        named = read_label_table(table(tmp_path, f"slide_id,y\na,0\nb,{odd}\n"), "y")
        assert named.classes == sorted(["0", odd]), odd
    text = read_label_table(table(tmp_path, "slide_id,y\na,tumour\nb,normal\nc,tumour\n"), "y")
    assert text.classes == ["normal", "tumour"] and text.values == {"a": 1, "b": 0, "c": 1}


def test_integers_other_than_0_to_k_are_classes_named_by_their_values(tmp_path: Path) -> None:
    """A grade coded 1, 2, 3 is three classes, not four of which class 0 is empty; codes 1 and 2
    are a binary task; the class ids follow the values' order and the names keep the values."""
    grades = read_label_table(table(tmp_path, "slide_id,g\na,3\nb,1\nc,2\nd,10\n"), "g")
    assert grades.classes == ["1", "2", "3", "10"] and grades.num_classes == 4
    assert grades.values == {"a": 2, "b": 0, "c": 1, "d": 3}
    binary = read_label_table(table(tmp_path, "slide_id,g\na,2\nb,1\n"), "g")
    assert binary.num_classes == 2 and binary.values == {"a": 1, "b": 0}
    assert "labels: column 'g'" in binary.match(["a", "b"], "c/e/s").summary and "(1=1, 2=1)" in binary.match(
        ["a", "b"], "c/e/s").summary


def test_utf8_with_bom_spaces_and_empty_cells(tmp_path: Path) -> None:
    path = table(tmp_path, "\ufeffslide_id , grade\nß-1, G2\nb,\n\nc,G1\n")
    read = read_label_table(path, "grade")
    assert read.values == {"ß-1": 1, "c": 0} and read.empty == 1
    matched = read.match(["c", "b", "ß-1", "z"], "cohort/e/s")
    assert matched.labels.tolist() == [0, -1, 1, -1] and matched.positions.tolist() == [0, 2]
    assert "2 of 4 slides of cohort/e/s labelled (G1=1, G2=1); 2 without a label left out ('b', 'z')" \
        in matched.summary
    tsv = read_label_table(table(tmp_path, "slide_id\tgrade\nx.svs\tG1\n", name="t.tsv"), "grade")
    assert tsv.match(["x"], "s").labels.tolist() == [0]  # the slide file's extension is allowed


@pytest.mark.parametrize(("text", "column", "message"), [
    ("slide_id,label,site\na,1,x\n", "task", "has no column 'task' (--label-column); its columns are: 'slide_id', "
                                             "'label', 'site'"),
    ("id,label\na,1\n", "label", "has no column 'slide_id' (--id-column)"),
    ("slide_id,label\na,1\nb,0\na,0\n", "label", "'a' is listed twice in column 'slide_id' with two labels in "
                                                "column 'label' ('1' on line 2, '0' on line 4)"),
    ("slide_id,label\na,\nb,\n", "label", "column 'label' has no label in any row"),
    ("slide_id,label\n,1\n", "label", "no row has an id in column 'slide_id'"),
])
def test_bad_tables_are_one_line_errors(tmp_path: Path, text: str, column: str, message: str) -> None:
    with pytest.raises(InvalidLabels) as error:
        read_label_table(table(tmp_path, text), column)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_missing_value_markers_are_empty_cells(tmp_path: Path) -> None:
    # How pandas (nan, NaN) and R (NA) write a missing value: no class of its own, the slide left out.
    markers = ("nan", "NaN", "NA", "N/A", " null ", "None", "NONE", "n/a")
    rows = "".join(f"m{k},{marker}\n" for k, marker in enumerate(markers))
    read = read_label_table(table(tmp_path, f"slide_id,grade\na,G1\nb,G2\n{rows}a,NaN\n"), "grade")
    assert read.classes == ["G1", "G2"] and read.values == {"a": 0, "b": 1} and read.empty == len(markers)
    digits = read_label_table(table(tmp_path, "slide_id,y\na,0\nb,1\nc,nan\n"), "y")
    assert digits.classes is None and digits.values == {"a": 0, "b": 1}  # still integer class ids
    with pytest.raises(InvalidLabels, match="column 'y' has no label in any row"):
        read_label_table(table(tmp_path, "slide_id,y\na,NA\nb,nan\n"), "y")


@pytest.mark.parametrize(("name", "text", "hint"), [
    ("tab.csv", "slide_id\tlabel\na\t1\n", "the header looks tab-separated: save it as comma-separated text or "
                                              "name it .tsv"),
    ("semi.csv", "slide_id;label\na;1\n", "the header looks semicolon-separated: save it as comma-separated text"),
    ("comma.tsv", "slide_id,label\na,1\n", "the header looks comma-separated: name the file .csv"),
])
def test_a_header_in_another_separator_says_so(tmp_path: Path, name: str, text: str, hint: str) -> None:
    with pytest.raises(InvalidLabels) as error:
        read_label_table(table(tmp_path, text, name=name), "label")
    assert "has no column 'slide_id' (--id-column)" in str(error.value) and hint in str(error.value)
    assert "\n" not in str(error.value)


def test_an_id_repeated_with_one_label_is_one_row(tmp_path: Path) -> None:
    # A slide table keyed by its patients (a patient's row once per slide) labels patient embeddings.
    text = "slide_id,case_id,grade\ns1,P1,G2\ns2,P1,G2\ns3,P2,\ns4,P2,G1\ns5,P3,G1\ns6,P3,\nx1,,G1\n"
    read = read_label_table(table(tmp_path, text), "grade", "case_id")
    assert read.values == {"P1": 1, "P2": 0, "P3": 0} and read.empty == 0
    assert read.match(["P3", "P1", "P2"], "d/e-patients/all", "patients").labels.tolist() == [0, 1, 0]
    with pytest.raises(InvalidLabels, match=r"'P1' is listed twice .* \('G2' on line 2, 'G1' on line 5\)"):
        read_label_table(table(tmp_path, text.replace("s4,P2,G1", "s4,P1,G1")), "grade", "case_id")


def test_a_table_that_is_not_utf8_or_matches_no_slide(tmp_path: Path) -> None:
    with pytest.raises(InvalidLabels, match=r"is not UTF-8 text \(byte 0xfc on line 2\)"):
        read_label_table(table(tmp_path, "slide_id,label\nMünchen,1\n", encoding="latin-1"), "label")
    # Deep in a longer table (past the decoder's first read-ahead), after a byte-order mark: the
    # line that holds the byte, not the last line csv had parsed before the decoder failed.
    rows = "".join(f"slide-{k},1\n" for k in range(3000))
    deep = b"\xef\xbb\xbf" + f"slide_id,label\n{rows}".encode() + "Zürich,0\n".encode("latin-1")
    (tmp_path / "deep.csv").write_bytes(deep)
    with pytest.raises(InvalidLabels, match=r"is not UTF-8 text \(byte 0xfc on line 3002\)"):
        read_label_table(str(tmp_path / "deep.csv"), "label")
    read = read_label_table(table(tmp_path, "slide_id,label\nTCGA-01,1\nTCGA-02,0\n"), "label")
    with pytest.raises(InvalidLabels, match=r"none of the 2 slides of d/e/s has a label .* look like 'TCGA-01'"):
        read.match(["slide-0000", "slide-0001"], "d/e/s")
    twins = read_label_table(table(tmp_path, "slide_id,label\nx.svs,1\nx.tif,0\n"), "label")
    with pytest.raises(InvalidLabels, match="matches rows 'x.svs' and 'x.tif'"):
        twins.match(["x"], "d/e/s")


def test_a_group_table_naming_a_slide_twice_with_two_groups_is_refused(tmp_path: Path) -> None:
    """A slide written once bare and once with its file's extension, in two groups, was read with
    the bare row's group (the other ignored); and "S1.1" gave slide "S1" its group."""
    from featurestore.probes.groups import read_group_table

    both = table(tmp_path, "slide_id,case_id\nslide-0001,case-00\nslide-0002,case-01\nslide-0001.svs,case-09\n")
    with pytest.raises(InvalidLabels, match=r"rows 'slide-0001' and 'slide-0001.svs' name one slide with two groups "
                                            r"in column 'case_id' \('case-00' on line 2, 'case-09' on line 4\)"):
        read_group_table(both, "case_id", "slide_id")
    twins = table(tmp_path, "slide_id,case_id\ns2.svs,A\ns2.tiff,B\n", name="twins.csv")
    with pytest.raises(InvalidLabels, match="rows 's2.svs' and 's2.tiff' name one slide with two groups"):
        read_group_table(twins, "case_id", "slide_id")
    dotted = table(tmp_path, "slide_id,case_id\nS1.1,A\nS2.svs,B\nS2,B\n", name="dotted.csv")
    assert read_group_table(dotted, "case_id", "slide_id") == {"S1.1": "A", "S2.svs": "B", "S2": "B"}
    labels = read_label_table(table(tmp_path, "slide_id,label\nS1.1,x\nS3.svs,y\n", name="l.csv"), "label")
    assert labels.match(["S1", "S1.1", "S3"], "d/e/s").labels.tolist() == [-1, 0, 1]  # no ".1" extension


def test_an_empty_table_and_a_header_alone_say_so(tmp_path: Path) -> None:
    with pytest.raises(InvalidLabels, match=r"empty\.csv is empty: a table needs a header row"):
        read_label_table(table(tmp_path, "", name="empty.csv"), "label")
    with pytest.raises(InvalidLabels, match="has a header but no rows: add one row per slide"):
        read_label_table(table(tmp_path, "slide_id,label\n\n"), "label")


def test_cells_with_line_breaks_and_cells_too_long(tmp_path: Path) -> None:
    from featurestore.probes.groups import table_has_column

    # A clinical table's free-text column: a quoted cell over two lines, and an unquoted U+2028
    # (Python's str.splitlines breaks on it, splitting the row: s2 lost its label before).
    text = 'slide_id,note,label\ns1,"line one\nline two",1\ns2,a\u2028b,0\ns3,x,1\n'
    assert read_label_table(table(tmp_path, text), "label").values == {"s1": 1, "s2": 0, "s3": 1}
    huge = table(tmp_path, 'slide_id,label,report\ns1,1,"' + "x" * 200_000 + '"\n', name="huge.csv")
    with pytest.raises(InvalidLabels, match=r"huge\.csv line 2: not a table .*field larger than field limit"):
        read_label_table(huge, "label")
    # Whether a column exists reads the header alone: a body that would be refused is not read.
    assert table_has_column(huge, "report") and not table_has_column(huge, "grade")


# ------------------------------------------------------------------------------------- ABMIL


def test_abmil_table_repeating_the_stored_labels_trains_the_same_probe(store: str, tmp_path: Path) -> None:
    options = dict(train_split="train", eval_split="val", seeds=[0], epochs=2, device="cpu")
    stored = run_mil_probe(store, "cohort", "bags", **options)
    for loader in ("stream", "ram"):
        from_table = run_mil_probe(store, "cohort", "bags", loader=loader,
                                   labels=read_label_table(stored_table(tmp_path, store), "task"), **options)
        assert from_table["runs"] == stored["runs"]
    named = run_mil_probe(store, "cohort", "bags", labels=read_label_table(stored_table(tmp_path, store, names=True),
                                                                             "task"), **options)
    assert named["runs"] == stored["runs"]  # 'neg' < 'pos': the same class ids
    shifted = tmp_path / "one-based.csv"  # the same task coded 1 and 2: a binary probe, no empty class
    shifted.write_text("".join(line if k == 0 else f"{line.rsplit(',', 1)[0]},{int(line.rsplit(',', 1)[1]) + 1}\n"
                               for k, line in enumerate(open(stored_table(tmp_path, store)).read().splitlines(True))))
    one_based = run_mil_probe(store, "cohort", "bags", labels=read_label_table(str(shifted), "task"), **options)
    assert one_based["num_classes"] == stored["num_classes"] == 2 and one_based["runs"] == stored["runs"]


def test_abmil_leaves_out_slides_the_table_does_not_label(store: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = stored_table(tmp_path, store, skip=4)
    code = main(["probe", store, "--head", "abmil", "--dataset", "cohort", "--encoder", "bags", "--train", "train",
                 "--folds", "2", "--seeds", "1", "--epochs", "1", "--device", "cpu", "--quiet",
                 "--labels", path, "--label-column", "task", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0
    assert "18 of 24 slides of cohort/bags/train labelled (0=6, 1=12); 6 without a label left out" in out
    import json

    result = json.loads((tmp_path / "r.json").read_text())
    assert result["train_samples"] + result["eval_samples"] == 18


def test_abmil_on_a_bag_split_without_stored_labels(store: str, tmp_path: Path) -> None:
    writer = featurestore.open_store(store, mode="a").create_bag_split("cohort", "unlabelled", "train", dim=DIM,
                                                                       overwrite=True)
    for bag, features, coords, _ in synthetic_slides(12, DIM, seed=4, min_patches=5, max_patches=9):
        writer.add_bag(bag, features, coords=coords)
    writer.commit()
    with pytest.raises(MissingLabels):
        run_mil_probe(store, "cohort", "unlabelled", train_split="train", folds=2, seeds=1, epochs=1, device="cpu")
    path = table(tmp_path, "slide_id,task\n" + "".join(f"slide-{i:04d},{'ab'[i % 2]}\n" for i in range(12)))
    result = run_mil_probe(store, "cohort", "unlabelled", train_split="train", folds=2, seeds=1, epochs=1,
                           device="cpu", labels=read_label_table(path, "task"))
    assert result["num_classes"] == 2 and result["train_samples"] == 6


@pytest.mark.parametrize(("argv", "message"), [
    (["--labels", "x.csv"], "--labels CSV and --label-column COL go together"),
    (["--label-column", "task"], "--labels CSV and --label-column COL go together"),
    (["--labels", "{table}", "--label-column", "nope"], "has no column 'nope' (--label-column); its columns are"),
    (["--labels", "{table}", "--label-column", "task", "--id-column", "case"], "none of the 24 slides"),
])
def test_cli_table_errors_are_one_line(store: str, tmp_path: Path, argv: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = stored_table(tmp_path, store)
    argv = [a.replace("{table}", path) for a in argv]
    code = main(["probe", store, "--head", "abmil", "--dataset", "cohort", "--encoder", "bags", "--train", "train",
                 "--folds", "2", "--seeds", "1", "--epochs", "1", "--device", "cpu", "--quiet", *argv])
    err = capsys.readouterr().err
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1


# -------------------------------------------------------------------------------- dense + ids


def test_linear_probe_over_an_embedding_split_takes_the_table(store: str, tmp_path: Path) -> None:
    options = dict(train_split="train", eval_split="val", seeds=[0, 1], epochs=3, batch_size=8, device="cpu")
    stored = run_probe(store, "cohort", "emb", **options)
    for loader in ("stream", "ram"):
        relabelled = run_probe(store, "cohort", "emb", loader=loader,
                               labels=read_label_table(stored_table(tmp_path, store, names=True), "task"), **options)
        assert relabelled["runs"] == stored["runs"], loader
    partial = run_probe(store, "cohort", "emb", labels=read_label_table(stored_table(tmp_path, store, skip=3), "task"),
                        **options)
    assert (partial["train_samples"], partial["eval_samples"]) == (16, 8)
    assert any("8 without a label left out" in note for note in partial["label_notes"])
    with pytest.raises(MissingLabels, match="has no sample ids"):
        run_probe(store, "cohort", "emb-noids", labels=read_label_table(stored_table(tmp_path, store), "task"),
                  **options)


def test_dense_chance_baseline_and_one_class(store: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    options = dict(train_split="train", eval_split="val", seeds=[0, 1], epochs=2, batch_size=8, device="cpu")
    flat = run_probe(store, "cohort", "flat", **options)
    assert flat["chance"]["balanced_accuracy"] == {"baseline": 0.5, "what": "best constant prediction",
                                                   "at_chance": True}
    assert flat["chance"]["macro_f1"]["baseline"] == pytest.approx(2 * 6 / 18 / 2)  # 6 of 12 in the top class
    learned = run_probe(store, "cohort", "emb", **{**options, "epochs": 10})
    assert not any(c["at_chance"] for c in learned["chance"].values())
    assert main(["probe", store, "--dataset", "cohort", "--encoder", "flat", "--compare", "flat", "--train", "train",
                 "--eval", "val", "--seeds", "2", "--epochs", "1", "--device", "cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: AT CHANCE" in out and "uninformative" in out
    one = table(tmp_path, "slide_id,task\n" + "".join(f"{split}-slide-{i:04d},x\n" for split in ("train", "val")
                                                    for i in range(24 if split == "train" else 12)))
    with pytest.raises(InvalidLabels, match="holds only label 'x' \\(0\\) .*AUC is undefined for one"):
        run_probe(store, "cohort", "emb", labels=read_label_table(one, "task"), **options)
    rare = table(tmp_path, "slide_id,site\n" + "".join(f"train-slide-{i:04d},{'liver' if i == 0 else 'lung'}\n"
                                                      for i in range(24)), name="site.csv")
    with pytest.raises(InvalidLabels, match="class 'liver' \\(0\\) has 1 sample\\(s\\): a fold would train without it"):
        run_probe(store, "cohort", "emb", labels=read_label_table(rare, "site"),
                  **{**options, "eval_split": None, "folds": 3})


def test_seg_baseline_is_the_best_constant_map() -> None:
    from featurestore.probes.chance import seg_baseline
    from featurestore.probes.seg import per_image_jaccard

    masks = torch.from_numpy(np.random.default_rng(0).integers(0, 3, (5, 4, 4)))
    masks[0] = 0  # an image of one class
    best = max(float(per_image_jaccard(torch.full_like(masks, c), masks, 3).mean()) for c in range(3))
    assert seg_baseline([masks[:2].numpy(), masks[2:].numpy()], 3) == pytest.approx(best)


def _float_label_split(root: Path, labels: np.ndarray, name: str) -> None:
    store = featurestore.open_store(str(root), mode="a")
    for split in ("train", "val"):
        w = store.create_split("d", name, split, num_samples=len(labels), sample_shape=(4, 8), dtype="float32",
                               label_dtype="float32")
        w.write(0, np.random.default_rng(0).standard_normal((len(labels), 4, 8)).astype(np.float32), labels)
        w.commit()


@pytest.mark.parametrize(("name", "labels", "says"), [
    ("nan", np.array([0, 1, np.nan, 1, 0, 1] * 4, np.float32), "label nan"),
    ("frac", np.array([0.5, 1.5, 2.5] * 8, np.float32), "label 0.5"),
])  # fmt: skip
@pytest.mark.parametrize("num_classes", [None, 3])
def test_labels_that_are_not_class_ids_are_one_line(tmp_path: Path, name: str, labels: np.ndarray, says: str,
                                                   num_classes: int | None) -> None:
    """A NaN label was a ValueError traceback (with --num-classes: "label -9223372036854775808 is
    negative"); 0.5, 1.5, 2.5 were truncated to classes 0, 1, 2 and a probe trained on them."""
    _float_label_split(tmp_path, labels, name)
    with pytest.raises(InvalidLabels, match=f"{says}.* is not a class id"):
        run_probe(str(tmp_path), "d", name, train_split="train", eval_split="val", task="linear", seeds=1, epochs=1,
                  device="cpu", num_classes=num_classes)


def test_batch_size_one_with_the_linear_head_is_refused(tmp_path: Path) -> None:
    """Every batch of one was skipped (BatchNorm): the untrained head was scored, exit 0."""
    from featurestore.errors import InvalidOption

    _float_label_split(tmp_path, np.array([0, 1] * 6, np.float32), "ok")
    with pytest.raises(InvalidOption, match="batch_size 1 with the linear head"):
        run_probe(str(tmp_path), "d", "ok", train_split="train", eval_split="val", task="linear", seeds=1, epochs=1,
                  device="cpu", batch_size=1)
