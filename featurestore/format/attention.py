"""Attention maps saved beside a bag split (docs/FORMAT.md, "Attention maps"); no I/O here.

``featurestore probe --head abmil --save-attention NAME`` keeps the trained head's attention over
the patches of every bag it evaluated, under the evaluated bag split:

    <split>/attention/                  group
    <split>/attention/<NAME>/           group; attributes.featurestore = the lineage (below)
        values                          float32 [total rows of the split]: one value per patch,
                                        aligned with ``features`` (bag i: offsets[i]:offsets[i+1]);
                                        NaN for the patches of a bag the run did not evaluate
        fold                            int32 [bags]: the fold that evaluated each bag (0 with an
                                        eval split), -1 if none did (an empty bag)

The lineage names the split as it was when the attention was computed (generation, commit time,
bag and row counts) and the probe run (head, splits, folds, seed, settings, time). A map is
**stale** when the split differs from that record (overwritten: another generation; re-committed
with more bags: another commit time or count): its rows no longer belong to those patches, so no
reader may show it as current (:func:`stale_reason`).
"""

from __future__ import annotations

from typing import Any

from featurestore.errors import InvalidMetadata

ATTENTION = "attention"
VALUES = "values"
FOLD = "fold"
KIND = "attention"
VERSION = 1
NOT_EVALUATED = -1
# What a map records of its split, and so what must still hold for it to be current.
SPLIT_FIELDS = ("generation", "completed", "num_bags", "num_rows")


def group_key(split_key: str, name: str | None = None) -> str:
    return f"{split_key}/{ATTENTION}" + ("" if name is None else f"/{name}")


def split_state(metadata: dict[str, Any]) -> dict[str, Any]:
    """What a map records of its bag split's metadata (``SPLIT_FIELDS``)."""
    return {"generation": metadata.get("generation"), "completed": metadata.get("completed"),
            "num_bags": int((metadata.get("bags") or {}).get("count", 0)),
            "num_rows": int(metadata.get("num_samples", 0))}


def lineage(*, name: str, split_key: str, metadata: dict[str, Any], probe: dict[str, Any],
            created: str, creator_version: str) -> dict[str, Any]:
    """The ``attributes.featurestore`` document of a saved map."""
    return {"kind": KIND, "version": VERSION, "name": name, "split": {"key": split_key, **split_state(metadata)},
            "probe": probe, "created": created, "creator_version": creator_version}


def check_lineage(doc: Any, where: str) -> dict[str, Any]:
    """The lineage of a stored map, validated (InvalidMetadata naming what is wrong)."""
    try:
        if doc["kind"] != KIND:
            raise ValueError(f"kind {doc['kind']!r}")
        if doc["version"] != VERSION:
            raise ValueError(f"version {doc['version']!r} (this code reads {VERSION})")
        split = doc["split"]
        for field in SPLIT_FIELDS:
            split[field]  # noqa: B018 - presence
        if not isinstance(doc["probe"], dict):
            raise ValueError("probe is not an object")
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidMetadata(f"attention map {where} has a damaged lineage ({error}): save it again "
                              "(featurestore probe ... --save-attention NAME)") from None
    return dict(doc)


def stale_reason(doc: dict[str, Any], metadata: dict[str, Any]) -> str | None:
    """Why a map (its lineage ``doc``) no longer describes the split whose ``metadata`` is given,
    or None when it is current."""
    saved, now = doc["split"], split_state(metadata)
    if saved["generation"] != now["generation"]:
        return (f"saved for generation {saved['generation']} of the split, which is now generation "
                f"{now['generation']} (overwritten)")
    for field in ("num_bags", "num_rows", "completed"):
        if saved[field] != now[field]:
            return (f"saved when the split had {saved['num_bags']} bags / {saved['num_rows']} patches "
                    f"(committed {saved['completed']}), now {now['num_bags']} / {now['num_rows']} "
                    f"(committed {now['completed']})")
    return None


def advice(name: str) -> str:
    return f"run the probe again with --save-attention {name}"
