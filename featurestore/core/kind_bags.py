"""Bag splits as a kind (featurestore.core.split_kind): ragged per-slide bags written by
:class:`~featurestore.core.bag_writer.BagWriter` sessions, resumable by bag.

What only a bag split has: its metadata (the ``bags`` settings: coordinates, patch size, label
dtype), the settings a resume must share, its resumable units (the complete bags found in the
segments; on a complete split, every bag but those of damaged chunks, which
featurestore.core.bag_repair adds again) and its checks (featurestore.core.bag_verify). Its
arrays are written by its commit (featurestore.core.bag_commit), none at creation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featurestore import __version__
from featurestore.core import bag_commit, bag_repair, bag_verify
from featurestore.core.bag_writer import BagWriter
from featurestore.core.split_kind import Findings, SplitKind, check_chunk_bytes
from featurestore.core.storage import Storage
from featurestore.errors import ShapeMismatch, SplitSettingsMismatch
from featurestore.format import bags, dtypes
from featurestore.format.metadata import BAGS, SplitMetadata

DEFAULT_CHUNK_BYTES = 8 << 20


class BagKind(SplitKind[BagWriter]):
    name = BAGS

    def new_metadata(self, dataset: str, encoder: str, split: str, *, dim: int, dtype: str,
                     metadata: dict[str, Any] | None, coords_unit: str | None, coords_dtype: str,
                     patch_size_level0: Any, label_dtype: Any, chunk_bytes: int) -> SplitMetadata:
        dtypes.check_feature_dtype(dtype)
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ShapeMismatch(f"dim must be a positive int (the encoder's feature width, e.g. 1536), got {dim!r}")
        chunk_bytes = check_chunk_bytes(chunk_bytes, DEFAULT_CHUNK_BYTES)
        chunk_rows = max(1, chunk_bytes // (int(dim) * dtypes.storage_dtype(dtype).itemsize))
        spec = bags.bag_spec(coords_unit=coords_unit, coords_dtype=coords_dtype,
                             patch_size_level0=patch_size_level0, label_dtype=label_dtype)
        return SplitMetadata.new(dataset=dataset, encoder_name=encoder, split=split, num_samples=0,
                                 sample_shape=(int(dim),), logical_dtype=dtype, chunk_rows=chunk_rows,
                                 user=metadata, creator_version=__version__, bags=spec)

    def check_resumable(self, meta: SplitMetadata, wanted: SplitMetadata, key: str) -> None:
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

    def create(self, storage: Storage, key: str, meta: SplitMetadata, **_: Any) -> BagWriter:
        return BagWriter(storage, key, meta, done_ids=set())

    def resume(self, storage: Storage, key: str, meta: SplitMetadata, *, verify_chunks: bool, **_: Any) -> BagWriter:
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

    def verify(self, storage: Storage, key: str, meta: SplitMetadata, found: Findings) -> None:
        bag_verify.verify_bags(storage, key, meta, found)


BAG_KIND = BagKind()
