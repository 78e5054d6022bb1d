"""The ABMIL reference probe on bag splits: run under K seeds, and compare two storage dtypes.

``featurestore probe STORE --head abmil`` is the command line of :func:`run_mil_probe` and
:func:`compare_mil_probes`. Evaluation is either a second split (``eval_split``) or ``folds=K``
stratified folds of one split (the same folds for every seed and for both sides of a comparison:
they come from a fixed stream, :data:`FOLD_SEED`, not from the training seed). A seed's metric is
the mean over its folds; the spread is over seeds, and the comparison is the dense probes' rule
(:func:`featurestore.probes.compare.compare_summaries`). The results have the dense probes'
shape, so ``featurestore.commands.probe.format_report`` prints them too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from featurestore.errors import InvalidLabels, InvalidOption, MissingLabels, ShapeMismatch
from featurestore.probes import chance
from featurestore.probes.compare import SPREAD_FACTOR, compare_summaries, seed_list_of
from featurestore.probes.folds import FOLD_SEED, fold_parts, stratified_folds
from featurestore.probes.groups import GroupSpec, bag_groups
from featurestore.probes.labels import LabelTable, task_record

__all__ = ["FOLD_SEED", "compare_mil_probes", "fold_parts", "open_bags", "run_mil_probe", "stratified_folds"]

LOADERS = ("stream", "ram")


def open_bags(source: str, dataset: str, encoder: str, split: str, *, storage_options: dict[str, Any] | None = None,
              token: str | None = None, table: LabelTable | None = None) -> Any:
    """A ``client.BagDataset`` over a store path, fsspec URL or http(s) server; labels required,
    stored or from ``table`` (then ``ds.labels`` are the table's, -1 for a slide it leaves out,
    and ``ds.labelled`` the positions it labels)."""
    from client import BagDataset

    http = source.startswith(("http://", "https://"))
    ds = BagDataset(source, dataset, encoder, split, storage_options=None if http else storage_options,
                    token=token if http else None)
    if table is not None:
        matched = table.match(ds.ids, f"{dataset}/{encoder}/{split}")
        ds.labels, ds.labelled, ds.label_summary = matched.labels, matched.positions, matched.summary
        ds.class_names = matched.names
        return _without_empty(ds, f"{dataset}/{encoder}/{split}")
    ds.labelled, ds.label_summary = np.arange(ds.num_bags, dtype=np.int64), None
    names = (ds.metadata or {}).get("label_names") or ((ds.metadata or {}).get("label_info") or {}).get("classes")
    ds.class_names = [str(n) for n in names] if isinstance(names, list) else None
    _without_empty(ds, f"{dataset}/{encoder}/{split}")
    if ds.labels is None:
        raise MissingLabels(f"bag split {dataset}/{encoder}/{split} has no labels, so no slide-level probe can be "
                            "trained on it: give the task's labels from a table (--labels CSV --label-column COL), "
                            "or import the slides with --labels CSV")
    if ds.labels.dtype.kind not in "iub":
        raise InvalidLabels(f"bag split {dataset}/{encoder}/{split} has {ds.labels.dtype} labels: the ABMIL probe "
                            "needs integer class ids")
    return ds


def _without_empty(ds: Any, key: str) -> Any:
    """Empty bags (a slide without tissue) leave the probe's bags before its folds are made: the
    report counts only bags it trains or evaluates on, and says how many it left out."""
    lengths = np.asarray(ds.lengths)[ds.labelled]
    empty = ds.labelled[lengths == 0]
    if len(empty):
        ds.labelled = ds.labelled[lengths > 0]
        note = (f"{len(empty)} empty bag(s) of {key} (no patches, e.g. {ds.ids[int(empty[0])]!r}) left out of the "
                "probe")
        ds.label_summary = f"{ds.label_summary}; {note}" if ds.label_summary else note
    return ds


def num_classes_of(datasets: Sequence[Any], table: LabelTable | None = None) -> int:
    """The task's class count: the table's, else the splits' class names, else max label + 1."""
    if table is not None:
        return table.num_classes
    for ds in datasets:
        info = ds.metadata.get("label_info") or {}
        if info.get("classes"):
            return len(info["classes"])
    top = max(int(np.max(ds.labels)) if len(ds.labels) else -1 for ds in datasets)
    if min(int(np.min(ds.labels)) if len(ds.labels) else 0 for ds in datasets) < 0:
        raise InvalidLabels("bag labels must be class ids >= 0")
    return top + 1


