"""The demo's slide-bag section: MIL training streamed from bag splits, local and over HTTP.

1. :func:`make_bags` writes a synthetic cohort (:mod:`featurestore.demo.synthetic_bags`: slides
   whose label is carried by a few "tumour" patches; one empty slide in val) three times, as
   float32 (``mil-fp32``), float16 (``mil-fp16``) and int8 (``mil-int8``) bag splits, before the
   store is served;
2. :func:`bag_section` streams one ``BagLoader`` epoch from disk and over HTTP, trains the ABMIL
   probe under K seeds per dtype (``compare_mil_probes``, the same check as ``featurestore probe
   --head abmil --compare``: float16 and int8, each against float32), and checks that seed 0 from the float32 store equals seed 0 from the
   same bags held in RAM (the parity the probe's test pins);
3. the cohort workflow: a clinical table of its own (:func:`write_clinical_table`: a second task,
   the slides' grade as text, and a case id grouping two slides per patient) is the ABMIL probe's
   task (``--labels``), whose attention over the val slides is saved in the store and drawn for one
   slide by the web page's own picture code into ``<workdir>/attention_<slide>.png``; and mean
   slide embeddings (``featurestore embed --slide-encoder mean``) of both dtypes, scored by the
   linear probe beside ABMIL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from featurestore.demo.synthetic_bags import PATCH_PX

DATASET = "slides"
ENCODERS = {"float32": "mil-fp32", "float16": "mil-fp16", "int8": "mil-int8"}
EMBEDDED = ("float32", "float16")  # the dtypes whose mean embeddings the linear probe compares
TABLE, TASK, CASE = "clinical.csv", "grade", "case_id"
GRADES = ("low", "high")  # by the synthetic label: "high" slides carry the planted tumour patches
ATTENTION = "demo"
LINEAR_SEEDS = 3


@dataclass(frozen=True)
class BagPlan:
    train: int  # slides
    val: int
    dim: int
    patches: tuple[int, int]  # min, max patches per slide
    epochs: int


# A few seconds on 2 cores either way: the probe's cost is slides x patches x epochs x seeds.
BAG_SIZES = {
    "small": BagPlan(train=32, val=16, dim=32, patches=(20, 120), epochs=8),
    "default": BagPlan(train=64, val=32, dim=64, patches=(40, 400), epochs=6),
}


def make_bags(store: str, size: str) -> dict[str, Any]:
    from featurestore.demo.synthetic_bags import write_bag_splits

    plan = BAG_SIZES[size]
    began = time.perf_counter()
    low, high = plan.patches
    counts = write_bag_splits(store, DATASET, ENCODERS, {
        "train": {"num": plan.train, "seed": 10, "min_patches": low, "max_patches": high},
        "val": {"num": plan.val, "seed": 11, "min_patches": low, "max_patches": high, "empty": 1},
    }, dim=plan.dim)
    return {"plan": asdict(plan), "seconds": time.perf_counter() - began, **counts}


def bag_section(store: str, url: str, size: str, seeds: int, log: Callable[[str], None], workdir: str
                ) -> dict[str, Any]:
    import warnings

    from featurestore.probes.mil_run import compare_mil_probes, run_mil_probe

    plan = BAG_SIZES[size]
    out: dict[str, Any] = {"plan": asdict(plan)}
    with warnings.catch_warnings():  # the val split's empty slide is left out, as documented
        warnings.simplefilter("ignore")
        out["loader"] = {"local": _epoch(store), "http": _epoch(url)}
        out["compare"] = compare_mil_probes(store, DATASET, ENCODERS["float16"], ENCODERS["float32"],
                                            train_split="train", eval_split="val", seeds=seeds, epochs=plan.epochs,
                                            device="auto", log=lambda line: log(f"      {line}"))
        out["compare_int8"] = compare_mil_probes(store, DATASET, ENCODERS["int8"], ENCODERS["float32"],
                                                 train_split="train", eval_split="val", seeds=seeds,
                                                 epochs=plan.epochs, device="auto",
                                                 log=lambda line: log(f"      {line}"))
        ram = run_mil_probe(store, DATASET, ENCODERS["float32"], train_split="train", eval_split="val", seeds=[0],
                            epochs=plan.epochs, device="auto", loader="ram")
        stream = out["compare"]["b"]["runs"][0]
        out["cohort"] = cohort_section(store, workdir, size, log)
    out["parity"] = {"stream": stream, "ram": ram["runs"][0], "identical": stream == ram["runs"][0]}
    return out


def write_clinical_table(path: str, size: str) -> str:
    """The demo's own clinical table (CSV: slide_id, grade, case_id). Train and val slides share
    ids (``slide-0000`` ...) and the label pattern (odd ids positive), so one row per id labels both
    splits; two consecutive slides make one case."""
    import csv

    plan = BAG_SIZES[size]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["slide_id", TASK, CASE])
        for i in range(max(plan.train, plan.val)):
            writer.writerow([f"slide-{i:04d}", GRADES[i % 2], f"case-{i // 2:04d}"])
    return path


def cohort_section(store: str, workdir: str, size: str, log: Callable[[str], None]) -> dict[str, Any]:
    """The table's task under ABMIL with its attention drawn for one slide; mean embeddings under
    the linear probe, per dtype."""
    from featurestore.probes.labels import read_label_table
    from featurestore.probes.mil_run import run_mil_probe

    plan = BAG_SIZES[size]
    table_path = write_clinical_table(os.path.join(workdir, TABLE), size)
    table = read_label_table(table_path, TASK, "slide_id")
    began = time.perf_counter()
    task = run_mil_probe(store, DATASET, ENCODERS["float32"], train_split="train", eval_split="val", seeds=[0],
                         epochs=plan.epochs, device="auto", labels=table, save_attention=ATTENTION)
    picture = _draw_attention(store, workdir, table)
    log(f"      {TASK} from {table_path}: ABMIL AUC {task['metrics']['auc']['mean']:.4f} (seed 0); attention map "
        f"{ATTENTION!r} of {picture['slide']} -> {picture['path']}")
    out: dict[str, Any] = {"table": table_path, "task": task, "attention": picture,
                           "task_seconds": time.perf_counter() - began}
    out["embeddings"] = _mean_embeddings(store)
    from featurestore.probes.run import compare_probes

    out["linear"] = compare_probes(store, DATASET, _mean_name(ENCODERS["float16"]), _mean_name(ENCODERS["float32"]),
                                   train_split="train", eval_split="val", seeds=LINEAR_SEEDS, batch_size=8,
                                   device="auto")
    return out


def _draw_attention(store: str, workdir: str, table: Any) -> dict[str, Any]:
    """The web page's attention picture of the first evaluated "high" val slide, as a PNG file."""
    import numpy as np

    import featurestore
    from featurestore.core.bag_attention import open_attention
    from server.web import pictures
    from server.web.png import encode_png

    opened = featurestore.open_store(store)
    bags = opened.open_bags(DATASET, ENCODERS["float32"], "val")
    amap = open_attention(opened.storage, bags.key, ATTENTION, bags.metadata)
    high = table.classes.index("high")  # text labels: class ids by the table's own order
    for i, bag_id in enumerate(bags.ids):
        weights = amap.bag(i, bags.offsets)
        if weights is not None and table.values.get(bag_id) == high:
            break
    else:  # the val split holds several non-empty "high" slides, all evaluated
        raise AssertionError("the probe evaluated no 'high' val slide")
    coords = bags.coords.read_numpy(bags.rows_of(i)).astype(np.float64)
    image = pictures.slide_map(coords, pictures.ranks(weights), patch=PATCH_PX)
    path = os.path.join(workdir, f"attention_{bag_id}.png")
    with open(path, "wb") as f:
        f.write(encode_png(image))
    return {"slide": bag_id, "path": path, "shape": list(image.shape), "patches": len(weights)}


