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
# After a file is fixed: the bags already written are kept by --resume, but the split's cache key
# covers every file's name and size (bag_import), so a file that changed size needs --overwrite.
RERUN = "rerun the import with --resume (with --overwrite if the file's size changed)"


class SlideFileError(SourceError):
    """A per-slide feature file that cannot be imported (one line naming the file). ``damaged``:
    a truncated or damaged file, whose fix is to re-create it and run again: a plain run with
    ``--resume``; under ``--worker`` (:attr:`worker_text`, which refuses ``--resume``) the slide's
    next attempt reads the file again, and the worker's line says whether there is one."""

    def __init__(self, problem: str, *, damaged: bool = False) -> None:
        self.worker_text = f"{problem}: a truncated or damaged file; re-create it" if damaged else problem
        super().__init__(f"{self.worker_text}, then {RERUN}" if damaged else problem)


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


def slide_directories_below(directory: str, depth: int = 2) -> list[tuple[str, int]]:
    """``(path relative to directory, slide files)`` for each directory up to ``depth`` levels below
    ``directory`` that :func:`find_slides` would import (a TRIDENT job's ``20x_256px/features_uni``,
    a CLAM job): what to suggest when ``directory`` itself holds no feature files."""
    found: list[tuple[str, int]] = []
    level = [directory]
    for _ in range(depth):
        below = []
        for parent in level:
            try:
                names = sorted(n for n in os.listdir(parent) if not n.startswith("."))
            except OSError:
                continue
            for name in names:
                path = os.path.join(parent, name)
                if not os.path.isdir(path):
                    continue
                slides = find_slides(path)
                if slides is not None:
                    count = len(_files(slides[0], H5_SUFFIXES + PT_SUFFIXES))
                    found.append((os.path.relpath(path, directory), count))
                else:
                    below.append(path)
        level = below
    return found


def _files(directory: str, suffixes: tuple[str, ...], hidden: bool = False) -> list[str]:
    """The names ending in ``suffixes``; names starting with "." only with ``hidden`` (macOS
    writes ``._<name>.h5`` resource forks beside copied files: never slides)."""
    return sorted(n for n in os.listdir(directory) if n.lower().endswith(suffixes) and n.startswith(".") == hidden)


class SlideFiles:
    """The slides of one directory, in name order (the bag id is the file's stem)."""

    def __init__(self, directory: str, kind: str) -> None:
        # absolute: the split's provenance must not depend on where the command ran
        directory = os.path.abspath(directory)
        self.directory, self.kind = directory, kind
        names = _files(directory, H5_SUFFIXES if kind == "h5" else PT_SUFFIXES)
        self.hidden = _files(directory, H5_SUFFIXES if kind == "h5" else PT_SUFFIXES, hidden=True)
        self.dropped: dict[str, str] = {}  # a .pt dict's keys other than features -> the first file holding it
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
        try:
            with _open_h5(slide.path) as f:
                name = _features_name(f, slide.path)
                features, coords = _dataset(f, name, slide.path), _dataset(f, "coords", slide.path)
                _check_attrs(_attrs(f, name), slide)  # refused now, not after earlier slides are written
                if coords is not None and coords.dtype.kind not in "iuf":
                    raise SlideFileError(f"{slide.path!r}: coords of dtype {coords.dtype} are not numbers: a per-slide "
                                         "file's coords are [n, 2] integer pixels or float micrometres (re-create it)")
                return _header(slide.path, tuple(features.shape), features.dtype.name,
                               None if coords is None else tuple(coords.shape), _unit(f))
        except SlideFileError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as error:
            raise SlideFileError(f"cannot read the header of {slide.path!r} ({type(error).__name__}: {error}): a "
                                 "damaged file; re-create it (or move it out of the directory)") from None

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
                features = read_rows(_dataset(f, name, slide.path))  # h5py's one-chunk-at-a-time read, without its cost
                found = _dataset(f, "coords", slide.path)
                coords = None if found is None else _coords_for_split(slide, read_rows(found), _unit(f))
                attrs: dict[str, Any] = {"source_file": os.path.basename(slide.path), **_attrs(f, name)}
        except SlideFileError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as error:
            raise SlideFileError(f"cannot read {slide.path!r} ({type(error).__name__}: {error})",
                                 damaged=True) from None
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
            for other in value:
                if other != "features":
                    self.dropped.setdefault(str(other), os.path.basename(path))
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
        raise SlideFileError(f"cannot open {path!r} as HDF5 ({' '.join(str(error).split())})", damaged=True) from None


