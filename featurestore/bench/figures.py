"""The figures a bench's result holds, by name: what the gate (:mod:`featurestore.bench.gate`) checks.

Each bench's result is read into ``{figure: {"value": v, "spread": [low, high] or None,
"repeats": n}}``. ``value`` is the figure as the bench reports it (best or median of its
interleaved repeats); ``spread`` is the lowest and highest of the same ratio taken per repeat, side
by side (None where the bench keeps one number, a latency or a stall share, or ran one repeat). A figure measured per
sample shape is named ``name[TxD]``, one per shape the run measured. ``bench all`` stores these in
``report.json`` (``benches.NAME.figures``); an older report without them is read from its results.
A figure whose inputs are absent (a part the bench skipped) is simply not emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Figures = dict[str, dict[str, Any]]


def figure(value: float, pairs: Sequence[float] | None = None) -> dict[str, Any]:
    """One figure; ``repeats``: how many per-repeat pairs the bench kept (0: one number only)."""
    pairs = [float(p) for p in pairs or () if p is not None]
    return {"value": float(value), "spread": [min(pairs), max(pairs)] if len(pairs) > 1 else None,
            "repeats": len(pairs)}


def paired(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """``numerator[i] / denominator[i]`` per repeat (lists of equal length, else none)."""
    if not numerator or len(numerator) != len(denominator):
        return []
    return [a / b for a, b in zip(numerator, denominator) if b]


def label(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def _read(result: dict[str, Any]) -> Figures:
    out = {f"vs_memmap[{label(s['sample_shape'])}]": figure(s["median_paired_vs_memmap"], s["paired_vs_memmap"])
           for s in result["shapes"]}
    rss = result.get("rss") or {}
    if len(rss) == 2:  # N and 4N: the reader's peak anonymous RSS must not grow with the split
        small, large = (rss[k] for k in sorted(rss, key=int))
        out["rss_4n_vs_n"] = figure(large["peak_anon"] / small["peak_anon"])
    return out


def _write(result: dict[str, Any]) -> Figures:
    out = {}
    for s in result["shapes"]:
        times, tag = s["repeats_s"], s.get("label") or label(s["sample_shape"])  # "256x384", or "256x384 250MB"
        for source in ("float16", "float32"):
            out[f"{source}_vs_tofile[{tag}]"] = figure(
                s[f"writer_{source}_ratio"], paired(times["tofile"], times[source]))
        if "float16 second" in times:  # diagnostic, no target: a process's second write (warm writer)
            out[f"float16_second_vs_tofile[{tag}]"] = figure(
                s["writer_float16_second_ratio"], paired(times["tofile"], times["float16 second"]))
    return out


def _http(result: dict[str, Any]) -> Figures:
    rates, per_repeat = result["gb_per_s"], result.get("paired_vs_raw_tcp", {})
    out = {"client_vs_raw_tcp": figure(result["http_vs_raw_tcp"], per_repeat.get("http")),
           "naive_httpx_vs_raw_tcp": figure(rates["http naive client"] / rates["raw tcp"],
                                            per_repeat.get("http naive client")),
           "item_p50_ms": figure(result["item_latency_ms"]["p50"])}
    loader = result.get("loader") or {}
    if loader:
        epochs = loader.get("per_epoch_s", {})
        out["loader_vs_client"] = figure(loader["loader_vs_client"], paired(epochs.get("client"), epochs.get("loader")))
    if result.get("load"):
        out["load_failures"] = figure(result["load"]["errors"] + result["load"]["mismatches"])
    return out


def _loader(result: dict[str, Any]) -> Figures:
    t, times = result["throughput"], result["throughput"].get("times_s", {})
    out = {"loader_vs_reader": figure(t["loader_vs_reader"], paired(times.get("reader"), times.get("loader"))),
           "loader_vs_reader_float32": figure(t["loader_vs_reader_float32"],
                                              paired(times.get("reader_f32"), times.get("loader_f32"))),
           "stall_percent": figure(100 * result["stall"]["stall_fraction"])}
    rss = result.get("rss")
    if rss:  # the loader's own memory, N and 4N, against one N-independent limit (docs/LOADER.md)
        limit = rss.get("limit_bytes", rss["bound_bytes"] + (32 << 20))
        out["rss_vs_bound"] = figure(max(rss["loader_bytes"].values()) / limit)
    cgroup = result.get("cgroup") or {}
    if cgroup and "skipped" not in cgroup:  # 1: the epoch completed and the RAM tensor was killed
        out["cgroup_epoch"] = figure(1.0 if cgroup["ok"] else 0.0)
    return out


def _extract(result: dict[str, Any]) -> Figures:
    times = result["repeats"]
    if result.get("benchmark") == "extract-wsi":
        out = {"vs_openslide": figure(result["extract_vs_openslide"], result["pair_ratios"])}
        if "ratio" in result:  # a real encoder: wall time over encoding alone
            out["vs_encode_only"] = figure(result["ratio"], paired(times["extract_s"], times["encode_only_s"]))
        return out
    return {"vs_encode_only": figure(result["ratio"], paired(times["extract_s"], times["encode_only_s"])),
            "vs_tofile": figure(result["extract_vs_tofile"], paired(times["tofile_s"], times["extract_s"]))}


def _cold(result: dict[str, Any]) -> Figures:
    out = {}
    for s in result["shapes"]:
        rows = s.get("rows")
        if not rows:
            continue
        loader = rows["FeatureLoader"]
        tag = label(s["sample_shape"]) + ("" if s.get("dtype", "float16") == "float16" else f" {s['dtype']}")
        for name, base in (("loader_vs_pread", "pread reference"), ("loader_vs_memmap", "np.memmap gather")):
            out[f"{name}[{tag}]"] = figure(
                loader["gb_per_s"] / rows[base]["gb_per_s"],
                paired(loader.get("all_gb_per_s", []), rows[base].get("all_gb_per_s", [])))
        q = s.get("int8")
        if q:  # int8 beside float16, float32 out: samples/s ratio (median of per-repeat pairs), bytes
            out[f"int8_bytes_vs_float16[{tag}]"] = figure(q["bytes_ratio"])
            for device, suffix in (("cpu", ""), ("cuda", "_cuda")):
                if device in q:
                    out[f"int8_vs_float16{suffix}[{tag}]"] = figure(q[device]["ratio_median"], q[device]["ratio_per_repeat"])
    return out


def _bags(result: dict[str, Any]) -> Figures:
    rows = result["rows"]
    out = {}
    for name, value in result["ratios"].items():
        pairs: list[float] = []
        if name.endswith((" cold", " warm")):  # pass times: the baseline's over featurestore's
            temperature = name.rsplit(" ", 1)[1]
            pairs = paired(rows[name]["all_seconds"], rows[f"featurestore {temperature}"]["all_seconds"])
        elif name == "import vs h5 read":
            pairs = paired(rows["TRIDENT h5 cold"]["all_seconds"], result.get("all_import_seconds", []))
        out[name] = figure(value, pairs)
    return out


def _bag_loader(result: dict[str, Any]) -> Figures:
    out = {}
    for mode in ("warm", "cold"):
        f = result.get(mode)
        if not f:
            continue
        times = f.get("times_s", {})
        out[f"{mode}_loader_vs_reader"] = figure(f["loader_vs_reader"], paired(times.get("reader"), times.get("loader")))
        if "loader_vs_clam" in f:
            out[f"{mode}_loader_vs_clam"] = figure(f["loader_vs_clam"], paired(times.get("clam"), times.get("loader_f32")))
    p = result.get("padded")
    if p:
        times = p.get("times_s", {})
        out["padded_vs_reader"] = figure(p["padded_vs_reader"], paired(times.get("reader"), times.get("loader")))
    rss = result.get("rss")
    if rss:
        out["rss_vs_bound"] = figure(max(rss["loader_bytes"].values()) / rss["bound_bytes"])
    q = result.get("int8")
    if q:  # int8 beside float16, float32 out: bags/s ratio (median of per-repeat pairs), bytes on storage
        out["int8_bytes_vs_float16"] = figure(q["bytes_ratio"])
        for mode in ("warm", "cold"):
            if mode in q:
                out[f"int8_vs_float16_{mode}"] = figure(q[mode]["ratio_median"], q[mode]["ratio_per_repeat"])
    return out


# The runs (GB/s per repeat) each s3 ratio divides: ``bench s3`` takes its ratios of their medians.
_CEILING, _EPOCH1 = "ceiling (whole chunks, 8 GETs)", "cache epoch 1 (empty, full-size cache)"
# Shuffled reads without a cache, each epoch on a new array (or client): every row once, or the first batches.
S3_FS_EPOCH, S3_FS_SHORT = "featurestore epoch (fresh array)", "featurestore short epoch (fresh array)"
S3_BARE_EPOCH, S3_BARE_SHORT = "bare get_ranges epoch (new client)", "bare get_ranges short epoch (new client)"
_FS = S3_FS_EPOCH
_BAGS_EPOCH1, _BAGS_PT = "bag loader, cache epoch 1 (empty)", "bags, .pt per slide (4 in flight)"
S3_PAIRS = {
    "read_vs_ceiling": (_FS, _CEILING), "read_vs_zarr": (_FS, "zarr-python FsspecStore"),
    "loader_vs_ceiling": ("FeatureLoader epoch (uniform shuffle)", _CEILING),
    "write_vs_put": ("featurestore write", "plain concurrent put"),
    "read_vs_fsspec_path": (_FS, "featurestore via fsspec (before)"),
    "read_vs_bare_ranges": (_FS, S3_BARE_EPOCH),
    "read_vs_bare_ranges_short": (S3_FS_SHORT, S3_BARE_SHORT),
    "cache_epoch1_vs_ceiling": (_EPOCH1, _CEILING),
    "cache_epoch1_vs_fill_ceiling": (_EPOCH1, "cache fill ceiling (chunks into files)"),
    "cache_epoch2_vs_local_cold": ("cache epoch 2 (filled, cold files)", "local cold loader"),
    "half_cache_vs_ceiling": ("half cache epoch 2", _CEILING),
    "half_cache_epoch1_vs_ceiling": ("half cache epoch 1", _CEILING),
    "bags_cache_epoch1_vs_ceiling": (_BAGS_EPOCH1, "bags ceiling (whole chunks, 8 GETs)"),
    "bags_cache_epoch1_vs_pt_per_slide": (_BAGS_EPOCH1, _BAGS_PT),
    "bags_cache_epoch2_vs_pt_per_slide": ("bag loader, cache epoch 2 (cold files)", _BAGS_PT),
    "bags_no_cache_vs_pt_per_slide": ("bag loader, no cache (ranged GETs)", _BAGS_PT),
}


def _s3(result: dict[str, Any]) -> Figures:
    runs = result.get("runs", {})
    out = {}
    for name, value in result["ratios"].items():
        num, den = S3_PAIRS.get(name, ("", ""))
        out[name] = figure(value, paired(runs.get(num, []), runs.get(den, [])))
    return out


EXTRACTORS: dict[str, Callable[[dict[str, Any]], Figures]] = {
    "read": _read, "write": _write, "http": _http, "loader": _loader, "extract": _extract, "cold": _cold,
    "bags": _bags, "bag_loader": _bag_loader, "s3": _s3}


def bench_figures(bench: str, result: dict[str, Any] | None) -> Figures:
    """The figures of one bench's result (``{}`` for a bench without figures or without a result)."""
    fn = EXTRACTORS.get(bench)
    return fn(result) if fn and result else {}


__all__ = ["EXTRACTORS", "S3_BARE_EPOCH", "S3_BARE_SHORT", "S3_FS_EPOCH", "S3_FS_SHORT", "Figures", "bench_figures",
           "figure", "paired"]
