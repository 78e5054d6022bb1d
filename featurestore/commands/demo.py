"""``featurestore demo``: the pipeline end to end on built-in data (``featurestore/demo/run.py``),
then one summary table. torch and the pipeline are imported when the command runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from featurestore.commands.parsers import add_verb

SIZE_NAMES = ("small", "default")  # mirrors featurestore.demo.run.SIZES; no import at --help time


HELP = "the whole pipeline end to end on built-in data (synthetic PanNuke, tiny ViT)"
DESCRIPTION = """\
Make a synthetic PanNuke-style fold, extract builtin:tiny-vit features as float32, float16 and int8, serve the store
on loopback, train the segmentation probe streaming from disk and over HTTP, then the slide-bag section (ABMIL
per dtype, the demo's own clinical table as a --labels task with one attention map written to
DIR/attention_<slide>.png, mean embeddings + linear probe), and print one summary table. --size small runs in
well under a minute (CI); the default in a few minutes on 2 CPU cores.
"""


def register(subparsers: Any) -> None:
    parser = add_verb(subparsers, "demo", run, HELP, DESCRIPTION)
    parser.add_argument("--workdir", default=None, metavar="DIR",
                        help="where the fold, the store and the outputs (clinical.csv, the attention PNG) go "
                        "(default: a temporary directory)")
    parser.add_argument("--size", choices=SIZE_NAMES, default="default", help="small (CI) or default")
    parser.add_argument("--keep", action="store_true", help="keep the fold and the store afterwards (the outputs are always kept)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: all cores, 1 if the machine is oversubscribed)")


def run(args: argparse.Namespace) -> int:
    from featurestore.demo.run import run_demo

    def log(line: str) -> None:
        print(line, flush=True)

    result = run_demo(args.workdir, size=args.size, keep=args.keep, threads=args.threads, log=log)
    print()
    print(format_table(result))
    sys.stdout.flush()
    return 0


def format_table(r: dict[str, Any]) -> str:
    """The one summary table the demo prints (rows: figure, float32, float16, int8)."""
    e32, e16, e8 = r["extract"]["float32"], r["extract"]["float16"], r["extract"]["int8"]
    mem, cmp = r["memory"], r["compare"]
    c = cmp["comparison"]["jaccard"]
    a, b = cmp["a"]["metrics"]["jaccard"], cmp["b"]["metrics"]["jaccard"]  # a = float16, b = float32
    http = r["http_probe"]
    base = r["baseline_jaccard"]
    plan = r["plan"]
    q, q8 = e16["quantization"], e8["quantization"]
    c8 = r["compare_int8"]["comparison"]["jaccard"]
    shape = "x".join(str(s) for s in e32.get("sample_shape") or [])

    def mib(n: float) -> str:
        return f"{n / 2**20:.2f} MiB"

    def ms(s: dict[str, Any]) -> str:
        return f"{s['mean']:.4f}" + ("" if s["std"] is None else f" ± {s['std']:.4f}")

    def diff(c: dict[str, Any]) -> str:
        return f"{-c['diff']:+.5f} (2x pooled std " + ("n/a" if c["threshold"] is None else f"{c['threshold']:.4f}") + ")"

    rows = [
        ("", "float32", "float16", "int8"),
        ("store size (features + masks)", mib(e32["store_bytes"]), mib(e16["store_bytes"]), mib(e8["store_bytes"])),
        ("extraction rate", f"{e32['images_per_s']:.1f} img/s", f"{e16['images_per_s']:.1f} img/s",
         f"{e8['images_per_s']:.1f} img/s"),
        ("quantization max rel error", "0 (exact)", f"{q.get('max_rel_error', 0):.2g} (overflow {q.get('overflow_count', 0)})",
         # int8's bound is per channel (half a scale step): a value far below its channel's scale
         # rounds to 0, a relative error of 1 that rel RMS weighs by its size.
         f"{q8.get('max_rel_error', 0):.2g} (tiny values -> 0; saturation {q8.get('saturation_count', 0)})"),
        ("quantization rel RMS error", "0 (exact)", f"{q.get('rel_rms_error') or 0:.2g}", f"{q8.get('rel_rms_error') or 0:.2g}"),
        ("loader, local disk", "", f"{r['loader']['local']['gb_per_s']:.3f} GB/s"),
        ("loader, over HTTP", "", f"{r['loader']['http']['gb_per_s']:.3f} GB/s"),
        ("in-RAM float32 cache (train+val)", mib(mem["ram_cache_bytes"]), ""),
        ("loader: peak RSS growth, 1 epoch", "", mib(mem["stream_rss_growth"])),
        ("process peak RSS (all steps)", "", mib(mem["process_peak_rss"])),
        (f"Jaccard, {len(cmp['a']['seeds'])} seeds, local", ms(b), ms(a), ms(r["compare_int8"]["a"]["metrics"]["jaccard"])),
        ("Jaccard, seed 0, over HTTP", "", f"{http['jaccard']:.4f} ({'= local' if http['identical'] else 'DIFFERS from local'})"),
        ("constant predictor Jaccard", f"{base['jaccard']:.4f}", f"{base['jaccard']:.4f}", f"{base['jaccard']:.4f}"),
        ("dtype - float32 (mean)", "", diff(c), diff(c8)),
        ("max |paired diff| per seed", "", f"{c['max_abs_paired_diff']:.5f}", f"{c8['max_abs_paired_diff']:.5f}"),
        ("exceeds run-to-run spread?", "", _verdict(c), _verdict(c8)),
        *_bag_rows(r["bags"]),
    ]
    rows = [(*row, *[""] * (4 - len(row))) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    rule = "-" * (sum(widths) + 4)
    lines = [f"featurestore demo ({r['size']}): {plan['train']} train + {plan['val']} val synthetic PanNuke "
             f"images ({plan['image_size']} px), builtin:tiny-vit features [{shape}], {r['threads']} thread(s), "
             f"{r['seconds']:.0f} s", rule]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append(rule)
    lines.append(rule)
    lines.append("Jaccard: per-image macro Jaccard on val, mean ± std over seeds; seed k gives every dtype the "
                 "same head init and batch order. 'exceeds' = |diff| > 2 x pooled std (float16 and int8 each "
                 "against float32, as probe --compare).")
    lines.append("At demo scale the whole cache is a few batches, so the loader's bound of (prefetch + 3) "
                 "batches is as large; that bound does not grow with N, the cache does, and per-epoch "
                 "start-up dominates loader GB/s: `featurestore bench loader` measures both at scale.")
    lines.append("MIL: one BagLoader epoch of the train slides (batch 1, float32); ABMIL = gated-attention MIL "
                 "(featurestore probe --head abmil), slide AUC on val, mean ± std over seeds; the float32 store and "
                 "the same bags in RAM must train the same head.")
    cohort = r["bags"]["cohort"]
    lines.append(f"Cohort: {cohort['table']} (slide_id, grade, case_id) is the ABMIL probe's task (--labels), "
                 f"its attention saved in the store; attention map: {cohort['attention']['path']}. Mean embeddings: "
                 "featurestore embed --slide-encoder mean, then the linear probe, slide AUC on val.")
    lines.append("Measure, never assume: `featurestore probe STORE --compare ENCODER` runs this check on "
                 "your own features.")
    if r.get("kept"):
        lines.append(f"kept: {r['workdir']} (store: {r['store']})")
    return "\n".join(lines)


def _verdict(c: dict[str, Any]) -> str:
    """Whether a dtype's metric moved beyond the run-to-run spread of the seeds, against float32."""
    return ("identical" if c["max_abs_paired_diff"] == 0.0 else "n/a (1 seed)" if c["exceeds_spread"] is None
            else "YES: the storage dtype moved the metric" if c["exceeds_spread"] else "no: within seed noise")


