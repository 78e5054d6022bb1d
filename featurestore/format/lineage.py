"""Lineage of a derived split (``featurestore embed``): where its rows come from, and when they no
longer describe their source (no I/O here; docs/FORMAT.md, "Lineage of derived splits").

A split computed from another split (slide or patient embeddings pooled from a bag split) records
its source in the split metadata under ``lineage``:

    {"kind": "embedding", "version": 1,
     "source": {"dataset", "encoder", "split", "kind", "generation", "completed", "num_bags", "num_rows"},
     "slide_encoder": {"spec", "weights_hash", "output_dim"},
     "autocast", "max_patches", "seed", "group_by", "empty_bags", "skipped",
     "groups": {"table", "id_column", "sha256"} (only with a --groups table)}

The derived split is **stale** when its source is gone or is no longer the one it was computed
from: another generation (overwritten), or the same generation committed again with other counts.
:func:`stale_reason` is the one rule; ``featurestore.core.lineage`` reads the source's current
metadata for it, and ``verify``, ``ls``/``info``, the web page, the server and ``embed --resume``
all ask there.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from featurestore.errors import InvalidMetadata

KEY = "lineage"  # the split metadata key
KIND = "embedding"
VERSION = 1
# The response header that says a derived split read over HTTP is stale (its value: the reason).
STALE_HEADER = "X-Featurestore-Stale"
# What a derived split records of its source's metadata; all must still hold for it to be current.
SOURCE_FIELDS = ("generation", "completed", "num_bags", "num_rows")


def source_state(metadata: dict[str, Any]) -> dict[str, Any]:
    """What a derived split records of its source split's metadata (``SOURCE_FIELDS`` + kind)."""
    bags = metadata.get("bags") or {}
    return {"kind": metadata.get("kind", "dense"), "generation": metadata.get("generation"),
            "completed": metadata.get("completed"), "num_bags": int(bags.get("count", 0)),
            "num_rows": int(metadata.get("num_samples", 0))}


def build(*, dataset: str, encoder: str, split: str, source_metadata: dict[str, Any],
          slide_encoder: dict[str, Any], autocast: str | None, max_patches: int | None, seed: int,
          group_by: str | None, empty_bags: str, skipped: list[str], no_labels: bool = False,
          groups: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``lineage`` document of a derived split. ``labels: "left out"`` and ``groups`` (the
    ``--groups`` table's record) only where they apply: a document (and so the cache key) of a run
    without them is the one earlier versions wrote."""
    return {"kind": KIND, "version": VERSION,
            "source": {"dataset": dataset, "encoder": encoder, "split": split, **source_state(source_metadata)},
            "slide_encoder": slide_encoder, "autocast": autocast, "max_patches": max_patches, "seed": seed,
            "group_by": group_by, "empty_bags": empty_bags, "skipped": list(skipped),
            **({"labels": "left out"} if no_labels else {}), **({"groups": groups} if groups else {})}


def cache_key(doc: dict[str, Any], dtype: str) -> str:
    """The derived split's cache key: a resume with another source generation, encoder, autocast,
    subset, grouping or dtype is another computation (``CacheKeyMismatch`` at ``create_split``)."""
    return hashlib.sha256(json.dumps({"lineage": doc, "dtype": dtype}, sort_keys=True).encode()).hexdigest()


def recipe(doc: dict[str, Any]) -> dict[str, Any]:
    """What a derived split computes, whatever its source holds now: the lineage without the
    source's state (generation, counts) and the bags it skipped. A stale split recomputed with
    the same recipe is the same computation on new bags; with another, it is another split."""
    source = doc.get("source") or {}
    return {**{k: v for k, v in doc.items() if k not in ("source", "skipped")},
            "source": {k: source.get(k) for k in ("dataset", "encoder", "split", "kind")}}


def recipe_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The recipe keys in which two lineage documents differ, e.g. ``["slide_encoder", "group_by"]``."""
    a, b = recipe(old), recipe(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def of(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The split's lineage document, checked, or None for a split that records none."""
    doc = metadata.get(KEY)
    if doc is None:
        return None
    where = "/".join(str(metadata.get(k)) for k in ("dataset", "encoder_name", "split"))
    try:
        if doc["kind"] != KIND or doc["version"] != VERSION:
            raise ValueError(f"kind {doc['kind']!r} version {doc['version']!r}")
        source = doc["source"]
        for name in ("dataset", "encoder", "split", *SOURCE_FIELDS):
            source[name]  # noqa: B018 - presence
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidMetadata(f"split {where} has a damaged lineage ({type(error).__name__}: {error}): "
                              f"{RECOMPUTE_IT}") from None
    return dict(doc)


def source_key(doc: dict[str, Any]) -> str:
    source = doc["source"]
    return f"{source['dataset']}/{source['encoder']}/{source['split']}"


# Re-running the embed command recomputes a stale split whole, --resume or not (featurestore.embed.run
# keeps no row of it), with the recipe it was made with (--overwrite is for another recipe): the fix
# of a stale or damaged derived split (core.lineage.stale_fix).
RECOMPUTE = "featurestore embed ... --resume: a stale split is recomputed whole"
RECOMPUTE_IT = f"compute it again ({RECOMPUTE})"
GONE = " is gone"  # the ends of stale_reason's reasons that call for another fix (core.lineage.stale_fix)
REWRITTEN = " is being rewritten"


def gone_source(reason: str) -> str | None:
    """The source key of a reason that says the source is gone, else None."""
    if reason.startswith("source ") and reason.endswith(GONE):
        return reason[len("source "):-len(GONE)]
    return None


def stale_reason(doc: dict[str, Any], source_metadata: dict[str, Any] | None) -> str | None:
    """Why a derived split (its lineage ``doc``) no longer describes its source, whose current
    metadata is ``source_metadata`` (None: the source is gone), or None when it is current.
    The text is ASCII (it travels in an HTTP header)."""
    key, saved = source_key(doc), doc["source"]
    if source_metadata is None:
        return f"source {key}{GONE}"
    if source_metadata.get("status") != "complete":
        return f"source {key}{REWRITTEN} (status {source_metadata.get('status')})"
    now = source_state(source_metadata)
    if saved["generation"] != now["generation"]:
        return f"source {key} generation changed ({saved['generation']} -> {now['generation']})"
    for name in ("num_bags", "num_rows", "completed"):
        if saved[name] != now[name]:
            return (f"source {key} changed ({saved['num_bags']} bags / {saved['num_rows']} patches committed "
                    f"{saved['completed']}, now {now['num_bags']} / {now['num_rows']} committed {now['completed']})")
    return None


def describe(doc: dict[str, Any]) -> str:
    """One line for ``info`` and the web page: the source and how the rows were computed."""
    source, enc = doc["source"], doc.get("slide_encoder") or {}
    parts = [f"{source_key(doc)} (generation {source['generation']})", f"slide encoder {enc.get('spec')}"]
    if enc.get("weights_hash"):
        parts.append(f"weights {enc['weights_hash'][:16]}")
    if doc.get("autocast"):
        parts.append(f"autocast {doc['autocast']}")
    if doc.get("max_patches"):
        parts.append(f"max {doc['max_patches']} patches, seed {doc.get('seed')}")
    if doc.get("group_by"):
        table = (doc.get("groups") or {}).get("table")
        parts.append(f"grouped by {doc['group_by']}" + (f" (from {table})" if table else ""))
    if doc.get("skipped"):
        parts.append(f"{len(doc['skipped'])} empty bag(s) skipped")
    if doc.get("labels") == "left out":
        parts.append("labels left out")
    return ", ".join(parts)
