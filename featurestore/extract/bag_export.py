"""``featurestore export``: a bag split back out as one file per slide, in another tool's layout.

The way out of the store, the inverse of ``featurestore import DIR`` (featurestore.extract.bag_import):

- **trident**: ``<out>/<slide>.h5`` (``<out>`` plays TRIDENT's ``features_<encoder>/``):
  ``features`` [n, D] in the stored dtype (bfloat16, which HDF5 lacks, and int8, whose codes
  need their bag's scale, as float32 values) and
  ``coords`` [n, 2] in the stored dtype (int64 level-0 pixels), with the attributes the import
  kept (root, features, coords; a split written otherwise gets ``patch_size_level0``, the
  split's or the bag's own, and ``name`` on ``coords``, as TRIDENT writes them);
- **clam-pt**: CLAM's ``pt_files/<slide>.pt`` (the features as a float32 tensor, all CLAM's
  training loads) and ``h5_files/<slide>.h5`` (``features`` float32 and ``coords`` int32, as
  ``create_patches_fp.py`` / ``extract_features_fp.py`` write them) when the split has coordinates.

- **stamp**: ``<out>/<slide>.h5`` as STAMP reads it: ``feats`` [n, D] (stored dtype, bfloat16 and
  int8 as float32 values) and ``coords`` [n, 2] float32 in micrometres, root attributes ``unit="um"``,
  ``tile_size_um``, ``tile_size_px`` (when known), ``feat_type="tile"`` and ``extractor``. Level-0
  pixel coordinates are converted with each bag's ``mpp`` attribute (slide extraction records it)
  or ``mpp=`` (``--mpp``); a split imported from STAMP keeps the attributes it came with.

Bag labels go to ``<out>/labels.csv`` (``slide_id,label``; class names when the split has
``label_names``; then the import's table columns it kept as bag attributes, ``case_id``...), the
CSV ``featurestore import --labels`` reads. Where a kept column is itself named ``label`` (or
``slide_id``: the import read its labels and ids from other columns), the label (id) column takes
the name the import read it from, never a second column of one name (:func:`csv_columns`), and
``ExportResult.note`` gives the re-import its ``--label-column`` (``--id-column``). A file keeps the name its slide
was imported from, so import -> export -> import gives the same bag ids, features, coordinates,
attributes and labels, byte for byte (tests/test_export.py). Each file is written under a
temporary hidden name and renamed when complete: an export cut short leaves no file that looks whole.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.core.storage.files import nearest_existing
from featurestore.errors import InvalidOption, SplitExists
from featurestore.format import dtypes

__all__ = ["FORMATS", "LABELS_CSV", "ExportResult", "atomic_write", "check_file_stem", "check_out", "csv_columns",
           "export_bags", "export_bar", "labels_csv", "prepare_out", "table_columns", "write_h5"]

FORMATS = ("trident", "clam-pt", "stamp")
LABELS_CSV = "labels.csv"
_H5_GROUPS = ("root", "features", "feats", "coords")  # how bag_import keeps an h5 file's attributes
_MAX_NAME_BYTES = 250  # a file name's limit (255) less the extension


@dataclass(frozen=True)
class ExportResult:
    key: str
    format: str
    out: str
    bags: int
    files: int
    seconds: float
    note: str = ""  # a line the user needs to read the files back (the columns of labels.csv)


def export_bags(store: Any, dataset: str, encoder: str, split: str, *, fmt: str, out: str,
                overwrite: bool = False, progress: bool = True, mpp: float | None = None) -> ExportResult:
    """Write every bag of ``dataset/encoder/split`` of ``store`` (an open FeatureStore) under
    ``out`` in format ``fmt`` (``FORMATS``). Files already there are refused unless ``overwrite``.
    ``mpp``: level-0 micrometres per pixel for ``stamp`` where a bag records none."""
    if fmt not in FORMATS:
        raise InvalidOption(f"export format {fmt!r} is not supported: use one of {', '.join(FORMATS)}")
    if mpp is not None and not (fmt == "stamp" and np.isfinite(mpp) and mpp > 0):
        raise InvalidOption(f"--mpp {mpp:g}: a positive level-0 micrometres per pixel, for --format stamp only")
    started = time.perf_counter()
    bags = store.open_bags(dataset, encoder, split)
    key = f"{dataset}/{encoder}/{split}"
    if fmt == "clam-pt" and bags.coords_unit == "um":
        raise InvalidOption(f"bag split {key} has coordinates in micrometres; CLAM's h5_files hold level-0 "
                            "pixels: export it with --format trident or stamp (coords kept in micrometres)")
    if not bags.ids:
        raise InvalidOption(f"bag split {key} holds no bags: nothing to export")
    scales = _stamp_scales(bags, key, mpp) if fmt == "stamp" else []
    clam_coords = []  # refused before the first file, not halfway; kept for the writes
    if fmt == "clam-pt" and bags.coords_unit is not None:
        clam_coords = [_clam_coords(bags.coords.read_numpy(np.arange(bags.offsets[i], bags.offsets[i + 1])), key,
                                    bags.ids[i]) for i in range(len(bags))]
    plan = [_files_of(bags, i, fmt, out) for i in range(len(bags))]
    targets = [path for paths in plan for path in paths.values()]
    if bags.labels is not None:
        targets.append(os.path.join(out, LABELS_CSV))
    prepare_out(targets, out, overwrite)
    bar = export_bar(len(bags), "slide", progress)
    try:
        # int8 codes mean nothing without their bag's scale (another per bag): written as their
        # float32 values, codes x scale, which the field's readers take as features.
        values = "float32" if dtypes.is_int8(bags.dtype) else None
        logical = values or bags.dtype
        for i, paths in enumerate(plan):
            features, coords = bags.read_numpy(i, dtype=values)
            if bags.coords_unit is None:
                coords = None
            attrs = bags.attrs(i)
            if fmt == "trident":
                write_h5(paths["h5"], _trident_features(features, logical), coords,
                         _h5_attributes(attrs, bags, i, "trident"))
            elif fmt == "stamp":
                coords_um, stamp_attrs = _stamp_bag(coords, attrs, bags, i, scales[i])
                write_h5(paths["h5"], _trident_features(features, logical), coords_um, stamp_attrs, "feats")
            else:
                as_float32 = dtypes.stored_as_float32(features, logical)
                _write_pt(paths["pt"], as_float32)
                if coords is not None:
                    write_h5(paths["h5"], as_float32, clam_coords[i], _h5_attributes(attrs, bags, i, "clam-pt"))
            bar.update(1)
    finally:
        bar.close()
    note = ""
    if bags.labels is not None:
        columns = table_columns(bags.metadata)
        id_column, label_column, note = csv_columns(bags.metadata, columns)
        csv_text = labels_csv(bags.ids, bags.labels, bags.metadata.get("label_names"), id_column,
                              columns={c: [bags.attrs(i).get(c) for i in range(len(bags))] for c in columns},
                              label_column=label_column)
        atomic_write(os.path.join(out, LABELS_CSV), csv_text.encode("utf-8"))
    return ExportResult(key, fmt, out, len(bags), len(targets), time.perf_counter() - started, note)


def check_out(out: str) -> None:
    """Refuse an ``out`` that cannot become the folder to write in (a file, a path under one, a
    folder this user may not write), before the store is read: an OSError there would otherwise
    surface as the store's failure (the CLI wraps the export in ``store_errors``)."""
    existing = nearest_existing(out)  # the folder makedirs would create the rest under
    if existing == os.path.abspath(out) and not os.path.isdir(existing):
        raise InvalidOption(f"--out {out} is a file, not a directory: give a folder to write the files in")
    if not os.path.isdir(existing):
        raise InvalidOption(f"--out {out}: {existing} is a file, not a directory: give a folder to write the files in")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InvalidOption(f"cannot write into --out {out!r} (Permission denied): give a folder you can write in")


