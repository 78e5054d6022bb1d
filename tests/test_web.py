"""The web page in-process (``TestClient(create_app(...))``): catalog, split pages, PCA pictures,
escaping, status codes, sign-in by cookie, bounded work. The real browser test is
tests/browser/test_browser.py (opt-in)."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from server import Settings, create_app  # noqa: E402
from server.web import pictures, plots  # noqa: E402
from server.web.figures import PictureCache  # noqa: E402
from server.web.markup import h  # noqa: E402
from server.web.png import decode_png, encode_png  # noqa: E402
from server.web.session import COOKIE, RedactAccessLog, safe_next, session_value  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _web_fixtures import BAG_IDS, GRID, SAMPLES, XSS, make_web_store, regions, slide  # noqa: E402

HAS_BAGS = int(hasattr(__import__("featurestore").FeatureStore, "open_bags"))
needs_bags = pytest.mark.skipif(not HAS_BAGS, reason="bag splits (branch bags) are not in this tree")
SLIDES = "/ui/splits/demo/vit-s/slides"

TOKEN = "s3cret-Token_for-tests"
TRAIN = "/ui/splits/demo/vit-s/train"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_web_store(str(tmp_path_factory.mktemp("web") / "store"))


@pytest.fixture(scope="module")
def client(store_path: str) -> Iterator[TestClient]:
    with TestClient(create_app(store_path, Settings())) as test_client:
        yield test_client


@pytest.fixture()
def secured(store_path: str) -> Iterator[TestClient]:
    with TestClient(create_app(store_path, Settings(token=TOKEN))) as test_client:
        yield test_client


# ---------------------------------------------------------------------- catalog and split pages
def test_catalog_lists_every_split_with_its_facts(client: TestClient, store_path: str) -> None:
    import featurestore

    for path in ("/", "/ui", "/ui/"):
        page = client.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    assert f"2 datasets \u00b7 3 encoders \u00b7 {5 + HAS_BAGS} splits" in text
    meta = featurestore.open_store(store_path).split_info("demo", "vit-s", "train")
    for fact in ("[12, 257, 48]", "float16", "bfloat16", "292.0 KiB", meta.generation, "builtin:vit-s14",
                 "3f1a9c0e7d2b", ">writing<", ">complete<", "dense", "&quot;resize&quot;: 224"):  # fmt: skip
        assert fact in text, fact
    for link in (TRAIN, "/ui/splits/demo/vit-s-bf16/train", "/ui/splits/demo/vit-s/val", "/ui/splits/markup/enc/split"):
        assert f'href="{link}"' in text
        assert client.get(link).status_code == 200
    # the page never names where the store lives
    assert store_path not in text
    # rows are cached for every split: without the per-channel statistics (the bulk of a document)
    row = client.app.state.web.catalog.row("demo", "vit-s", "train")  # type: ignore[attr-defined]
    assert "channel_stats" not in row.metadata and row.metadata["generation"] == meta.generation


def test_split_page_shows_precision_channels_and_pictures(client: TestClient, store_path: str) -> None:
    import featurestore

    meta = featurestore.open_store(store_path).split_info("demo", "vit-s", "train")
    text = client.get(TRAIN).text
    q = meta.quantization or {}
    assert "float32</code> \u2192 <code>float16" in text
    assert format(q["max_rel_error"], ".3g") in text and format(q["rel_rms_error"], ".3g") in text
    assert meta.cache_key in text and meta.generation in text
    assert client.get("/v1/features/demo/vit-s/train").json()["generation"] == meta.generation  # its JSON link
    assert '<a href="/v1/features/demo/vit-s/train">metadata as JSON</a>' in text
    # per-channel mean and std as inline SVG, one point per channel (48 < plots.MAX_POINTS)
    svgs = re.findall(r'<svg class="plot (\w+)"[^>]*data-channels="(\d+)"', text)
    assert svgs == [("mean", "48"), ("std", "48")]
    line = re.search(r'<svg class="plot mean".*?<polyline class="line" points="([^"]+)"', text, re.S)
    assert line is not None and len(line.group(1).split()) == 48
    # this split's picture and the same split under the other encoder, side by side
    assert 'src="/ui/pca/demo/vit-s/train/0.png"' in text and 'src="/ui/pca/demo/vit-s-bf16/train/0.png"' in text
    assert 'src="/ui/pca/demo/vit-s/train/5.png"' in client.get(TRAIN + "?sample=5").text
    # no grid, not complete: said, no picture
    val = client.get("/ui/splits/demo/vit-s/val").text
    assert "not a patch grid" in val and "/ui/pca/" not in val
    writing = client.get("/ui/splits/demo/vit-s/writing").text
    assert "status writing: pictures need a complete split" in writing


def test_metadata_strings_show_as_text(client: TestClient) -> None:
    for path in ("/", "/ui/splits/markup/enc/split"):
        text = client.get(path).text
        assert "<script" not in text
        assert "&lt;script&gt;alert(&#x27;featurestore&#x27;)&lt;/script&gt;" in text
    assert h("<p>{}</p>", XSS) == "<p>&lt;script&gt;alert(&#x27;featurestore&#x27;)&lt;/script&gt;</p>"


def test_pages_send_a_strict_content_security_policy(client: TestClient) -> None:
    headers = client.get(TRAIN).headers
    assert "default-src 'none'" in headers["content-security-policy"]
    assert "script-src" not in headers["content-security-policy"]  # no script at all
    assert headers["referrer-policy"] == "no-referrer" and headers["x-content-type-options"] == "nosniff"
    css = client.get("/ui/static/style.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert client.get("/ui/static/favicon.svg").headers["content-type"] == "image/svg+xml"
    assert client.get("/favicon.ico").content == client.get("/ui/static/favicon.svg").content
    assert client.get("/ui/static/..%2Fviews.py").status_code == 404
    assert client.get("/ui/static/nope.js").status_code == 404


@pytest.mark.parametrize(("path", "status"), [
    ("/ui/splits/demo/vit-s/nope", 404), ("/ui/splits/nope/vit-s/train", 404), ("/ui/splits/demo/x/train", 404),
    ("/ui/splits/demo/vit-s/bad%20name", 400), ("/ui/splits/demo/vit-s/train?sample=-1", 400),
])  # fmt: skip
def test_page_errors_are_pages_with_status_codes(client: TestClient, path: str, status: int) -> None:
    answer = client.get(path)
    assert answer.status_code == status, answer.text
    if status == 404:
        assert answer.headers["content-type"].startswith("text/html") and "not found" in answer.text


def test_a_damaged_split_does_not_break_the_catalog(tmp_path: object) -> None:
    path = make_web_store(str(tmp_path) + "/store")  # type: ignore[operator]
    with open(os.path.join(path, "markup", "enc", "split", "zarr.json"), "w") as f:
        f.write('{"zarr_format": 3, "node_type": "group", "attributes": {"featurestore": {"num_samples": "<b>"}}}')
    with TestClient(create_app(path, Settings())) as client:
        page = client.get("/")
        assert page.status_code == 200 and "unreadable" in page.text and "[12, 257, 48]" in page.text
        assert path not in page.text


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


# ---------------------------------------------------------------------- bag splits
@needs_bags
def test_bag_split_in_catalog_and_its_page(client: TestClient) -> None:
    total = sum(len(slide(i)[0]) for i in range(len(BAG_IDS) - 1))
    catalog = client.get("/").text
    assert f'href="{SLIDES}">slides</a></td><td>bags</td><td class="num">5 bags, {total:,} patches, dim 48</td>' in catalog
    page = client.get(SLIDES)
    assert page.status_code == 200
    text = page.text
    assert "<script" not in text and "&lt;script&gt;alert(&#x27;featurestore&#x27;)&lt;/script&gt;" in text
    hist = re.search(r'<svg class="plot hist lengths"[^>]*data-count="(\d+)"', text)
    assert hist is not None and hist.group(1) == "5"
    for i, bag_id in enumerate(sorted(BAG_IDS)):  # stored in id order
        assert f'<a href="{SLIDES}?bag={i}&amp;start=0">' in text
    assert 'src="/ui/slidemap/demo/vit-s/slides/0.png"' in text
    json_link = re.search(r'<a href="([^"]+)">metadata as JSON</a>', text)
    assert json_link is not None and client.get(json_link.group(1)).status_code == 200
    assert "patch size at level 0 256" in text
    empty = sorted(BAG_IDS).index("empty-slide")
    assert "this bag is empty" in client.get(f"{SLIDES}?bag={empty}").text


@needs_bags
def test_sizes_say_which_they_are_and_match_the_files(client: TestClient, store_path: str) -> None:
    """Every view shows the same two figures, named: bytes of data and bytes on storage (the chunk
    files, counted on disk here), not one of them under the other's name."""
    import featurestore
    from featurestore.format.sizes import split_size

    catalog = client.get("/").text
    assert "<th>data</th><th>on storage</th>" in catalog
    for key in (("demo", "vit-s", "slides"), ("demo", "vit-s", "train")):
        size = split_size(featurestore.open_store(store_path).split_info(*key))
        root = os.path.join(store_path, *key)
        on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files
                      if f != "zarr.json" and not os.path.relpath(d, root).startswith(("bag_ids", "bag_attrs")))
        assert size.stored == on_disk
        page = client.get("/ui/splits/" + "/".join(key)).text
        assert f"<tr><th>data</th><td>{size.data_text()}</td></tr>" in page
        assert f"<tr><th>on storage</th><td>{size.stored_text()}</td></tr>" in page
        assert f'<td class="num">{size.data_text()}</td>' in catalog and size.stored_text(notes=False) in catalog
    slides = client.get(SLIDES).text
    assert "<tr><th>on storage</th><td>at least " in slides and "patches per chunk, stored whole" in slides


