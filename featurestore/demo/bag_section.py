"""The demo's slide-bag section: MIL training streamed from bag splits, local and over HTTP.

1. :func:`make_bags` writes a synthetic cohort (:mod:`featurestore.demo.synthetic_bags`: slides
   whose label is carried by a few "tumour" patches; one empty slide in val) twice, as float32
   (``mil-fp32``) and float16 (``mil-fp16``) bag splits, before the store is served;
2. :func:`bag_section` streams one ``BagLoader`` epoch from disk and over HTTP, trains the ABMIL
   probe under K seeds per dtype (``compare_mil_probes``, the same check as ``featurestore probe
   --head abmil --compare``), and checks that seed 0 from the float32 store equals seed 0 from the
   same bags held in RAM (the parity the probe's test pins).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

DATASET = "slides"
ENCODERS = {"float32": "mil-fp32", "float16": "mil-fp16"}


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


def bag_section(store: str, url: str, size: str, seeds: int, log: Callable[[str], None]) -> dict[str, Any]:
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
        ram = run_mil_probe(store, DATASET, ENCODERS["float32"], train_split="train", eval_split="val", seeds=[0],
                            epochs=plan.epochs, device="auto", loader="ram")
    stream = out["compare"]["b"]["runs"][0]
    out["parity"] = {"stream": stream, "ram": ram["runs"][0], "identical": stream == ram["runs"][0]}
    return out


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


__all__ = ["BAG_SIZES", "DATASET", "ENCODERS", "bag_section", "make_bags"]
