"""The store's doors to bag splits: create (or resume, or overwrite) one, open one for reading.

``FeatureStore.create_bag_split`` and ``FeatureStore.open_bags`` are thin methods over these
functions, so the dense store module stays the dense one; both share the store's name checks,
group documents, generation rules and leftover clean-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore import __version__
from featurestore.core import bag_commit, bag_repair
from featurestore.core.bag_writer import BagWriter
from featurestore.core.bags import BagSplit
from featurestore.core.leftovers import remove_stale_temp_files
from featurestore.errors import (
    CacheKeyMismatch,
    IncompleteSplit,
    InvalidOption,
    ReadOnlyStore,
    ShapeMismatch,
    SplitExists,
    SplitSettingsMismatch,
    WrongSplitKind,
)
from featurestore.format import bags, dtypes, layout
from featurestore.format.metadata import WRITING, SplitMetadata

if TYPE_CHECKING:
    from featurestore.core.store import FeatureStore

DEFAULT_CHUNK_BYTES = 8 << 20


def create_bag_split(store: FeatureStore, dataset: str, encoder: str, split: str, *, dim: int,
                     dtype: str = "float16", metadata: dict[str, Any] | None = None,
                     resume: bool = False, overwrite: bool = False, coords_unit: str | None = "px",
                     coords_dtype: str = "int64", patch_size_level0: Any = None,
                     label_dtype: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     verify_chunks: bool = False) -> BagWriter:
    """See :meth:`featurestore.FeatureStore.create_bag_split`."""
    from featurestore.core.store import check_split

    if store.mode != "a":
        raise ReadOnlyStore(f"store {store.url} is open read-only: open_store(url, mode='a') to write")
    if resume and overwrite:
        raise InvalidOption("resume=True and overwrite=True exclude each other: choose one")
    key = store._split_key(dataset, encoder, split)
    wanted = new_metadata(dataset, encoder, split, dim=dim, dtype=dtype, metadata=metadata,
                          coords_unit=coords_unit, coords_dtype=coords_dtype,
                          patch_size_level0=patch_size_level0, label_dtype=label_dtype, chunk_bytes=chunk_bytes)
    storage = store.storage
    existing = store._read_document(f"{key}/{layout.ZARR_JSON}")
    if existing is not None and not overwrite:
        if not resume:
            raise SplitExists(f"split {key} already exists at {store.url}: pass resume=True to continue it "
                              "(--resume) or overwrite=True to replace it (--overwrite)")
        meta = check_split(existing, key)
        check_resumable(meta, wanted, key)
        remove_stale_temp_files(storage, key)  # of killed writers only (core.leftovers)
        if meta.complete:
            storage.delete_tree(f"{key}/{bags.SEGMENTS}")  # left if a commit died after its last write
            # Damaged chunks (sizes; every chunk read with verify_chunks): the bags they hold are
            # added again and only their chunks rewritten (core.bag_repair).
            repair = bag_repair.open_complete(storage, key, meta, verify_chunks=verify_chunks)
            if repair is not None:
                return repair
            return BagWriter(storage, key, meta, done_ids=set(bag_commit.read_strings(storage, f"{key}/{bags.BAG_IDS}")))
        if bag_repair.REPAIR in (meta.bags or {}):  # a repair began: it goes on
            return bag_repair.resume_repair(storage, key, meta, verify_chunks=verify_chunks)
        return BagWriter(storage, key, meta, done_ids=set(bag_commit.collect(storage, key, meta).records))
    if existing is not None:
        # As for a dense split: marked incomplete before the delete, so a delete cut short never
        # leaves a split that reads as complete.
        stale = dict((existing.get("attributes") or {}).get("featurestore") or {})
        stale["status"] = WRITING
        storage.write(f"{key}/{layout.ZARR_JSON}", layout.group_document({"featurestore": stale}))
        storage.delete_tree(key)
    store._ensure_group(dataset, {"featurestore": {"kind": "dataset"}})
    store._ensure_group(f"{dataset}/{encoder}", {"featurestore": {"kind": "encoder"}})
    storage.write(f"{key}/{layout.ZARR_JSON}", layout.group_document({"featurestore": wanted.to_json()}))
    return BagWriter(storage, key, wanted, done_ids=set())


def new_metadata(dataset: str, encoder: str, split: str, *, dim: int, dtype: str,
                 metadata: dict[str, Any] | None, coords_unit: str | None, coords_dtype: str,
                 patch_size_level0: Any, label_dtype: Any, chunk_bytes: int) -> SplitMetadata:
    dtypes.check_feature_dtype(dtype)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ShapeMismatch(f"dim must be a positive int (the encoder's feature width, e.g. 1536), got {dim!r}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)) or chunk_bytes < 1:
        raise InvalidOption(f"chunk_bytes must be a positive int (e.g. 8 << 20), got {chunk_bytes!r}")
    chunk_rows = max(1, int(chunk_bytes) // (int(dim) * dtypes.storage_dtype(dtype).itemsize))
    spec = bags.bag_spec(coords_unit=coords_unit, coords_dtype=coords_dtype,
                         patch_size_level0=patch_size_level0, label_dtype=label_dtype)
    return SplitMetadata.new(dataset=dataset, encoder_name=encoder, split=split, num_samples=0,
                             sample_shape=(int(dim),), logical_dtype=dtype, chunk_rows=chunk_rows,
                             user=metadata, creator_version=__version__, bags=spec)


def check_resumable(meta: SplitMetadata, wanted: SplitMetadata, key: str) -> None:
    if not meta.is_bags:
        raise WrongSplitKind(f"split {key} is a dense split, not a bag split: use another split name, "
                             "or overwrite=True (--overwrite) to replace it")
    old, new = meta.cache_key, wanted.cache_key
    if old and new and old != new:
        raise CacheKeyMismatch(f"split {key} was written with cache key {old}, this run has {new}: use "
                               "overwrite=True (--overwrite) to replace it, or another split name")
    if meta.sample_shape != wanted.sample_shape or meta.logical_dtype != wanted.logical_dtype:
        raise ShapeMismatch(f"cannot resume {key}: it holds dim {meta.sample_shape[0]} {meta.logical_dtype}, this "
                            f"run asks for dim {wanted.sample_shape[0]} {wanted.logical_dtype}; use overwrite=True (--overwrite)")
    old_spec, new_spec = meta.bags or {}, wanted.bags or {}
    for name in ("coords", "patch_size_level0"):
        if old_spec.get(name) != new_spec.get(name):
            raise SplitSettingsMismatch(f"cannot resume {key}: its {name} is {old_spec.get(name)!r}, this run asks "
                                        f"for {new_spec.get(name)!r}; run with the split's own setting or --overwrite")
    declared = new_spec.get("labels")
    if declared is not None and old_spec.get("labels") not in (None, declared):
        raise SplitSettingsMismatch(f"cannot resume {key}: its labels are {old_spec.get('labels')!r}, this run "
                                    f"asks for {declared!r}; run with the split's own label dtype or --overwrite")
    if meta.chunk_rows != wanted.chunk_rows:
        raise SplitSettingsMismatch(f"split {key} was written with chunk_rows {meta.chunk_rows}, this run asks for "
                                    f"{wanted.chunk_rows} (chunk_bytes, --chunk-mb): run with the split's own "
                                    "setting, or --overwrite")


def open_bags(store: FeatureStore, dataset: str, encoder: str, split: str,
              allow_incomplete: bool = False) -> BagSplit:
    """See :meth:`featurestore.FeatureStore.open_bags`."""
    meta = store.split_info(dataset, encoder, split)
    key = store._split_key(dataset, encoder, split)
    if not meta.is_bags:
        raise WrongSplitKind(f"split {key} is a dense split, not a bag split: open it with store.open(...)")
    if not meta.complete and not allow_incomplete:
        raise IncompleteSplit(f"bag split {key} is not complete (status {meta.status!r}): its writer is still "
                              "running or died. Resume it (featurestore import ... --resume, or "
                              "create_bag_split(..., resume=True) then commit())")
    names = [layout.FEATURES, bags.COORDS, bags.OFFSETS]
    if (meta.bags or {}).get("labels") is not None:
        names.append(layout.LABELS)
    if dtypes.is_int8(meta.logical_dtype):
        names.append(layout.SCALES)
    store._require_inside(dataset, encoder, split, *names, bags.BAG_IDS, bags.BAG_ATTRS)
    documents: dict[str, dict[str, Any]] = {}
    for name in names:
        doc = store._read_document(f"{key}/{name}/{layout.ZARR_JSON}")
        if doc is not None:
            documents[name] = doc
        else:
            if not meta.complete:
                raise IncompleteSplit(f"bag split {key} has never been committed: nothing to read yet; "
                                      "commit it (writer.commit()) first")
            store._array_document(f"{key}/{name}")  # raises, naming the missing array
    return BagSplit(store.storage, key, meta, documents)
