"""One reading of a bench's result: its rows (rates per method, featurestore first), its figures
(what the gate checks) and its notes (the other figures); ``bench NAME`` prints it, ``bench all``
reports it, the gate checks it (docs/BENCHMARKS.md, "The harness", "The targets file").

A figure is ``{"value": v, "spread": [low, high] or None, "repeats": n}``, named ``name[TxD]``
when measured per sample shape. A result whose keys changed keeps what was read before the
missing key, and says which (:attr:`Reading.error`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Figures = dict[str, dict[str, Any]]
Panels = dict[str, list[tuple[str, float]]]
UNREADABLE = (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError)


def figure(value: float, pairs: Sequence[float] | None = None) -> dict[str, Any]:
    """One figure; ``repeats``: how many per-repeat pairs the bench kept (0: one number only)."""
    pairs = [float(p) for p in pairs or () if p is not None]
    return {"value": float(value), "spread": [min(pairs), max(pairs)] if len(pairs) > 1 else None,
            "repeats": len(pairs)}


def paired(numerator: Sequence[float] | None, denominator: Sequence[float] | None) -> list[float]:
    """``numerator[i] / denominator[i]`` per repeat (lists of equal length, else none)."""
    if not numerator or not denominator or len(numerator) != len(denominator):
        return []
    return [a / b for a, b in zip(numerator, denominator) if b]


def label(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class Reading:
    """Rows, figures and notes of one result, filled in that order by its bench's reader."""

    def __init__(self) -> None:
        self.rows: Panels = {}
        self.figures: Figures = {}
        self.notes: list[str] = []
        self.error: str | None = None

    def fig(self, name: str, value: float, pairs: Sequence[float] | None = None) -> None:
        self.figures[name] = figure(value, pairs)

    def pair(self, name: str, value: float, times: dict[str, Any] | None, numerator: str, denominator: str) -> None:
        """A figure whose spread is ``times[numerator][i] / times[denominator][i]``, per repeat."""
        self.fig(name, value, paired((times or {}).get(numerator), (times or {}).get(denominator)))


def _read(r: dict[str, Any], out: Reading) -> None:
    for s in r["shapes"]:
        tag = label(s["sample_shape"])
        out.fig(f"vs_memmap[{tag}]", s["median_paired_vs_memmap"], s["paired_vs_memmap"])
        if "paired_vs_pread" in s:  # the limit of a read that maps nothing in, measured beside it
            out.fig(f"vs_pread_limit[{tag}]", s["median_paired_vs_pread"], s["paired_vs_pread"])
        if "paired_vs_chunk_pread" in s:  # ... of the same rows out of the store's own files
            out.fig(f"vs_chunk_pread_limit[{tag}]", s["median_paired_vs_chunk_pread"], s["paired_vs_chunk_pread"])
        out.rows[f"read [{tag}] float16, GB/s"] = [(m, row["gb_per_s"]) for m, row in s["read"].items()]
    runs = [(r.get("rss") or {}).get(k) for k in ("N", "4N")]
    if all(runs):  # N and 4N: the reader's peak anonymous RSS must not grow with the split
        out.fig("rss_4n_vs_n", runs[1]["peak_anon"] / runs[0]["peak_anon"])
    out.notes += [f"- read, N={x['n']}: reader peak anonymous RSS {mib(x['peak_anon'])} (after imports "
                  f"{mib(x['baseline_anon'])})" for x in runs if x]


def _write(r: dict[str, Any], out: Reading) -> None:
    # second: diagnostic, a process's second write; a figure per shape and size ("256x384 250MB")
    sources = {"float16": "writer, f16 input", "float32": "writer, f32 input",
               "float16_second": "writer, f16, second write"}
    for s in r["shapes"]:
        times, tag = s["repeats_s"], s.get("label") or label(s["sample_shape"])
        for key in [k for k in sources if k.replace("_", " ") in times or k != "float16_second"]:
            out.pair(f"{key}_vs_tofile[{tag}]", s[f"writer_{key}_ratio"], times, "tofile", key.replace("_", " "))
    for s in r["shapes"]:
        out.rows[f"write [{s.get('label') or label(s['sample_shape'])}] float16 stored, to os.sync, GB/s"] = [
            *((name, s[f"writer_{key}_gb_per_s"]) for key, name in sources.items() if f"writer_{key}_gb_per_s" in s),
            ("numpy tofile", s["tofile_gb_per_s"])]


