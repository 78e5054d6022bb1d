"""FeatureStore: the root of a store, its listings, and the doors to readers and writers."""

from __future__ import annotations

import os
from typing import Any

from featurestore.core import lifecycle
from featurestore.core.bag_writer import BagWriter
from featurestore.core.bag_array import BagArray
from featurestore.core.kinds import BAG_KIND, DENSE_KIND
from featurestore.core.lifecycle import check_split
from featurestore.core.reader import FeatureArray
from featurestore.core.seals import SealTable
from featurestore.core.storage import Storage, open_storage
from featurestore.core.storage.files import nearest_existing
from featurestore.core.writer import SplitWriter
from featurestore.errors import (
    DatasetNotFound,
    EncoderNotFound,
    FeatureStoreError,
    IncompleteSplit,
    InvalidOption,
    NotAFeatureStore,
    ReadOnlyStore,
    SplitNotFound,
    StoreNotFound,
)
from featurestore.format import bags, dtypes, layout
from featurestore.format.metadata import BAGS, DENSE, Provenance, SplitMetadata, check_version
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
    if mode == "a" and _over_http(str(url)):
        raise ReadOnlyStore(f"store {redact_url(str(url))} is read-only: HTTP serves reads (a featurestore server, or "
                            "a store's files on a web server); write to the store's own path or s3:// URL")
    return FeatureStore(open_storage(url, storage_options), mode=mode)