def prepare_out(targets: list[str], out: str, overwrite: bool) -> None:
    """Refuse to write over an earlier export's files (unless ``overwrite``), before writing any;
    make the folders ``targets`` go in."""
    check_out(out)
    taken = [t for t in targets if os.path.lexists(t)]
    if taken and not overwrite:
        raise SplitExists(f"{out!r} already holds {len(taken)} of the files this export writes (first: "
                          f"{os.path.relpath(taken[0], out)!r}): choose an empty --out directory or pass --overwrite")
    for folder in sorted({os.path.dirname(t) for t in targets}):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:  # what check_out cannot foresee: /proc/x, a read-only mount...
            raise InvalidOption(f"cannot write into --out {out!r} ({error.strerror or error}): give a folder you can "
                                "write in") from error


def export_bar(total: int, unit: str, progress: bool) -> Any:
    """The export's progress bar on stderr (off without ``progress``; tqdm's own check off a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc="export", disable=True if not progress else None, file=sys.stderr,
                dynamic_ncols=True)


# ---------------------------------------------------------------------- names
def _files_of(bags: Any, i: int, fmt: str, out: str) -> dict[str, str]:
    """The files of bag ``i``: ``{"h5": path}`` (trident), ``{"pt": path, "h5": path}`` (clam-pt;
    no h5 without coordinates)."""
    bag_id = bags.ids[i]
    check_file_stem(bag_id, bags.key)
    if fmt in ("trident", "stamp"):
        return {"h5": os.path.join(out, _file_name(bags, i, (".h5", ".hdf5"), ".h5"))}
    files = {"pt": os.path.join(out, "pt_files", _file_name(bags, i, (".pt", ".pth"), ".pt"))}
    if bags.coords_unit is not None:
        files["h5"] = os.path.join(out, "h5_files", _file_name(bags, i, (".h5", ".hdf5"), ".h5"))
    return files


def _file_name(bags: Any, i: int, suffixes: tuple[str, ...], default: str) -> str:
    """The file the slide was imported from when it had this format's suffix (a round trip keeps
    ``source_file``), else ``<bag id><default>``."""
    bag_id = bags.ids[i]
    try:
        source = bags.attrs(i).get("source_file")
    except AttributeError:
        source = None
    if isinstance(source, str):
        stem, suffix = os.path.splitext(source)
        if stem == bag_id and suffix.lower() in suffixes and os.path.basename(source) == source:
            return source
    return bag_id + default


def check_file_stem(bag_id: str, key: str) -> None:
    """A bag id is data; as a file name it may not leave ``out`` nor hide from a listing."""
    bad = ("/" in bag_id or "\0" in bag_id or bag_id.startswith(".")
           or len(bag_id.encode("utf-8")) > _MAX_NAME_BYTES)  # fmt: skip
    if bad:
        raise InvalidOption(f"bag id {bag_id[:80]!r} of {key} cannot be a file name (a '/', a NUL, a leading '.' or "
                            f"over {_MAX_NAME_BYTES} bytes): export a split whose bag ids are slide names")


# ---------------------------------------------------------------------- values
def _trident_features(features: np.ndarray, logical: str) -> np.ndarray:
    # HDF5 has no bfloat16: its values are exact in float32 (re-import with --dtype bfloat16).
    return dtypes.stored_as_float32(features, logical) if logical == "bfloat16" else features


def _clam_coords(coords: np.ndarray, key: str, bag_id: str) -> np.ndarray:
    info = np.iinfo(np.int32)
    if coords.dtype.kind == "f" and not np.array_equal(coords, np.round(coords)):
        raise InvalidOption(f"bag {bag_id!r} of {key} has fractional coordinates; CLAM's are int32 pixels: "
                            "use --format trident")
    if len(coords) and (coords.min() < info.min or coords.max() > info.max):
        raise InvalidOption(f"bag {bag_id!r} of {key} has coordinates beyond int32, CLAM's coords dtype: "
                            "use --format trident (int64)")
    return coords.astype(np.int32)


def _kept_groups(attrs: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The ``{"root", "features", "coords"}`` attributes the import kept from the slide's h5 (its
    features' under ``features`` or STAMP's ``feats``), or None for a bag written otherwise."""
    if not any(isinstance(attrs.get(name), dict) for name in _H5_GROUPS):
        return None
    return {"root": dict(attrs.get("root") or {}), "features": attrs.get("features") or attrs.get("feats") or {},
            "coords": dict(attrs.get("coords") or {})}