@needs_bags
def test_a_bag_split_without_optional_metadata_shows_no_none(tmp_path: object) -> None:
    """Imported features record no token layout, preprocessing or patch size: the page leaves those
    rows out (or says "not recorded"), never "None" or "null"."""
    import featurestore

    path = str(tmp_path) + "/store"  # type: ignore[operator]
    w = featurestore.open_store(path, mode="a").create_bag_split("tcga", "uni", "train", dim=8, label_dtype="int64")
    w.add_bag("TCGA-01", np.ones((3, 8), np.float32), coords=np.zeros((3, 2), np.int64), label=1)
    w.commit()
    with TestClient(create_app(path, Settings())) as client:
        text = client.get("/ui/splits/tcga/uni/train").text
        overview = text[text.index("<h2>Overview</h2>"):text.index("metadata as JSON")]
        assert "None" not in text and "null" not in overview, overview
        assert "token layout" not in overview and "preprocessing" not in overview
        assert "<tr><th>shape</th><td>1 bag, 3 patches, dim 8</td></tr>" in overview
        assert "coordinates: px" in text and "patch size at level 0" not in text
        assert "not recorded" in overview  # the cache key, encoder spec, weights hash


@needs_bags
def test_slide_map_draws_every_patch(client: TestClient) -> None:
    bag = sorted(BAG_IDS).index("TCGA-A1-0002")
    features, coords = slide(1)
    answer = client.get(f"/ui/slidemap/demo/vit-s/slides/{bag}.png")
    assert answer.status_code == 200 and answer.headers["content-type"] == "image/png"
    image = decode_png(answer.content)
    assert max(image.shape[:2]) == 512
    painted = (image != 245).any(axis=2)
    extent = coords.max(axis=0) - coords.min(axis=0) + 256
    cell = 512 / extent.max() * 256  # pixels per patch side
    assert abs(painted.sum() / (len(coords) * cell * cell) - 1) < 0.15
    # the features change from core to rim: the first component separates them
    colours = {tuple(c) for c in image[painted].reshape(-1, 3)}
    assert len(colours) > 20


