"""``featurestore verify``: check a store's documents against each other and against its chunks.

What is checked (docs/FORMAT.md, "Guarantees"):

* every dataset, encoder and split directory has its group ``zarr.json``, and every split's
  metadata parses;
* a directory under a reserved name (featurestore.format.names) is reported: readers skip it;
* each complete split by its kind (featurestore.core.kinds: a dense split in
  featurestore.core.dense_verify, a bag split in featurestore.core.bag_verify), every array
  through the one array checker (featurestore.core.array_check: documents against the split
  metadata, every chunk's size and crc32c) and every chunk against its seals.

Every problem is listed; nothing stops at the first one. Temporary files of writers killed
mid-put are listed apart, as leftovers (featurestore.core.leftovers): not damage, since nothing
reads them. A dataset, encoder or split asked for by name that is not there is an error, not
an empty, clean check.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from featurestore.core.kinds import kind_of
from featurestore.core.leftovers import TempFile, find_temp_files
from featurestore.core.store import FeatureStore
from featurestore.errors import DatasetNotFound, EncoderNotFound, FeatureStoreError, SplitNotFound
from featurestore.format import layout
from featurestore.format.names import reserved_reason, validate_name


@dataclass
class SplitCheck:
    key: str
    status: str  # "writing" | "complete" | "unreadable" (no or damaged metadata)
    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        # An incomplete split is listed, not counted; one whose metadata cannot be read is damaged.
        return self.status != "writing" and bool(self.problems)


def iter_splits(store: FeatureStore, dataset: str | None = None, encoder: str | None = None,
                split: str | None = None) -> Iterator[tuple[str, str, str]]:
    for ds in [dataset] if dataset else store.datasets():
        for enc in [encoder] if encoder else store.encoders(ds):
            for sp in [split] if split else store.splits(ds, enc):
                yield ds, enc, sp


@dataclass
class StoreCheck:
    """What ``verify`` found: problems of the group documents, one check per split directory,
    and the temporary files killed writers left (not damage: nothing reads them)."""

    problems: list[str]
    checks: list[SplitCheck]
    leftovers: list[TempFile]


def verify_store(store: FeatureStore, dataset: str | None = None, encoder: str | None = None,
                 split: str | None = None) -> StoreCheck:
    """Check the whole store, or the one split named by ``dataset``, ``encoder`` and ``split``.

    Walks the storage listing, not the group documents, so a split or dataset whose
    ``zarr.json`` is gone is reported instead of silently skipped. A named dataset, encoder or
    split that is not there raises :class:`DatasetNotFound` / :class:`EncoderNotFound` /
    :class:`SplitNotFound` (naming the ones that are): nothing was checked, which must not read
    as a clean store.
    """
    scope = [name for name in (dataset, encoder, split) if name is not None]
    if scope:
        require_target(store, *scope)
    problems: list[str] = []
    checks: list[SplitCheck] = []
    for ds in [dataset] if dataset else _children(store, "", problems):
        if not store.storage.exists(f"{ds}/{layout.ZARR_JSON}"):
            problems.append(f"{ds}: dataset group has no zarr.json (deleted?): its splits are invisible to readers")
        for enc in [encoder] if encoder else _children(store, ds, problems):
            if not store.storage.exists(f"{ds}/{enc}/{layout.ZARR_JSON}"):
                problems.append(f"{ds}/{enc}: encoder group has no zarr.json (deleted?)")
            for sp in [split] if split else _children(store, f"{ds}/{enc}", problems):
                checks.append(verify_split(store, ds, enc, sp))
    return StoreCheck(problems, checks, find_temp_files(store.storage, "/".join(scope)))


def require_target(store: FeatureStore, dataset: str, encoder: str | None = None,
                   split: str | None = None) -> None:
    """Raise unless the named dataset (and encoder, and split) is in the storage listing.

    The listing, not the group documents: a split whose ``zarr.json`` is gone is still there to
    be reported as damaged."""
    named = [("dataset", DatasetNotFound, dataset), ("encoder", EncoderNotFound, encoder),
             ("split", SplitNotFound, split)]
    parent = ""
    for what, error, name in named:
        if name is None:
            return
        validate_name(name, what)
        known = _children(store, parent, [])
        if name not in known:
            where = f" in {parent}" if parent else ""
            raise error(f"no such {what} {name!r}{where} at {store.url} (known: {', '.join(known) or 'none'})")
        parent = f"{parent}/{name}" if parent else name


def verify_split(store: FeatureStore, dataset: str, encoder: str, split: str) -> SplitCheck:
    key = layout.split_key(dataset, encoder, split)
    try:
        meta = store.split_info(dataset, encoder, split)
    except FeatureStoreError as error:
        return SplitCheck(key=key, status="unreadable", problems=[f"{key}/{layout.ZARR_JSON}: {error}"])
    result = SplitCheck(key=key, status=meta.status)
    if meta.complete:
        kind_of(meta).verify(store.storage, key, meta, result)
    return result


def _children(store: FeatureStore, prefix: str, problems: list[str]) -> list[str]:
    """Directories under ``prefix`` that can be datasets, encoders or splits (valid names with
    something in them). A directory with a reserved name (a split called ``zarr.json`` beside its
    encoder's document, written on object storage before such names were refused) is a problem:
    readers never see it."""
    names = []
    for name in store.storage.listdir(prefix):
        path = f"{prefix}/{name}" if prefix else name
        try:
            validate_name(name)
        except FeatureStoreError:
            reason = reserved_reason(name)
            if reason is not None and _is_directory(store, path, name):
                problems.append(f"{path}/: a directory under a reserved name ({reason}): readers "
                                "cannot see it; copy its data under another name, then delete it")
            continue  # the group document itself, hidden entries, temporary files
        if store.storage.listdir(path):
            names.append(name)
    return sorted(names)


def _is_directory(store: FeatureStore, path: str, name: str) -> bool:
    """Whether ``path`` holds entries (a directory or key prefix), not only a file of that name:
    fsspec lists a file as itself, and a split called ``zarr.json`` holds a ``zarr.json`` too."""
    return bool(set(store.storage.listdir(path)) - {name}) or store.storage.exists(f"{path}/{layout.ZARR_JSON}")
