"""The quantization report as one human line, for every verb that prints it (extract, import, info).

A figure the report could not represent is stored as ``null`` (docs/FORMAT.md); it prints as
``n/a`` rather than breaking the format.
"""

from __future__ import annotations

from typing import Any


def _figure(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def quantization_line(q: dict[str, Any]) -> str:
    """``float32 -> float16: max abs error ..., overflow 0, NaN 0, Inf 0`` (int8: with its saturation
    count, and why a max rel error of 1 is expected there)."""
    exact = " (exact)" if q.get("exact") else ""
    int8 = q.get("stored_dtype") == "int8"
    rel = _figure(q.get("max_rel_error"), ".3g")
    if int8 and (q.get("max_rel_error") or 0) >= 1:  # a scale's step is its position's abs max / 127
        rel += " (a value under half its scale's step stores as 0)"
    return (f"{q.get('source_dtype')} -> {q.get('stored_dtype')}{exact}: "
            f"max abs error {_figure(q.get('max_abs_error'), '.3g')}, max rel error {rel}, "
            f"rel rms error {_figure(q.get('rel_rms_error'), '.3g')}, "
            f"abs max {_figure(q.get('abs_max'), '.6g')}, "
            f"overflow {q.get('overflow_count', 0)}, NaN {q.get('nan_count', 0)}, Inf {q.get('inf_count', 0)}"
            + (f", saturation {q.get('saturation_count', 0)}" if int8 else ""))


def nothing_to_do(what: str, meta: dict[str, Any], *, store: str, key: str, worker: bool) -> str:
    """The line of a run that found its split complete already: ``what`` it holds, the slides its
    commit left out (skipped or failed: a re-run does not retry them), and how to redo it (``--worker``
    refuses ``--overwrite``: the split is removed, then the workers start again)."""
    from featurestore.extract.dist_run import left_out  # loaded already by the run that calls this

    ended = sorted(str(i) for i in left_out(meta))
    left = (f"; {len(ended)} slide(s) skipped or failed are not in it and a re-run does not retry them: "
            f"{', '.join(ended[:5])}{', ...' if len(ended) > 5 else ''}") if ended else ""
    redo = (f"to redo it: featurestore rm {split_args(store, key)} --yes, then start the workers again"
            if worker else "--overwrite to redo it")
    return f"{what}: nothing to do{left} ({redo})"


def split_args(store: str, key: str) -> str:
    """``STORE DATASET ENCODER SPLIT`` as a command line takes them, for a split's ``key``."""
    return f"{store} {key.replace('/', ' ')}"