def run_mil_probe(
    source: str, dataset: str, encoder: str, *, train_split: str, eval_split: str | None = None,
    folds: int | None = None, seeds: int | Sequence[int] = 3, epochs: int | None = None, lr: float | None = None,
    batch_size: int = 1, max_patches: int | None = None, device: str = "auto", num_classes: int | None = None,
    loader: str = "stream", storage_options: dict[str, Any] | None = None, token: str | None = None,
    log: Callable[[str], None] | None = None, labels: LabelTable | None = None,
    save_attention: str | None = None, group_by: GroupSpec | str | None = None, save_predictions: str | None = None,
) -> dict[str, Any]:
    """Train the ABMIL head on ``train_split`` and score it on ``eval_split`` (or ``folds``
    stratified folds of ``train_split``) under each seed. ``max_patches``: training bags are
    subsampled to that many patches per epoch (evaluation always reads whole bags). ``loader``:
    ``"stream"`` (``client.BagLoader``) or ``"ram"`` (every bag read into RAM as float32 first).
    ``save_attention``: keep the first seed's attention over the evaluated bags in the store under
    that name (featurestore.probes.attention). ``labels``: the task's labels from a table
    (:mod:`featurestore.probes.labels`) instead of the stored ones; slides it does not label are left
    out. ``group_by``: with ``folds``, the column (``case_id``) whose bags stay in one fold: the bags'
    attribute, or a :class:`GroupSpec` whose table gives each slide's (featurestore.probes.groups).
    ``save_predictions``: a CSV of every evaluated bag's class probabilities per seed and fold
    (featurestore.probes.predictions). Returns the setup,
    every run's metrics, each metric's ``{"mean", "std", "values"}`` and, under ``"chance"``, its
    chance baseline."""
    sides = _open_side(source, dataset, encoder, train_split, eval_split, folds, storage_options, token, labels)
    classes = num_classes if num_classes is not None else num_classes_of([d for d in sides if d is not None], labels)
    recorder = None
    if save_attention is not None:
        from featurestore.probes.attention import AttentionRecorder

        recorder = AttentionRecorder(save_attention, sides[1] if sides[1] is not None else sides[0], source=source,
                                     storage_options=storage_options, fold_seed=FOLD_SEED, labels=task_record(labels))
    predictions = None
    if save_predictions is not None:
        from featurestore.probes.predictions import PredictionRecorder, class_names_of

        evaluated = sides[1] if sides[1] is not None else sides[0]
        predictions = PredictionRecorder.of_bags(save_predictions, evaluated, num_classes=classes, group_by=group_by,
                                                 class_names=class_names_of(evaluated, labels, classes))
    return _run(*sides, folds=folds, num_classes=classes, seeds=seeds, epochs=epochs, lr=lr, batch_size=batch_size,
                max_patches=max_patches, device=device, loader=loader, log=log, recorder=recorder, group_by=group_by,
                predictions=predictions)


def compare_mil_probes(
    source: str, dataset: str, encoder: str, compare_encoder: str, *, train_split: str,
    eval_split: str | None = None, folds: int | None = None, compare_source: str | None = None,
    seeds: int | Sequence[int] = 3, epochs: int | None = None, lr: float | None = None, batch_size: int = 1,
    max_patches: int | None = None, device: str = "auto", num_classes: int | None = None, loader: str = "stream",
    storage_options: dict[str, Any] | None = None, token: str | None = None,
    log: Callable[[str], None] | None = None, labels: LabelTable | None = None,
    group_by: GroupSpec | str | None = None,
) -> dict[str, Any]:
    """The same probe, folds, seeds and batches on ``encoder`` (A) and ``compare_encoder`` (B),
    e.g. the same slides' features stored as float16 and as float32; B is read from
    ``compare_source`` (default ``source``). Returns ``{"a", "b", "comparison", "rule"}``."""
    a_sides = _open_side(source, dataset, encoder, train_split, eval_split, folds, storage_options, token, labels)
    b_sides = _open_side(compare_source or source, dataset, compare_encoder, train_split, eval_split, folds,
                         storage_options, token, labels)
    for a_ds, b_ds in zip(a_sides, b_sides):
        if a_ds is not None and (a_ds.ids != b_ds.ids or not np.array_equal(a_ds.labels, b_ds.labels)):
            raise ShapeMismatch(f"{dataset}/{encoder}/{a_ds.split} and {dataset}/{compare_encoder}/{b_ds.split} hold "
                                "different bags (ids or labels differ): compare the same slides stored twice")
    everything = [d for d in (*a_sides, *b_sides) if d is not None]
    classes = num_classes if num_classes is not None else num_classes_of(everything, labels)
    options: dict[str, Any] = dict(folds=folds, num_classes=classes, seeds=seeds, epochs=epochs, lr=lr,
                                   batch_size=batch_size, max_patches=max_patches, device=device, loader=loader,
                                   log=log, group_by=group_by)
    a, b = _run(*a_sides, **options), _run(*b_sides, **options)
    comparison = compare_summaries(a, b)
    chance.mark_comparison(comparison, a, b)
    return {"a": a, "b": b, "comparison": comparison,
            "rule": (f"diff = mean(A) - mean(B); std = sample std over seeds (ddof=1); pooled std = "
                     f"sqrt((std_A^2 + std_B^2) / 2); exceeds spread = |diff| > {SPREAD_FACTOR:g} x pooled std")}


