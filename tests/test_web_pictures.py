"""The web page's pictures in-process (``TestClient(create_app(...))``): PCA and int8 pictures,
their cache and caps, and the parts that draw them (PNG, SVD, slide maps, plots), tested alone."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from server import Settings, create_app  # noqa: E402
from server.web import pictures, plots  # noqa: E402
from server.web.figures import PictureCache  # noqa: E402
from server.web.png import decode_png, encode_png  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import served_store  # noqa: E402
from _web_fixtures import GRID, SAMPLES, make_web_store, regions, slide  # noqa: E402

TRAIN = "/ui/splits/demo/vit-s/train"


store_path, client = served_store(make_web_store, "web")


# ---------------------------------------------------------------------- pictures
def test_an_int8_split_shows_its_scales_errors_saturation_and_a_picture_of_its_values(tmp_path: object, client: TestClient) -> None:
    """An int8 split's page says its codes carry scales, shows the report's errors with saturation
    (not float16's overflow), and its picture is that of its values, not of its codes."""
    import featurestore
    from _web_fixtures import DIM, _metadata, tokens

    store = featurestore.open_store(str(tmp_path), mode="a")
    writer = store.create_split("demo", "vit-s", "i8", num_samples=4, sample_shape=(1 + GRID[0] * GRID[1], DIM),
                                dtype="int8", chunk_rows=4, metadata=_metadata("builtin:vit-s14", "3f1a9c0e7d2b4a61"))
    writer.write(0, tokens(4, 1))
    writer.commit()
    bags = store.create_bag_split("demo", "vit-s", "i8bags", dim=DIM, dtype="int8")
    bags.add_bag("slide", slide(0)[0], coords=slide(0)[1])
    bags.commit()
    q = store.split_info("demo", "vit-s", "i8").quantization or {}
    with TestClient(create_app(str(tmp_path), Settings())) as web:
        text = web.get("/ui/splits/demo/vit-s/i8").text
        assert "int8 codes \u00d7 float32 scales per chunk and position" in text
        assert "float32</code> \u2192 <code>int8" in text
        for key in ("max_abs_error", "max_rel_error", "rel_rms_error"):
            assert format(q[key], ".3g") in text, key
        assert "saturated (codes clipped at \u00b1127)" in text and "65504" not in text
        bag_page = web.get("/ui/splits/demo/vit-s/i8bags").text
        assert "int8 codes \u00d7 float32 scales per bag and channel" in bag_page and "saturated" in bag_page
        values = store.open("demo", "vit-s", "i8").read_numpy([2], dtype="float32")[0]
        picture = decode_png(web.get("/ui/pca/demo/vit-s/i8/2.png").content)
        assert np.array_equal(picture, pictures.pca_picture(values, 1, GRID))
        assert web.get("/ui/slidemap/demo/vit-s/i8bags/0.png").status_code == 200
    assert "overflow (beyond" in client.get(TRAIN).text  # a float16 split keeps float16's row


def test_pca_picture_shows_the_regions_of_the_sample(client: TestClient) -> None:
    for encoder in ("vit-s", "vit-s-bf16"):
        answer = client.get(f"/ui/pca/demo/{encoder}/train/3.png")
        assert answer.status_code == 200 and answer.headers["content-type"] == "image/png"
        image = decode_png(answer.content)
        side = 384 // GRID[0]
        assert image.shape == (GRID[0] * side, GRID[1] * side, 3)
        cells = image[::side, ::side].astype(np.float64)  # one pixel per token
        ids = regions(3)
        means = np.stack([cells[ids == r].mean(axis=0) for r in range(4) if (ids == r).any()])
        within = max(cells[ids == r].std(axis=0).max() for r in range(4) if (ids == r).sum() > 1)
        between = min(np.linalg.norm(a - b) for i, a in enumerate(means) for b in means[i + 1:])
        assert between > 3 * within, (between, within)


def test_pictures_are_cached_per_split_document(tmp_path: object) -> None:
    import featurestore

    path = make_web_store(str(tmp_path) + "/store")  # type: ignore[operator]
    with TestClient(create_app(path, Settings())) as client:
        figures = client.app.state.web.figures  # type: ignore[attr-defined]
        first = client.get("/ui/pca/demo/vit-s/train/1.png").content
        assert client.get("/ui/pca/demo/vit-s/train/1.png").content == first and figures.computed == 1
        # an overwrite (new generation, new values) is never answered from the cache
        store = featurestore.open_store(path, mode="a")
        old = store.split_info("demo", "vit-s", "train")
        w = store.create_split("demo", "vit-s", "train", num_samples=SAMPLES, sample_shape=(257, 48),
                               dtype="float16", overwrite=True, metadata={"token_layout": old.token_layout})
        w.write(0, np.random.default_rng(0).standard_normal((SAMPLES, 257, 48)).astype(np.float32))
        w.commit()
        assert client.get("/ui/pca/demo/vit-s/train/1.png").content != first and figures.computed == 2
        new = store.split_info("demo", "vit-s", "train").generation
        assert new != old.generation and new in client.get("/").text


@pytest.mark.parametrize(("path", "status"), [
    ("/ui/pca/demo/vit-s/train/12.png", 416), ("/ui/pca/demo/vit-s/train/-1.png", 416),
    ("/ui/pca/demo/vit-s/val/0.png", 400), ("/ui/pca/demo/vit-s/writing/0.png", 409),
    ("/ui/pca/demo/vit-s/nope/0.png", 404), ("/ui/pca/demo/vit-s/train/x.png", 400),
])  # fmt: skip
def test_picture_errors(client: TestClient, path: str, status: int) -> None:
    answer = client.get(path)
    assert answer.status_code == status, answer.text
    assert answer.json()["detail"]


def test_picture_reads_are_capped(store_path: str) -> None:
    settings = Settings(ui_max_sample_bytes=1000)
    with TestClient(create_app(store_path, settings)) as client:
        answer = client.get("/ui/pca/demo/vit-s/train/0.png")
        assert answer.status_code == 413 and "FEATURESTORE_UI_MAX_SAMPLE_BYTES" in answer.json()["detail"]


def test_pictures_at_once_are_capped(store_path: str) -> None:
    with TestClient(create_app(store_path, Settings(ui_pictures_at_once=1, inflight_wait_s=0))) as client:
        slots = client.app.state.web.figures._slots  # type: ignore[attr-defined]
        assert slots.acquire(timeout=1)  # one picture in flight
        try:
            busy = client.get("/ui/pca/demo/vit-s/train/2.png")
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert "FEATURESTORE_UI_PICTURES_AT_ONCE" in busy.json()["detail"]
        finally:
            slots.release()
        assert client.get("/ui/pca/demo/vit-s/train/2.png").status_code == 200


def test_ui_can_be_turned_off(store_path: str) -> None:
    with TestClient(create_app(store_path, Settings(ui=False))) as client:
        assert client.get("/").status_code == 404 and client.get(TRAIN).status_code == 404
        assert client.get("/v1/datasets").status_code == 200


# ---------------------------------------------------------------------- the parts
def test_png_decodes_with_pillow() -> None:
    image = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    data = encode_png(image)
    assert (decode_png(data) == image).all()
    pil = pytest.importorskip("PIL.Image")
    import io

    assert (np.asarray(pil.open(io.BytesIO(data)).convert("RGB")) == image).all()


def test_components_match_an_exact_svd() -> None:
    rng = np.random.default_rng(0)
    scales = np.array([9.0, 5.0, 3.0] + [0.5] * 253)
    x = (rng.standard_normal((1200, 256)) * scales) @ np.linalg.qr(rng.standard_normal((256, 256)))[0]
    fitted = pictures.fit_components(x.astype(np.float32), 3)
    exact = np.linalg.svd(x - x.mean(axis=0), full_matrices=False)[2][:3]
    assert np.abs((fitted.axes * exact).sum(axis=1)).min() > 0.999
    again = pictures.fit_components(x.astype(np.float32), 3)
    assert (again.axes == fitted.axes).all()  # deterministic, signs included
    # fits use at most FIT_ROWS rows
    big = np.repeat(x[:10], pictures.FIT_ROWS, axis=0).astype(np.float32)
    assert pictures.fit_components(big, 1).axes.shape == (1, 256)


def test_token_grid_rules() -> None:
    assert pictures.token_grid({"prefix_tokens": 1, "grid": [16, 16]}, (257, 8)) == (1, (16, 16))
    assert pictures.token_grid({"prefix_tokens": 1, "grid": [16, 16]}, (256, 8)) == (0, (16, 16))
    assert pictures.token_grid({"prefix_tokens": 5, "grid": [16, 16]}, (300, 8)) is None
    assert pictures.token_grid(None, (196, 8)) == (0, (14, 14))
    assert pictures.token_grid({"prefix_tokens": 1}, (197, 8)) == (1, (14, 14))
    assert pictures.token_grid(None, (8,)) is None and pictures.token_grid("junk", (3, 8)) is None


def test_slide_map_paints_each_patch() -> None:
    coords = np.array([[0, 0], [256, 0], [0, 256], [512, 512]])
    image = pictures.slide_map(coords, np.array([0.0, 1.0, 0.5, 1.0]), max_side=96)
    assert image.shape == (96, 96, 3)
    assert (image[5, 5] == pictures.VIRIDIS[0]).all() and (image[5, 40] == pictures.VIRIDIS[255]).all()
    assert (image[40, 70] == 245).all()  # no patch there: background
    assert pictures.patch_step(coords) == 256


def _painted_square_by_square(coords: np.ndarray, values: np.ndarray, patch: int, max_side: int) -> np.ndarray:
    """The slide map as first written: each patch's square painted in order (the later one on top)."""
    origin = coords.min(axis=0)
    extent = coords.max(axis=0) - origin + patch
    scale = max_side / float(extent.max())
    width, height = (max(1, int(np.ceil(e * scale))) for e in extent)
    image = np.full((height, width, 3), 245, np.uint8)
    side = max(1, int(np.ceil(patch * scale)))
    colours = pictures.VIRIDIS[(np.clip(values, 0.0, 1.0) * 255).round().astype(np.int64)]
    for (x, y), colour in zip(((coords - origin) * scale).astype(np.int64), colours):
        image[y : y + side, x : x + side] = colour
    return image


@pytest.mark.parametrize(("step", "patch", "max_side"), [(256, 256, 96), (256, 256, 500), (224, 224, 512),
                                                          (64, 256, 300), (16, 256, 128)])  # fmt: skip
def test_slide_map_is_the_square_by_square_picture(step: int, patch: int, max_side: int) -> None:
    rng = np.random.default_rng(step + max_side)
    yy, xx = np.mgrid[0:23, 0:31]
    keep = rng.random(yy.shape) < 0.7  # holes, like tissue
    coords = np.stack([xx[keep], yy[keep]], axis=1).astype(np.int64) * step + 1000
    coords = coords[rng.permutation(len(coords))]  # overlapping squares: the order decides
    values = rng.random(len(coords))
    expected = _painted_square_by_square(coords, values, patch, max_side)
    assert np.array_equal(pictures.slide_map(coords, values, patch=patch, max_side=max_side), expected)


def test_slide_map_work_is_bounded_by_the_picture() -> None:
    """300,000 patches of 4096 px on a 16 px step (each pixel under ~65,000 squares): one picture
    within a fixed CPU budget (the process's CPU clock interrupts it), not n * side**2 pixel
    writes (minutes)."""
    import signal

    yy, xx = np.divmod(np.arange(300_000), 600)
    coords = np.stack([xx, yy], axis=1).astype(np.int64) * 16
    values = (coords[:, 0] % 997) / 997.0

    def over_budget(*_: object) -> None:
        raise TimeoutError("the slide map took more than 5 s of CPU for one picture")

    previous = signal.signal(signal.SIGPROF, over_budget)
    signal.setitimer(signal.ITIMER_PROF, 5.0)
    try:
        image = pictures.slide_map(coords, values, patch=4096, max_side=512)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
    assert image.shape == (453, 512, 3)  # 13680 x 12080 level-0 px at 512 / 13680
    assert (image != 245).any(axis=2).mean() > 0.99  # the bag covers its bounding box
    x, y = (coords[-1] * 512 / 13680).astype(np.int64) + 1
    assert np.array_equal(image[y, x], pictures.VIRIDIS[round(values[-1] * 255)])  # the last patch on top


def test_plots_bin_many_channels_and_escape_titles() -> None:
    svg = plots.channel_plot(np.arange(3072.0), "<b>mean</b>")
    assert 'data-channels="3072"' in svg and "<b>" not in svg and len(svg) < 40_000
    points = re.search(r'polyline class="line" points="([^"]+)"', svg)
    assert points is not None and len(points.group(1).split()) == plots.MAX_POINTS
    hist = plots.histogram([1, 2, 2, 3, 100], "lengths", "patches", bins=10)
    assert hist.count('class="bar"') == 2 and 'data-count="5"' in hist
    assert plots.histogram([4, 5, 6], "l", "p").count('class="bar"') == 3
    assert "no finite" in plots.channel_plot([float("nan")], "x")


def test_picture_cache_is_bounded() -> None:
    cache = PictureCache(100)
    for i in range(10):
        cache.put((i,), bytes(30))
    assert cache.nbytes <= 100 and cache.get((9,)) is not None and cache.get((0,)) is None
    cache.put(("big",), bytes(101))
    assert cache.get(("big",)) is None


def test_static_files_ship_in_the_wheel() -> None:
    """Every file the page serves is matched by pyproject's package-data (else an installed
    server answers 500 for its own stylesheet)."""
    import fnmatch
    from pathlib import Path

    from server.web.routes import STATIC_TYPES

    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["server.web"]
    for name in STATIC_TYPES:
        assert (root / "server" / "web" / "static" / name).is_file()
        assert any(fnmatch.fnmatch(f"static/{name}", p) for p in patterns), name


def test_serve_runs_blas_on_one_thread(tmp_path: object) -> None:
    """``featurestore serve`` (a process of its own) limits numpy's BLAS; create_app does not."""
    import subprocess

    pytest.importorskip("threadpoolctl")
    code = ("import numpy, threadpoolctl\n"
            "from server.app import create_app, app_from_env\n"
            "threads = lambda: [c.num_threads for c in threadpoolctl.ThreadpoolController().select(user_api='blas').lib_controllers]\n"
            "before = threads(); create_app(); middle = threads(); app_from_env(); print(before, middle, threads())")
    path = make_web_store(str(tmp_path) + "/store")  # type: ignore[operator]
    env = {**os.environ, "FEATURESTORE_STORE": path, "OPENBLAS_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[2]", "[2]", "[1]"]
