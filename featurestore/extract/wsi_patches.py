"""The DataLoader side of slide extraction: slide plans and patch reads in workers, batches across slides.

Two map-style datasets, each behind its own DataLoader:

* :class:`SlidePlanner`, item ``i`` -> the :class:`SlidePlan` of slide ``i`` (open it, its scale and
  level, the thumbnail's tissue mask, the kept grid patches) or a :class:`Skipped` with the one
  line that says why. Planning is per slide and independent of the run (workers, ranks, resume),
  so the same slide always gets the same patches.
* :class:`PatchReader`, item :class:`PatchKey` -> ``(key, image uint8 [3, P, P])`` or a
  :class:`Skipped` for that key's slide: one ``read_region`` at the plan's level, resized when the
  level does not match the target scale (bilinear, antialiased, rounded back to uint8). Patches
  cross from the workers as uint8, a quarter of float32's bytes, and :func:`to_encoder` makes
  them floats and normalises them on the encoder's device (``sources.Preprocessing.normalize``,
  the same float32 operations as every other source). Measured on 2 cores: normalising in the
  workers instead made them ~1.5x slower per patch than OpenSlide's own read, and the main
  thread waits for the workers whenever the encoder is fast.
  Each worker keeps a few slides open, with a small OpenSlide tile cache each (OpenSlide's cache
  otherwise grows per handle: MSKCC MIL #5).

:class:`PatchBatches` is the patch loader's ``batch_sampler``: it pulls plans from the planner's
loader as the patch loader asks for batches (on the main process's thread), records each plan
for the extraction loop, and cuts the patch keys of consecutive slides into batches of
``batch_size``, across slide boundaries, so the encoder always gets full batches.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from featurestore.errors import FeatureStoreError
from featurestore.extract.coords_from import FixedGrid, fixed_coords
from featurestore.extract.sources import Preprocessing
from featurestore.extract.tissue import patch_fractions, read_thumbnail, tissue_mask
from featurestore.extract.wsi import Geometry, SlideRef, Target, geometry, grid, open_slide, read_rgb

SLIDE_CACHE_BYTES = 32 << 20  # OpenSlide's tile cache per open slide in a worker (its default size, made explicit)
OPEN_SLIDES = 4  # slides a patch worker keeps open


@dataclass
class Skipped:
    """A slide that is left out of the split, and why (one line naming it)."""

    position: int  # in this run's slide order
    ref: SlideRef
    reason: str


@dataclass
class SlidePlan:
    """One slide, cut: the geometry, the kept patches' level-0 coordinates, per-bag attributes."""

    position: int
    ref: SlideRef
    geometry: Geometry
    coords: np.ndarray  # int64 [n, 2], (x, y) top-left at level 0, row-major
    attrs: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.coords)


@dataclass(frozen=True)
class PatchKey:
    """Everything a worker needs to read one patch (sent to it with the batch)."""

    position: int  # the slide's position in the run
    row: int  # the patch's row in the slide's bag
    path: str
    level: int
    x: int
    y: int
    read_size: int


@dataclass(frozen=True)
class Patching:
    """``--magnification/--mpp/--patch-size/--slide-mpp`` and ``--tissue/--min-tissue``."""

    target: Target
    tissue: str = "otsu"
    min_tissue: float = 0.5

    def to_dict(self) -> dict[str, Any]:
        return {**self.target.to_dict(), "tissue": self.tissue, "min_tissue": self.min_tissue,
                "grid": "non-overlapping, whole patches inside level 0, row-major",
                "coords": "level-0 px of the top-left corner, (x, y)"}


def plan_slide(position: int, ref: SlideRef, patching: Patching, fixed: FixedGrid | None = None) -> SlidePlan:
    """Open one slide and cut it (raises SlideError / FeatureStoreError on a bad slide); ``fixed``:
    the patches of another split's bag instead of the grid and tissue mask (extract.coords_from)."""
    slide = open_slide(ref.path)
    try:
        geo = geometry(slide.properties, slide.dimensions, tuple(slide.level_downsamples), patching.target,
                       ref.path)
        coords = grid(geo.width, geo.height, geo.patch_size_level0)
        attrs: dict[str, Any] = {"path": ref.path, "vendor": slide.properties.get("openslide.vendor"),
                                 "file_bytes": os.path.getsize(ref.path), **geo.attrs(),
                                 "grid_patches": len(coords), "tissue": patching.tissue}
        if fixed is not None:
            coords = fixed_coords(fixed, ref, geo.patch_size_level0, geo.width, geo.height)
            attrs.update(tissue=None, coords_from=fixed.source)
        elif patching.tissue == "otsu" and len(coords):
            thumb, scale = read_thumbnail(slide, geo.patch_size_level0, ref.path)
            mask, threshold = tissue_mask(thumb, geo.patch_size_level0 * scale[0])
            keep = patch_fractions(mask, coords, geo.patch_size_level0, scale) >= patching.min_tissue
            coords = coords[keep]
            attrs.update(saturation_threshold=threshold, tissue_fraction=float(mask.mean()))
        return SlidePlan(position, ref, geo, np.ascontiguousarray(coords, dtype=np.int64), attrs)
    finally:
        slide.close()