def _http(r: dict[str, Any], out: Reading) -> None:
    rates, per_repeat, lat = r["gb_per_s"], r.get("paired_vs_raw_tcp", {}), r["item_latency_ms"]
    out.fig("client_vs_raw_tcp", r["http_vs_raw_tcp"], per_repeat.get("http"))
    out.fig("naive_httpx_vs_raw_tcp", rates["http naive client"] / rates["raw tcp"],
            per_repeat.get("http naive client"))
    out.fig("item_p50_ms", lat["p50"])
    if loader := r.get("loader"):
        out.pair("loader_vs_client", loader["loader_vs_client"], loader.get("per_epoch_s"), "client", "loader")
    if load := r.get("load"):
        out.fig("load_failures", load["errors"] + load["mismatches"])
    out.rows["http batches, GB/s"] = list(rates.items())
    out.notes.append(f"- http (median batch times) vs raw tcp + gather {r['http_vs_raw_tcp_gather']:.2f}x; single item "
                     f"p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms")
    if load:
        out.notes += [f"- http load test: {load['requests']} requests ({load['requests_per_s']:.0f}/s), errors "
                      f"{load['errors']}, payload mismatches {load['mismatches']}; server anonymous RSS "
                      f"{mib(load['server_rss_anon_start'])} -> {mib(load['server_rss_anon_end'])}",
                      *(f"  - {failure}" for failure in load["failures"][:5])]


def _loader(r: dict[str, Any], out: Reading) -> None:
    t, s, rss, cg = r["throughput"], r["stall"], r.get("rss"), r.get("cgroup") or {}
    out.pair("loader_vs_reader", t["loader_vs_reader"], t.get("times_s"), "reader", "loader")
    out.pair("loader_vs_reader_float32", t["loader_vs_reader_float32"], t.get("times_s"), "reader_f32", "loader_f32")
    out.fig("stall_percent", 100 * s["stall_fraction"], [100 * f for f in s.get("stall_fractions", ())])
    if rss:  # the loader's own memory, N and 4N, against one N-independent limit (docs/LOADER.md)
        limit = rss.get("limit_bytes", rss["bound_bytes"] + (32 << 20))
        out.fig("rss_vs_bound", max(rss["loader_bytes"].values()) / limit)
        if "rss_growth_bytes" in rss:  # the process RSS as top shows it (docs/READS.md, "Resident bytes")
            out.fig("vmrss_growth_mib", rss["rss_growth_bytes"] / 2**20)
    if cg and "skipped" not in cg:  # 1: the epoch completed and the RAM tensor was killed
        out.fig("cgroup_epoch", 1.0 if cg["ok"] else 0.0)
    out.rows["loader (CPU consumer), GB/s"] = [
        ("loader", t["loader_gbps"]), ("bare reader", t["reader_gbps"]),
        ("loader -> f32", t["loader_float32_gbps"]), ("reader + .float()", t["reader_float32_gbps"])]
    out.notes.append(f"- loader stall over {s['batches']} batches with a {s['consumer_step_s'] * 1e3:.1f} ms "
                     "consumer step")
    if rss:
        cache = rss["4N"]["num_samples"] * math.prod(r["sample_shape"]) * 4  # what the loader replaces
        out.notes.append(f"- loader's own anonymous memory: N {mib(rss['loader_bytes']['N'])}, 4N "
                         f"{mib(rss['loader_bytes']['4N'])}; bound {mib(rss['bound_bytes'])} + 32 MiB; the 4N "
                         f"samples as an in-RAM float32 cache: {mib(cache)}")
    if cg:
        out.notes.append(f"- cgroup epoch: skipped ({cg['skipped']})" if "skipped" in cg else
                         f"- cgroup limit {mib(cg['limit_bytes'])}, store {mib(cg['store_bytes'])}: loader rc "
                         f"{cg['loader_returncode']}, RAM tensor killed: {cg['ram_killed']}")


