"""``extract --images wsi:... --coords-from D/E/S``: cut each slide at an existing bag split's coordinates.

Models that take several encoders' features of one patch (multi-encoder MIL, feature fusion) need
the bags of each encoder to hold the same patches in the same order. Re-running the grid and the
tissue detection would usually give the same patches, but not by contract (another ``--tissue``,
``--min-tissue``, a changed thumbnail rule); so the second encoder's run reads the first split's
level-0 coordinates, row for row, instead of cutting its own.

Checked before any slide is read, each refused in one line: the source is a bag split in level-0
pixels, cut at this run's patch size and scale (``--patch-size``, ``--magnification``/``--mpp``,
``--slide-mpp``), and it has a bag for every slide of this run. A slide the source run skipped
(recorded in its ``skipped``) is skipped here too, by name. Per slide, the plan checks that the
slide still cuts patches of the source's level-0 size and that the coordinates lie inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.core.store import open_store
from featurestore.errors import FeatureStoreError, InvalidOption
from featurestore.extract.wsi import SlideRef, Target

# The Target fields that decide where patches fall and how big they are at level 0.
_SCALE_FLAGS = {"patch_size": "--patch-size", "magnification": "--magnification", "mpp": "--mpp",
                "slide_mpp": "--slide-mpp"}


@dataclass(frozen=True)
class FixedGrid:
    """One slide's patches as the source split has them (sent to the planner's workers)."""

    coords: np.ndarray | None  # int64 [n, 2] level-0 (x, y); None: the source run skipped the slide
    patch_size_level0: int | None
    source: str  # "D/E/S", for messages and the bag's attrs
    skipped: str = ""  # the source run's reason, when coords is None


@dataclass
class SourceGrid:
    """Every slide's :class:`FixedGrid` by slide id, and the lineage the new split records."""

    slides: dict[str, FixedGrid]
    lineage: dict[str, Any]


def parse_source(spec: str) -> tuple[str, str, str]:
    parts = spec.split("/")
    if len(parts) != 3 or not all(parts):
        raise InvalidOption(f"--coords-from takes DATASET/ENCODER/SPLIT of a bag split, but got: {spec!r}")
    return parts[0], parts[1], parts[2]


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return float(a) == float(b)


def check_patching(recorded: Any, target: Target, spec: str) -> None:
    """Refuse a source cut at another patch size or scale, naming both values."""
    if not isinstance(recorded, dict) or "patch_size" not in recorded:
        raise InvalidOption(f"--coords-from {spec} records no slide patching (it was not written by "
                            "`featurestore extract --images wsi:...`): give a slide extraction's split")
    ours = target.to_dict()
    for key, flag in _SCALE_FLAGS.items():
        if not _same(recorded.get(key), ours[key]):
            raise InvalidOption(f"--coords-from {spec} was cut with {key} {recorded.get(key)}, but this run has "
                                f"{flag} {ours[key]}: give {flag} {recorded.get(key)} (the same patches need the "
                                "same patch settings)")


def load_source(spec: str, store_url: str, coords_store: str | None, storage_options: dict[str, Any],
                refs: list[SlideRef], target: Target) -> SourceGrid:
    """Read the source split's coordinates for every slide of ``refs`` (from ``coords_store``, else
    the run's own store); refuse what cannot align."""
    dataset, encoder, split = parse_source(spec)
    source = open_store(coords_store or store_url, mode="r", **storage_options).open_bags(dataset, encoder, split)
    if source.coords_unit != "px":
        raise InvalidOption(f"--coords-from {spec} has coords in {source.coords_unit!r}, not level-0 px: "
                            "only a slide extraction's coordinates can be read again from the slides")
    meta = source.metadata
    check_patching((meta.get("preprocessing") or {}).get("patching"), target, spec)
    skipped = {s.get("id"): s.get("reason", "") for s in meta.get("skipped") or [] if isinstance(s, dict)}
    have = set(source.ids)
    slides: dict[str, FixedGrid] = {}
    for ref in refs:
        if ref.id in have:
            coords = np.ascontiguousarray(source.coords.read_numpy(source.rows_of(ref.id)), dtype=np.int64)
            size = source.attrs(ref.id).get("patch_size_level0")
            slides[ref.id] = FixedGrid(coords, None if size is None else int(size), spec)
        elif ref.id in skipped:
            slides[ref.id] = FixedGrid(None, None, spec, skipped[ref.id])
        else:
            raise InvalidOption(f"slide {ref.id} ({ref.path}) has no bag in --coords-from {spec} "
                                f"({len(have)} bags): extract it there first, or leave it out of --images")
    lineage = {"dataset": dataset, "encoder": encoder, "split": split, "generation": meta.get("generation")}
    if coords_store is not None:
        lineage["store"] = coords_store
    return SourceGrid(slides, lineage)


def fixed_coords(fixed: FixedGrid, ref: SlideRef, patch_size_level0: int, width: int, height: int) -> np.ndarray:
    """The slide's coordinates from the source, after checking they still fit this slide."""
    if fixed.coords is None:
        raise FeatureStoreError(f"skipped in --coords-from {fixed.source}: {fixed.skipped}")
    if fixed.patch_size_level0 is not None and fixed.patch_size_level0 != patch_size_level0:
        raise FeatureStoreError(f"slide {ref.path!r} cuts {patch_size_level0} px patches at level 0, but its bag in "
                                f"--coords-from {fixed.source} has {fixed.patch_size_level0} px: not the same scan")
    coords = fixed.coords
    if len(coords) and (coords.min() < 0 or (coords[:, 0] + patch_size_level0).max() > width
                        or (coords[:, 1] + patch_size_level0).max() > height):
        raise FeatureStoreError(f"slide {ref.path!r} ({width} x {height} px) does not hold the patches of its bag "
                                f"in --coords-from {fixed.source}: not the same scan")
    return coords


__all__ = ["FixedGrid", "SourceGrid", "check_patching", "fixed_coords", "load_source", "parse_source"]