def table_columns(metadata: dict[str, Any]) -> list[str]:
    """The columns of the labels CSV an import kept as bag attributes (``case_id``...): labels.csv
    carries them back out, so a re-import (or a probe's ``--group-by``) finds them again."""
    columns = (metadata.get("source") or {}).get("table_columns")
    return [c for c in columns if isinstance(c, str)] if isinstance(columns, list) else []


def csv_columns(metadata: dict[str, Any], columns: Sequence[str]) -> tuple[str, str, str]:
    """labels.csv's id and label column names, and the note for the re-import: ``slide_id`` and
    ``label``, unless the import kept a table column of that name as a bag attribute; then the
    column the import read the ids (labels) from, recorded as ``source.id_column``
    (``source.label_column``), so that ``import --labels OUT/labels.csv`` with the import's own
    ``--id-column``/``--label-column`` gives the same labels and attributes back."""
    source = metadata.get("source") or {}
    taken, names, options = set(columns), [], []
    for default, recorded, option in (("slide_id", "id_column", "--id-column"),
                                      ("label", "label_column", "--label-column")):
        name = default
        if name in taken:
            name = source.get(recorded) if isinstance(source.get(recorded), str) else f"split_{default}"
            while name in taken:  # a split imported before the column was recorded, or an odd table
                name = f"split_{name}"
            options.append(f"{option} {name}")
        taken.add(name)
        names.append(name)
    note = "" if not options else (
        f"labels.csv: the bags keep attributes named {', '.join(d for d in ('slide_id', 'label') if d in columns)}, "
        f"so its ids and labels are in columns {names[0]!r} and {names[1]!r}: import it with "
        f"--labels labels.csv {' '.join(options)}")
    return names[0], names[1], note