@needs_bags
@pytest.mark.parametrize(("path", "status"), [
    ("/ui/slidemap/demo/vit-s/slides/5.png", 416), ("/ui/slidemap/demo/vit-s/train/0.png", 400),
    ("/ui/pca/demo/vit-s/slides/0.png", 400), ("/ui/slidemap/demo/vit-s/nope/0.png", 404),
])  # fmt: skip
def test_bag_picture_errors(client: TestClient, path: str, status: int) -> None:
    assert client.get(path).status_code == status


@needs_bags
def test_unfinished_bag_split_has_a_page(tmp_path: object) -> None:
    import featurestore

    path = make_web_store(str(tmp_path) + "/store")  # type: ignore[operator]
    w = featurestore.open_store(path, mode="a").create_bag_split("demo", "vit-s", "wip", dim=48)
    w.add_bag("a", np.zeros((3, 48), np.float32), coords=np.zeros((3, 2), np.int64))
    w.close()
    with TestClient(create_app(path, Settings())) as client:
        assert 'href="/ui/splits/demo/vit-s/wip"' in client.get("/").text
        page = client.get("/ui/splits/demo/vit-s/wip")
        assert page.status_code == 200 and "status writing: the bags are listed once the split is committed" in page.text
        assert client.get("/ui/slidemap/demo/vit-s/wip/0.png").status_code == 409


