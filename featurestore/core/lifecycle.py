"""One split's life on storage, whatever its kind: create, attach, resume, overwrite, mark.

Every kind of split (featurestore.core.kinds: dense, bags) goes through :func:`open_writer`; the
kind supplies only what differs (its metadata, its arrays, its resumable units and its writer).
The steps, and why they come in this order (docs/FORMAT.md, "Writing protocol"):

- an existing split is refused unless ``resume`` (continue it: same kind and settings, checked
  by the kind) or ``overwrite`` (replace it);
- a resume first removes the temporary files of killed writers (core.leftovers), then hands the
  split to its kind, which finds what is done and returns the writer for the rest;
- an overwrite marks the old split ``writing`` before deleting it: a delete cut short (SIGKILL, a
  lost connection) must not leave a split that reads as complete with chunks gone. It keeps its
  own metadata (cache key and generation included), so a later resume cannot mix its surviving
  chunks with another encoder's;
- a new split's group document (status ``writing``, a new generation) goes first: a creation cut
  short is visible as an incomplete split, never as a complete one, and a writer of a replaced
  split sees the generation change at its next chunk. The kind's arrays come after it.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, TypeVar

from featurestore.core import split_protocol
from featurestore.core.leftovers import remove_stale_temp_files
from featurestore.core.split_kind import SplitKind
from featurestore.core.storage import Storage
from featurestore.errors import (CacheKeyMismatch, InvalidMetadata, InvalidOption, NotAFeatureStore, ReadOnlyStore,
                                 SplitExists, SplitNotFound, WrongSplitKind)
from featurestore.format import key_change, layout
from featurestore.format.metadata import COMPLETE, WRITING, SplitMetadata

W = TypeVar("W")

# How a kind is named in messages ("split x is a bag split, not a dense split").
KIND_WORDS = {"dense": "a dense split", "bags": "a bag split"}
OPEN_WITH = {"dense": "store.open(...) (over HTTP: FeatureClient.open or read_samples, FeatureDataset)",
             "bags": "store.open_bags(...) (over HTTP: FeatureClient.read_bag, BagDataset)"}


def open_writer(storage: Storage, url: str, mode: str, key: str, kind: SplitKind[W], wanted: SplitMetadata, *,
                resume: bool, overwrite: bool, verify_chunks: bool, **create: Any) -> W:
    """The writer of split ``key`` (module doc); ``create`` goes to ``kind.create`` on a new split."""
    check_request(url, mode, resume=resume, overwrite=overwrite)
    existing = read_document(storage, url, f"{key}/{layout.ZARR_JSON}")
    if existing is not None and not overwrite:
        if not resume:
            raise SplitExists(f"split {key} already exists at {url}: pass resume=True to continue it "
                              "(--resume) or overwrite=True to replace it (--overwrite)")
        meta = check_split(existing, key)
        check_same(meta, wanted, key)
        kind.check_resumable(meta, wanted, key)
        remove_stale_temp_files(storage, key)  # of killed writers only (core.leftovers)
        return kind.resume(storage, key, meta, verify_chunks=verify_chunks, **create)
    if existing is not None:
        stale = dict((existing.get("attributes") or {}).get("featurestore") or {})
        stale["status"] = WRITING
        storage.write(f"{key}/{layout.ZARR_JSON}", layout.group_document({"featurestore": stale}))
        storage.delete_tree(key)
    dataset, encoder, _ = key.split("/")
    ensure_group(storage, dataset, {"featurestore": {"kind": "dataset"}})
    ensure_group(storage, f"{dataset}/{encoder}", {"featurestore": {"kind": "encoder"}})
    write_split_document(storage, key, wanted)
    return kind.create(storage, key, wanted, **create)


def check_request(url: str, mode: str, *, resume: bool, overwrite: bool) -> None:
    """What is refused before anything else (a door calls it before it builds the metadata)."""
    if mode != "a":
        raise ReadOnlyStore(f"store {url} is open read-only: open_store(url, mode='a') to write")
    if resume and overwrite:
        raise InvalidOption("resume=True and overwrite=True exclude each other: choose one")


def check_same(meta: SplitMetadata, wanted: SplitMetadata, key: str) -> None:
    """What every kind's resume checks first: the same kind, and the same cache key where the run
    has one (a split written without a key cannot show that its rows came from this run's inputs).
    A resume without a key (a library writer adding rows it vouches for) takes the split's."""
    if meta.kind != wanted.kind:
        raise WrongSplitKind(f"split {key} is {kind_words(meta.kind)}, not {kind_words(wanted.kind)}: use another "
                             "split name, or overwrite=True (--overwrite) to replace it")
    old, new = meta.cache_key, wanted.cache_key
    if new and not old:
        raise CacheKeyMismatch(
            f"split {key} was written without a cache key, this run has {new[:16]}: its rows cannot be checked to "
            "come from this run's inputs, encoder and settings. Use overwrite=True (--overwrite) to replace it, "
            "or another split name")
    if old and new and old != new:
        why = key_change.explain(meta.to_json(), wanted.to_json())
        raise CacheKeyMismatch(
            f"split {key} was written with cache key {old[:16]}, this run has {new[:16]}: {why}. Use "
            "overwrite=True (--overwrite) to replace it, or another split name")


def check_kind(meta: SplitMetadata, kind: str, key: str) -> None:
    """Refuse to open a split of another kind than the door asked for, naming the right door."""
    if meta.kind != kind:
        raise WrongSplitKind(f"split {key} is {kind_words(meta.kind)}, not {kind_words(kind)}{WrongSplitKind.DOOR}"
                             f"{OPEN_WITH.get(meta.kind, 'the reader of its kind')}")


def kind_words(kind: str) -> str:
    return KIND_WORDS.get(kind, f"a {kind!r} split")


def mark_writing(storage: Storage, key: str, meta: SplitMetadata, **changes: Any) -> SplitMetadata:
    """``meta`` with status ``writing`` (and ``changes``), on storage: a split whose chunks are
    being rewritten must not read as complete meanwhile."""
    writing = meta.replace(status=WRITING, completed=None, **changes)
    write_split_document(storage, key, writing)
    return writing


def mark_complete(storage: Storage, key: str, meta: SplitMetadata, **changes: Any) -> SplitMetadata:
    """``meta`` complete (with ``changes``: its report, its counts), on storage: the one write that
    makes a split complete, preceded by the generation check (an overwrite that started while the
    commit ran must not be marked complete by it)."""
    final = meta.replace(status=COMPLETE, completed=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                         **changes)
    split_protocol.check_generation(storage, key, meta)
    write_split_document(storage, key, final)
    return final


def write_split_document(storage: Storage, key: str, meta: SplitMetadata) -> None:
    storage.write(f"{key}/{layout.ZARR_JSON}", layout.group_document({"featurestore": meta.to_json()}))


def ensure_group(storage: Storage, key: str, attributes: dict[str, Any]) -> None:
    if not storage.exists(f"{key}/{layout.ZARR_JSON}"):
        storage.write(f"{key}/{layout.ZARR_JSON}", layout.group_document(attributes))


def read_document(storage: Storage, url: str, key: str) -> dict[str, Any] | None:
    """The JSON document at ``key`` of the store at ``url``, None if there is none."""
    try:
        raw = storage.read(key)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        return layout.load_document(raw)
    except ValueError as error:
        # The root's document: no store there. Another (a split's, a group's): one damaged part of
        # a store (a server answers 500 for it, as for a damaged chunk, not 503 "no store").
        damaged = NotAFeatureStore if key == layout.ZARR_JSON else InvalidMetadata
        raise damaged(f"{url}/{key} is not valid JSON ({error}): the store is damaged; `featurestore verify` "
                      "names what else is") from None


def check_split(doc: dict[str, Any], key: str) -> SplitMetadata:
    if doc.get("node_type") != "group":
        raise SplitNotFound(f"{key} is not a featurestore split (its zarr.json is not a group)")
    return SplitMetadata.from_json((doc.get("attributes") or {}).get("featurestore"), key)
