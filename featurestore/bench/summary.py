"""What a ``bench all`` report holds, as rows and series: GB/s per bench and RSS over an epoch.

Shared by the plots and the markdown of :mod:`featurestore.bench.report`; a bench that failed or
was skipped yields no rows instead of stopping the report.
"""

from __future__ import annotations

import math
from typing import Any


def _guarded(report: dict[str, Any], name: str, fn: Any, default: Any) -> Any:
    """``fn(result of bench name)``; a result whose keys changed under the report is noted in
    ``render_errors`` (shown in report.md) instead of taking the other benches' figures down."""
    result = report["benches"].get(name, {}).get("result")
    if not result:
        return default
    try:
        return fn(result)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as error:
        report.setdefault("render_errors", {})[f"{name}: {fn.__name__}"] = f"{type(error).__name__}: {error}"
        return default


def throughput_rows(report: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Per panel title: ``(method, rate)`` pairs, featurestore first. Rates: GB/s (img/s for extract)."""
    panels: dict[str, list[tuple[str, float]]] = {}
    for name, rows in (("read", _read_rows), ("write", _write_rows), ("http", _http_rows),
                       ("loader", _loader_rows), ("extract", _extract_rows), ("s3", _s3_rows), ("cold", _cold_rows),
                       ("bags", _bags_rows), ("bag_loader", _bag_loader_rows)):
        panels.update(_guarded(report, name, rows, {}))
    return panels


def _read_rows(read: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    return {f"read [{'x'.join(map(str, shape['sample_shape']))}] float16, GB/s":
            [(m, r["gb_per_s"]) for m, r in shape["read"].items()] for shape in read["shapes"]}


def _write_rows(write: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    return {f"write [{'x'.join(map(str, shape['sample_shape']))}] float16 stored, to os.sync, GB/s": [
        ("writer, f16 input", shape["writer_float16_gb_per_s"]), ("writer, f32 input", shape["writer_float32_gb_per_s"]),
        ("numpy tofile", shape["tofile_gb_per_s"])] for shape in write["shapes"]}


def _http_rows(http: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    return {"http batches, GB/s": list(http["gb_per_s"].items())}


def _loader_rows(loader: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    t = loader["throughput"]
    return {"loader (CPU consumer), GB/s": [
        ("loader", t["loader_gbps"]), ("bare reader", t["reader_gbps"]),
        ("loader -> f32", t["loader_float32_gbps"]), ("reader + .float()", t["reader_float32_gbps"])]}


def _cold_rows(cold: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    panels = {}
    for shape in cold["shapes"]:
        if "rows" not in shape:
            continue
        rows = shape["rows"]
        first = [k for k in ("FeatureLoader", "FeatureArray.read") if k in rows]
        names = first + [k for k in rows if k not in first]
        panels[f"cold [{'x'.join(map(str, shape['sample_shape']))}] float16 (page cache cold), GB/s"] = [
            (name, rows[name]["gb_per_s"]) for name in names]
    return panels


def _bags_rows(bags: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Whole-bag reads, bags/s (the formats read different bytes: CLAM's .pt is float32)."""
    from featurestore.bench.bag_loader import throughput_rows

    rows = bags["rows"]
    panels = {f"bags, one shuffled pass over {bags['slides']} slides x {bags['dim']} features, {temperature}, bags/s": [
        (name, rows[f"{name} {temperature}"]["bags_per_s"]) for name in ("featurestore", "TRIDENT h5", "CLAM .pt",
                                                                         "parallel pread")]
        for temperature in ("cold", "warm")}
    if "loader" in bags:
        panels.update(throughput_rows(bags["loader"]))
    return panels


def _bag_loader_rows(result: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    from featurestore.bench.bag_loader import throughput_rows

    return {f"bench bag-loader: {title}": bars for title, bars in throughput_rows(result).items()}


def _extract_rows(extract: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    if extract.get("benchmark") == "extract-wsi":
        return {}
    return {"extract, images/s": [("extract", extract["extract_img_s"]),
                                  ("encode only", extract["encode_only_img_s"])]}


def _s3_rows(s3: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    rates = s3["gb_per_s"]
    reads = ["featurestore shuffled batches", "ceiling (whole chunks, 8 GETs)", "FeatureLoader epoch (uniform shuffle)",
             "zarr-python FsspecStore", "featurestore via fsspec (before)"]
    return {"S3 (SeaweedFS, loopback) reads, GB/s": [(name, rates[name]) for name in reads],
            "S3 (SeaweedFS, loopback) writes, GB/s": [(name, rates[name]) for name in
                                                      ("featurestore write", "plain concurrent put")]}


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
        if not run or not run.get("samples"):
            continue
        series.append({
            "label": f"{label} = {run['num_samples']} samples",
            "t": [s[0] for s in run["samples"]],
            "anon_mib": [s[1] / 2**20 for s in run["samples"]],
            "peak_anon_mib": run["peak_anon"] / 2**20,
            "baseline_mib": run["baseline_anon"] / 2**20,
            "cache_mib": run["num_samples"] * elements * 4 / 2**20,
        })
    return series