def _bag_root(attrs: dict[str, Any], skip: Sequence[str] = ()) -> dict[str, Any]:
    """A bag written otherwise: its attributes go on the file's root (not the name it came from,
    nor the table's columns, which go to labels.csv)."""
    return {k: v for k, v in attrs.items() if k != "source_file" and k not in skip}


def _h5_attributes(attrs: dict[str, Any], bags: Any, i: int, fmt: str) -> dict[str, dict[str, Any]]:
    """``{"root", "features", "coords"}`` attributes: those the import kept from the slide's h5,
    else what the tool itself would write from the split's settings."""
    kept = _kept_groups(attrs)
    if kept is not None:
        # Another tool's attributes: the keys the target tool reads are added (CLAM's readers and
        # heatmaps read patch_size at patch_level, TRIDENT's slide encoders patch_size_level0).
        size = bags.patch_size_of(i) if bags.coords_unit == "px" else None
        coords = kept["coords"]
        if size is not None and fmt == "trident" and "patch_size_level0" not in coords:
            coords["patch_size_level0"] = size
        elif size is not None and fmt == "clam-pt" and "patch_level" not in coords:
            coords.update({"patch_size": size, "patch_level": 0})
        return kept
    root = _bag_root(attrs, table_columns(bags.metadata))
    coords: dict[str, Any] = {"name": bags.ids[i]}
    size = bags.patch_size_of(i) if bags.coords_unit == "px" else None
    if size is not None:
        coords.update({"patch_size_level0": size} if fmt == "trident" else {"patch_size": size, "patch_level": 0})
    if bags.coords_unit == "um":
        root.setdefault("unit", "um")
    return {"root": root, "features": {}, "coords": coords}


def _stamp_scales(bags: Any, key: str, mpp: float | None) -> list[float]:
    """Per bag, micrometres per coordinate unit (1 for a split in micrometres); refused before any
    file is written when a bag in level-0 pixels has no ``mpp`` and none was given."""
    if bags.coords_unit is None:
        raise InvalidOption(f"bag split {key} has no coordinates; STAMP's files hold coords in micrometres: export "
                            "it with --format clam-pt (features only) or trident")
    scales = []
    for i, bag_id in enumerate(bags.ids):
        attrs = bags.attrs(i)  # slide extraction's mpp and patch size, or the root attributes an import kept
        if bags.patch_size_of(i) is None:
            raise InvalidOption(f"bag {bag_id!r} of {key} records no patch size at level 0 (the split's or its own "
                                "'patch_size_level0'), which STAMP's files carry as tile_size_um: export it with "
                                "--format trident, or write the split with patch_size_level0 (create_bag_split)")
        if bags.coords_unit == "um":
            scales.append(1.0)
            continue
        recorded = attrs.get("mpp", (attrs.get("root") or {}).get("mpp"))
        scale = float(recorded) if isinstance(recorded, (int, float)) and recorded > 0 else mpp
        if scale is None:
            raise InvalidOption(f"bag {bag_id!r} of {key} has level-0 pixel coordinates and records no mpp; STAMP's "
                                "are micrometres: pass --mpp UM, the slides' level-0 micrometres per pixel (0.25 at "
                                "40x, 0.5 at 20x)")
        scales.append(scale)
    return scales