def _mean_name(encoder: str) -> str:
    return f"{encoder}-mean"


def _mean_embeddings(store: str) -> dict[str, Any]:
    """``featurestore embed --slide-encoder mean`` over both dtypes' train and val bags, stored in
    the bags' dtype (the val split's empty slide skipped: it has no patches to average)."""
    from featurestore.embed.run import EmbedOptions, embed

    began, rows = time.perf_counter(), 0
    for dtype, encoder in ((d, ENCODERS[d]) for d in EMBEDDED):  # each embedding stored in its bags' dtype
        for split in ("train", "val"):
            result = embed(EmbedOptions(store=store, dataset=DATASET, encoder=encoder, split=split, slide_encoder="mean",
                                        encoder_name=_mean_name(encoder), dtype=dtype, empty_bags="skip",
                                        device="cpu"))
            rows += result.num_rows
    return {"rows": rows, "seconds": time.perf_counter() - began}


def _epoch(source: str) -> dict[str, Any]:
    """One shuffled BagLoader epoch (batch 1, float32 on the CPU) of the float16 train bags."""
    import torch

    from client import BagDataset, BagLoader

    ds = BagDataset(source, DATASET, ENCODERS["float16"], "train")
    loader = BagLoader(ds, batch_size=1, shuffle=True, seed=0, device="cpu", dtype=torch.float32)
    began, patches = time.perf_counter(), 0
    for features, _mask, _coords, _labels in loader:
        patches += features.shape[1]
    seconds = time.perf_counter() - began
    return {"bags": len(loader), "patches": patches, "seconds": seconds,
            "gb_per_s": patches * ds.row_nbytes / seconds / 1e9}


__all__ = ["BAG_SIZES", "DATASET", "ENCODERS", "bag_section", "cohort_section", "make_bags", "write_clinical_table"]