def _int8(out: Reading, tag: str, what: str, q: dict[str, Any] | None, unit: str) -> None:
    """int8 beside its float16 reference (float32 out, epochs interleaved): ratio per mode, bytes."""
    if not q:
        return
    modes = [(mode, suffix, q[mode]) for mode, suffix in (("cpu", tag), ("cuda", f"_cuda{tag}"), ("warm", "_warm"),
                                                        ("cold", "_cold")) if q.get(mode)]
    out.fig(f"int8_bytes_vs_float16{tag}", q["bytes_ratio"])
    for _, suffix, f in modes:
        out.fig(f"int8_vs_float16{suffix}", f["ratio_median"], f["ratio_per_repeat"])
    ref, sizes = q["reference"], q["split_bytes"]
    out.notes.append(f"- {what}: int8 features + scales {mib(sizes['int8'])} on storage = {q['bytes_ratio']:.3f}x "
                     f"{ref}'s features {mib(sizes[ref])}")
    for mode, _, f in modes:
        rate = f.get(f"{unit}_per_s", {})
        out.notes.append(f"  - {mode}, float32 out: int8 {rate.get('int8', 0):.1f} {unit}/s, {ref} "
                         f"{rate.get(ref, 0):.1f} {unit}/s; int8 / {ref} {f['ratio_median']:.2f}x median, per "
                         "repeat " + " ".join(f"{x:.2f}" for x in f["ratio_per_repeat"]))


def _cold(r: dict[str, Any], out: Reading) -> None:
    def tag(s: dict[str, Any]) -> str:
        return label(s["sample_shape"]) + ("" if s.get("dtype", "float16") == "float16" else f" {s['dtype']}")
    for s in r["shapes"]:  # the figures first: a note's missing key must not hide them
        if rows := s.get("rows"):
            loader = rows["FeatureLoader"]
            for name, base in (("loader_vs_pread", "pread reference"), ("loader_vs_memmap", "np.memmap gather")):
                out.fig(f"{name}[{tag(s)}]", loader["gb_per_s"] / rows[base]["gb_per_s"],
                        paired(loader.get("all_gb_per_s"), rows[base].get("all_gb_per_s")))
            _int8(out, f"[{tag(s)}]", f"cold [{tag(s)}]", s.get("int8"), "samples")
    for s in r["shapes"]:
        if not (rows := s.get("rows")):
            out.notes.append(f"- cold [{tag(s)}]: child failed (rc {s.get('returncode')}): "
                             f"{s.get('stderr', '')[-300:]}")
            continue
        first = [k for k in ("FeatureLoader", "FeatureArray.read") if k in rows]
        out.rows[f"cold [{label(s['sample_shape'])}] {s.get('dtype', 'float16')} (page cache cold), GB/s"] = [
            (name, rows[name]["gb_per_s"]) for name in first + [k for k in rows if k not in first]]
        limit, loader = s.get("limit_bytes", r.get("limit_bytes", 0)), rows["FeatureLoader"]
        out.notes.append(f"- cold [{tag(s)}], {s['chunk_rows']}-row chunks, store {s['store_bytes'] / 2**30:.2f} GiB, "
                         f"memory cgroup {limit >> 20} MiB ({s['cgroup']}), median of {s['repeats']}: loader "
                         f"{loader['gb_per_s'] / rows['device limit']['gb_per_s']:.2f}x the device limit; loader peak "
                         f"RSS {mib(loader['peak_rss'])}; same bytes: {s['same_bytes']}")
        cached = {name: row["cached_after_evict"] for name, row in rows.items() if "cached_after_evict" in row}
        if cached:  # an eviction that left pages behind (a map still open) would measure a warm epoch as cold
            name = max(cached, key=cached.__getitem__)
            out.notes.append(f"  - still cached after each eviction, the most: {mib(cached[name])} before {name!r} "
                             f"({cached[name] / s['store_bytes']:.1%} of the store's size)")
        out.notes += [f"  - {name} FAILED: {error}" for name, error in s.get("errors", {}).items()]