def _open_side(source: str, dataset: str, encoder: str, train_split: str, eval_split: str | None,
               folds: int | None, storage_options: dict[str, Any] | None, token: str | None,
               table: LabelTable | None) -> tuple[Any, Any]:
    if (eval_split is None) == (folds is None):
        raise InvalidOption("give either an eval split (--eval SPLIT) or a number of folds (--folds K), not both "
                            "and not neither")
    train = open_bags(source, dataset, encoder, train_split, storage_options=storage_options, token=token,
                      table=table)
    evaluate = None if eval_split is None else open_bags(source, dataset, encoder, eval_split,
                                                         storage_options=storage_options, token=token, table=table)
    if evaluate is not None and evaluate.dim != train.dim:
        raise ShapeMismatch(f"{train_split} has {train.dim}-dim features but {eval_split} has {evaluate.dim}: "
                            "train and eval splits must come from the same encoder")
    return train, evaluate


def _run(train: Any, evaluate: Any, *, folds: int | None, num_classes: int, seeds: int | Sequence[int],
         epochs: int | None, lr: float | None, batch_size: int, max_patches: int | None, device: str, loader: str,
         log: Callable[[str], None] | None, recorder: Any = None, group_by: GroupSpec | str | None = None,
         predictions: Any = None) -> dict[str, Any]:
    from featurestore.probes.abmil import ABMILConfig, train_abmil
    from featurestore.probes.train import resolve_device

    seed_list = seed_list_of(seeds)
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("max_patches", max_patches)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidOption(f"{name} must be a positive integer, but got: {value!r}")
    if loader not in LOADERS:
        raise InvalidOption(f"loader must be one of {', '.join(LOADERS)}, but got: {loader!r}")
    # (train bags, eval bags) per fold: positions into `train` (and `evaluate` for a second split),
    # only those labelled; empty bags are in them but the loaders leave them out.
    where = f"{train.dataset}/{train.encoder}"
    chance.check_two_classes(_labels_at(train, train.labelled), f"{where}/{train.split}",
                             "a slide-level probe needs slides of each class (--labels CSV --label-column COL "
                             "takes another task's labels)", getattr(train, "class_names", None))
    spec = GroupSpec.of(group_by)
    if spec is not None and folds is None:
        raise InvalidOption("--group-by groups the bags of --folds K: add --folds K, or drop --group-by")
    if folds is None:
        parts = [(train.labelled, evaluate.labelled)]
        chance.check_two_classes(_labels_at(evaluate, evaluate.labelled), f"{where}/{evaluate.split}",
                                 "evaluate on a split holding slides of each class, or use --folds K",
                                 getattr(evaluate, "class_names", None))
    else:
        name = f"{where}/{train.split}"
        groups = None if spec is None else bag_groups(train.bags, train.labelled, spec, name)
        parts = fold_parts(train.labels[train.labelled], train.labelled, folds, name, groups,
                           group_name=spec.column if spec else "group", names=getattr(train, "class_names", None))
    eval_ds = train if evaluate is None else evaluate
    baselines = chance.class_baselines([_labels_at(eval_ds, index) for _, index in parts])
    if num_classes < 2:
        raise InvalidOption(f"num_classes is {num_classes}: a probe needs at least 2 classes")
    if lr is not None and (not isinstance(lr, (int, float)) or not 0 < lr < math.inf):
        raise InvalidOption(f"lr must be a positive number, but got: {lr!r}")
    torch_device = resolve_device(device)
    config = ABMILConfig(**{k: v for k, v in (("epochs", epochs), ("lr", lr)) if v is not None})
    make = _loaders(train, evaluate, batch_size=batch_size, max_patches=max_patches, device=torch_device,
                    loader=loader)

    def train_fold(seed: int, fold: int) -> dict[str, float]:
        train_index, eval_index = parts[fold]
        train_batches, eval_batches = make(seed, train_index, eval_index)
        sink = None if recorder is None else recorder.sink(seed, fold, eval_index)
        predicted = None if predictions is None else predictions.sink(seed, fold, eval_index)
        return train_abmil(train_batches, eval_batches, in_dim=train.dim, num_classes=num_classes,
                           seed=seed, device=torch_device, config=config, attention_sink=sink,
                           prediction_sink=predicted)

    started = time.perf_counter()
    result = chance.run_fold_seeds(train_fold, len(parts), seed_list, baselines, log, train, folds)
    # Bags per training and evaluation set (for folds: those of the first fold).
    train_bags, eval_bags = len(parts[0][0]), len(parts[0][1])
    notes = [ds.label_summary for ds in (train, evaluate) if ds is not None and ds.label_summary]
    out = {
        "source": train.source, "dataset": train.dataset, "encoder": train.encoder, "dtype": train.stored_dtype,
        "train_split": train.split, "eval_split": evaluate.split if evaluate is not None else f"{folds} folds",
        "eval_dtype": evaluate.stored_dtype if evaluate is not None else train.stored_dtype,
        "folds": folds, "group_by": spec.column if spec else None, "train_samples": train_bags,
        "eval_samples": eval_bags, "eval_per_fold": [len(index) for _, index in parts] if folds else None,
        "patches": int(train.lengths.sum()), "sample_shape": ["bag", train.dim], "task": "abmil",
        "num_classes": num_classes, "device": str(torch_device), "loader": loader, "batch_size": batch_size,
        "max_patches": max_patches, "config": asdict(config), "seconds": time.perf_counter() - started,
        "label_notes": notes, **result,
    }
    if recorder is not None:
        out["attention"] = recorder.save(out)
    if predictions is not None:
        out["predictions"] = predictions.save()
    return out