def _over_http(url: str) -> bool:
    """A plain HTTP(S) URL: a store's files on a web server (read-only), or, where there is no store
    document, most likely `featurestore serve`'s address given to a store door."""
    return url.lower().startswith(("http://", "https://"))


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
            if mode == "r" and _over_http(self.url):
                raise StoreNotFound(
                    f"no featurestore at {self.url!r}: a featurestore server (featurestore serve) is read with "
                    "FeatureClient, FeatureDataset or BagDataset, and by `featurestore probe URL`; ls, info, "
                    "verify and the other commands take the store the server serves (its path or s3:// URL), "
                    "and a browser shows the server's catalog at the URL")
            if mode == "r":
                raise StoreNotFound(
                    f"no featurestore at {self.url!r}: check the URL, or create one by writing a "
                    "split (featurestore extract --store URL ..., or open_store(url, mode='a'))"
                )
            if root is not None and not os.path.isdir(nearest_existing(root)):
                raise InvalidOption(f"{self.url} is, or is under, a file: a store is a directory; give a path to a "
                                    "directory (new or empty for a new store)")
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
        lifecycle.check_kind(meta, DENSE, key)
        if not meta.complete and not allow_incomplete:
            raise IncompleteSplit(
                f"split {key} is not complete (status {meta.status!r}): its writer is still "
                "running or died. Resume it: rerun the command that wrote it plus --resume "
                "(`featurestore extract ...` or `featurestore import ...`); or, in Python, read it as it "
                "is with allow_incomplete=True"
            )
        user_meta = meta.to_json()  # arr.metadata stays a dict for users (SPEC)
        self._require_inside(dataset, encoder, split, layout.FEATURES, layout.LABELS)
        seals = SealTable(self.storage, key, meta)  # the cache's check of a cached file, read on first use
        labels = None
        if meta.labels is not None:
            labels_doc = self._array_document(f"{key}/{layout.LABELS}")
            labels = FeatureArray(self.storage, key, layout.LABELS, labels_doc,
                                  logical_dtype=meta.labels.dtype, metadata=user_meta)
            labels.seals = (seals, layout.LABELS)
        features_doc = self._array_document(f"{key}/{layout.FEATURES}")
        features = FeatureArray(self.storage, key, layout.FEATURES, features_doc,
                                logical_dtype=meta.logical_dtype, metadata=user_meta, labels=labels)
        features.seals = (seals, layout.FEATURES)
        return features

    def open_bags(self, dataset: str, encoder: str, split: str, allow_incomplete: bool = False) -> BagArray:
        """A bag split for reading (:class:`featurestore.core.bag_array.BagArray`): ``len``, ``ids``,
        ``lengths``, ``labels``, ``read(i_or_id)``; docs/CORE-API.md."""
        meta = self.split_info(dataset, encoder, split)
        key = self._split_key(dataset, encoder, split)
        lifecycle.check_kind(meta, BAGS, key)
        if not meta.complete and not allow_incomplete:
            raise IncompleteSplit(f"bag split {key} is not complete (status {meta.status!r}): its writer is still "
                                  "running or died. Resume it (featurestore import ... --resume, or "
                                  "create_bag_split(..., resume=True) then commit())")
        names = [layout.FEATURES, bags.COORDS, bags.OFFSETS]
        if (meta.bags or {}).get("labels") is not None:
            names.append(layout.LABELS)
        if dtypes.is_int8(meta.logical_dtype):
            names.append(layout.SCALES)
        self._require_inside(dataset, encoder, split, *names, bags.BAG_IDS, bags.BAG_ATTRS)
        documents: dict[str, dict[str, Any]] = {}
        for name in names:
            doc = self._read_document(f"{key}/{name}/{layout.ZARR_JSON}")
            if doc is not None:
                documents[name] = doc
            elif not meta.complete:
                raise IncompleteSplit(f"bag split {key} has never been committed: nothing to read yet; "
                                      "commit it (writer.commit()) first")
            else:
                self._array_document(f"{key}/{name}")  # raises, naming the missing array
        return BagArray(self.storage, key, meta, documents)

    # ------------------------------------------------------------------ writing
    def create_bag_split(self, dataset: str, encoder: str, split: str, *, dim: int, dtype: str = "float16",
                         metadata: dict[str, Any] | None = None, resume: bool = False, overwrite: bool = False,
                         coords_unit: str | None = "px", coords_dtype: str = "int64",
                         patch_size_level0: Any = None, label_dtype: Any = None,
                         chunk_bytes: int = 8 << 20, verify_chunks: bool = False) -> BagWriter:
        """Create (or resume, or overwrite) a bag split and return its
        :class:`~featurestore.core.bag_writer.BagWriter` (``add_bag``, ``done_ids``, ``commit``).

        ``coords_unit``: ``"px"`` (level-0 pixels), ``"um"`` or None; ``coords_dtype``: int64,
        int32, float32 or float64; ``patch_size_level0``: the patch side at level 0, if known;
        ``label_dtype``: the dtype of per-bag labels (None: inferred from the labels given).
        ``resume=True`` continues a split (every torchrun rank attaches with it after one
        created it): ``writer.done_ids`` are the bags already complete; on a complete split, all
        but those of damaged chunks (sizes checked; crc32c and seals too with ``verify_chunks``),
        to be added again: ``commit()`` rewrites their chunks only. docs/FORMAT.md, "Slide bags"."""
        lifecycle.check_request(self.url, self.mode, resume=resume, overwrite=overwrite)
        key = self._split_key(dataset, encoder, split)
        wanted = BAG_KIND.new_metadata(dataset, encoder, split, dim=dim, dtype=dtype, metadata=metadata,
                                       coords_unit=coords_unit, coords_dtype=coords_dtype,
                                       patch_size_level0=patch_size_level0, label_dtype=label_dtype,
                                       chunk_bytes=chunk_bytes)
        return lifecycle.open_writer(self.storage, self.url, self.mode, key, BAG_KIND, wanted, resume=resume,
                                     overwrite=overwrite, verify_chunks=verify_chunks)

    def create_split(self, dataset: str, encoder: str, split: str, *, num_samples: int,
                     sample_shape: tuple[int, ...] | list[int], dtype: str = "float16",
                     label_shape: tuple[int, ...] | list[int] = (), label_dtype: Any = None,
                     metadata: dict[str, Any] | None = None, chunk_bytes: int | None = None,
                     chunk_rows: int | None = None, resume: bool = False, overwrite: bool = False,
                     compressor: str | None = None, ids: list[str] | None = None,
                     provenance: Provenance | None = None, verify_chunks: bool = False) -> SplitWriter:
        """Create (or resume, or overwrite) a split and return its :class:`SplitWriter`.

        The chunk size is ``chunk_rows`` samples, or as many samples as fit in ``chunk_bytes``
        (default 8 MiB); give one of them. An existing split is refused unless ``resume=True``
        (keep its valid chunks, rewrite the rest) or ``overwrite=True`` (delete it first, new
        generation). Resuming a split whose ``cache_key`` differs raises
        :class:`CacheKeyMismatch`; one whose geometry, compressor or chunk size differs raises
        :class:`SplitSettingsMismatch`. Resuming a complete split re-checks its chunks (sizes;
        crc32c and seals too with ``verify_chunks=True``) and reopens it for the missing or
        damaged ones. The steps are featurestore.core.lifecycle's, shared by every kind.
        """
        lifecycle.check_request(self.url, self.mode, resume=resume, overwrite=overwrite)
        key = self._split_key(dataset, encoder, split)
        wanted = DENSE_KIND.new_metadata(dataset, encoder, split, num_samples=num_samples, sample_shape=sample_shape,
                                         dtype=dtype, label_shape=label_shape, label_dtype=label_dtype,
                                         metadata=metadata, chunk_bytes=chunk_bytes, chunk_rows=chunk_rows,
                                         compressor=compressor, ids=ids, provenance=provenance)
        return lifecycle.open_writer(self.storage, self.url, self.mode, key, DENSE_KIND, wanted, resume=resume,
                                     overwrite=overwrite, verify_chunks=verify_chunks, ids=ids)

    # ------------------------------------------------------------------ internals
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

    def _read_document(self, key: str) -> dict[str, Any] | None:
        return lifecycle.read_document(self.storage, self.url, key)

    def _array_document(self, key: str) -> dict[str, Any]:
        doc = self._read_document(f"{key}/{layout.ZARR_JSON}")
        if doc is None or doc.get("node_type") != "array":
            raise SplitNotFound(f"array {key} is missing at {self.url}: the split is damaged; rewrite it with overwrite=True")
        return doc


__all__ = ["FeatureStore", "check_root", "check_split", "open_store"]


def check_root(doc: dict[str, Any], url: str) -> None:
    info = (doc.get("attributes") or {}).get("featurestore") or {}
    if doc.get("node_type") != "group" or info.get("format") != layout.FORMAT_NAME:
        raise NotAFeatureStore(
            f"{url} holds a zarr node that is not a featurestore root: point to the store's root "
            "directory, or use an empty location for a new store"
        )
    check_version(info.get("version"), url)


def _is_name(name: str) -> bool:
    try:
        validate_name(name)
    except FeatureStoreError:
        return False
    return True