def _bag_rows(bags: dict[str, Any]) -> list[tuple[str, ...]]:
    """The slide-bag section's rows (float32, float16 and int8 columns)."""
    cmp, cmp8 = bags["compare"], bags["compare_int8"]
    a, b = cmp["a"]["metrics"]["auc"], cmp["b"]["metrics"]["auc"]  # a = float16, b = float32
    c = cmp["comparison"]["auc"]
    local, http = bags["loader"]["local"], bags["loader"]["http"]
    plan = bags["plan"]

    def ms(s: dict[str, Any]) -> str:
        return f"{s['mean']:.4f}" + ("" if s["std"] is None else f" ± {s['std']:.4f}")

    return [
        (f"MIL: {plan['train']} + {plan['val']} slides, dim {plan['dim']}", "", f"{local['patches']} train patches"),
        ("BagLoader epoch, local / HTTP", "", f"{local['seconds']:.2f} s / {http['seconds']:.2f} s"),
        (f"ABMIL slide AUC, {len(cmp['a']['seeds'])} seeds", ms(b), ms(a), ms(cmp8["a"]["metrics"]["auc"])),
        ("ABMIL AUC exceeds spread?", "", _verdict(c), _verdict(cmp8["comparison"]["auc"])),
        ("ABMIL from store = from RAM (seed 0)", "yes" if bags["parity"]["identical"] else "NO", ""),
        *_cohort_rows(bags["cohort"]),
    ]


def _cohort_rows(cohort: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The clinical table's task with its attention picture, and mean embeddings + linear probe."""
    linear = cohort["linear"]
    a, b = linear["a"]["metrics"]["auc"], linear["b"]["metrics"]["auc"]  # a = float16, b = float32
    task = cohort["task"]["metrics"]["auc"]

    def ms(s: dict[str, Any]) -> str:
        return f"{s['mean']:.4f}" + ("" if s["std"] is None else f" ± {s['std']:.4f}")

    return [
        (f"mean embedding + linear probe AUC, {len(linear['a']['seeds'])} seeds", ms(b), ms(a)),
        ("ABMIL AUC, clinical.csv grade (seed 0)", f"{task['mean']:.4f}", ""),
        ("attention map of one val slide (PNG)", cohort["attention"]["slide"], ""),
    ]
