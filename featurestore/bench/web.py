"""``featurestore bench web``: server time of the web page, the catalog of N splits and the PCA
picture (docs/BENCHMARKS.md, docs/SERVER.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import featurestore
from featurestore.bench import harness
from featurestore.bench.harness import Method, interleaved
from featurestore.demo.synthetic_splits import write_catalog, write_picture_split
from featurestore.errors import InvalidOption
from featurestore.testing.cgroup import evict


def register(subparsers: Any) -> None:
    harness.add_bench(subparsers, "web", "web page server time: catalog of N splits, PCA picture", {
        "--splits": (100, "splits in the catalog store"), "--dim": (3072, "channels of every split"),
        "--tokens": (1024, "patch tokens of the PCA sample (a square)"),
        "--samples": (5, "samples pictured, each computed once (2 or more: the first is an untimed warm-up)"),
        "--repeats": (10, "timed catalog views per case; the median is kept")})


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def _timed(fn: Any) -> tuple[float, Any]:
    out: list[Any] = []
    return harness.timed(lambda: out.append(fn())), out[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from server import Settings, create_app

    if args.samples < 2:  # sample 0 warms the route up (imports, BLAS), the others are timed
        raise InvalidOption(f"--samples {args.samples}: give 2 or more (the first is a warm-up, not timed)")
    side = int(round(args.tokens**0.5))
    if side * side != args.tokens:
        raise InvalidOption(f"--tokens {args.tokens} is not a square (the picture needs a grid); give one such as 1024")

    results: dict[str, Any] = {"benchmark": "web", "cpus": os.cpu_count(), "splits": args.splits, "dim": args.dim}
    with harness.scratch(args, "web") as work:
        catalog_path = os.path.join(work, "catalog")
        write_catalog(catalog_path, args.splits, args.dim)
        doc = os.path.join(catalog_path, "ds0", "enc0", "split000", "zarr.json")
        results["document_bytes"] = os.path.getsize(doc)
        with TestClient(create_app(catalog_path, Settings())) as client:
            first, page = _timed(lambda: client.get("/"))
            assert page.status_code == 200 and page.text.count("<tr>") >= args.splits, page.text[:500]
            warm = interleaved([Method("warm", lambda: client.get("/")),
                                Method("split", lambda: client.get("/ui/splits/ds0/enc0/split000"))], args.repeats)
            cold = interleaved([Method("cold", lambda: client.get("/"), lambda: evict(catalog_path))],
                               max(1, args.repeats // 2))
        results["catalog"] = {"first_view_ms": _ms(first), "warm_ms": _ms(warm.median("warm")),
                              "documents_evicted_ms": _ms(cold.median("cold")), "page_bytes": len(page.content),
                              "split_page_warm_ms": _ms(warm.median("split"))}
        picture_path = os.path.join(work, "pictures")
        write_picture_split(picture_path, args.samples, side, args.dim)
        results["picture"] = _bench_picture(picture_path, (side, side), args)
        results["load_average"] = [round(v, 1) for v in os.getloadavg()]
    return results


def _bench_picture(path: str, grid: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from featurestore.format import dtypes
    from server import Settings, create_app
    from server.web import pictures
    from server.web.blas import limit_blas_threads
    from server.web.png import encode_png

    limited = limit_blas_threads(Settings().ui_blas_threads)  # what featurestore serve does
    with TestClient(create_app(path, Settings())) as client:
        client.get("/ui/pca/pictures/enc/train/0.png")  # imports, BLAS start-up: not a sample's cost
        computed = [harness.timed(lambda i=i: client.get(f"/ui/pca/pictures/enc/train/{i}.png"))
                    for i in range(1, args.samples)]
        cached = interleaved([Method("cached", lambda: client.get("/ui/pca/pictures/enc/train/1.png"))], args.repeats)
        assert client.app.state.web.figures.computed == args.samples  # type: ignore[attr-defined]
    arr = featurestore.open_store(path).open("pictures", "enc", "train")
    read, stored = _timed(lambda: arr.read_numpy([1])[0])
    cast, sample = _timed(lambda: dtypes.stored_as_float32(stored, "float16"))
    fit, image = _timed(lambda: pictures.pca_picture(sample, 0, grid))
    png = harness.timed(lambda: encode_png(image))
    return {"shape": [args.tokens, args.dim], "computed_ms": _ms(statistics.median(computed)),
            "computed_max_ms": _ms(max(computed)), "cached_ms": _ms(cached.median("cached")),
            "parts_ms": {"read": _ms(read), "float16->float32": _ms(cast), "components+image": _ms(fit),
                         "png": _ms(png)},
            "blas_threads": Settings().ui_blas_threads if limited else None}  # None: the library's own