@needs_bags
def test_big_bags_are_drawn_from_a_bounded_sample(store_path: str) -> None:
    with TestClient(create_app(store_path, Settings(ui_max_sample_bytes=100 * (48 * 2 + 2 * 8)))) as client:
        bag = sorted(BAG_IDS).index("TCGA-A1-0002")
        text = client.get(f"{SLIDES}?bag={bag}").text
        assert f"100 of {len(slide(1)[0])} patches shown" in text
        assert client.get(f"/ui/slidemap/demo/vit-s/slides/{bag}.png").status_code == 200


@needs_bags
def test_slide_map_by_saved_attention_beside_pc1(tmp_path: object) -> None:
    import shutil

    import featurestore
    from _attention_fixtures import save_map

    path = make_web_store(str(tmp_path) + "/store")  # type: ignore[operator]
    # attention growing from left to right: the map's left patches purple, its right ones yellow
    save_map(path, "demo", "vit-s", "slides", "abmil-att", lambda i, coords: (coords[:, 0] + 256.0) ** 3)
    broken = os.path.join(path, "demo", "vit-s", "slides", "attention", "broken")
    os.makedirs(broken)
    with open(os.path.join(broken, "zarr.json"), "w") as f:  # a map whose lineage is damaged
        f.write('{"zarr_format": 3, "node_type": "group", "attributes": {"featurestore": {"kind": "attention"}}}')
    bag = sorted(BAG_IDS).index("TCGA-A1-0002")
    pc1 = f"/ui/slidemap/demo/vit-s/slides/{bag}.png"
    src = f"{pc1}?attention=abmil-att"
    with TestClient(create_app(path, Settings())) as client:
        text = client.get(f"{SLIDES}?bag={bag}").text
        assert f'src="{pc1}"' in text and f'src="{src}"' in text  # the PC1 map and the attention map beside it
        assert "attention <code>abmil-att</code>: ABMIL on <code>slides</code>, seed 0" in text
        assert "attention map demo/vit-s/slides/attention/broken has a damaged lineage" in text
        answer = client.get(src)
        assert answer.status_code == 200 and answer.content != client.get(pc1).content
        image = decode_png(answer.content)
        painted = (image != 245).any(axis=2)
        columns = np.flatnonzero(painted.any(axis=0))
        left, right = image[painted[:, columns[0]], columns[0]], image[painted[:, columns[-1]], columns[-1]]
        assert (left[:, 1] < 80).all() and (right[:, 1] > 180).all()  # viridis: green grows with the rank
        empty = sorted(BAG_IDS).index("empty-slide")
        assert client.get(f"/ui/slidemap/demo/vit-s/slides/{empty}.png?attention=abmil-att").status_code == 404
        assert client.get(f"{pc1}?attention=nope").status_code == 404
        assert client.get(f"{pc1}?attention=..%2Fx").status_code == 400
    # the split overwritten (a new generation) and the old map copied back: never shown as current
    key = os.path.join(path, "demo", "vit-s", "slides", "attention")
    kept = str(tmp_path) + "/kept"  # type: ignore[operator]
    shutil.rmtree(broken)
    shutil.copytree(key, kept)
    w = featurestore.open_store(path, mode="a").create_bag_split("demo", "vit-s", "slides", dim=48, overwrite=True,
                                                                 patch_size_level0=256, label_dtype="int64")
    for i, bag_id in enumerate(BAG_IDS[:-1]):
        w.add_bag(bag_id, *slide(i), label=i % 2)
    w.commit()
    shutil.copytree(kept, key)
    with TestClient(create_app(path, Settings())) as client:
        text = client.get(f"{SLIDES}?bag={bag}").text
        assert f'src="{pc1}"' in text and "attention=abmil-att" not in text
        assert "stale, not shown: saved for generation" in text and "--save-attention abmil-att" in text
        stale = client.get(src)
        assert stale.status_code == 409 and "stale" in stale.json()["detail"]


