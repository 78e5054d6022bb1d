"""Reference probes on frozen features, and the check of whether a storage dtype moves a metric.

The public entry points (``featurestore probe`` is their command line):

- :func:`run_probe`: train the reference probe for one encoder's split under K seeds and score it
  on another split, or (linear) on K folds of it, grouped by patient if asked
  (:mod:`featurestore.probes.dense_folds`) -> mean ± std per metric;
- :func:`compare_probes`: the same for two encoder names holding the same images (e.g. the
  features stored as float16 and as float32), plus, per metric, the difference and whether it
  exceeds the run-to-run spread (:func:`featurestore.probes.compare.compare_summaries`).

The probes themselves train from any iterable of ``(features, labels)`` batches, so they run the
same on ``client.FeatureLoader`` (streaming from a store, local or over HTTP) and on an in-RAM
:class:`~featurestore.probes.train.TensorLoader`:
:func:`~featurestore.probes.linear.train_linear_probe` (AUC, balanced accuracy, macro-F1) and
:func:`~featurestore.probes.seg.train_seg_probe` (per-image macro Jaccard). Metric definitions
and how to read a comparison: ``docs/PROBES.md``. Torch and the client are imported inside the
functions, so importing this module (and ``featurestore --help``) stays cheap.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from featurestore.errors import InvalidLabels, InvalidOption, MissingLabels, ShapeMismatch, StaleSplitWarning
from featurestore.probes import chance
from featurestore.probes.compare import SPREAD_FACTOR, compare_summaries, seed_list_of
from featurestore.probes.groups import GroupSpec
from featurestore.probes.labels import LabelTable

__all__ = ["SplitInfo", "compare_probes", "describe_split", "detect_task", "num_classes_of", "run_probe",
           "token_layout"]

TASKS = ("auto", "linear", "seg")
LOADERS = ("stream", "ram")


# --------------------------------------------------------------------------- split description


@dataclass(frozen=True)
class SplitInfo:
    """One opened split: what the probe needs to know before reading any features."""

    source: str
    dataset: str
    encoder: str
    split: str
    num_samples: int
    sample_shape: tuple[int, ...]
    dtype: str
    label_shape: tuple[int, ...] | None  # None: the split has no labels
    metadata: dict[str, Any]
    ds: Any = field(repr=False, compare=False)  # the client.FeatureDataset it was read from
    stale: str | None = None  # a derived split whose source changed since (client.stale)

    @property
    def name(self) -> str:
        return f"{self.dataset}/{self.encoder}/{self.split}"


def describe_split(
    source: str,
    dataset: str,
    encoder: str,
    split: str,
    *,
    storage_options: dict[str, Any] | None = None,
    token: str | None = None,
) -> SplitInfo:
    """Open a split through ``client.FeatureDataset``: a store path, fsspec URL or http(s) server."""
    from client import FeatureDataset

    http = source.startswith(("http://", "https://"))
    with warnings.catch_warnings():  # a stale split: the report says so (result["stale"])
        warnings.simplefilter("ignore", StaleSplitWarning)
        ds = FeatureDataset(source, dataset, encoder, split, storage_options=None if http else storage_options,
                            token=token if http else None)
    return SplitInfo(
        source=source, dataset=dataset, encoder=encoder, split=split,
        num_samples=int(ds.num_samples), sample_shape=tuple(ds.sample_shape), dtype=ds.stored_dtype,
        label_shape=tuple(ds.label_shape) if ds.has_labels else None,
        metadata=dict(ds.metadata), ds=ds,
        stale=ds.stale,
    )


def detect_task(info: SplitInfo, task: str = "auto") -> str:
    """``auto``: labels with a spatial shape ``[H, W]`` -> ``seg``; one id per sample -> ``linear``."""
    if task not in TASKS:
        raise InvalidOption(f"task must be one of {', '.join(TASKS)}, but got: {task!r}")
    if info.label_shape is None:
        raise MissingLabels(
            f"split {info.name} has no labels, so no probe can be trained on it; write labels "
            "with the features (featurestore extract --labels ..., or a labelled source)"
        )
    spatial = len(info.label_shape) >= 2
    if task == "auto":
        return "seg" if spatial else "linear"
    if task == "seg" and not spatial:
        raise InvalidLabels(
            f"task seg needs class maps [H, W] per sample, but {info.name} has labels of shape "
            f"{list(info.label_shape)}; use task linear"
        )
    if task == "linear" and info.label_shape not in ((), (1,)):
        raise InvalidLabels(
            f"task linear needs one class id per sample, but {info.name} has labels of shape "
            f"{list(info.label_shape)}; use task seg"
        )
    return task


def token_layout(info: SplitInfo) -> tuple[tuple[int, int] | None, int]:
    """``(grid, prefix tokens still present in the features)`` from ``metadata["token_layout"]``.

    A store written with ``tokens=patch`` has dropped the prefix tokens but still records how
    many the encoder had, so the prefix counts only when the token count says it is there.
    """
    layout = info.metadata.get("token_layout") or {}
    grid_value = layout.get("grid")
    grid = (int(grid_value[0]), int(grid_value[1])) if grid_value else None
    prefix = int(layout.get("prefix_tokens") or 0)
    if len(info.sample_shape) < 2 or (grid is not None and info.sample_shape[0] == grid[0] * grid[1]):
        prefix = 0
    return grid, prefix


def num_classes_of(infos: Sequence[SplitInfo]) -> int:
    """The class count: ``label_info.classes`` or ``num_classes`` in metadata, else max label + 1.

    The scan reads labels only (never features), 4096 rows at a time.
    """
    for info in infos:
        label_info = info.metadata.get("label_info") or {}
        if label_info.get("classes"):
            return len(label_info["classes"])
        if info.metadata.get("num_classes"):
            return int(info.metadata["num_classes"])
    top = -1
    for info in infos:
        labels = info.ds.array.labels
        for start in range(0, info.num_samples, 4096):
            values = chance.class_ids(labels.read_range(start, min(start + 4096, info.num_samples)),
                                      f"split {info.name}, samples from {start}")
            if values.size and int(values.min()) < 0:
                raise InvalidLabels(f"split {info.name} has negative labels; class ids must be >= 0")
            top = max(top, int(values.max()) if values.size else -1)
    return top + 1


# --------------------------------------------------------------------------------- running


def run_probe(
    source: str,
    dataset: str,
    encoder: str,
    *,
    train_split: str,
    eval_split: str | None = None,
    task: str = "auto",
    seeds: int | Sequence[int] = 3,
    epochs: int | None = None,
    lr: float | None = None,
    batch_size: int = 64,
    device: str = "auto",
    num_classes: int | None = None,
    pool: str | None = None,
    loader: str = "stream",
    storage_options: dict[str, Any] | None = None,
    token: str | None = None,
    log: Callable[[str], None] | None = None,
    labels: LabelTable | None = None,
    folds: int | None = None,
    group_by: GroupSpec | str | None = None,
    save_predictions: str | None = None,
) -> dict[str, Any]:
    """Train the reference probe on ``train_split`` under each seed and score it on ``eval_split``,
    or (linear probe) on ``folds`` stratified folds of ``train_split``, grouped by ``group_by`` (a
    column: groups from the lineage, or a :class:`~featurestore.probes.groups.GroupSpec` with a table).

    ``source``: store path, fsspec URL (with ``storage_options``) or ``http(s)://`` server (with
    ``token``). ``seeds``: a count K (seeds ``0..K-1``) or explicit seeds. ``epochs`` and ``lr``:
    default per task (``LinearProbeConfig``: 20 epochs, lr 1e-2; ``SegProbeConfig``: 10 epochs,
    lr 1e-3); small splits give few optimizer steps per epoch, so raise ``epochs`` or lower
    ``batch_size`` there. ``loader``: ``"stream"`` (``client.FeatureLoader``) or ``"ram"`` (the
    split read into host RAM as float32 first, the classic cache). ``log`` receives one line per
    seed. ``labels``: a task's labels from a table (:mod:`featurestore.probes.labels`), matched by
    sample id (linear probe; samples it does not label are left out). ``save_predictions``: the
    linear head's class probabilities per seed, fold and sample as a CSV (featurestore.probes.
    predictions). Returns the setup, every run's metrics, under ``"metrics"`` each metric's
    ``{"mean", "std", "values"}`` (std over seeds, ddof=1; None with one seed), under ``"chance"``
    its chance baseline (:mod:`featurestore.probes.chance`) and under ``"stale"`` the reason of
    each stale derived split it read (:mod:`client.stale`).
    """
    infos = [describe_split(source, dataset, encoder, split, storage_options=storage_options, token=token)
             for split in _splits(train_split, eval_split, folds, group_by)]
    task = _resolve_task(infos, task, labels)
    num_classes = num_classes if num_classes is not None else _classes(infos, labels)
    return _run(infos[0], infos[-1], task=task, num_classes=num_classes, seeds=seeds, epochs=epochs, lr=lr,
                batch_size=batch_size, device=device, pool=pool, loader=loader, log=log, table=labels,
                folds=(folds, group_by, storage_options, token), predictions=save_predictions)


def compare_probes(
    source: str,
    dataset: str,
    encoder: str,
    compare_encoder: str,
    *,
    train_split: str,
    eval_split: str | None = None,
    compare_source: str | None = None,
    task: str = "auto",
    seeds: int | Sequence[int] = 3,
    epochs: int | None = None,
    lr: float | None = None,
    batch_size: int = 64,
    device: str = "auto",
    num_classes: int | None = None,
    pool: str | None = None,
    loader: str = "stream",
    storage_options: dict[str, Any] | None = None,
    token: str | None = None,
    log: Callable[[str], None] | None = None,
    labels: LabelTable | None = None,
    folds: int | None = None,
    group_by: GroupSpec | str | None = None,
) -> dict[str, Any]:
    """Run the same probe, seeds, folds and batches on ``encoder`` (A) and ``compare_encoder`` (B).

    B is read from ``compare_source`` (default: ``source``), so a store can also be compared with
    its copy served over HTTP. Seed k gives A and B the same initialisation and batch order, so
    identical features give identical metrics. Other arguments as :func:`run_probe`. Returns
    ``{"a": run, "b": run, "comparison": {metric: {...}}, "rule": str}``; the comparison fields
    are those of :func:`compare_summaries`.
    """
    compare_source = compare_source or source
    splits = _splits(train_split, eval_split, folds, group_by) * (2 if eval_split is None else 1)
    infos = [
        describe_split(src, dataset, enc, split, storage_options=storage_options, token=token)
        for src, enc in ((source, encoder), (compare_source, compare_encoder))
        for split in splits
    ]
    # One task and one class count for both sides, or the two metrics would not be comparable.
    task = _resolve_task(infos, task, labels)
    num_classes = num_classes if num_classes is not None else _classes(infos, labels)
    for a_info, b_info in zip(infos[:2], infos[2:]):
        if a_info.num_samples != b_info.num_samples:
            raise ShapeMismatch(
                f"{a_info.name} has {a_info.num_samples} samples but {b_info.name} has "
                f"{b_info.num_samples}: compare the same images stored twice"
            )
    options: dict[str, Any] = dict(task=task, num_classes=num_classes, seeds=seeds, epochs=epochs,
                                   lr=lr, batch_size=batch_size, device=device, pool=pool, loader=loader,
                                   log=log, table=labels, folds=(folds, group_by, storage_options, token))
    a = _run(infos[0], infos[1], **options)
    b = _run(infos[2], infos[3], **options)
    comparison = compare_summaries(a, b)
    chance.mark_comparison(comparison, a, b)
    return {
        "a": a,
        "b": b,
        "comparison": comparison,
        "rule": (
            f"diff = mean(A) - mean(B); std = sample std over seeds (ddof=1); pooled std = "
            f"sqrt((std_A^2 + std_B^2) / 2); exceeds spread = |diff| > {SPREAD_FACTOR:g} x pooled std"
        ),
    }


def _splits(train_split: str, eval_split: str | None, folds: int | None, group_by: Any) -> list[str]:
    if (eval_split is None) == (folds is None):
        raise InvalidOption("give either an eval split (--eval SPLIT) or a number of folds (--folds K), not both and "
                            "not neither")
    if group_by is not None and folds is None:
        raise InvalidOption("--group-by groups the samples of --folds K: add --folds K, or drop --group-by")
    return [train_split] if eval_split is None else [train_split, eval_split]


def _resolve_task(infos: Sequence[SplitInfo], task: str, table: LabelTable | None = None) -> str:
    if table is not None:  # one label per slide: whatever the splits store (class maps are refused later)
        if task not in ("auto", "linear"):
            raise InvalidOption(f"--labels gives one label per slide: task linear, not {task}")
        return "linear"
    tasks = {detect_task(info, task) for info in infos}
    if len(tasks) > 1:
        raise ShapeMismatch(
            "the splits disagree on the task (some have class maps, some class ids): "
            + ", ".join(f"{i.name} labels {list(i.label_shape or ())}" for i in infos)
        )
    return tasks.pop()


def _classes(infos: Sequence[SplitInfo], table: LabelTable | None) -> int:
    return table.num_classes if table is not None else num_classes_of(infos)


def _run(
    train: SplitInfo,
    evaluate: SplitInfo,
    *,
    task: str,
    num_classes: int,
    seeds: int | Sequence[int],
    epochs: int | None,
    lr: float | None,
    batch_size: int,
    device: str,
    pool: str | None,
    loader: str,
    log: Callable[[str], None] | None,
    table: LabelTable | None,
    folds: tuple[int | None, GroupSpec | str | None, dict[str, Any] | None, str | None] = (None, None, None, None),
    predictions: str | None = None,
) -> dict[str, Any]:
    """``folds``: ``(K, grouping, storage_options, token)``; K None: train on ``train``, score on ``evaluate``."""
    from featurestore.probes.dense_folds import fold_pairs
    from featurestore.probes.dense_labels import dense_baselines, read_all, table_labels
    from featurestore.probes.linear import LinearProbeConfig, train_linear_probe
    from featurestore.probes.predictions import PredictionRecorder
    from featurestore.probes.seg import SegProbeConfig, train_seg_probe
    from featurestore.probes.train import resolve_device

    seed_list = seed_list_of(seeds)
    for name, value in (("epochs", epochs), ("batch_size", batch_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidOption(f"{name} must be a positive integer, but got: {value!r}")
    if task == "linear" and batch_size == 1:  # every batch would be skipped: an untrained head scored
        raise InvalidOption("batch_size 1 with the linear head: its BatchNorm trains on 2 samples a batch at least; "
                            "give --batch-size 2 or more")
    if loader not in LOADERS:
        raise InvalidOption(f"loader must be one of {', '.join(LOADERS)}, but got: {loader!r}")
    # Labels first: one class is refused with what the labels hold, not only a class count.
    n_folds, spec, storage_options, token = folds
    spec = GroupSpec.of(spec)
    if n_folds is not None and task != "linear":
        raise InvalidOption(f"--folds K applies to the linear and abmil heads, not to task {task}")
    if n_folds is None:
        matched = None if table is None else (table_labels(train, table), table_labels(evaluate, table))
        baselines = dense_baselines(train, evaluate, task, num_classes, matched)
        pairs, groups = [matched], None
    else:
        pairs, baselines, groups = fold_pairs(train, None if table is None else table_labels(train, table),
                                              n_folds, spec, storage_options=storage_options, token=token)
        matched = pairs[0]
    if num_classes < 2:
        raise InvalidOption(f"num_classes is {num_classes}: a probe needs at least 2 classes")
    if train.sample_shape != evaluate.sample_shape:
        raise ShapeMismatch(
            f"{train.name} has samples of shape {list(train.sample_shape)} but {evaluate.name} has "
            f"{list(evaluate.sample_shape)}: train and eval splits must come from the same encoder"
        )
    torch_device = resolve_device(device)
    grid, prefix = token_layout(train)
    if lr is not None and (not isinstance(lr, (int, float)) or not 0 < lr < math.inf):
        raise InvalidOption(f"lr must be a positive number, but got: {lr!r}")
    overrides: dict[str, Any] = {"epochs": epochs, "lr": lr}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if task == "seg" and pool is not None:
        raise InvalidOption(f"pool {pool!r} (--pool) pools a sample's tokens for the linear head; a seg task "
                            "predicts every patch: leave it out")
    config: Any = (SegProbeConfig(**overrides) if task == "seg"
                   else LinearProbeConfig(pool=pool or "mean", prefix_tokens=prefix, **overrides))
    if predictions is not None and task != "linear":
        raise InvalidOption(f"--save-predictions applies to the linear and abmil heads, not to task {task}")
    recorder = None if predictions is None else PredictionRecorder.of_split(
        predictions, evaluate, num_classes=num_classes, table=table, group_by=spec, groups=groups)
    held = None if loader != "ram" or n_folds is None else read_all(train)
    makes = [_batches(train, evaluate, batch_size=batch_size, device=torch_device, loader=loader,
                      matched=pair, held=held) for pair in pairs]

    def train_fold(seed: int, fold: int) -> dict[str, float]:
        train_batches, eval_batches = makes[fold](seed)
        if task == "seg":
            return train_seg_probe(train_batches, eval_batches, num_classes=num_classes, grid=grid,
                                   prefix_tokens=prefix, seed=seed, device=torch_device, config=config)
        sink = None if recorder is None else recorder.sink(seed, fold, None if pairs[fold] is None else
                                                             pairs[fold][1].positions)
        return train_linear_probe(train_batches, eval_batches, num_classes=num_classes,
                                  seed=seed, device=torch_device, config=config, prediction_sink=sink)

    started = time.perf_counter()
    result = chance.run_fold_seeds(train_fold, len(makes), seed_list, baselines, log, train, n_folds)
    return {
        "source": train.source, "dataset": train.dataset, "encoder": train.encoder,
        "dtype": train.dtype, "eval_dtype": evaluate.dtype, "train_split": train.split,
        "eval_split": evaluate.split if n_folds is None else f"{n_folds} folds", "folds": n_folds,
        "group_by": None if spec is None else spec.column,
        "train_samples": train.num_samples if matched is None else len(matched[0].positions),
        "eval_samples": evaluate.num_samples if matched is None else len(matched[1].positions),
        "eval_per_fold": [len(pair[1].positions) for pair in pairs] if n_folds is not None else None,
        "sample_shape": list(train.sample_shape), "task": task, "num_classes": num_classes,
        "token_grid": None if grid is None else list(grid), "prefix_tokens_dropped": prefix,
        "device": str(torch_device), "loader": loader, "batch_size": batch_size,
        "config": asdict(config), "seconds": time.perf_counter() - started,
        "label_notes": [] if matched is None else [m.summary for m in matched if m.summary], **result,
        "stale": {i.name: i.stale for i in (train, evaluate) if i.stale},
        **({} if recorder is None else {"predictions": recorder.save()}),
    }


def _batches(
    train: SplitInfo, evaluate: SplitInfo, *, batch_size: int, device: Any, loader: str,
    matched: Any = None, held: Any = None,
) -> Callable[[int], tuple[Any, Any]]:
    """``seed -> (train batches, eval batches)``; datasets (or RAM copies) are reused across seeds.
    ``matched``: a table's labels of both splits (the labelled samples only, with those labels), or
    a fold's train and eval samples. ``held``: the split already in RAM (folds of one split)."""
    import torch

    from featurestore.probes.dense_labels import read_all

    if matched is not None:
        from featurestore.probes.dense_labels import TableBatches

        rams = [held or (read_all(i) if loader == "ram" else None) for i in (train, evaluate)]
        return lambda seed: (
            TableBatches(train, matched[0], batch_size=batch_size, shuffle=True, seed=seed,
                         device=device, held=rams[0]),
            TableBatches(evaluate, matched[1], batch_size=batch_size, shuffle=False, seed=0,
                         device=device, held=rams[1]),
        )
    if loader == "ram":
        from featurestore.probes.train import TensorLoader

        train_x, train_y = read_all(train)
        eval_x, eval_y = read_all(evaluate)
        return lambda seed: (
            TensorLoader(train_x, train_y, batch_size=batch_size, shuffle=True, seed=seed,
                         device=device),
            TensorLoader(eval_x, eval_y, batch_size=batch_size, shuffle=False, device=device),
        )
    from client import FeatureLoader

    # order="shuffle" (uniform rows) everywhere, not the loader's "auto", which picks a chunk-local
    # shuffle on object storage and HTTP: with one order for every source, seed k feeds A and B the
    # same batches even when one side is local and the other remote.
    return lambda seed: (
        FeatureLoader(train.ds, batch_size=batch_size, shuffle=True, seed=seed, device=device,
                      dtype=torch.float32, order="shuffle"),
        FeatureLoader(evaluate.ds, batch_size=batch_size, shuffle=False, device=device,
                      dtype=torch.float32),
    )

