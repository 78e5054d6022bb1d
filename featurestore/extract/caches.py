"""Readers of existing feature caches, row by row, for ``featurestore import`` (extract/importer.py).

- :class:`DirectorySource`: one ``.pt``/``.npy`` file per sample (eva), natural name order, stems -> ids;
- :class:`ArraySource`: one ``[N, ...]`` array: a torch file (memory-mapped), ``.npy``
  (``mmap_mode="r"``) or an HDF5 dataset (h5py reads only the rows asked for);
- :class:`H5PerSampleSource`: one HDF5 dataset per sample in a group (THUNDER-style).

Each checks every sample against sample 0's shape and dtype as it reads it (one
:class:`~featurestore.errors.ShapeMismatch` naming the sample), and fingerprints its input from
shape, dtype, sizes and sampled contents, so the cache key changes when the cache does.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import numpy as np
import torch

from featurestore.errors import ShapeMismatch
from featurestore.extract.sources import SourceError

__all__ = ["ArraySource", "CacheSource", "DirectorySource", "H5PerSampleSource", "open_cache", "open_labels"]

_FLOATS = ("float32", "float16", "bfloat16", "float64")
_H5_SUFFIXES = (".h5", ".hdf5", ".hdf")
_TENSOR_SUFFIXES = (".pt", ".pth", ".bin")


def _natural(name: str) -> list[Any]:
    """``"s10"`` after ``"s2"``: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _dtype_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


# --------------------------------------------------------------------------- sources
class CacheSource:
    """Rows of an existing cache: ``read(start, stop)`` -> ``[stop - start, *sample_shape]``."""

    spec: str
    kind: str
    num_samples: int
    sample_shape: tuple[int, ...]
    dtype: str
    ids: list[str] | None = None

    def read(self, start: int, stop: int) -> Any:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def input_files(self, start: int, stop: int) -> list[str]:
        """The files rows ``[start, stop)`` are read from (extract.input_check)."""
        raise NotImplementedError

    def _check(self, value: Any, where: str) -> Any:
        shape, dtype = tuple(value.shape), _dtype_name(value.dtype)
        if shape != self.sample_shape or dtype != self.dtype:
            fix = "pad or crop the cache, or import the groups as separate splits"
            if self.kind == "directory" and len(shape) == len(self.sample_shape) == 2 and (
                    shape[1:] == self.sample_shape[1:]):  # [n, D] files of different n: one slide's patches each
                fix = "if each file holds one slide's patches, import the directory as a bag split with --bags"
            raise ShapeMismatch(
                f"{where} is {dtype} {list(shape)} but sample 0 of {self.spec} is {self.dtype} "
                f"{list(self.sample_shape)}: every sample of a split has one shape and dtype ({fix})")
        return value


def _check_float(dtype: str, spec: str) -> None:
    if dtype not in _FLOATS:
        raise ShapeMismatch(f"{spec} holds {dtype} values: featurestore stores float features "
                            "(float32, float16, bfloat16; float64 is read as float32)")


def _load_pt(path: str, mmap: bool = False) -> Any:
    try:
        # mmap: a [N, ...] cache is paged in as rows are read, never loaded whole.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # pickled objects beyond tensors, or not a torch file at all
        raise SourceError(f"cannot read {path!r} as a torch tensor file ({type(error).__name__}: {error}); "
                          "save tensors with torch.save(tensor, path)") from error


def _tensor_of(value: Any, path: str, key: str | None) -> Any:
    if isinstance(value, dict):
        if key is None:
            tensors = [k for k, v in value.items() if isinstance(v, torch.Tensor)]
            raise SourceError(f"{path!r} holds a dict ({', '.join(map(str, tensors)) or 'no tensors'}): "
                              "name the features with --key (and the labels, if it holds them, with --labels KEY)")
        if key not in value:
            raise SourceError(f"{path!r} has no key {key!r}; it has: {', '.join(map(str, value))}")
        value = value[key]
    if not isinstance(value, (torch.Tensor, np.ndarray)):
        raise SourceError(f"{path!r} holds a {type(value).__name__}, not a tensor")
    return value