class SlidePlanner(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Item ``i``: the plan of ``refs[i]`` (its position in the run is ``i``), or a Skipped."""

    def __init__(self, refs: list[SlideRef], patching: Patching, fixed: dict[str, FixedGrid] | None = None) -> None:
        self.refs = refs
        self.patching = patching
        self.fixed = fixed  # by slide id: --coords-from

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, position: int) -> SlidePlan | Skipped:
        ref = self.refs[position]
        try:
            return plan_slide(position, ref, self.patching, None if self.fixed is None else self.fixed[ref.id])
        except FeatureStoreError as error:
            return Skipped(position, ref, str(error))
        except Exception as error:  # OpenSlide's or a codec's failure on a damaged slide
            return Skipped(position, ref, f"cannot read slide {ref.path!r}: {type(error).__name__}: {error}")


def resize_uint8(image: torch.Tensor, size: int) -> torch.Tensor:
    """``uint8 [3, h, w]`` -> ``uint8 [3, size, size]``: bilinear with antialiasing (as
    ``Preprocessing`` resizes), rounded back to uint8."""
    x = F.interpolate(image[None].float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x[0].round_().clamp_(0, 255).to(torch.uint8)


def to_encoder(images: torch.Tensor, preprocessing: Preprocessing, device: torch.device) -> torch.Tensor:
    """uint8 ``[B, 3, P, P]`` -> normalised float32 on ``device``."""
    x = images.to(device, non_blocking=True).float().div_(255.0)  # one new buffer, then in place
    return preprocessing.normalize(x, inplace=True)


class PatchReader(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Item ``key`` -> ``(key, uint8 image)``; a read failure becomes ``Skipped`` for the key's slide."""

    def __init__(self, patch_size: int) -> None:
        self.patch_size = patch_size
        self._open: OrderedDict[str, Any] = OrderedDict()

    def _slide(self, path: str) -> Any:
        slide = self._open.pop(path, None) or open_slide(path, SLIDE_CACHE_BYTES)
        self._open[path] = slide
        while len(self._open) > OPEN_SLIDES:
            self._open.popitem(last=False)[1].close()
        return slide

    def read(self, key: PatchKey) -> torch.Tensor:
        """The patch's pixels at its level, before resizing: ``uint8 [3, s, s]``."""
        size = (key.read_size, key.read_size)
        rgba = np.asarray(self._slide(key.path).read_region((key.x, key.y), key.level, size))
        if rgba[..., 3].min() == 255:  # the usual case: one copy, RGBA [s, s, 4] -> RGB [3, s, s]
            # numpy makes the copy: torch.from_numpy of PIL's read-only buffer would warn, and
            # silencing that with catch_warnings changes every thread's filters while it runs.
            return torch.from_numpy(np.ascontiguousarray(rgba.transpose(2, 0, 1)[:3]))
        composited = read_rgb(self._slide(key.path), (key.x, key.y), key.level, size)
        return torch.from_numpy(composited).permute(2, 0, 1).contiguous()

    def __getitem__(self, key: PatchKey) -> tuple[PatchKey, torch.Tensor] | Skipped:
        try:
            image = self.read(key)
            if key.read_size != self.patch_size:
                image = resize_uint8(image, self.patch_size)
            return key, image
        except Exception as error:  # a damaged tile: the slide is skipped, the cohort goes on
            self._open.pop(key.path, None)
            ref = SlideRef("", key.path)
            return Skipped(key.position, ref, f"cannot read slide {key.path!r} at level {key.level} "
                                              f"({key.x}, {key.y}): {type(error).__name__}: {error}")


def identity(item: Any) -> Any:
    """A DataLoader ``collate_fn`` that keeps items as they are (no numpy -> tensor conversion)."""
    return item


@dataclass
class PatchBatch:
    keys: list[PatchKey]
    images: torch.Tensor  # uint8 [len(keys), 3, P, P]
    skipped: list[Skipped]  # slides whose patch failed to read in this batch


def collate_patches(items: list[tuple[PatchKey, torch.Tensor] | Skipped]) -> PatchBatch:
    good = [item for item in items if not isinstance(item, Skipped)]
    # default_collate stacks straight into shared memory in a worker: no copy on the way out.
    images = torch.utils.data.default_collate([x for _, x in good]) if good else torch.empty(0)
    return PatchBatch([k for k, _ in good], images, [item for item in items if isinstance(item, Skipped)])


class PatchBatches:
    """The patch loader's ``batch_sampler`` (see the module docstring); iterate it once."""

    def __init__(self, plans: Iterable[SlidePlan | Skipped], batch_size: int,
                 on_plan: Callable[[SlidePlan | Skipped], None]) -> None:
        self.plans = plans
        self.batch_size = batch_size
        self.on_plan = on_plan

    def __iter__(self) -> Iterator[list[PatchKey]]:
        batch: list[PatchKey] = []
        for plan in self.plans:
            self.on_plan(plan)
            if isinstance(plan, Skipped):
                continue
            geo = plan.geometry
            for row, (x, y) in enumerate(plan.coords.tolist()):
                batch.append(PatchKey(plan.position, row, plan.ref.path, geo.level, x, y, geo.read_size))
                if len(batch) == self.batch_size:
                    yield batch
                    batch = []
        if batch:
            yield batch


__all__ = ["PatchBatch", "PatchBatches", "PatchKey", "PatchReader", "Patching", "Skipped", "SlidePlan",
           "SlidePlanner", "collate_patches", "identity", "plan_slide", "resize_uint8", "to_encoder"]