def _bags(r: dict[str, Any], out: Reading) -> None:
    rows = r["rows"]
    for name, value in r["ratios"].items():
        pairs: list[float] = []
        if name.endswith((" cold", " warm")):  # pass times: the baseline's over featurestore's
            pairs = paired(rows[name]["all_seconds"], rows[f"featurestore {name.rsplit(' ', 1)[1]}"]["all_seconds"])
        elif name == "import vs h5 read":
            pairs = paired(rows["TRIDENT h5 cold"]["all_seconds"], r.get("all_import_seconds"))
        out.fig(name, value, pairs)
    for temperature in ("cold", "warm"):  # the formats read different bytes: CLAM's .pt is float32
        out.rows[f"bags, one shuffled pass over {r['slides']} slides x {r['dim']} features, {temperature}, bags/s"] = [
            (name, rows[f"{name} {temperature}"]["bags_per_s"])
            for name in ("featurestore", "TRIDENT h5", "CLAM .pt", "parallel pread")]
    out.notes.append(f"- bags: {r['slides']} slides (median {r['median_patches']}, max {r['max_patches']} patches, dim "
                     f"{r['dim']}, featurestore {r['sizes']['store'] / 2**30:.2f} GiB); CLAM .pt reads float32 "
                     "features only (twice the bytes)")


def _bag_loader(r: dict[str, Any], out: Reading) -> None:
    for mode in ("warm", "cold"):
        if f := r.get(mode):
            out.pair(f"{mode}_loader_vs_reader", f["loader_vs_reader"], f.get("times_s"), "reader", "loader")
            if "loader_vs_clam" in f:
                out.pair(f"{mode}_loader_vs_clam", f["loader_vs_clam"], f.get("times_s"), "clam", "loader_f32")
    if p := r.get("padded"):
        out.pair("padded_vs_reader", p["padded_vs_reader"], p.get("times_s"), "reader", "loader")
    if rss := r.get("rss"):
        out.fig("rss_vs_bound", max(rss["loader_bytes"].values()) / rss["bound_bytes"])
        if "rss_growth_bytes" in rss:
            out.fig("vmrss_growth_mib", rss["rss_growth_bytes"] / 2**20)
    for mode in ("warm", "cold"):
        if f := r.get(mode):
            out.rows[f"bag loader, batch 1, {mode}, GB/s"] = [
                ("BagLoader", f["loader_gbps"]), ("bare reader", f["reader_gbps"]),
                ("BagLoader -> f32", f["loader_f32_gbps"]),
                *([("CLAM torch.load .pt", f["clam_gbps"])] if "clam_gbps" in f else [])]
            out.notes.append(f"- bag loader, batch 1, {mode}: loader / reader {f['loader_vs_reader_median']:.2f}x "
                             "median")
    if p:
        out.rows[f"bag loader, padded, batch {p['batch_size']}, GB/s"] = [
            ("BagLoader", p["loader_gbps"]), ("reader + pad", p["loader_gbps"] * p["loader_s"] / p["reader_s"])]
    if rss:
        out.notes.append(f"- bag loader anonymous RSS, float32 epoch: B = {rss['B']['bags']} bags "
                         f"{mib(rss['loader_bytes']['B'])}, 4B {mib(rss['loader_bytes']['4B'])}; bound "
                         f"{mib(rss['bound_bytes'])}")
        if "rss_growth_bytes" in rss:
            out.notes.append(f"- bag loader peak RSS as top shows it (VmHWM): B {mib(rss['B']['peak_rss'])} (split "
                             f"{mib(rss['B']['store_bytes'])}), 4B {mib(rss['4B']['peak_rss'])} (split "
                             f"{mib(rss['4B']['store_bytes'])})")
    _int8(out, "", "bag loader, batch 1", r.get("int8"), "bags")