def _stamp_bag(coords: np.ndarray, attrs: dict[str, Any], bags: Any, i: int,
               scale: float) -> tuple[np.ndarray, Any]:
    """A bag's coords in micrometres (float32) and the attributes of its STAMP file."""
    kept = _kept_groups(attrs)
    if kept is not None and bags.coords_unit == "um":  # a STAMP file imported: written back as it came
        return coords.astype(np.float32, copy=False), kept
    root = kept["root"] if kept is not None else _bag_root(attrs)
    if bags.coords_unit == "px":
        coords = coords.astype(np.float64) * scale
    root.setdefault("tile_size_um", float(bags.patch_size_of(i)) * scale)
    # The side the encoder saw: slide extraction's "patch_size", or TRIDENT's on its coords.
    tile_px = kept["coords"].get("patch_size") if kept is not None else attrs.get("patch_size")
    if isinstance(tile_px, int) and not isinstance(tile_px, bool) and tile_px > 0:
        root.setdefault("tile_size_px", tile_px)
    root.update(unit="um")
    root.setdefault("feat_type", "tile")
    root.setdefault("extractor", bags.metadata.get("encoder_name"))
    # The source's coords attributes are left out: their pixel figures would read as micrometres.
    features = kept["features"] if kept is not None else {}
    return coords.astype(np.float32, copy=False), {"root": root, "features": features, "coords": {}}


def labels_csv(ids: list[str], labels: Any, names: list[str] | None, id_column: str = "slide_id",
               columns: dict[str, list[Any]] | None = None, label_column: str = "label") -> str:
    """``id_column,label_column[,column...]`` per sample (a class id as its name when ``names`` has
    it; ``columns``: more columns' values per sample, None an empty cell): the CSV ``featurestore
    import --labels`` (and ``probe --labels``) reads. Two columns of one name are refused (a reader
    could only guess which holds what)."""
    columns = columns or {}
    header = [id_column, label_column, *columns]
    if len(set(header)) != len(header):
        twice = sorted({c for c in header if header.count(c) > 1})
        raise InvalidOption(f"labels.csv would have two columns named {twice[0]!r} (columns {', '.join(header)}): "
                            "it would not read back; this is a bug of featurestore export, please report it")
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    for k, (sample_id, value) in enumerate(zip(ids, np.asarray(labels).reshape(len(ids), -1)[:, 0].tolist())):
        if names is not None and isinstance(value, int) and 0 <= value < len(names):
            value = names[value]
        writer.writerow([sample_id, _cell(value), *(_cell(cells[k]) for cells in columns.values())])
    return text.getvalue()


def _cell(value: Any) -> Any:
    """A CSV cell read back as the same value: floats as repr (every digit), null as empty."""
    return "" if value is None else repr(value) if isinstance(value, float) else value


# ---------------------------------------------------------------------- files
def _temp(path: str) -> str:
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{os.getpid()}.tmp")


def atomic_write(path: str, payload: bytes) -> None:
    temp = _temp(path)
    with open(temp, "wb") as f:
        f.write(payload)
    os.replace(temp, path)


def write_h5(path: str, features: np.ndarray, coords: np.ndarray | None, attrs: dict[str, dict[str, Any]],
              features_name: str = "features") -> None:
    try:
        import h5py
    except ImportError:
        from featurestore.errors import MissingDependency

        raise MissingDependency("writing .h5 feature files needs h5py: pip install 'featurestore[hdf5]'") from None
    temp = _temp(path)
    try:
        with h5py.File(temp, "w") as f:
            f.create_dataset(features_name, data=features)
            _set_attrs(f[features_name], attrs["features"])
            if coords is not None:
                f.create_dataset("coords", data=coords)
                _set_attrs(f["coords"], attrs["coords"])
            _set_attrs(f, attrs["root"])
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _set_attrs(node: Any, attrs: dict[str, Any]) -> None:
    for name, value in attrs.items():
        if value is None:
            continue  # HDF5 has no null attribute (the import kept a NaN as null)
        if isinstance(value, list) and None in value:  # an array holding NaN, kept as nulls
            numbers = all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in value)
            value = [float("nan") if v is None else float(v) for v in value] if numbers else json.dumps(value)
        if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)):
            value = json.dumps(value, sort_keys=True)  # nested JSON: kept as its text
        node.attrs[name] = value


def _write_pt(path: str, features: np.ndarray) -> None:
    import torch

    temp = _temp(path)
    try:
        torch.save(torch.from_numpy(np.ascontiguousarray(features)), temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
