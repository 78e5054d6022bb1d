"""``featurestore probe``: train a reference probe on one split, score it on another, and with
``--compare`` check whether the storage dtype of the features moves the metric.

A thin layer over :func:`featurestore.probes.run.run_probe` / :func:`~featurestore.probes.run.compare_probes`;
this module adds the argument parser and :func:`format_report`, the table it prints. Nothing
heavy is imported until the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from typing import Any

from featurestore.commands.parsers import add_verb
from featurestore.commands.storeargs import (add_cache_options, add_storage_options, is_http, kind_hint,
                                             options_from_args, refuse_unused)
from featurestore.errors import InvalidOption

# Mirrors featurestore.probes.run.TASKS / LOADERS, kept here so `featurestore --help` imports nothing.
TASKS = ("auto", "linear", "seg")
LOADERS = ("stream", "ram")
METRIC_TITLES = {
    "macro_f1": "macro-F1",
    "balanced_accuracy": "balanced accuracy",
    "jaccard": "per-image macro Jaccard",
    "auc": "AUC",
}
HEADS = ("linear", "seg", "abmil")  # abmil: featurestore.probes.mil_run, on bag splits


# ------------------------------------------------------------------------------- reporting


def format_report(result: dict[str, Any]) -> str:
    """The text ``featurestore probe`` prints, for a :func:`run_probe` or :func:`compare_probes` result."""
    from featurestore.probes.chance import report_notes

    if "comparison" not in result:
        run = result
        lines = [_setup_line(run), f"  {_side(run)}", *_label_lines(run), ""]
        rows = [("metric", f"{run['encoder']} ({run['dtype']})", "chance")]
        rows += [(name, _mean_std(s), _chance(run, name)) for name, s in run["metrics"].items()]
        lines += _table(rows)
        lines += ["", f"mean ± sample std over {len(run['seeds'])} seed(s) {run['seeds']}; chance = the best "
                  "constant prediction's score on the same evaluation labels."]
        notes = report_notes(run) + _collapse_notes(run) + _stale_notes(run)
        lines += _training_fit_notes(run) + [line for note in notes for line in textwrap.wrap(note, width=100)]
        return "\n".join(lines)

    a, b, comparison = result["a"], result["b"], result["comparison"]
    lines = [_setup_line(a), f"  A = {_side(a)}", f"  B = {_side(b)}", *_label_lines(a), ""]
    rows = [("metric", f"A {a['dtype']}", f"B {b['dtype']}", "chance", "diff A-B", "2x pooled std",
             "max |paired diff|", "exceeds spread?")]
    for name, c in comparison.items():
        rows.append((
            name,
            _mean_std(a["metrics"][name]),
            _mean_std(b["metrics"][name]),
            _chance(a, name),
            _small(c["diff"], sign=True),
            "n/a" if c["threshold"] is None else f"{c['threshold']:.4f}",
            _small(c["max_abs_paired_diff"]),
            _verdict(c),
        ))
    lines += _table(rows)
    k = len(a["seeds"])
    notes = [
        f"How to read: each cell is mean ± sample std over {k} seed(s) {a['seeds']}; seed k gives A "
        "and B the same head initialisation and batch order, so only the stored features differ.",
        "diff = mean(A) - mean(B). Run-to-run spread: pooled std = sqrt((std_A^2 + std_B^2) / 2). "
        "'exceeds spread' = |diff| > 2 x pooled std: the storage dtype moved the metric by more "
        "than changing the seed does. 'no' = within seed noise (not zero); 'identical' = every "
        "seed gave exactly the same metric in A and B. Paired diff = A - B for the same seed.",
    ]
    if k < 2:
        notes.append("With one seed there is no spread to compare with: use --seeds 3 or more.")
    notes += report_notes(a, "A = ") + report_notes(b, "B = ")
    useless = [name for name, c in comparison.items() if c.get("uninformative")]
    if useless:
        notes.append(f"The comparison is uninformative for {', '.join(useless)}: A and B are both at chance, so "
                     "neither probe learned the task and the verdict says nothing about the storage dtype.")
    notes += _collapse_notes(a, True) + _collapse_notes(b, True) + _stale_notes(a) + _stale_notes(b)
    lines.append("")
    lines += _training_fit_notes(a) + [line for note in notes for line in textwrap.wrap(note, width=100)]
    return "\n".join(lines)


def _small(value: float, sign: bool = False) -> str:
    # A float16 cache typically moves a metric by 1e-5..1e-3: 4 decimals would print such a
    # difference as 0.0000, indistinguishable from an exact tie.
    if value != 0 and abs(value) < 5e-5:
        return f"{value:+.1e}" if sign else f"{value:.1e}"
    return f"{value:+.4f}" if sign else f"{value:.4f}"


def _collapse_notes(run: dict[str, Any], compared: bool = False) -> list[str]:
    # Seeds change the initialisation and the batch order, so a trained probe rarely scores
    # exactly the same under all of them; when it does at (or below) the score of a constant
    # prediction (balanced accuracy 1/K, AUC 0.5: what any constant prediction gets), it has
    # almost surely learned one (e.g. background everywhere). A metric above that score is no
    # constant prediction, however flat: on a small cohort with fixed folds a learned probe often
    # gives the same thresholded metric every seed (the AT CHANCE check judges it against the
    # spread). A metric without a recorded baseline keeps the old rule: flat is suspect.
    if len(run["seeds"]) < 2:
        return []
    chance = run.get("chance") or {}
    flat = [name for name, s in run["metrics"].items() if s["std"] == 0.0
            and (name not in chance or s["mean"] <= chance[name]["baseline"] + _SAME)]
    if not flat:
        return []
    read = "the comparison" if compared else "this number"
    return [
        f"Warning: {run['encoder']} gave exactly the same {', '.join(flat)} under every seed, no better than "
        "a constant prediction: the probe probably predicts one class everywhere. Train longer (--epochs), with "
        f"smaller batches (--batch-size) or another --lr before reading {read}."
    ]


_SAME = 1e-6  # a metric computed in float32 against a baseline in float64


def _training_fit_notes(run: dict[str, Any]) -> list[str]:
    # --train X --eval X scores the slides the head was fitted to: a figure of the fit, which
    # overstates any held-out score (and reads as one unless said). One line, not wrapped.
    if run.get("folds") or run["train_split"] != run["eval_split"]:
        return []
    return [f"Warning: trained and evaluated on the same split {run['eval_split']!r}: the training fit, not a "
            "held-out score; evaluate on another split (--eval) or on folds (--folds K)."]


def _stale_notes(run: dict[str, Any]) -> list[str]:
    from featurestore.core.lineage import stale_fix  # the one fix text of verify, status, info and export

    return [f"WARNING: STALE: {split} was computed from a source that has changed since ({reason}): these "
            f"figures describe the old rows. Before reading them: {stale_fix(reason, split, run.get('store'))}"
            for split, reason in (run.get("stale") or {}).items()]


def _setup_line(run: dict[str, Any]) -> str:
    titles = {**METRIC_TITLES, "auc": "slide AUC"} if run["task"] == "abmil" else METRIC_TITLES
    title = ", ".join(titles.get(m, m) for m in run["metrics"])
    grouped = f", grouped by {run['group_by']}" if run.get("group_by") else ""
    return (
        f"{run['task']} probe ({title}): train on '{run['train_split']}', evaluate on "
        f"'{run['eval_split']}'{grouped}; {run['num_classes']} classes; {run['config']['epochs']} epochs, "
        f"lr {run['config']['lr']:g}, batch {run['batch_size']}, device {run['device']}, "
        f"{run['loader']} loader"
    )


def _side(run: dict[str, Any]) -> str:
    unit = "bags" if run["task"] == "abmil" else "samples"
    return (
        f"{run['dataset']}/{run['encoder']} stored as {run['dtype']}"
        + (f" (the eval split as {run['eval_dtype']})" if run.get("eval_dtype", run["dtype"]) != run["dtype"] else "")
        + ", features "
        f"{run['sample_shape'] if unit == 'samples' else '[patches, %d] per bag' % run['sample_shape'][-1]}, "
        f"{_counts(run, unit)}, {run['seconds']:.1f} s ({run['source']})"
    )


def _counts(run: dict[str, Any], unit: str) -> str:
    """``200 train + 40 eval bags``; for folds, every labelled one and what each fold evaluates."""
    sizes = run.get("eval_per_fold")
    if not sizes:
        return f"{run['train_samples']} train + {run['eval_samples']} eval {unit}"
    each = f"{min(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
    return f"{run['train_samples'] + run['eval_samples']} {unit} in {len(sizes)} folds, {each} evaluated per fold"


def _mean_std(summary: dict[str, Any]) -> str:
    std = summary["std"]
    return f"{summary['mean']:.4f}" + ("" if std is None else f" ± {std:.4f}")


def _chance(run: dict[str, Any], name: str) -> str:
    c = (run.get("chance") or {}).get(name)
    if c is None:
        return "n/a"
    return f"{c['baseline']:.4f}" + (" AT CHANCE" if c["at_chance"] else "")


def _label_lines(run: dict[str, Any]) -> list[str]:
    return [f"  {note}" for note in run.get("label_notes") or []]


def _verdict(c: dict[str, Any]) -> str:
    if c.get("uninformative"):
        return "uninformative (chance)"
    if c["max_abs_paired_diff"] == 0.0:
        return "identical"
    if c["exceeds_spread"] is None:
        return "n/a (1 seed)"
    return "YES" if c["exceeds_spread"] else "no"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


# ------------------------------------------------------------------------------ command line


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


HELP = (
    "train a reference probe on a split; --compare checks whether the storage dtype "
    "moves the metric"
)
DESCRIPTION = """\
Train the reference probe (linear on pooled tokens, or a segmentation head on the token grid) on one split and
evaluate it on another, under K seeds. With --compare ENCODER, run the same seeds on a second encoder name
holding the same images (e.g. the features stored as float32) and report each metric as mean ± std per storage
dtype, the difference, and whether it exceeds 2 x the pooled run-to-run std. --head abmil trains a
gated-attention MIL head on a bag split (one label per slide) and reports slide AUC and balanced accuracy, on
--eval SPLIT or --folds K. The linear head reports AUC (binary, or macro one-vs-rest), balanced accuracy and
macro-F1; on a slide-embedding split [n, E] (featurestore embed) it is the logistic-regression probe. --folds
K --group-by COLUMN keeps each group (a patient's slides) in one fold, stratified by label. Every report shows
each metric's chance baseline (the best constant prediction) and flags a metric AT CHANCE. --labels CSV
--label-column COL takes a task's labels from a table. See docs/PROBES.md.
"""


def register(subparsers: Any) -> None:
    parser = add_verb(subparsers, "probe", run_command, HELP, DESCRIPTION)
    parser.add_argument("store", metavar="STORE",
                        help="store path, fsspec URL (s3://..., memory://...) or http(s):// server")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--encoder", required=True, help="encoder name in the store (A)")
    parser.add_argument("--train", required=True, metavar="SPLIT", help="split to train on")
    parser.add_argument("--eval", metavar="SPLIT", help="split to evaluate on (required, except with --folds K)")
    parser.add_argument("--task", choices=TASKS, default="auto",
                        help="auto: class maps [H, W] -> seg, one class id per sample -> linear")
    parser.add_argument("--head", choices=HEADS, default=None,
                        help="linear or seg: the dense probes (same as --task); abmil: gated-attention MIL "
                        "(Ilse et al. 2018) on a bag split, slide-level AUC and balanced accuracy")
    parser.add_argument("--folds", type=_positive_int, default=None, metavar="K",
                        help="linear or abmil: K stratified folds of the --train split instead of --eval (the same "
                        "folds for every seed); a seed's metric is the mean over the folds")
    parser.add_argument("--group-by", metavar="COLUMN", default=None,
                        help="--folds: keep every group (e.g. case_id: a patient's slides) in one fold. Each "
                        "sample's group: the --groups CSV, else the --labels CSV when it has COLUMN, else for abmil "
                        "the bags' attribute COLUMN (import keeps a --labels CSV's other columns as attributes), "
                        "for linear over a split with ids the attributes of the bag split it was derived from "
                        "(metadata 'lineage')")
    parser.add_argument("--groups", metavar="CSV", default=None,
                        help="--group-by: a table (UTF-8 CSV) with the --id-column and COLUMN giving each slide's or "
                        "sample's group")
    parser.add_argument("--max-patches", type=_positive_int, default=None, metavar="P",
                        help="abmil: train on a seeded random subset of P patches per bag per epoch")
    parser.add_argument("--save-attention", metavar="NAME", default=None,
                        help="abmil: keep the first seed's attention over every evaluated bag's patches in the "
                        "store, beside the evaluated bag split, as map NAME (the web page's slide map shows it)")
    parser.add_argument("--save-predictions", metavar="CSV", default=None,
                        help="abmil, or linear on slide/patient embeddings: write every evaluated sample's class "
                        "probabilities to CSV, one row per seed, fold and sample (slide_id, abmil's --group-by "
                        "column, label, predicted, prob_<class>)")
    parser.add_argument("--labels", metavar="CSV", default=None,
                        help="take the task's labels from this table (UTF-8 CSV, one row per slide) instead of the "
                        "stored ones; slides it does not list are left out. Bag splits, and dense splits with "
                        "sample ids (embeddings); needs --label-column")
    parser.add_argument("--label-column", metavar="COL", default=None,
                        help="--labels: the column holding the task's labels (digits only: class ids; else class "
                        "names, numbered in sorted order)")
    parser.add_argument("--id-column", metavar="COL", default="slide_id",
                        help="--labels, --groups: the column holding the slide ids (default slide_id)")
    parser.add_argument("--compare", metavar="ENCODER",
                        help="second encoder name (B), e.g. the same features stored as float32")
    parser.add_argument("--compare-store", metavar="STORE",
                        help="where B lives, if not in STORE (e.g. the same store over HTTP)")
    parser.add_argument("--seeds", type=_positive_int, default=3,
                        help="number of seeds K, run as seeds 0..K-1 (default 3)")
    parser.add_argument("--epochs", type=_positive_int, default=None,
                        help="training epochs (default: 20 linear, 10 seg, 20 abmil)")
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW learning rate (default: 1e-2 linear, 1e-3 seg, 1e-3 abmil)")
    parser.add_argument("--batch-size", type=_positive_int, default=None,
                        help="default 64 (dense), 1 bag (abmil; more pads to the longest bag, bucketed)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument("--num-classes", type=_positive_int, default=None,
                        help="class count (default: the --labels table's classes, else label_info.classes in "
                        "metadata, else max label + 1)")
    parser.add_argument("--pool", choices=("mean", "cls"), default=None,
                        help="linear probe pooling: mean over patch tokens (default), or the CLS token")
    parser.add_argument("--loader", choices=LOADERS, default="stream",
                        help="stream: FeatureLoader from the store; ram: read the split into host "
                        "RAM as float32 first (the classic cache, for comparison)")
    parser.add_argument("--token", default=None,
                        help="bearer token for an http(s):// STORE (default: $FEATURESTORE_TOKEN)")
    parser.add_argument("--json", metavar="OUT", help="also write the full result as JSON to OUT ('-' = stdout)")
    parser.add_argument("--quiet", action="store_true", help="no per-seed progress on stderr")
    add_storage_options(parser)
    add_cache_options(parser)


def run_command(args: argparse.Namespace) -> int:
    hint = ("--head abmil trains on bag splits; a dense split takes --head linear (or seg)" if args.head == "abmil"
            else "probe a bag split with --head abmil, or its slide embeddings (featurestore embed) with --head linear")
    with kind_hint(hint):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.compare_store and not args.compare:
        raise InvalidOption("--compare-store needs --compare ENCODER")
    if (args.labels is None) != (args.label_column is None):
        raise InvalidOption("--labels CSV and --label-column COL go together: the table and the column of the task's "
                            "labels")
    stores = (args.store, args.compare_store)
    if args.token:  # the flag; $FEATURESTORE_TOKEN is set once for every store
        refuse_unused("--token", "a featurestore server's http(s):// URL", [s for s in stores if s], is_http)
    token = args.token or os.environ.get("FEATURESTORE_TOKEN") or None
    storage = options_from_args(args, *stores, servers=True)  # the probes pass it to the stores that are no server
    if args.groups is not None and args.group_by is None:
        raise InvalidOption("--groups CSV gives the column of --group-by COLUMN: add --group-by")
    if args.json not in (None, "-"):
        _check_json_out(args.json)
    if args.pool is not None and args.head == "abmil":
        raise InvalidOption(f"--pool {args.pool} pools a sample's tokens for the linear head; --head abmil pools "
                            "a bag's patches by attention: leave out --pool")
    if args.head == "abmil":
        result = _run_abmil(args, token, storage, None if args.quiet else log)
    else:
        if args.max_patches is not None or args.save_attention is not None:
            raise InvalidOption("--max-patches and --save-attention apply to --head abmil only")
        if args.eval is None and args.folds is None:
            raise InvalidOption("--eval SPLIT or --folds K is required: the split (or folds) to evaluate the probe on")
        task = args.head or args.task
        common: dict[str, Any] = dict(
            train_split=args.train, eval_split=args.eval, task=task, seeds=args.seeds,
            epochs=args.epochs, lr=args.lr, batch_size=args.batch_size or 64, device=args.device,
            num_classes=args.num_classes, pool=args.pool, loader=args.loader, token=token,
            log=None if args.quiet else log, labels=_label_table(args), folds=args.folds,
            group_by=_group_spec(args), storage_options=storage,
        )
        from featurestore.probes.run import compare_probes, run_probe

        if args.compare:
            if args.save_predictions is not None:
                raise InvalidOption("--save-predictions keeps one run's outputs: drop --compare, or save them from "
                                    "a run of its own")
            result = compare_probes(args.store, args.dataset, args.encoder, args.compare,
                                    compare_source=args.compare_store, **common)
        else:
            result = run_probe(args.store, args.dataset, args.encoder, save_predictions=args.save_predictions,
                               **common)
    if args.json == "-":
        json.dump(result, sys.stdout, indent=2, allow_nan=True)
        print()
        return 0
    print(format_report(result))
    if result.get("attention"):
        saved = result["attention"]
        print(f"attention map {saved['name']!r} (seed {saved['seed']}, {saved['bags']} bags) saved in {saved['key']}")
    if result.get("predictions"):
        table = result["predictions"]
        unit = table.get("id_column", "slide_id")  # case_id: patient embeddings, a row per patient
        print(f"predictions: {table['rows']} rows (seed, fold, {'slide' if unit == 'slide_id' else unit}) in "
              f"{table['path']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2, allow_nan=True)
            handle.write("\n")
    return 0


def _check_json_out(path: str) -> None:
    from featurestore.probes.predictions import check_output_file

    check_output_file(path, "--json", "result.json")


def _run_abmil(args: argparse.Namespace, token: str | None, storage: dict[str, Any] | None,
               log: Any) -> dict[str, Any]:
    from featurestore.probes.mil_run import compare_mil_probes, run_mil_probe

    common: dict[str, Any] = dict(
        train_split=args.train, eval_split=args.eval, folds=args.folds, seeds=args.seeds, epochs=args.epochs,
        lr=args.lr, batch_size=args.batch_size or 1, max_patches=args.max_patches, device=args.device,
        num_classes=args.num_classes, loader=args.loader, token=token, storage_options=storage, log=log,
        labels=_label_table(args), group_by=_group_spec(args),
    )
    if args.compare:
        if args.save_attention is not None or args.save_predictions is not None:
            raise InvalidOption("--save-attention and --save-predictions keep one run's outputs: drop --compare, or "
                                "save them from a run of their own")
        return compare_mil_probes(args.store, args.dataset, args.encoder, args.compare,
                                  compare_source=args.compare_store, **common)
    return run_mil_probe(args.store, args.dataset, args.encoder, save_attention=args.save_attention,
                         save_predictions=args.save_predictions, **common)


def _group_spec(args: argparse.Namespace) -> Any:
    """``--group-by COLUMN`` from ``--groups CSV``, else from the ``--labels CSV`` when it holds
    COLUMN (the clinical table of the task), else from the samples' own (featurestore.probes.groups)."""
    from featurestore.probes.groups import GroupSpec, table_has_column

    if args.group_by is None:
        return None
    table = args.groups
    if table is None and args.labels is not None and table_has_column(args.labels, args.group_by):
        table = args.labels
    return GroupSpec(args.group_by, table, args.id_column)


def _label_table(args: argparse.Namespace) -> Any:
    if args.labels is None:
        return None
    from featurestore.probes.labels import read_label_table

    return read_label_table(args.labels, args.label_column, args.id_column)