def _extract(r: dict[str, Any], out: Reading) -> None:
    times = r["repeats"]
    if r.get("benchmark") == "extract-wsi":
        out.fig("vs_openslide", r["extract_vs_openslide"], r["pair_ratios"])
        rows = [("extract", r["extract_patches_s"]), ("OpenSlide alone", r["openslide_only_patches_s"])]
        if "ratio" in r:  # a real encoder: wall time over encoding alone
            out.pair("vs_encode_only", r["ratio"], times, "extract_s", "encode_only_s")
            rows.append(("encode only", r["encode_only_patches_s"]))
        out.rows["slide extraction, patches/s"] = rows
        out.notes.append(f"- slide extraction: extract's loop alone / OpenSlide alone "
                         f"{r['extract_loop_vs_openslide']:.2f}x")
        return
    out.pair("vs_encode_only", r["ratio"], times, "extract_s", "encode_only_s")
    out.pair("vs_tofile", r["extract_vs_tofile"], times, "tofile_s", "extract_s")
    out.rows["extract, images/s"] = [("extract", r["extract_img_s"]), ("encode only", r["encode_only_img_s"])]
    out.notes.append(f"- extract: write only {r['write_only_mb_s']:.0f} MB/s" + (
        f"; the encoder waited {r['writer_wait_s']:.2f} s for the writer" if "writer_wait_s" in r else ""))


def _s3(r: dict[str, Any], out: Reading) -> None:
    runs, pairs = r.get("runs", {}), r.get("pairs", {})  # per ratio: the two runs it divides
    for name, value in r["ratios"].items():
        out.fig(name, value, paired(*(runs.get(run) for run in pairs.get(name, ("", "")))))
    rates, writes = r["gb_per_s"], ("featurestore write", "plain concurrent put")
    out.rows["S3 (SeaweedFS, loopback) reads, GB/s"] = [(k, v) for k, v in rates.items() if k not in writes]
    out.rows["S3 (SeaweedFS, loopback) writes, GB/s"] = [(name, rates[name]) for name in writes]
    downloaded = r.get("downloaded_per_epoch_vs_split", {})
    out.notes += [f"- s3 ({r['server']}; {r['cache']})",
                  *(f"- downloaded, {name}: {value:.2f}x the split's bytes" for name, value in downloaded.items())]


def _web(r: dict[str, Any], out: Reading) -> None:
    c, p = r["catalog"], r["picture"]
    out.fig("catalog_warm_ms", c["warm_ms"])
    out.fig("pca_picture_ms", p["computed_ms"])
    out.notes += [
        f"- catalog page, {r['splits']} splits of {r['dim']} channels: warm {c['warm_ms']:.1f} ms, "
        f"documents evicted {c['documents_evicted_ms']:.1f} ms, first view {c['first_view_ms']:.1f} ms, one split's "
        f"page {c['split_page_warm_ms']:.1f} ms",
        f"- PCA picture of {p['shape'][0]}x{p['shape'][1]} float16, {p['blas_threads'] or 'the default'} BLAS "
        f"thread(s): computed {p['computed_ms']:.1f} ms median, cached {p['cached_ms']:.1f} ms; parts "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in p["parts_ms"].items())]


READERS: dict[str, Callable[[dict[str, Any], Reading], None]] = {
    "read": _read, "write": _write, "http": _http, "loader": _loader, "extract": _extract, "s3": _s3, "cold": _cold,
    "bags": _bags, "bag_loader": _bag_loader, "web": _web}
# The benches whose figures the targets may name, in the order bench all runs them.
FIGURE_BENCHES = tuple(READERS)


def read_result(bench: str, result: dict[str, Any] | None) -> Reading:
    """The reading of one bench's result (empty for a bench without a reader or a result)."""
    out = Reading()
    if result and bench in READERS:
        try:
            READERS[bench](result, out)
        except UNREADABLE as error:
            out.error = f"{type(error).__name__}: {error}"
    return out


def bench_figures(bench: str, result: dict[str, Any] | None) -> Figures:
    """The figures of one result; raises the reading's error when it stopped before any figure."""
    reading = read_result(bench, result)
    if reading.error and not reading.figures:
        raise KeyError(reading.error)
    return reading.figures
