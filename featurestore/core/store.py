"""FeatureStore: the root of a store, its listings, and the doors to readers and writers."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from featurestore import __version__
from featurestore.core import quantize_int8
from featurestore.core.leftovers import remove_stale_temp_files
from featurestore.core.reader import FeatureArray
from featurestore.core.storage import Storage, open_storage
from featurestore.core.writer import SplitWriter
from featurestore.errors import (
    CacheKeyMismatch,
    WrongSplitKind,
    DatasetNotFound,
    DtypeMismatch,
    EncoderNotFound,
    FeatureStoreError,
    IncompleteSplit,
    InvalidOption,
    NotAFeatureStore,
    ReadOnlyStore,
    ShapeMismatch,
    SplitExists,
    SplitNotFound,
    SplitSettingsMismatch,
    StoreNotFound,
)
from featurestore.format import chunks, dtypes, int8, layout
from featurestore.format.chunk_checks import features_match_stats
from featurestore.format.metadata import (
    WRITING,
    LabelSpec,
    Provenance,
    SplitMetadata,
    check_version,
    chunk_arrays,
    seal_problem,
    stats_row_length,
)
from featurestore.format.names import validate_name
from featurestore.format.redact import redact_url

# The levels of a split's key, with the error that names each (FeatureStore._require_inside).
_LEVELS = ((DatasetNotFound, "dataset"), (EncoderNotFound, "encoder"), (SplitNotFound, "split"))
ROOT_ATTRIBUTES = {"featurestore": {"format": layout.FORMAT_NAME, "version": layout.FORMAT_VERSION}}


def open_store(url: str, mode: str = "r", **storage_options: Any) -> FeatureStore:
    """Open the store at ``url`` (a path or any fsspec URL).

    ``mode="r"`` needs an existing store; ``mode="a"`` creates the root group if it is missing.
    ``storage_options`` go to fsspec (e.g. ``endpoint_url``, ``key``, ``secret`` for s3fs). On
    object storage, ``cache_dir=`` (and ``cache_bytes=``) keeps whole chunks in a local directory
    shared by the host's processes and reads them from there (docs/STORAGE.md, "Chunk cache").
    """
    if mode not in ("r", "a"):
        raise InvalidOption(f"mode {mode!r} is not supported: use 'r' (read) or 'a' (read and write)")
    return FeatureStore(open_storage(url, storage_options), mode=mode)


class FeatureStore:
    def __init__(self, storage: Storage, *, mode: str) -> None:
        self.storage = storage
        self.url = storage.url
        self.mode = mode
        root = storage.local_path("")
        # A local root's real path (symlinks resolved): nothing is listed or read outside it.
        self._real_root = os.path.realpath(root) if root is not None else None
        raw = self._read_document(layout.ZARR_JSON)
        if raw is None:
            if mode == "r":
                raise StoreNotFound(
                    f"no featurestore at {self.url!r}: check the URL, or create one by writing a "
                    "split (featurestore extract --store URL ..., or open_store(url, mode='a'))"
                )
            storage.write(layout.ZARR_JSON, layout.group_document(ROOT_ATTRIBUTES))
            return
        check_root(raw, self.url)

    def __repr__(self) -> str:
        return f"FeatureStore({redact_url(self.url)!r}, mode={self.mode!r})"

    # ------------------------------------------------------------------ listings
    def datasets(self) -> list[str]:
        return self._groups("")

    def encoders(self, dataset: str) -> list[str]:
        self._require_group(dataset)
        return self._groups(validate_name(dataset, "dataset"))

    def splits(self, dataset: str, encoder: str) -> list[str]:
        # validate here: _require_group treats encoder=None as "dataset only"
        self._require_group(dataset, validate_name(encoder, "encoder"))
        return self._groups(f"{dataset}/{encoder}")

    def split_info(self, dataset: str, encoder: str, split: str) -> SplitMetadata:
        """The split's metadata, typed (:class:`~featurestore.format.metadata.SplitMetadata`)."""
        key = self._split_key(dataset, encoder, split)
        self._require_inside(dataset, encoder, split)
        doc = self._read_document(f"{key}/{layout.ZARR_JSON}")
        if doc is None:
            self._require_group(dataset, encoder)
            raise SplitNotFound(
                f"split {split!r} not found in {dataset}/{encoder} at {self.url}; available: "
                f"{', '.join(self.splits(dataset, encoder)) or 'none'}"
            )
        return check_split(doc, key)

    def split_metadata(self, dataset: str, encoder: str, split: str) -> dict[str, Any]:
        """The split's metadata as the plain dict stored in its zarr.json (see :meth:`split_info`)."""
        return self.split_info(dataset, encoder, split).to_json()

    def split_status(self, dataset: str, encoder: str, split: str) -> str:
        return self.split_info(dataset, encoder, split).status

    def split_kind(self, dataset: str, encoder: str, split: str) -> str:
        """``"dense"`` (``open``) or ``"bags"`` (``open_bags``)."""
        return self.split_info(dataset, encoder, split).kind

    # ------------------------------------------------------------------ reading
    def open(self, dataset: str, encoder: str, split: str, allow_incomplete: bool = False) -> FeatureArray:
        meta = self.split_info(dataset, encoder, split)
        key = self._split_key(dataset, encoder, split)
        if meta.is_bags:
            raise WrongSplitKind(f"split {key} is a bag split (ragged per-slide bags): open it with "
                                 "store.open_bags(...)")
        if not meta.complete and not allow_incomplete:
            raise IncompleteSplit(
                f"split {key} is not complete (status {meta.status!r}): its writer is still "
                "running or died. Resume it (featurestore extract ... --resume), or pass "
                "allow_incomplete=True to read it as it is"
            )
        user_meta = meta.to_json()  # arr.metadata stays a dict for users (SPEC)
        self._require_inside(dataset, encoder, split, layout.FEATURES, layout.LABELS)
        labels = None
        if meta.labels is not None:
            labels_doc = self._array_document(f"{key}/{layout.LABELS}")
            labels = FeatureArray(self.storage, key, layout.LABELS, labels_doc,
                                  logical_dtype=meta.labels.dtype, metadata=user_meta)
        features_doc = self._array_document(f"{key}/{layout.FEATURES}")
        return FeatureArray(self.storage, key, layout.FEATURES, features_doc,
                            logical_dtype=meta.logical_dtype, metadata=user_meta, labels=labels)

    def open_bags(self, dataset: str, encoder: str, split: str, allow_incomplete: bool = False) -> Any:
        """A bag split for reading (:class:`featurestore.core.bags.BagSplit`): ``len``, ``ids``,
        ``lengths``, ``labels``, ``read(i_or_id)``; docs/CORE-API.md."""
        from featurestore.core.bag_store import open_bags

        return open_bags(self, dataset, encoder, split, allow_incomplete=allow_incomplete)

    # ------------------------------------------------------------------ writing
    def create_bag_split(self, dataset: str, encoder: str, split: str, *, dim: int, dtype: str = "float16",
                         metadata: dict[str, Any] | None = None, resume: bool = False, overwrite: bool = False,
                         coords_unit: str | None = "px", coords_dtype: str = "int64",
                         patch_size_level0: Any = None, label_dtype: Any = None,
                         chunk_bytes: int = 8 << 20, verify_chunks: bool = False) -> Any:
        """Create (or resume, or overwrite) a bag split and return its
        :class:`~featurestore.core.bag_writer.BagWriter` (``add_bag``, ``done_ids``, ``commit``).

        ``coords_unit``: ``"px"`` (level-0 pixels), ``"um"`` or None; ``coords_dtype``: int64,
        int32, float32 or float64; ``patch_size_level0``: the patch side at level 0, if known;
        ``label_dtype``: the dtype of per-bag labels (None: inferred from the labels given).
        ``resume=True`` continues a split (every torchrun rank attaches with it after one
        created it): ``writer.done_ids`` are the bags already complete; on a complete split, all
        but those of damaged chunks (sizes checked; crc32c and seals too with ``verify_chunks``),
        to be added again: ``commit()`` rewrites their chunks only. docs/FORMAT.md, "Slide bags"."""
        from featurestore.core.bag_store import create_bag_split

        return create_bag_split(self, dataset, encoder, split, dim=dim, dtype=dtype, metadata=metadata,
                                resume=resume, overwrite=overwrite, coords_unit=coords_unit,
                                coords_dtype=coords_dtype, patch_size_level0=patch_size_level0,
                                label_dtype=label_dtype, chunk_bytes=chunk_bytes, verify_chunks=verify_chunks)

    def create_split(
        self,
        dataset: str,
        encoder: str,
        split: str,
        *,
        num_samples: int,
        sample_shape: tuple[int, ...] | list[int],
        dtype: str = "float16",
        label_shape: tuple[int, ...] | list[int] = (),
        label_dtype: Any = None,
        metadata: dict[str, Any] | None = None,
        chunk_bytes: int | None = None,
        chunk_rows: int | None = None,
        resume: bool = False,
        overwrite: bool = False,
        compressor: str | None = None,
        ids: list[str] | None = None,
        provenance: Provenance | None = None,
        verify_chunks: bool = False,
    ) -> SplitWriter:
        """Create (or resume, or overwrite) a split and return its :class:`SplitWriter`.

        The chunk size is ``chunk_rows`` samples, or as many samples as fit in ``chunk_bytes``
        (default 8 MiB); give one of them. An existing split is refused unless ``resume=True``
        (keep its valid chunks, rewrite the rest) or ``overwrite=True`` (delete it first, new
        generation). Resuming a split whose ``cache_key`` differs raises
        :class:`CacheKeyMismatch`; one whose geometry, compressor or chunk size differs raises
        :class:`SplitSettingsMismatch`. Resuming a complete split re-checks its chunks (sizes;
        crc32c too with ``verify_chunks=True``) and reopens it for the missing or damaged ones.
        """
        if self.mode != "a":
            raise ReadOnlyStore(f"store {self.url} is open read-only: open_store(url, mode='a') to write")
        key = self._split_key(dataset, encoder, split)
        if resume and overwrite:
            raise InvalidOption("resume=True and overwrite=True exclude each other: choose one")
        wanted = self._new_metadata(dataset, encoder, split, num_samples, sample_shape, dtype,
                                    label_shape, label_dtype, metadata, chunk_bytes, chunk_rows,
                                    compressor, ids, provenance)
        label_np = np.dtype(wanted.labels.dtype) if wanted.labels is not None else None
        existing = self._read_document(f"{key}/{layout.ZARR_JSON}")
        if existing is not None and not overwrite:
            if not resume:
                raise SplitExists(
                    f"split {key} already exists at {self.url}: pass resume=True to continue it "
                    "(--resume) or overwrite=True to replace it (--overwrite)"
                )
            meta = check_split(existing, key)
            check_resumable(meta, wanted, key)
            remove_stale_temp_files(self.storage, key)  # of killed writers only (core.leftovers)
            if meta.complete:
                done = self._valid_chunks(key, meta, crc=verify_chunks)
                if len(done) == meta.num_chunks:
                    return SplitWriter(self.storage, key, meta, done_chunks=done, label_dtype=label_np)
                # Damaged: it must not read as complete while its chunks are rewritten.
                meta = meta.replace(status=WRITING, completed=None)
                self._write_split_document(key, meta)
                return SplitWriter(self.storage, key, meta, done_chunks=done, label_dtype=label_np)
            # The array documents may be missing if the creating process died right after the
            # group; writing them again is idempotent (same geometry, checked above).
            self._write_arrays(key, meta, ids)
            done = self._valid_chunks(key, meta)
            return SplitWriter(self.storage, key, meta, done_chunks=done, label_dtype=label_np)
        if existing is not None:
            # Mark the old split incomplete before deleting it: a delete cut short (SIGKILL, a
            # lost connection) must not leave a split that reads as complete with chunks gone.
            # It keeps its own metadata (cache key and generation included), so a later resume
            # cannot mix its surviving chunks with another encoder's.
            stale = dict((existing.get("attributes") or {}).get("featurestore") or {})
            stale["status"] = WRITING
            self.storage.write(f"{key}/{layout.ZARR_JSON}", layout.group_document({"featurestore": stale}))
            self.storage.delete_tree(key)
        self._ensure_group(dataset, {"featurestore": {"kind": "dataset"}})
        self._ensure_group(f"{dataset}/{encoder}", {"featurestore": {"kind": "encoder"}})
        # The split's group (status "writing", a new generation) goes first: a creation cut short
        # is visible as an incomplete split, never as a complete one, and a writer of the
        # replaced split sees the generation change at its next chunk.
        self._write_split_document(key, wanted)
        self._write_arrays(key, wanted, ids)
        return SplitWriter(self.storage, key, wanted, done_chunks=set(), label_dtype=label_np)

    # ------------------------------------------------------------------ internals
    def _new_metadata(self, dataset: str, encoder: str, split: str, num_samples: int,
                      sample_shape: Any, dtype: str, label_shape: Any, label_dtype: Any,
                      metadata: dict[str, Any] | None, chunk_bytes: int | None,
                      chunk_rows: int | None, compressor: str | None,
                      ids: list[str] | None, provenance: Provenance | None) -> SplitMetadata:
        dtypes.check_feature_dtype(dtype)
        if not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ShapeMismatch(f"num_samples must be a positive int, got {num_samples!r}")
        shape = tuple(int(s) for s in sample_shape)
        if not shape or any(s < 1 for s in shape):
            raise ShapeMismatch(f"sample_shape must have at least one positive axis (e.g. (tokens, dim)), got {tuple(sample_shape)!r}")
        if chunk_rows is not None and chunk_bytes is not None:
            raise InvalidOption(f"chunk_rows={chunk_rows!r} and chunk_bytes={chunk_bytes!r} exclude each other: give one")
        if chunk_rows is None:
            chunk_bytes = 8 << 20 if chunk_bytes is None else chunk_bytes
            if not isinstance(chunk_bytes, (int, np.integer)) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
                raise InvalidOption(f"chunk_bytes must be a positive int (e.g. 8 << 20), got {chunk_bytes!r}")
            sample_nbytes = int(np.prod(shape)) * dtypes.storage_dtype(dtype).itemsize
            chunk_rows = layout.chunk_rows_for(sample_nbytes, chunk_bytes, int(num_samples))
            chunk_rows = int8.chunk_rows(dtype, chunk_rows, int(num_samples))
        elif not isinstance(chunk_rows, (int, np.integer)) or isinstance(chunk_rows, bool) or chunk_rows < 1:
            raise InvalidOption(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        else:
            chunk_rows = min(int(chunk_rows), int(num_samples))
        if ids is not None and len(ids) != num_samples:
            raise ShapeMismatch(f"ids has {len(ids)} entries for {num_samples} samples: pass one id per sample")
        labels = None
        if label_dtype is not None:
            label_np = np.dtype(label_dtype)
            if label_np.kind not in "iufb":
                raise DtypeMismatch(f"label_dtype {label_np} is not numeric: use e.g. 'int64' or 'uint8'")
            labels = LabelSpec(tuple(int(s) for s in label_shape), label_np.name)
        return SplitMetadata.new(
            dataset=dataset, encoder_name=encoder, split=split, num_samples=int(num_samples),
            sample_shape=shape, logical_dtype=dtype, chunk_rows=int(chunk_rows), compressor=compressor,
            labels=labels, ids=ids is not None, user=metadata, provenance=provenance,
            creator_version=__version__)

    def _write_split_document(self, key: str, meta: SplitMetadata) -> None:
        self.storage.write(f"{key}/{layout.ZARR_JSON}", layout.group_document({"featurestore": meta.to_json()}))

    def _write_arrays(self, key: str, meta: SplitMetadata, ids: list[str] | None) -> None:
        n, rows = meta.num_samples, meta.chunk_rows
        logical = meta.logical_dtype
        attrs = {"featurestore": {"logical_dtype": logical}}
        self.storage.write(f"{key}/{layout.FEATURES}/{layout.ZARR_JSON}", layout.array_document(
            shape=(n, *meta.sample_shape), chunk_rows=rows, data_type=dtypes.zarr_data_type(logical),
            compressor=meta.compressor, attributes=attrs))
        if meta.labels is not None:
            self.storage.write(f"{key}/{layout.LABELS}/{layout.ZARR_JSON}", layout.array_document(
                shape=(n, *meta.labels.shape), chunk_rows=rows, data_type=meta.labels.dtype,
                attributes={"featurestore": {"logical_dtype": meta.labels.dtype}}))
        quantize_int8.write_scales_document(self.storage, key, meta)
        self.storage.write(f"{key}/{layout.CHUNK_STATS}/{layout.ZARR_JSON}", layout.array_document(
            shape=(meta.num_chunks, stats_row_length(meta)), chunk_rows=1, data_type="float64",
            attributes={"featurestore": {"description": "per-chunk partial sums; see docs/FORMAT.md"}}))
        if ids is not None:
            import zarr

            array = zarr.create_array(store=self.storage.zarr_store(read_only=False),
                                      name=f"{key}/{layout.IDS}", shape=(n,), dtype=str,
                                      chunks=(max(1, min(n, 65536)),), overwrite=True)
            array[:] = np.asarray([str(i) for i in ids], dtype=object)

    def _valid_chunks(self, key: str, meta: SplitMetadata, crc: bool = True) -> set[int]:
        """Chunks whose features, statistics row and labels are all present with the right size
        (and valid crc32c unless ``crc=False``), whose statistics row carries this split's
        generation and the chunk's own index, and (with ``crc``, which reads the features)
        whose features are the ones that row describes: a swapped or moved chunk file with a
        valid crc32c of its own is rewritten too (format.chunk_checks, as `verify` checks)."""
        valid: set[int] | None = None
        stats_rows: dict[int, np.ndarray] = {}
        # Statistics rows first: each features chunk is then checked against its row.
        for name, ndim, nbytes in sorted(chunk_arrays(meta), key=lambda a: a[0] != layout.CHUNK_STATS):
            present = {int(n) for n in self.storage.listdir(f"{key}/{name}/c") if n.isdigit()}
            good = set()
            for index in sorted(present if valid is None else present & valid):
                if index >= meta.num_chunks:
                    continue
                chunk = layout.chunk_key(f"{key}/{name}", index, ndim)
                if not crc and nbytes is not None and name != layout.CHUNK_STATS:
                    # Sizes only (a stat per chunk, no read); a directory has another size.
                    size = self.storage.size(chunk)
                    if size == nbytes + layout.CRC_BYTES:
                        good.add(index)
                    continue
                try:
                    raw = self.storage.read(chunk)
                except (FileNotFoundError, IsADirectoryError):
                    # c/<i>/ exists locally from the moment a writer starts chunk i (makedirs,
                    # then the atomic rename): another rank mid-write, or one killed there.
                    continue
                if chunks.check(raw, nbytes) is not None:
                    continue
                if name == layout.CHUNK_STATS:
                    if seal_problem(raw, meta, index) is not None:
                        continue  # another run's chunk (overwrite raced) or a moved file
                    stats_rows[index] = np.frombuffer(raw[: -layout.CRC_BYTES], np.float64)
                elif name == layout.FEATURES and features_match_stats(raw, meta, index, stats_rows[index]):
                    continue  # a swapped or moved features file: its rows belong elsewhere
                good.add(index)
            valid = good
        return valid or set()

    def _split_key(self, dataset: str, encoder: str, split: str) -> str:
        return layout.split_key(validate_name(dataset, "dataset"), validate_name(encoder, "encoder"),
                                validate_name(split, "split"))

    def _groups(self, prefix: str) -> list[str]:
        names = []
        for name in self.storage.listdir(prefix):
            if name.startswith(".") or not _is_name(name):
                continue
            key = f"{prefix}/{name}" if prefix else name
            if self._inside(key) and self.storage.exists(f"{key}/{layout.ZARR_JSON}"):
                names.append(name)
        return sorted(names)

    def _inside(self, key: str) -> bool:
        """Whether ``key`` really lies inside the store: on a local store a symlink (the key
        itself or any directory above it) may not lead out of the root. The one containment
        check of listings and opens; object stores have no links."""
        if self._real_root is None:
            return True
        path = self.storage.local_path(key)
        real = os.path.realpath(path) if path is not None else self._real_root
        return real == self._real_root or real.startswith(self._real_root.rstrip(os.sep) + os.sep)

    def _require_inside(self, dataset: str, encoder: str | None = None, split: str | None = None,
                        *arrays: str) -> None:  # fmt: skip
        """Refuse the first level (dataset, encoder, split, then each of the split's ``arrays``)
        that leads out of the store, with that level's not-found error."""
        names = [n for n in (dataset, encoder, split) if n is not None]
        checks = [("/".join(names[: i + 1]), level) for i, level in enumerate(_LEVELS[: len(names)])]
        checks += [(f"{'/'.join(names)}/{array}", (SplitNotFound, "array")) for array in arrays]
        for key, (error, what) in checks:
            if not self._inside(key):
                raise error(f"{what} {key} at {self.url} is a symbolic link that leads out of the "
                            "store: it is neither listed nor read. Copy the data into the store, or "
                            "open the store it belongs to")  # fmt: skip

    def _require_group(self, dataset: str, encoder: str | None = None) -> None:
        self._require_inside(validate_name(dataset, "dataset"),
                             None if encoder is None else validate_name(encoder, "encoder"))
        if not self.storage.exists(f"{dataset}/{layout.ZARR_JSON}"):
            raise DatasetNotFound(
                f"dataset {dataset!r} not found at {self.url}; available: {', '.join(self.datasets()) or 'none'}"
            )
        if encoder is not None:
            validate_name(encoder, "encoder")
            if not self.storage.exists(f"{dataset}/{encoder}/{layout.ZARR_JSON}"):
                raise EncoderNotFound(
                    f"encoder {encoder!r} not found in dataset {dataset!r} at {self.url}; "
                    f"available: {', '.join(self._groups(dataset)) or 'none'}"
                )

    def _ensure_group(self, key: str, attributes: dict[str, Any]) -> None:
        if not self.storage.exists(f"{key}/{layout.ZARR_JSON}"):
            self.storage.write(f"{key}/{layout.ZARR_JSON}", layout.group_document(attributes))

    def _read_document(self, key: str) -> dict[str, Any] | None:
        try:
            raw = self.storage.read(key)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        try:
            return layout.load_document(raw)
        except ValueError as error:
            raise NotAFeatureStore(f"{self.url}/{key} is not valid JSON ({error}): the store is damaged") from None

    def _array_document(self, key: str) -> dict[str, Any]:
        doc = self._read_document(f"{key}/{layout.ZARR_JSON}")
        if doc is None or doc.get("node_type") != "array":
            raise SplitNotFound(f"array {key} is missing at {self.url}: the split is damaged; rewrite it with overwrite=True")
        return doc


def check_root(doc: dict[str, Any], url: str) -> None:
    info = (doc.get("attributes") or {}).get("featurestore") or {}
    if doc.get("node_type") != "group" or info.get("format") != layout.FORMAT_NAME:
        raise NotAFeatureStore(
            f"{url} holds a zarr node that is not a featurestore root: point to the store's root "
            "directory, or use an empty location for a new store"
        )
    check_version(info.get("version"), url)


def check_split(doc: dict[str, Any], key: str) -> SplitMetadata:
    if doc.get("node_type") != "group":
        raise SplitNotFound(f"{key} is not a featurestore split (its zarr.json is not a group)")
    return SplitMetadata.from_json((doc.get("attributes") or {}).get("featurestore"), key)


def check_resumable(meta: SplitMetadata, wanted: SplitMetadata, key: str) -> None:
    """The one check that a run may continue (or re-run into) an existing split."""
    if meta.is_bags:
        raise WrongSplitKind(f"split {key} is a bag split, not a dense split: use another split name, "
                             "or overwrite=True (--overwrite) to replace it")
    old, new = meta.cache_key, wanted.cache_key
    if old and new and old != new:
        raise CacheKeyMismatch(
            f"split {key} was written with cache key {old}, this run has {new} (another encoder, "
            "weights, preprocessing, dtype or input): use overwrite=True (--overwrite) to replace it, "
            "or another split name"
        )
    for name in ("num_samples", "sample_shape", "logical_dtype", "labels"):
        if getattr(meta, name) != getattr(wanted, name):
            raise ShapeMismatch(
                f"cannot resume {key}: its {name} is {getattr(meta, name)!r}, this run asks for "
                f"{getattr(wanted, name)!r}; use overwrite=True (--overwrite) to replace it"
            )
    for name, flag in (("compressor", "--compressor"), ("chunk_rows", "--chunk-mb")):
        if getattr(meta, name) != getattr(wanted, name):
            raise SplitSettingsMismatch(
                f"split {key} ({meta.status}) was written with {name} {getattr(meta, name)!r}, this run "
                f"asks for {getattr(wanted, name)!r} ({flag}): run with the split's own setting, or "
                "--overwrite to rewrite it with the new one"
            )


def _is_name(name: str) -> bool:
    try:
        validate_name(name)
    except FeatureStoreError:
        return False
    return True