def _dataset(f: Any, name: str, path: str) -> Any:
    """The dataset ``name`` of an open h5 file (None when absent); anything else there (a group,
    a named type) is refused naming the file."""
    import h5py

    node = f.get(name)
    if node is None or isinstance(node, h5py.Dataset):
        return node
    what = "group" if isinstance(node, h5py.Group) else type(node).__name__
    shape = "[n, 2]" if name == "coords" else "[n, dim]"
    raise SlideFileError(f"{path!r}: {name!r} is an HDF5 {what}, not a dataset: a per-slide file holds its "
                         f"{name} as one {shape} array (re-create the file, or move it out of the directory)")


def _attrs(f: Any, name: str) -> dict[str, Any]:
    """The attributes of the root, the features and the coords, as kept per bag."""
    attrs: dict[str, Any] = {}
    for where, node in (("root", f), (name, f.get(name)), ("coords", f.get("coords"))):
        if node is not None and len(node.attrs):
            attrs[where] = {str(k): _attr(v) for k, v in node.attrs.items()}
    return attrs


def _check_attrs(attrs: dict[str, Any], slide: Slide) -> None:
    from featurestore.format.bags import describe, unplain

    for where, values in attrs.items():
        for key, value in values.items():
            bad = unplain(value)
            if bad is not None:
                inner, found = bad
                node = "the root group" if where == "root" else f"dataset {where!r}"
                raise SlideFileError(
                    f"{slide.path!r} (bag {slide.bag_id!r}): HDF5 attribute {key!r} of {node} is "
                    f"{describe(found)}{' at ' + inner if inner else ''}, which the bag's attributes (JSON) "
                    f"cannot hold: remove or convert it (h5py: del f[{('/' if where == 'root' else where)!r}]"
                    f".attrs[{key!r}]), then rerun")


def _coords_for_split(slide: Slide, coords: np.ndarray, unit: str) -> np.ndarray:
    """Pixel coordinates as the split stores them (int64, see SlideFiles.settings), refused
    naming the file when they are not whole numbers within int64 (uint64 ones that fit are
    converted); micrometres are stored float32 (float64 ones rounded: well below a nanometre at a
    slide's scale), integer ones go to the writer, which refuses any a float32 cannot hold."""
    if unit == "um":
        return coords.astype(np.float32) if coords.dtype == np.float64 else coords
    if coords.dtype == np.int64 or not len(coords):
        return coords
    if coords.dtype.kind == "u":
        beyond = coords > np.iinfo(np.int64).max
        if beyond.any():
            row = int(np.argmax(beyond.any(axis=1)))
            raise SlideFileError(f"{slide.path!r} (bag {slide.bag_id!r}): coords row {row} ({coords[row, 0]}, "
                                 f"{coords[row, 1]}) is beyond int64, the type of level-0 pixel coordinates: "
                                 "damaged coords; re-create the file (or move it out of the directory)")
        return coords.astype(np.int64)
    if coords.dtype.kind == "f":
        whole = np.isfinite(coords) & (coords == np.round(coords)) & (np.abs(coords) < 2.0**63)
        if not whole.all():
            row = int(np.argmax(~whole.all(axis=1)))
            raise SlideFileError(f"{slide.path!r} (bag {slide.bag_id!r}): coords row {row} ({coords[row, 0]}, "
                                 f"{coords[row, 1]}) is not a whole level-0 pixel: coordinates in micrometres need "
                                 "the root attribute unit='um' (STAMP); re-create the file")
        return coords.astype(np.int64)
    return coords.astype(np.int64)


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
    from featurestore.format.bags import recorded_patch_size

    coords = f["coords"].attrs if "coords" in f else {}
    return recorded_patch_size({str(k): _attr(v) for k, v in coords.items()},
                               {str(k): _attr(v) for k, v in f.attrs.items()})


def _attr(value: Any) -> Any:
    import h5py

    if isinstance(value, h5py.Empty):  # an attribute with a null dataspace: no value
        return None
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
