"""One reading of every bench's result: its rows (rates per method), its figures against the
targets of ``targets.json`` and its notes (the other figures).

``featurestore bench NAME`` prints them (:func:`print_result`) and ``bench all`` puts the same
into ``report.md`` and the plots (:mod:`featurestore.bench.report`); a result whose keys changed
is noted in the report instead of stopping it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from featurestore.bench.figures import bench_figures
from featurestore.bench.figures import label as _label

Panels = dict[str, list[tuple[str, float]]]


def _guarded(report: dict[str, Any], name: str, fn: Any, default: Any) -> Any:
    """``fn(result of bench name)``; a result whose keys changed is noted in ``render_errors``."""
    result = report["benches"].get(name, {}).get("result")
    if not result:
        return default
    try:
        return fn(result)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as error:
        report.setdefault("render_errors", {})[f"{name}: {fn.__name__}"] = f"{type(error).__name__}: {error}"
        return default


# ---------------------------------------------------------------------- rows: rates per method
def _read_rows(read: dict[str, Any]) -> Panels:
    return {f"read [{_label(s['sample_shape'])}] float16, GB/s": [(m, r["gb_per_s"]) for m, r in s["read"].items()]
            for s in read["shapes"]}


def _write_rows(write: dict[str, Any]) -> Panels:
    return {f"write [{s.get('label') or _label(s['sample_shape'])}] float16 stored, to os.sync, GB/s": [
        ("writer, f16 input", s["writer_float16_gb_per_s"]), ("writer, f32 input", s["writer_float32_gb_per_s"]),
        *([("writer, f16, second write", s["writer_float16_second_gb_per_s"])]
          if "writer_float16_second_gb_per_s" in s else []),
        ("numpy tofile", s["tofile_gb_per_s"])] for s in write["shapes"]}


def _http_rows(http: dict[str, Any]) -> Panels:
    return {"http batches, GB/s": list(http["gb_per_s"].items())}


def _loader_rows(loader: dict[str, Any]) -> Panels:
    t = loader["throughput"]
    return {"loader (CPU consumer), GB/s": [
        ("loader", t["loader_gbps"]), ("bare reader", t["reader_gbps"]),
        ("loader -> f32", t["loader_float32_gbps"]), ("reader + .float()", t["reader_float32_gbps"])]}


def _cold_rows(cold: dict[str, Any]) -> Panels:
    panels = {}
    for shape in cold["shapes"]:
        rows = shape.get("rows") or {}
        first = [k for k in ("FeatureLoader", "FeatureArray.read") if k in rows]
        if rows:
            panels[f"cold [{_label(shape['sample_shape'])}] {shape.get('dtype', 'float16')} (page cache cold), GB/s"] = [
                (name, rows[name]["gb_per_s"]) for name in first + [k for k in rows if k not in first]]
    return panels


def _bags_rows(bags: dict[str, Any]) -> Panels:
    """Whole-bag reads, bags/s (the formats read different bytes: CLAM's .pt is float32)."""
    rows = bags["rows"]
    panels = {f"bags, one shuffled pass over {bags['slides']} slides x {bags['dim']} features, {temperature}, bags/s": [
        (name, rows[f"{name} {temperature}"]["bags_per_s"]) for name in ("featurestore", "TRIDENT h5", "CLAM .pt",
                                                                         "parallel pread")]
        for temperature in ("cold", "warm")}
    return {**panels, **(_bag_loader_rows(bags["loader"]) if "loader" in bags else {})}


def _bag_loader_rows(results: dict[str, Any]) -> Panels:
    """Per stored dtype (``--dtype``: the first at the top, the others in ``by_dtype``)."""
    panels: Panels = {}
    for r in (results, *results.get("by_dtype", {}).values()):
        dtype = "" if r.get("dtype", "float16") == "float16" else f" {r['dtype']}"
        for mode in ("warm", "cold"):
            if f := r.get(mode):
                panels[f"bag loader{dtype}, batch 1, {mode}, GB/s"] = [
                    ("BagLoader", f["loader_gbps"]), ("bare reader", f["reader_gbps"]),
                    ("BagLoader -> f32", f["loader_f32_gbps"]),
                    *([("CLAM torch.load .pt", f["clam_gbps"])] if "clam_gbps" in f else [])]
        if p := r.get("padded"):
            panels[f"bag loader{dtype}, padded, batch {p['batch_size']}, GB/s"] = [
                ("BagLoader", p["loader_gbps"]), ("reader + pad", p["loader_gbps"] * p["loader_s"] / p["reader_s"])]
    return panels


def _extract_rows(extract: dict[str, Any]) -> Panels:
    if extract.get("benchmark") == "extract-wsi":
        rows = [("extract", extract["extract_patches_s"]), ("OpenSlide alone", extract["openslide_only_patches_s"])]
        if "encode_only_patches_s" in extract:
            rows.append(("encode only", extract["encode_only_patches_s"]))
        return {"slide extraction, patches/s": rows}
    return {"extract, images/s": [("extract", extract["extract_img_s"]),
                                  ("encode only", extract["encode_only_img_s"])]}


def _s3_rows(s3: dict[str, Any]) -> Panels:
    rates = s3["gb_per_s"]
    writes = ("featurestore write", "plain concurrent put")
    return {"S3 (SeaweedFS, loopback) reads, GB/s": [(k, v) for k, v in rates.items() if k not in writes],
            "S3 (SeaweedFS, loopback) writes, GB/s": [(name, rates[name]) for name in writes]}


ROWS: dict[str, Callable[[dict[str, Any]], Panels]] = {
    "read": _read_rows, "write": _write_rows, "http": _http_rows, "loader": _loader_rows, "extract": _extract_rows,
    "s3": _s3_rows, "cold": _cold_rows, "bags": _bags_rows, "bag_loader": _bag_loader_rows}


def throughput_rows(report: dict[str, Any]) -> Panels:
    """Per panel title: ``(method, rate)`` pairs, featurestore first, of every bench in the report."""
    panels: Panels = {}
    for name in report["benches"]:
        bench = report["benches"][name].get("bench", name)
        if bench in ROWS:  # a variant's panels are titled with its entry's name
            rows = _guarded(report, name, ROWS[bench], {})
            panels.update({(title if name == bench else f"{name}: {title}"): bars for title, bars in rows.items()})
    return panels


# ---------------------------------------------------------------------- notes: the other figures
def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _read_notes(read: dict[str, Any]) -> list[str]:
    lines = [f"- read [{_label(s['sample_shape'])}]: first pass with crc32c checks {s['verify']['ratio']:.2f}x the "
             "unchecked one" for s in read["shapes"]]
    return lines + [f"- read, N={n}: reader peak anonymous RSS {_mib(r['peak_anon'])} (after imports "
                    f"{_mib(r['baseline_anon'])})" for n, r in (read.get("rss") or {}).items()]


def _http_notes(http: dict[str, Any]) -> list[str]:
    lat = http["item_latency_ms"]
    lines = [f"- http (median batch times) vs raw tcp + gather {http['http_vs_raw_tcp_gather']:.2f}x, vs bare "
             f"http.client {http.get('client_vs_bare_http_client', 0):.2f}x, read-ahead client / raw tcp (groups) "
             f"{http.get('read_ahead_vs_raw_tcp', 0):.2f}x; single item p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms"]
    if http.get("load"):
        load = http["load"]
        lines.append(f"- http load test: {load['requests']} requests ({load['requests_per_s']:.0f}/s), errors "
                     f"{load['errors']}, payload mismatches {load['mismatches']}; server anonymous RSS "
                     f"{_mib(load['server_rss_anon_start'])} -> {_mib(load['server_rss_anon_end'])}")
        lines += [f"  - {failure}" for failure in load["failures"][:5]]
    return lines


def _loader_notes(loader: dict[str, Any]) -> list[str]:
    s, r, cg = loader["stall"], loader.get("rss"), loader.get("cgroup") or {}
    lines = [f"- loader stall over {s['batches']} batches with a {s['consumer_step_s'] * 1e3:.1f} ms consumer step"]
    if r:
        lines.append(f"- loader's own anonymous memory: N {_mib(r['loader_bytes']['N'])}, 4N {_mib(r['loader_bytes']['4N'])}"
                     f"; bound {_mib(r['bound_bytes'])} + 32 MiB")
    if "skipped" in cg:
        lines.append(f"- cgroup epoch: skipped ({cg['skipped']})")
    elif cg:
        lines.append(f"- cgroup limit {_mib(cg['limit_bytes'])}, store {_mib(cg['store_bytes'])}: loader rc "
                     f"{cg['loader_returncode']}, RAM tensor killed: {cg['ram_killed']}")
    return lines


def _cold_notes(cold: dict[str, Any]) -> list[str]:
    lines = []
    for shape in cold["shapes"]:
        label = f"{_label(shape['sample_shape'])}] {shape.get('dtype', 'float16')}"
        if "rows" not in shape:
            lines.append(f"- cold [{label}: child failed (rc {shape.get('returncode')}): {shape.get('stderr', '')[-300:]}")
            continue
        rows, limit = shape["rows"], shape.get("limit_bytes", cold["limit_bytes"])
        lines.append(f"- cold [{label}, {shape['chunk_rows']}-row chunks, store {shape['store_bytes'] / 2**30:.2f} GiB, "
                     f"memory cgroup {limit >> 20} MiB ({shape['cgroup']}), median of {shape['repeats']}: "
                     f"loader {rows['FeatureLoader']['gb_per_s'] / rows['device limit']['gb_per_s']:.2f}x the device "
                     f"limit; loader peak RSS {_mib(rows['FeatureLoader']['peak_rss'])}; same bytes: {shape['same_bytes']}")
        lines += [f"  - {name} FAILED: {error}" for name, error in shape.get("errors", {}).items()]
        lines += _int8_notes(f"cold [{label}", shape.get("int8"), "samples")
    return lines


def _int8_notes(what: str, q: dict[str, Any] | None, unit: str) -> list[str]:
    """int8 beside its float16 reference (float32 out, epochs interleaved): rates, ratio, bytes."""
    if not q:
        return []
    ref, sizes = q["reference"], q["split_bytes"]
    lines = [(f"- {what}: int8 features + scales {_mib(sizes['int8'])} on storage = {q['bytes_ratio']:.3f}x "
              f"{ref}'s features {_mib(sizes[ref])}")]
    for key in ("cpu", "cuda", "warm", "cold"):
        if f := q.get(key):
            rate = f"{unit}_per_s"
            lines.append(f"  - {key}, float32 out: int8 {f[rate]['int8']:.1f} {unit}/s, {ref} {f[rate][ref]:.1f} {unit}/s; "
                         f"int8 / {ref} {f['ratio_median']:.2f}x median, per repeat "
                         + " ".join(f"{r:.2f}" for r in f["ratio_per_repeat"]))
    return lines


def _bags_notes(bags: dict[str, Any]) -> list[str]:
    lines = [f"- bags: {bags['slides']} slides (median {bags['median_patches']}, max {bags['max_patches']} patches, dim "
             f"{bags['dim']}, featurestore {bags['sizes']['store'] / 2**30:.2f} GiB); CLAM .pt reads float32 features "
             "only (twice the bytes)" + ("" if "import vs h5 read" in bags["ratios"] else "; import not measured")]
    return lines + (_bag_loader_notes(bags["loader"]) if "loader" in bags else [])


def _bag_loader_notes(results: dict[str, Any]) -> list[str]:
    lines = [f"- bag loader, batch 1, {mode}: loader / reader {f['loader_vs_reader_median']:.2f}x median"
             for mode in ("warm", "cold") if (f := results.get(mode))]
    r = results.get("rss")
    if r:
        lines.append(f"- bag loader anonymous RSS, float32 epoch: B = {r['B']['bags']} bags {_mib(r['loader_bytes']['B'])}, "
                     f"4B {_mib(r['loader_bytes']['4B'])}; bound {_mib(r['bound_bytes'])}")
    return lines + _int8_notes("bag loader, batch 1", results.get("int8"), "bags")


def _extract_notes(extract: dict[str, Any]) -> list[str]:
    if extract.get("benchmark") == "extract-wsi":
        return [f"- slide extraction: extract's loop alone / OpenSlide alone {extract['extract_loop_vs_openslide']:.2f}x"]
    return [f"- extract: write only {extract['write_only_mb_s']:.0f} MB/s" + (
        f"; the encoder waited {extract['writer_wait_s']:.2f} s for the writer" if "writer_wait_s" in extract else "")]


def _s3_notes(s3: dict[str, Any]) -> list[str]:
    lines = [f"- s3 ({s3['server']}; {s3['cache']})"]
    lines += [f"- downloaded, {name}: {value:.2f}x the split's bytes"
              for name, value in s3.get("downloaded_per_epoch_vs_split", {}).items()]
    return lines + [f"- CPU ms per GB, {name}: client {client:.0f}" + ("" if server is None else f", server {server:.0f}")
                    for name, (client, server) in s3.get("cpu_ms_per_gb", {}).items()]


def _web_notes(web: dict[str, Any]) -> list[str]:
    c, p = web["catalog"], web["picture"]
    return [f"- catalog page, {web['splits']} splits of {web['dim']} channels: warm {c['warm_ms']:.1f} ms (target < 200 ms), "
            f"documents evicted {c['documents_evicted_ms']:.1f} ms, first view {c['first_view_ms']:.1f} ms, one split's "
            f"page {c['split_page_warm_ms']:.1f} ms",
            f"- PCA picture of {p['shape'][0]}x{p['shape'][1]} float16, {p['blas_threads']} BLAS thread(s): computed "
            f"{p['computed_ms']:.1f} ms median (target < 300 ms), cached {p['cached_ms']:.1f} ms; parts "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in p["parts_ms"].items())
            + f"; the default {p['default_blas_threads']} BLAS threads {p['default_threads_ms']} ms; exact SVD "
            f"{p['exact_svd_ms']:.1f} ms = {p['exact_over_randomized']}x"]


