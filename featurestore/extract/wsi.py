"""Whole-slide images: the slide list, opening a slide, its scale, the pyramid level and the patch grid.

``wsi:DIR`` (the slides directly in DIR, sorted by name), ``wsi:FILE`` (one slide) or
``wsi:LIST.csv`` (a ``path`` column, optional ``slide_id`` and ``label`` columns; labels need
slide ids and follow ``featurestore import``'s rules). A slide's bag id is its file stem unless the
CSV names it.

Scale: a slide's level-0 micrometres per pixel come from ``openslide.mpp-x``, else from the
objective power (10 / power: 20x is 0.5 um/px, the convention TRIDENT and CLAM use), else from
``--slide-mpp``; a slide with none of them is refused with one line naming it. A target
``--magnification M`` is reached at a downsample of ``slide magnification / M`` (the slide's
magnification is its objective power, else 10 / mpp), ``--mpp U`` at ``U / slide mpp``. Patches
are read at the coarsest level whose downsample is at most that (so they are never upsampled
beyond the 2 % a scanner's rounded downsamples need) and resized when the level does not match.

The grid: non-overlapping squares of ``patch_size_level0`` level-0 pixels, wholly inside the
slide, in row-major order (rows top to bottom, left to right in a row); a patch's coordinates
are the level-0 pixel of its top-left corner, ``(x, y)``, as TRIDENT and CLAM write them.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from featurestore.errors import InvalidOption, MissingDependency
from featurestore.extract.label_csv import undecodable_at
from featurestore.extract.sources import SourceError

# Files OpenSlide reads (https://openslide.org/formats/); other files in a wsi:DIR are ignored.
SLIDE_SUFFIXES = (".svs", ".tif", ".tiff", ".ndpi", ".vms", ".vmu", ".scn", ".mrxs", ".svslide", ".bif", ".czi")
UPSAMPLE_TOLERANCE = 0.02  # a target this much finer than the scan is read at level 0 and resized
LEVEL_TOLERANCE = 0.01  # scanners' downsamples are rounded (4.0002 for 4): a level this close matches


class SlideError(SourceError):
    """A slide that cannot be used: missing, not a slide, no resolution, too coarse for the target."""


@dataclass(frozen=True)
class SlideRef:
    """One slide of the cohort: its bag id, path and optional label (from a CSV)."""

    id: str
    path: str
    label: str | None = None


def import_openslide() -> Any:
    try:
        import openslide
    except ImportError as error:
        raise MissingDependency("wsi: sources read slides with OpenSlide: pip install 'featurestore[wsi]' "
                                f"(openslide-python and the openslide-bin library) ({error})") from error
    return openslide


def list_slides(target: str) -> list[SlideRef]:
    """The slides of ``wsi:TARGET``, in the order bags are written (sorted by id)."""
    if target.lower().endswith(".csv") and os.path.isfile(target):
        refs = _slides_from_csv(target)
    elif os.path.isdir(target):
        # Anything but a folder is listed (a link whose target is gone, a FIFO: skipped, named,
        # when opened), not dropped: a folder of links into an archive would otherwise commit
        # short with exit status 0.
        names = sorted(e.name for e in os.scandir(target) if not e.is_dir() and not e.name.startswith(".")
                       and e.name.lower().endswith(SLIDE_SUFFIXES))
        if not names:
            raise SlideError(f"slide directory {target!r} holds no slide files ({', '.join(SLIDE_SUFFIXES)})")
        refs = [SlideRef(_stem(n), os.path.join(target, n)) for n in names]
    elif os.path.exists(target):
        refs = [SlideRef(_stem(target), target)]
    else:
        raise SlideError(f"slide path {target!r} does not exist: pass wsi:DIR, wsi:SLIDE_FILE or wsi:LIST.csv")
    seen: dict[str, str] = {}
    files: dict[str, str] = {}
    for ref in refs:
        if ref.id in seen:
            raise SlideError(f"slides {seen[ref.id]!r} and {ref.path!r} share the bag id {ref.id!r}: "
                             "list them in a CSV with distinct slide_id values")
        seen[ref.id] = ref.path
        real = os.path.realpath(ref.path)
        if real in files:  # two bags of one slide: encoded twice, and they may fall in different folds
            raise SlideError(f"slide ids {files[real]!r} and {ref.id!r} name the same file {ref.path!r}: list each "
                             "slide once")
        files[real] = ref.id
    return sorted(refs, key=lambda r: r.id)


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _slides_from_csv(path: str) -> list[SlideRef]:
    """The slides a ``wsi:LIST.csv`` lists: UTF-8 (a spreadsheet's byte-order mark accepted), a
    ``path`` column (relative to the list's folder), optional ``slide_id`` and ``label``."""
    refs: list[SlideRef] = []
    reader: Any = None
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            columns = [c.strip() for c in reader.fieldnames or []]
            if "path" not in columns:
                raise SlideError(f"slide list {path!r} has columns {columns}; it needs a 'path' column "
                                 "(optional: slide_id, label)")
            if "label" in columns and "slide_id" not in columns:
                raise SlideError(f"slide list {path!r} has a label column but no slide_id column: add slide_id "
                                 "(the bag id each label belongs to, e.g. the file stem)")
            base = os.path.dirname(os.path.abspath(path))
            for row in reader:
                row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
                if not any(row.values()):
                    continue  # a blank line
                if not row.get("path"):
                    raise SlideError(f"slide list {path!r} line {reader.line_num} has no path: give every "
                                     "row a slide file in the 'path' column")
                slide = row["path"] if os.path.isabs(row["path"]) else os.path.join(base, row["path"])
                refs.append(SlideRef(row.get("slide_id") or _stem(slide), slide, row.get("label") or None))
    except UnicodeDecodeError as error:
        raise SlideError(f"slide list {path!r} is not UTF-8 ({undecodable_at(path, error)}): save it as UTF-8 "
                         "CSV") from None
    except csv.Error as error:
        raise SlideError(f"slide list {path!r} line {reader.reader.line_num if reader else 1} is not CSV ({error}): save "
                         "it as comma-separated text") from None
    except OSError as error:
        raise SlideError(f"cannot read the slide list {path!r} ({error.strerror or error})") from None
    if not refs:
        raise SlideError(f"slide list {path!r} lists no slides")
    return refs


def open_slide(path: str, cache_bytes: int | None = None) -> Any:
    """An ``OpenSlide`` handle, or one :class:`SlideError` line naming the file."""
    openslide = import_openslide()
    if not os.path.exists(path):
        link = f" (a link to {os.readlink(path)!r}, which is gone)" if os.path.islink(path) else ""
        raise SlideError(f"slide {path!r} does not exist{link}")
    if not os.path.isfile(path):  # a FIFO or a device: OpenSlide would wait on it for ever
        raise SlideError(f"slide {path!r} is not a regular file")
    try:
        slide = openslide.OpenSlide(path)
    except openslide.OpenSlideUnsupportedFormatError as error:
        raise SlideError(f"{path!r} is not a slide OpenSlide can read (SVS, NDPI, MRXS, SCN, tiled TIFF, ...): "
                         f"{error or 'unsupported or missing file format'}") from error
    except (openslide.OpenSlideError, OSError) as error:
        raise SlideError(f"cannot open slide {path!r}: {error}") from error
    if cache_bytes is not None:  # OpenSlide's tile cache is per handle; the default grows to 32 MiB
        slide.set_cache(openslide.OpenSlideCache(cache_bytes))
    return slide


#: The largest --patch-size: a region encoder's 4096 px (HIPT) with room to spare.
MAX_PATCH_SIZE = 8192


@dataclass(frozen=True)
class Target:
    """What ``--magnification`` / ``--mpp`` / ``--patch-size`` / ``--slide-mpp`` ask for."""

    patch_size: int = 256
    magnification: float | None = None
    mpp: float | None = None
    slide_mpp: float | None = None  # level-0 um/px for slides that carry no resolution

    def __post_init__(self) -> None:
        if self.magnification is not None and self.mpp is not None:
            raise InvalidOption("--magnification and --mpp exclude each other: give one")
        if self.magnification is None and self.mpp is None:
            object.__setattr__(self, "magnification", 20.0)
        for flag, value in (("--magnification", self.magnification), ("--mpp", self.mpp),
                            ("--slide-mpp", self.slide_mpp)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidOption(f"{flag} must be a positive number, but got: {value}")
        if self.patch_size < 1:
            raise InvalidOption(f"--patch-size must be a positive integer, but got: {self.patch_size}")
        if self.patch_size > MAX_PATCH_SIZE:  # its white probe patch alone would take gigabytes
            raise InvalidOption(f"--patch-size {self.patch_size} is larger than any patch encoders take: give at "
                                f"most {MAX_PATCH_SIZE} px (patch encoders take 224-1024, region encoders 4096)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Geometry:
    """How one slide is cut: its scale, the level read and the patch sizes there."""

    width: int  # level 0
    height: int
    mpp: float  # level-0 um/px (measured or derived, see ``mpp_source``)
    magnification: float  # the scan's (objective power, or 10 / mpp)
    mpp_source: str  # "openslide.mpp-x" | "objective-power" | "--slide-mpp"
    downsample: float  # level-0 pixels per target pixel
    level: int
    level_downsample: float
    patch_size: int  # the side the encoder sees
    patch_size_level0: int
    read_size: int  # the side read at ``level``; resized to ``patch_size`` when different

    def attrs(self) -> dict[str, Any]:
        """Per-bag attributes (the names TRIDENT writes, where it has one)."""
        return {"mpp": self.mpp, "level0_magnification": self.magnification, "mpp_source": self.mpp_source,
                "target_downsample": self.downsample, "patch_level": self.level,
                "level_downsample": self.level_downsample, "patch_size": self.patch_size,
                "patch_size_level0": self.patch_size_level0, "read_size": self.read_size,
                "level0_width": self.width, "level0_height": self.height}


def _number(props: Any, key: str) -> float | None:
    try:
        value = float(props.get(key) or "nan")
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def slide_scale(props: Any, name: str, slide_mpp: float | None) -> tuple[float, float, str]:
    """``(mpp, magnification, source)`` of level 0, or :class:`SlideError`."""
    mpp, power = _number(props, "openslide.mpp-x"), _number(props, "openslide.objective-power")
    if mpp is not None:
        return mpp, power or 10.0 / mpp, "openslide.mpp-x"
    if power is not None:
        return 10.0 / power, power, "objective-power"
    if slide_mpp is not None:
        return slide_mpp, 10.0 / slide_mpp, "--slide-mpp"
    raise SlideError(f"slide {name!r} has no resolution metadata (no openslide.mpp-x, no objective power): "
                     "pass --slide-mpp UM, its level-0 micrometres per pixel (0.25 at 40x, 0.5 at 20x)")


def geometry(props: Any, dimensions: tuple[int, int], level_downsamples: tuple[float, ...], target: Target,
             name: str) -> Geometry:
    """The level and sizes a slide is read at for ``target`` (pure: properties in, numbers out)."""
    mpp, magnification, source = slide_scale(props, name, target.slide_mpp)
    if target.mpp is not None:
        downsample = target.mpp / mpp
        asked, scan = f"--mpp {target.mpp:g}", f"{mpp:g} um/px"
        fix = f"--mpp {mpp:g} or more"
    else:
        assert target.magnification is not None
        downsample = magnification / target.magnification
        asked, scan = f"--magnification {target.magnification:g}", f"{magnification:g}x ({mpp:g} um/px)"
        fix = f"--magnification {magnification:g} or less"
    if downsample < 1.0 - UPSAMPLE_TOLERANCE:
        raise SlideError(f"slide {name!r}: {asked} is finer than the scan's {scan}; use {fix}")
    level = max(i for i, d in enumerate(level_downsamples) if i == 0 or d <= downsample * (1 + LEVEL_TOLERANCE))
    patch_size_level0 = max(1, round(target.patch_size * downsample))
    read_size = max(1, round(patch_size_level0 / level_downsamples[level]))
    width, height = dimensions
    return Geometry(int(width), int(height), mpp, magnification, source, downsample, level,
                    float(level_downsamples[level]), target.patch_size, patch_size_level0, read_size)


def grid(width: int, height: int, step: int) -> np.ndarray:
    """``int64 [n, 2]`` top-left ``(x, y)`` of every whole ``step`` square, row-major."""
    ys, xs = np.meshgrid(np.arange(0, height - step + 1, step, dtype=np.int64),
                         np.arange(0, width - step + 1, step, dtype=np.int64), indexing="ij")
    return np.stack([xs.reshape(-1), ys.reshape(-1)], axis=1)


def read_rgb(slide: Any, location: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
    """``uint8 [h, w, 3]`` of a region; transparent pixels (outside the scan) become white glass."""
    rgba = np.asarray(slide.read_region(location, level, size))
    rgb, alpha = rgba[..., :3], rgba[..., 3:]
    if alpha.min() == 255:
        return np.ascontiguousarray(rgb)
    a = alpha.astype(np.uint16)  # OpenSlide hands out un-premultiplied RGBA
    return ((rgb.astype(np.uint16) * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


__all__ = ["Geometry", "SLIDE_SUFFIXES", "SlideError", "SlideRef", "Target", "geometry", "grid", "list_slides",
           "open_slide", "read_rgb", "slide_scale"]