def _labels_at(ds: Any, positions: np.ndarray) -> np.ndarray:
    """The labels of the bags at ``positions`` that the loaders yield (empty bags are left out)."""
    positions = positions[ds.lengths[positions] > 0]
    return np.asarray(ds.labels)[positions]


def _loaders(train: Any, evaluate: Any, *, batch_size: int, max_patches: int | None, device: Any,
             loader: str) -> Callable[[int, Any, Any], tuple[Any, Any]]:
    """``(seed, train positions, eval positions) -> (train batches, eval batches)``."""
    import torch

    eval_ds = evaluate if evaluate is not None else train
    if loader == "ram":
        from featurestore.probes.bag_ram import BagTensorLoader, read_bags

        held = {id(train): read_bags(train)}
        if eval_ds is not train:
            held[id(eval_ds)] = read_bags(eval_ds)

        def ram(seed: int, train_index: Any, eval_index: Any) -> tuple[Any, Any]:
            return (BagTensorLoader(*held[id(train)], batch_size=batch_size, shuffle=True, seed=seed,
                                    max_patches=max_patches, bucket=batch_size > 1, indices=train_index, device=device),
                    BagTensorLoader(*held[id(eval_ds)], batch_size=1, shuffle=False, indices=eval_index, device=device))

        return ram
    from client import BagLoader

    def stream(seed: int, train_index: Any, eval_index: Any) -> tuple[Any, Any]:
        return (BagLoader(train, batch_size=batch_size, shuffle=True, seed=seed, device=device, dtype=torch.float32,
                          max_patches=max_patches, bucket=batch_size > 1, indices=train_index),
                BagLoader(eval_ds, batch_size=1, shuffle=False, device=device, dtype=torch.float32,
                          indices=eval_index))

    return stream