class DirectorySource(CacheSource):
    """One ``.pt`` or ``.npy`` file per sample."""

    kind = "directory"

    def __init__(self, directory: str, key: str | None = None) -> None:
        names = [n for n in os.listdir(directory) if n.endswith((".pt", ".npy")) and not n.startswith(".")]
        if not names:
            raise SourceError(f"directory {directory!r} has no .pt or .npy files (one file per sample)")
        suffixes = {os.path.splitext(n)[1] for n in names}
        if len(suffixes) > 1:
            raise SourceError(f"directory {directory!r} mixes .pt and .npy files: keep one kind per split")
        self.spec = f"dir:{directory}"
        self.directory, self.key = directory, key
        self.names = sorted(names, key=_natural)
        self.ids = [os.path.splitext(n)[0] for n in self.names]
        self.num_samples = len(self.names)
        first = self._load(0)
        self.sample_shape, self.dtype = tuple(first.shape), _dtype_name(first.dtype)
        _check_float(self.dtype, f"{self.names[0]} in {directory!r}")
        if self.num_samples > 1:  # before any split is made: files of one slide's patches each are bags
            self._check(self._load(self.num_samples - 1), f"sample {self.num_samples - 1} ({self.names[-1]})")

    def _load(self, index: int) -> Any:
        path = os.path.join(self.directory, self.names[index])
        if path.endswith(".npy"):
            try:
                return np.load(path, allow_pickle=False)
            except (ValueError, OSError, EOFError) as error:
                raise SourceError(f"cannot read {path!r} as a .npy array ({error})") from error
        return _tensor_of(_load_pt(path), path, self.key)

    def read(self, start: int, stop: int) -> Any:
        rows = [self._check(self._load(i), f"sample {i} ({self.names[i]})") for i in range(start, stop)]
        if isinstance(rows[0], torch.Tensor):
            return torch.stack(rows)
        return np.stack(rows)

    def input_files(self, start: int, stop: int) -> list[str]:
        return [os.path.join(self.directory, self.names[i]) for i in range(start, stop)]

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{self.sample_shape}|{self.dtype}".encode())
        sampled = sorted({0, self.num_samples - 1, *[self.num_samples * k // 17 for k in range(1, 17)]})
        for i, name in enumerate(self.names):
            path = os.path.join(self.directory, name)
            h.update(f"{name}|{os.path.getsize(path)}\n".encode())
            if i in sampled:  # whole files are small: hash the contents of 18 of them
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
        return h.hexdigest()


class ArraySource(CacheSource):
    """One ``[N, ...]`` array: a torch tensor file, a ``.npy`` file or one HDF5 dataset."""

    def __init__(self, spec: str, kind: str, array: Any, path: str, keepalive: Any = None) -> None:
        self.spec, self.kind, self.array, self.path = spec, kind, array, path
        self._keepalive = keepalive  # the open HDF5 file
        if len(array.shape) < 2:
            raise ShapeMismatch(f"{spec} has shape {list(array.shape)}: an [N, ...] array with one row per "
                                "sample needs at least 2 dimensions")
        self.num_samples = int(array.shape[0])
        self.sample_shape = tuple(int(s) for s in array.shape[1:])
        self.dtype = _dtype_name(array.dtype)
        _check_float(self.dtype, spec)

    def read(self, start: int, stop: int) -> Any:
        rows = self.array[start:stop]
        return rows if isinstance(rows, torch.Tensor) else np.asarray(rows)

    def input_files(self, start: int, stop: int) -> list[str]:
        return [self.path]

    def fingerprint(self) -> str:
        """Shape, dtype, file size and sampled row blocks (head, tail, 16 strided)."""
        h = hashlib.sha256(f"{self.kind}|{list(self.array.shape)}|{self.dtype}|{os.path.getsize(self.path)}".encode())
        for i in sorted({0, self.num_samples - 1, *[self.num_samples * k // 17 for k in range(1, 17)]}):
            row = self.array[i : i + 1]
            row = row.contiguous().view(torch.uint8).numpy() if isinstance(row, torch.Tensor) else np.asarray(row)
            h.update(np.ascontiguousarray(row).tobytes()[: 1 << 16])
        return h.hexdigest()


class H5PerSampleSource(CacheSource):
    """One HDF5 dataset per sample, in a group (natural name order)."""

    kind = "hdf5-per-sample"

    def __init__(self, spec: str, group: Any, names: list[str], keepalive: Any) -> None:
        self.spec, self.group, self._keepalive = spec, group, keepalive
        self.names = sorted(names, key=_natural)
        self.ids = list(self.names)
        self.num_samples = len(self.names)
        first = group[self.names[0]]
        self.sample_shape, self.dtype = tuple(int(s) for s in first.shape), _dtype_name(first.dtype)
        _check_float(self.dtype, f"{spec}/{self.names[0]}")

    def read(self, start: int, stop: int) -> Any:
        return np.stack([self._check(self.group[self.names[i]][()], f"sample {i} ({self.names[i]})")
                         for i in range(start, stop)])

    def input_files(self, start: int, stop: int) -> list[str]:
        return [self._keepalive.filename]

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{self.sample_shape}|{self.dtype}|{'|'.join(self.names)}".encode())
        for i in sorted({0, self.num_samples - 1, *[self.num_samples * k // 17 for k in range(1, 17)]}):
            h.update(np.ascontiguousarray(self.group[self.names[i]][()]).tobytes())
        return h.hexdigest()


_H5_FEATURE_NAMES = ("features", "embeddings", "feats", "embs", "x")


def _open_h5(path: str, key: str | None, labels_key: str | None) -> CacheSource:
    try:
        import h5py
    except ImportError as error:
        raise SourceError("HDF5 caches need h5py: pip install 'featurestore[hdf5]'") from error
    try:
        f = h5py.File(path, "r")
    except OSError as error:
        raise SourceError(f"cannot open {path!r} as an HDF5 file ({error})") from error
    node = f
    if key is not None:
        if key not in f:
            raise SourceError(f"HDF5 file {path!r} has no dataset or group {key!r}; it has: {', '.join(f.keys())}")
        node = f[key]
    if isinstance(node, h5py.Dataset):
        return ArraySource(f"hdf5:{path}:{key}", "hdf5", node, path, f)
    datasets = [name for name, item in node.items() if isinstance(item, h5py.Dataset) and name != labels_key]
    if not datasets:
        raise SourceError(f"HDF5 {path!r}{':' + key if key else ''} holds no datasets")
    named = [n for n in _H5_FEATURE_NAMES if n in datasets and len(node[n].shape) >= 2]
    if key is None and (named or len(datasets) == 1):
        name = named[0] if named else datasets[0]
        return ArraySource(f"hdf5:{path}:{name}", "hdf5", node[name], path, f)
    return H5PerSampleSource(f"hdf5:{path}:{key or '/'}", node, datasets, f)


def open_cache(path: str, key: str | None = None, labels_key: str | None = None) -> CacheSource:
    """The cache at ``path``: a directory, an HDF5 file, a torch tensor file or a ``.npy`` file."""
    # Absolute: the split's provenance names it, read from anywhere later (a relative path
    # means nothing outside the directory the import ran in).
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return DirectorySource(path, key)
    if not os.path.isfile(path):
        raise SourceError(f"cache {path!r} does not exist")
    lower = path.lower()
    if lower.endswith(_H5_SUFFIXES):
        return _open_h5(path, key, labels_key)
    if lower.endswith(".npy"):
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as error:
            raise SourceError(f"cannot read {path!r} as a .npy array ({error})") from error
        return ArraySource(f"npy:{path}", "npy", array, path)
    if lower.endswith(_TENSOR_SUFFIXES):
        return ArraySource(f"torch:{path}", "torch", _tensor_of(_load_pt(path, mmap=True), path, key), path)
    raise SourceError(f"cannot tell the format of {path!r}: give a directory of .pt/.npy files, an HDF5 "
                      f"file ({', '.join(_H5_SUFFIXES)}), a torch file ({', '.join(_TENSOR_SUFFIXES)}) or a .npy file")


def open_labels(spec: str | None, source: CacheSource) -> ArraySource | None:
    """``--labels``: a ``.npy``/torch file ``[N, ...]``, or a key of the torch dict (``--key`` names
    the features) or a dataset name inside an HDF5 source."""
    if spec is None:
        return None
    keepalive = getattr(source, "_keepalive", None)
    if not os.path.exists(spec) and keepalive is not None and spec in keepalive:
        array: Any = keepalive[spec]
        path = keepalive.filename
    elif spec.lower().endswith(".npy") and os.path.isfile(spec):
        spec = os.path.abspath(spec)  # the provenance names it (as open_cache's path)
        array, path = np.load(spec, mmap_mode="r", allow_pickle=False), spec
    elif spec.lower().endswith(_TENSOR_SUFFIXES) and os.path.isfile(spec):
        spec = os.path.abspath(spec)
        array, path = _tensor_of(_load_pt(spec, mmap=True), spec, None), spec
    elif not os.path.exists(spec) and source.kind == "torch" and isinstance(
            loaded := _load_pt(source.path, mmap=True), dict):  # type: ignore[attr-defined]
        if spec not in loaded:
            raise SourceError(f"--labels {spec!r} is neither a .npy/.pt file nor a key of the torch dict "
                              f"{source.path!r} (it has: {', '.join(map(str, loaded))})")  # type: ignore[attr-defined]
        array, path = _tensor_of(loaded, source.path, spec), source.path  # type: ignore[attr-defined]
    else:
        raise SourceError(f"--labels {spec!r} is neither a .npy/.pt file nor a dataset of the HDF5 source")
    dtype = _dtype_name(array.dtype)
    if len(array.shape) < 1 or int(array.shape[0]) != source.num_samples:
        raise ShapeMismatch(f"labels {spec!r} have shape {list(array.shape)} but the cache has "
                            f"{source.num_samples} samples: one label row per sample")
    if not (dtype.startswith(("int", "uint", "float")) or dtype == "bool"):
        raise ShapeMismatch(f"labels {spec!r} are {dtype}: use integer class ids/maps or floats")
    labels = ArraySource.__new__(ArraySource)
    labels.spec, labels.kind, labels.array, labels.path, labels._keepalive = spec, "labels", array, path, None
    labels.num_samples, labels.sample_shape, labels.dtype = int(array.shape[0]), tuple(array.shape[1:]), dtype
    return labels
