"""What changed between the run that wrote a split and this one, when their cache keys differ.

A cache key is a hash: on its own it says only *that* a resume or re-run is another computation.
The split's metadata records most of what went into it (the encoder's spec and weights hash, the
preprocessing, the tokens kept, the stored dtype, the input's fingerprint, a derived split's
lineage), so the refusal can name the part that moved. The most common one is an encoder whose
factory draws its weights at random (an unseeded head or adapter): each run hashes differently,
and every resume is refused until the factory is seeded.
"""

from __future__ import annotations

import json
from typing import Any

# (words, path in the split document): what every kind's cache key covers, where recorded.
PARTS = (("the encoder's weights", ("encoder", "weights_hash")), ("the encoder", ("encoder", "spec")),
         ("the encoder's precision", ("encoder", "precision")), ("the preprocessing", ("preprocessing",)),
         ("the tokens kept", ("token_layout",)), ("the stored dtype", ("logical_dtype",)),
         ("the input", ("source", "fingerprint")), ("the input", ("source", "spec")),
         ("the coordinates' source", ("coords_from",)), ("the lineage", ("lineage",)),
         ("the number of samples", ("num_samples",)))
LABELS_ONLY = ("other labels need no new split: featurestore probe --labels TABLE --label-column COL takes a task "
               "from a table at probe time")
UNSEEDED = ("an encoder factory that draws its weights at random (unseeded) hashes differently on every run: "
            "seed it, or load fixed weights")


def explain(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What this run changes against the split, from the documents ``old`` (the split's) and
    ``new`` (this run's): each recorded part of the cache key that differs, or a general phrase
    when none recorded does."""
    found: dict[str, str] = {}
    for words, path in PARTS:
        if words in found or (path == ("num_samples",) and "bags" in (old.get("kind"), new.get("kind"))):
            continue  # a bag split's sample count grows as bags come: not part of its key
        then, now = _at(old, path), _at(new, path)
        if then is not None and now is not None and then != now:
            found[words] = f"{words} ({_delta(then, now)})"
    if not found:
        return "this run has another encoder, weights, preprocessing, dtype or input"
    hints = []
    # Other weights under the same encoder spec: the factory itself gave them.
    if "the encoder's weights" in found and "the encoder" not in found:
        hints.append(UNSEEDED)
    then, now = _at(old, ("source", "fingerprint")), _at(new, ("source", "fingerprint"))
    if list(found) == ["the input"] and isinstance(then, dict) and isinstance(now, dict) and {
            k for k in {*then, *now} if then.get(k) != now.get(k)} == {"labels"}:  # an import's labels alone
        hints.append(LABELS_ONLY)
    return "this run changes " + "; ".join(found.values()) + "".join(f". {h[0].upper()}{h[1:]}" for h in hints)


def _at(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    for name in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(name)  # type: ignore[assignment]
    return doc


def _delta(then: Any, now: Any, name: str = "") -> str:
    """``then`` against ``now``: for two documents, only their keys that differ (nested ones by
    their dotted names), at most four."""
    if isinstance(then, str) and isinstance(now, str) and len(then) == len(now) == 64:  # a sha256
        then, now = then[:12], now[:12]
    if not (isinstance(then, dict) and isinstance(now, dict)):
        return f"{name + ': ' if name else ''}{_short(then)} then, {_short(now)} now"
    keys = [k for k in dict.fromkeys([*then, *now]) if then.get(k) != now.get(k)]
    return "; ".join(_delta(then.get(k), now.get(k), f"{name}.{k}" if name else str(k)) for k in keys[:4])


def _short(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."