NOTES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "read": _read_notes, "http": _http_notes, "loader": _loader_notes, "extract": _extract_notes,
    "s3": _s3_notes, "cold": _cold_notes, "bags": _bags_notes, "bag_loader": _bag_loader_notes, "web": _web_notes}


def figure_lines(name: str, bench: str, result: dict[str, Any], *, variants: bool = False) -> list[str]:
    """Every figure of a result (:mod:`featurestore.bench.figures`) with its spread and its targets
    in ``targets.json``: those of this entry (``name``: the bench or its variant), or with
    ``variants`` (a run of ``featurestore bench NAME``, whose flags may be any variant's) every
    target of the bench, each named."""
    from featurestore.bench.gate import load_targets, number

    targets = [t for t in load_targets().targets if (t.bench == bench if variants else t.run == name)]
    lines = []
    for figure, f in bench_figures(bench, result).items():
        found = [t for t in targets if figure == t.figure or figure.startswith(t.figure + "[")]
        unit = found[0].unit if found else "x"
        spread = f" (repeats {number(f['spread'][0], unit)} - {number(f['spread'][1], unit)})" if f["spread"] else ""
        lines.append(f"- {name}.{figure}: {number(f['value'], unit)}{spread}" + "".join(
            f"; target {t.id} {t.text()}: {'ok' if t.met(f['value']) else 'MISSED'} ({t.what})" for t in found))
    return lines


