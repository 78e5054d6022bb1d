"""Readers of per-slide feature files (one bag per file), for ``featurestore import DIR``.

What each tool writes (facts in shared/BAGS.md):

- **TRIDENT** ``features_<encoder>/<slide>.h5``: ``features`` [N, D] (float16 or float32) and
  ``coords`` [N, 2] int64 level-0 pixels, attributes on ``coords`` (``patch_size_level0``, ...);
- **CLAM** ``h5_files/<slide>.h5``: ``features`` float32, ``coords`` int32 level-0 pixels
  (``patch_size``, ``patch_level``, ...); ``pt_files/<slide>.pt``: the features only;
- **STAMP** ``<slide>.h5``: ``feats`` float16 and ``coords`` float32 in micrometres (root
  attribute ``unit="um"``, ``tile_size_um``, ...).

:func:`find_slides` says whether a directory is one of those (a directory of ``.h5`` files, a
CLAM job with ``h5_files/``, or ``pt_files/``); :class:`SlideFiles` probes every file's header
(datasets, shapes, dtypes: no rows read) so a malformed file is named before anything is written,
then reads one slide at a time (host memory bounded by the largest bag). Every problem is one
:class:`SlideFileError` line naming the file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.errors import SourceError
from featurestore.extract.h5_rows import read_rows

H5_SUFFIXES = (".h5", ".hdf5")
PT_SUFFIXES = (".pt", ".pth")
FEATURE_NAMES = ("features", "feats")


class SlideFileError(SourceError):
    """A per-slide feature file that cannot be imported (one line naming the file)."""


@dataclass(frozen=True)
class Slide:
    bag_id: str  # the file's stem: the slide name
    path: str


@dataclass(frozen=True)
class SlideHeader:
    rows: int
    dim: int
    dtype: str  # features dtype name
    coords: bool
    unit: str  # "px" | "um"


def find_slides(directory: str, force: bool = False) -> tuple[str, str] | None:
    """``(directory of the files, "h5" | "pt")`` when ``directory`` holds per-slide files, else
    None (a dense cache). ``force``: a directory of ``.pt`` files under another name than CLAM's
    ``pt_files`` is read as bags too."""
    if not os.path.isdir(directory):
        return None
    for sub, kind in (("h5_files", "h5"), ("pt_files", "pt")):  # a CLAM job directory: coords first
        inner = os.path.join(directory, sub)
        if os.path.isdir(inner) and _files(inner, H5_SUFFIXES if kind == "h5" else PT_SUFFIXES):
            return inner, kind
    if _files(directory, H5_SUFFIXES):
        return directory, "h5"
    if (force or os.path.basename(os.path.normpath(directory)) == "pt_files") and _files(directory, PT_SUFFIXES):
        return directory, "pt"
    return None


def _files(directory: str, suffixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.lower().endswith(suffixes) and not n.startswith("."))


class SlideFiles:
    """The slides of one directory, in name order (the bag id is the file's stem)."""

    def __init__(self, directory: str, kind: str) -> None:
        self.directory, self.kind = directory, kind
        names = _files(directory, H5_SUFFIXES if kind == "h5" else PT_SUFFIXES)
        if not names:
            raise SlideFileError(f"directory {directory!r} has no per-slide {kind} files")
        for name in names:
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:  # os.listdir hands undecodable bytes back as surrogates
                shown = os.fsencode(name).decode("utf-8", "backslashreplace")
                raise SlideFileError(f"file name '{shown}' in {directory!r} is not valid UTF-8: a bag id is the "
                                     "file's name as text; rename the file (e.g. convmv -f latin1 -t utf8)") from None
        other = _files(directory, PT_SUFFIXES if kind == "h5" else H5_SUFFIXES)
        if other:
            raise SlideFileError(f"directory {directory!r} mixes {kind} files with {len(other)} "
                                 f"{'.pt' if kind == 'h5' else '.h5'} file(s) ({other[0]!r}, ...): one bag split is "
                                 f"imported from one format; move the other files to a directory of their own")
        self.slides = [Slide(os.path.splitext(n)[0], os.path.join(directory, n)) for n in names]
        stems = [s.bag_id for s in self.slides]
        if len(set(stems)) != len(stems):
            dup = next(s for i, s in enumerate(stems) if s in stems[:i])
            raise SlideFileError(f"two files in {directory!r} are slide {dup!r} (e.g. .h5 and .hdf5): keep one")
        self.spec = f"{kind}-dir:{directory}"

    def __len__(self) -> int:
        return len(self.slides)

    # ------------------------------------------------------------------ headers
    def header(self, slide: Slide) -> SlideHeader:
        """Shapes and dtypes of one file, without reading its rows."""
        if self.kind == "pt":
            features = self._load_pt(slide.path)
            return _header(slide.path, tuple(features.shape), str(features.dtype).removeprefix("torch."), None, "px")
        with _open_h5(slide.path) as f:
            name = _features_name(f, slide.path)
            coords = f["coords"] if "coords" in f else None
            unit = _unit(f)
            return _header(slide.path, tuple(f[name].shape), f[name].dtype.name,
                           None if coords is None else tuple(coords.shape), unit)

    def settings(self, first: SlideHeader, slide: Slide) -> dict[str, Any]:
        """The split settings the first file gives: coordinates unit and dtype, patch size."""
        if self.kind == "pt" or not first.coords:
            return {"coords_unit": None, "coords_dtype": "int64", "patch_size_level0": None}
        with _open_h5(slide.path) as f:
            size = _patch_size_level0(f)
        if first.unit == "um":
            return {"coords_unit": "um", "coords_dtype": "float32", "patch_size_level0": size}
        return {"coords_unit": "px", "coords_dtype": "int64", "patch_size_level0": size}

    # ------------------------------------------------------------------ rows
    def read(self, slide: Slide) -> tuple[Any, np.ndarray | None, dict[str, Any]]:
        """``(features [n, D], coords [n, 2] or None, attributes)`` of one slide."""
        if self.kind == "pt":
            return self._load_pt(slide.path), None, {"source_file": os.path.basename(slide.path)}
        try:
            with _open_h5(slide.path) as f:
                name = _features_name(f, slide.path)
                features = read_rows(f[name])  # h5py's one-chunk-at-a-time read, without its cost
                coords = read_rows(f["coords"]) if "coords" in f else None
                attrs: dict[str, Any] = {"source_file": os.path.basename(slide.path)}
                for where, node in (("root", f), (name, f[name]), ("coords", f["coords"] if "coords" in f else None)):
                    if node is not None and len(node.attrs):
                        attrs[where] = {str(k): _attr(v) for k, v in node.attrs.items()}
        except (OSError, KeyError, ValueError, TypeError) as error:
            raise SlideFileError(f"cannot read {slide.path!r} ({type(error).__name__}: {error}): a truncated or "
                                 "damaged file; re-create it, then rerun the import with --resume") from None
        return features, coords, attrs

    def fingerprint(self) -> str:
        """Names and sizes of every file: the cache key changes when a file does."""
        h = hashlib.sha256(self.kind.encode())
        for slide in self.slides:
            h.update(f"{slide.bag_id}|{os.path.getsize(slide.path)}\n".encode())
        return h.hexdigest()

    def _load_pt(self, path: str) -> Any:
        import torch

        try:
            value = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # not a torch file, truncated, pickled objects
            raise SlideFileError(f"cannot read {path!r} as a torch tensor file ({type(error).__name__}: "
                                 f"{' '.join(str(error).split())[:200]})") from None
        if isinstance(value, dict) and "features" in value:
            value = value["features"]
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise SlideFileError(f"{path!r} holds a {type(value).__name__}, not a [patches, dim] tensor")
        return value


def _open_h5(path: str) -> Any:
    try:
        import h5py
    except ImportError:
        from featurestore.errors import MissingDependency

        raise MissingDependency("reading .h5 feature files needs h5py: pip install 'featurestore[hdf5]'") from None
    try:
        return h5py.File(path, "r")
    except OSError as error:
        raise SlideFileError(f"cannot open {path!r} as HDF5 ({' '.join(str(error).split())}): a truncated or "
                             "damaged file; re-create it, then rerun the import with --resume") from None


def _features_name(f: Any, path: str) -> str:
    for name in FEATURE_NAMES:
        if name in f:
            return name
    raise SlideFileError(f"{path!r} has no 'features' or 'feats' dataset (it has: {', '.join(f.keys()) or 'nothing'}): "
                         "not a per-slide feature file (TRIDENT/CLAM: 'features', STAMP: 'feats')")


def _unit(f: Any) -> str:
    unit = f.attrs.get("unit")
    if isinstance(unit, bytes):
        unit = unit.decode()
    return "um" if unit in ("um", "µm", "micrometer", "micrometers") else "px"


def _header(path: str, shape: tuple[int, ...], dtype: str, coords: tuple[int, ...] | None, unit: str) -> SlideHeader:
    if len(shape) != 2:
        raise SlideFileError(f"{path!r}: features of shape {list(shape)}, expected [patches, dim]")
    if dtype not in ("float16", "float32", "bfloat16", "float64"):
        raise SlideFileError(f"{path!r}: features of dtype {dtype}; float features are expected")
    if coords is not None and coords != (shape[0], 2):
        raise SlideFileError(f"{path!r}: coords of shape {list(coords)} for {shape[0]} feature rows: features "
                             "and coords must have one row per patch (re-create the file)")
    return SlideHeader(rows=int(shape[0]), dim=int(shape[1]), dtype=dtype, coords=coords is not None, unit=unit)


def _patch_size_level0(f: Any) -> Any:
    """The patch side at level 0, in the coordinates' unit, when the file says it."""
    coords = f["coords"].attrs if "coords" in f else {}
    size = None
    for attrs, name in ((coords, "patch_size_level0"), (f.attrs, "tile_size_um")):
        if name in attrs:
            size = _attr(attrs[name])
            break
    else:
        if "patch_size" in coords and _attr(coords.get("patch_level", 0)) in (0, None):
            size = _attr(coords["patch_size"])  # CLAM, patches cut at level 0
    positive = isinstance(size, (int, float)) and not isinstance(size, bool) and size > 0
    return size if positive else None


def _attr(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):
        # h5py decodes text that is not UTF-8 with surrogateescape: kept as the replacement character
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return [_attr(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value