# ---------------------------------------------------------------------- sign-in
def test_pages_ask_for_the_token_and_never_echo_it(secured: TestClient) -> None:
    page = secured.get(TRAIN + "?sample=2")
    assert page.status_code == 401 and 'name="token"' in page.text and 'value="/ui/splits/demo/vit-s/train?sample=2"' in page.text
    assert secured.get("/ui/pca/demo/vit-s/train/0.png").status_code == 401
    assert secured.get(TRAIN + "?not_a_token=1").status_code == 401  # the form, not "wrong token"
    assert "wrong token" not in secured.get(TRAIN + "?not_a_token=1").text
    wrong = secured.get(TRAIN + "?token=guess", follow_redirects=False)
    assert wrong.status_code == 401 and "wrong token" in wrong.text and "guess" not in wrong.text
    right = secured.get(TRAIN + "?sample=2&token=" + TOKEN, follow_redirects=False)
    assert right.status_code == 303 and right.headers["location"] == TRAIN + "?sample=2"
    cookie = right.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    assert TOKEN not in right.text and all(TOKEN not in v for v in right.headers.values())
    value = session_value(TOKEN)
    assert f"{COOKIE}={value}" in cookie
    secured.cookies.set(COOKIE, value)
    try:
        assert secured.get(TRAIN).status_code == 200
        assert secured.get("/ui/pca/demo/vit-s/train/0.png").status_code == 200
        assert secured.get("/v1/datasets").status_code == 200  # the page's JSON links work too
        # ...but not for the POST data route, and the cookie is no bearer token
        assert secured.post("/v1/features/demo/vit-s/train/batch", json={"indices": [0]}).status_code == 401
        secured.cookies.clear()
        assert secured.get("/", headers={"Authorization": f"Bearer {value}"}).status_code == 401
        assert secured.get("/v1/datasets").status_code == 401
        assert secured.get("/v1/datasets").headers["content-type"] == "application/json"
        assert secured.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    finally:
        secured.cookies.clear()


def test_sign_in_form(secured: TestClient) -> None:
    assert secured.get("/ui/login").status_code == 200  # open, as are its stylesheet and icon
    assert secured.get("/ui/static/style.css").status_code == 200
    assert secured.get("/favicon.ico").status_code == 200
    wrong = secured.post("/ui/login", data={"token": "nope", "next": TRAIN})
    assert wrong.status_code == 401 and "wrong token" in wrong.text
    right = secured.post("/ui/login", data={"token": TOKEN, "next": TRAIN}, follow_redirects=False)
    assert right.status_code == 303 and right.headers["location"] == TRAIN
    assert session_value(TOKEN) in right.headers["set-cookie"]
    outside = secured.post("/ui/login", data={"token": TOKEN, "next": "//evil.example/x"}, follow_redirects=False)
    assert outside.headers["location"] == "/"
    out = secured.post("/ui/logout", follow_redirects=False)
    assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
    assert [safe_next(t) for t in ("/a?b=1", "https://x", "//x", "/\\x", None)] == ["/a?b=1", "/", "/", "/", "/"]


def test_access_log_masks_the_token() -> None:
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:1", "GET", f"/?token={TOKEN}&x=1", "1.1", 303), None)  # fmt: skip
    RedactAccessLog().filter(record)
    assert TOKEN not in record.getMessage() and "token=***" in record.getMessage()


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