def notes(report: dict[str, Any]) -> list[str]:
    """Per entry of the report: its figures against their targets, then its other figures."""
    lines: list[str] = []
    for name, entry in report["benches"].items():
        bench = entry.get("bench", name)

        def figures(result: dict[str, Any], name: str = name, bench: str = bench,
                    variants: bool = "bench" not in entry) -> list[str]:
            return figure_lines(name, bench, result, variants=variants)
        lines += _guarded(report, name, figures, [])
        if bench in NOTES:
            lines += _guarded(report, name, NOTES[bench], [])
    return lines


def print_result(bench: str, result: dict[str, Any]) -> None:
    """What ``featurestore bench NAME`` prints at its end: the report's rows and notes of its result."""
    report = {"benches": {bench: {"result": result}}}
    for title, bars in throughput_rows(report).items():  # as report.md's tables: featurestore's rate / each
        print(f"[{bench}] {title}; {bars[0][0]} / method:")
        for name, rate in bars:
            print(f"  {name:<40} {rate:9.3f}  {bars[0][1] / rate if rate else float('nan'):6.2f}x")
    for line in notes(report):
        print(line)
    for where, error in report.get("render_errors", {}).items():
        print(f"(could not read {where}: {error})")


def finish(bench: str, result: dict[str, Any], json_out: str | None,
           failed: Callable[[dict[str, Any]], str | None] | None = None) -> int:
    """The end of ``featurestore bench NAME``: print, write ``--json``; 1 when ``failed(result)`` says why."""
    print_result(bench, result)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=2, default=lambda v: v.item() if hasattr(v, "item") else str(v))
    why = failed(result) if failed else None
    if why:
        print(f"featurestore: error: bench {bench} failed: {why}")
    return 1 if why else 0


# ---------------------------------------------------------------------- the loader's RSS over an epoch
def rss_series(report: dict[str, Any]) -> list[dict[str, Any]]:
    """From the loader bench: per run (N, 4N), time (s), anonymous RSS (MiB) and the float32 cache (MiB)."""
    series: list[dict[str, Any]] = _guarded(report, "loader", _rss_series, [])
    return series


def _rss_series(loader: dict[str, Any]) -> list[dict[str, Any]]:
    rss = loader.get("rss") or {}
    elements = math.prod(loader.get("sample_shape") or [0])
    series = []
    for label in ("N", "4N"):
        run = rss.get(label)
        if run and run.get("samples"):
            series.append({"label": f"{label} = {run['num_samples']} samples", "t": [s[0] for s in run["samples"]],
                           "anon_mib": [s[1] / 2**20 for s in run["samples"]], "peak_anon_mib": run["peak_anon"] / 2**20,
                           "baseline_mib": run["baseline_anon"] / 2**20,
                           "cache_mib": run["num_samples"] * elements * 4 / 2**20})
    return series
