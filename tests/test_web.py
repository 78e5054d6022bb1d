"""The web page in-process (``TestClient(create_app(...))``): catalog, split pages, PCA pictures,
escaping, status codes, sign-in by cookie, bounded work. The real browser test is
tests/browser/test_browser.py (opt-in)."""

from __future__ import annotations

import html
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
from server.web.markup import h  # noqa: E402
from server.web.png import decode_png  # noqa: E402
from server.web.session import COOKIE, RedactAccessLog, safe_next, session_value  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import served_store  # noqa: E402
from _web_fixtures import BAG_IDS, XSS, make_web_store, slide  # noqa: E402

HAS_BAGS = int(hasattr(__import__("featurestore").FeatureStore, "open_bags"))
needs_bags = pytest.mark.skipif(not HAS_BAGS, reason="bag splits (branch bags) are not in this tree")
SLIDES = "/ui/splits/demo/vit-s/slides"

TOKEN = "s3cret-Token_for-tests"
TRAIN = "/ui/splits/demo/vit-s/train"


store_path, client = served_store(make_web_store, "web")


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
    val = client.get("/ui/splits/demo/vit-s/val").text  # [N, D]: no pictures, its channel plots
    assert "<h2>Pictures</h2>" not in val and "/ui/pca/" not in val and '<svg class="plot mean"' in val
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
    ("/ui/splits/demo/vit-s/bad%20name", 400),
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


def test_a_slide_extractions_per_slide_patch_size_is_shown_and_drawn(tmp_path: object) -> None:
    """Slide extraction records each slide's level-0 patch size on its bag, none on the split: the
    page names the shown slide's, and its map draws squares of it (without a size, squares as
    large as the coordinates' spacing: here twice the side)."""
    import featurestore

    path = str(tmp_path) + "/store"  # type: ignore[operator]
    coords = np.array([[0, 0], [1024, 0], [0, 1024], [2048, 2048]], np.int64)  # 1024 apart
    for split, attrs in (("sized", [{"patch_size_level0": 512}, {"patch_size_level0": 256}]), ("bare", [{}, {}])):
        w = featurestore.open_store(path, mode="a").create_bag_split("tcga", "uni", split, dim=8)
        for k, bag_id in enumerate(("s40x", "s20x")):
            w.add_bag(bag_id, np.random.default_rng(k).standard_normal((4, 8)).astype(np.float32), coords=coords,
                      attrs=attrs[k])
        w.commit()
    with TestClient(create_app(path, Settings())) as client:
        page = client.get("/ui/splits/tcga/uni/sized?bag=0").text  # ids sorted: s20x, s40x
        assert "patch size at level 0 256 for this slide (per slide)" in page
        assert "patch size at level 0 512 for this slide" in client.get("/ui/splits/tcga/uni/sized?bag=1").text
        assert "patch size at level 0" not in client.get("/ui/splits/tcga/uni/bare?bag=1").text
        sized, bare = (decode_png(client.get(f"/ui/slidemap/tcga/uni/{split}/1.png").content) for split in
                       ("sized", "bare"))
    painted = [int((image != 245).any(axis=2).sum()) for image in (sized, bare)]
    assert 2 * painted[0] < painted[1], painted


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
def test_slide_map_by_bag_id_as_server_md_documents(client: TestClient) -> None:
    bag = sorted(BAG_IDS).index("TCGA-A1-0002")
    by_position = client.get(f"/ui/slidemap/demo/vit-s/slides/{bag}.png")
    by_id = client.get("/ui/slidemap/demo/vit-s/slides/TCGA-A1-0002.png")
    assert by_id.status_code == 200 and by_id.headers["content-type"] == "image/png"
    assert by_id.content == by_position.content
    missing = client.get("/ui/slidemap/demo/vit-s/slides/TCGA-none.png")
    assert missing.status_code == 404 and "no bag 'TCGA-none' in demo/vit-s/slides" in missing.text
    past = client.get("/ui/slidemap/demo/vit-s/slides/99999999999999999999999999.png")
    assert past.status_code == 416 and "or a bag id" in past.text
    longer = client.get(f"/ui/slidemap/demo/vit-s/slides/{'9' * 40}.png")  # a position still, not an id
    assert longer.status_code == 416 and "or a bag id" in longer.text
    assert client.get("/ui/slidemap/demo/vit-s/slides/-1.png").status_code == 416


@needs_bags
@pytest.mark.parametrize(("path", "status", "says"), [
    ("/ui/slidemap/demo/vit-s/slides/5.png", 416, ""),
    # The other kind of split: 404 WrongSplitKind as on the data routes (it was a 400), with the
    # page's own way forward rather than the library's store.open_bags(...).
    ("/ui/slidemap/demo/vit-s/train/0.png", 404, "its pictures are of samples: /ui/pca/demo/vit-s/train/INDEX.png"),
    ("/ui/pca/demo/vit-s/slides/0.png", 404, "its pictures are slide maps: /ui/slidemap/demo/vit-s/slides/BAG.png"),
    ("/ui/slidemap/demo/vit-s/nope/0.png", 404, ""),
])  # fmt: skip
def test_bag_picture_errors(client: TestClient, path: str, status: int, says: str) -> None:
    answer = client.get(path)
    assert answer.status_code == status, answer.text
    assert says in answer.text and "open_bags" not in answer.text, answer.text


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


def test_access_log_drops_healthy_health_checks_only() -> None:
    """docker compose's health check every 10 s buried the requests in the logs."""
    def line(path: str, status: int) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:1", "GET", path, "1.1", status), None)  # fmt: skip

    assert not RedactAccessLog().filter(line("/healthz", 200))
    assert RedactAccessLog().filter(line("/healthz", 503)) and RedactAccessLog().filter(line("/v1/datasets", 200))


# ---------------------------------------------------------------------- what a person types
@pytest.mark.parametrize(("query", "says"), [
    ("?sample=", None), ("?sample=abc", "sample 'abc' is out of range (0..11)"),
    ("?sample=-1", "sample -1 is out of range (0..11)"), ("?sample=12", "sample 12 is out of range (0..11)"),
])  # fmt: skip
def test_a_typed_sample_number_is_answered_on_the_page(client: TestClient, query: str, says: str | None) -> None:
    """The page's own form sent an emptied or mistyped box as ?sample=..., answered with the
    API's JSON 400 ("Input should be a valid integer")."""
    answer = client.get(TRAIN + query)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html"), answer.text
    shown = html.unescape(answer.text)
    assert ("out of range" not in shown) if says is None else (says in shown), answer.text


@needs_bags
@pytest.mark.parametrize(("query", "says"), [
    ("?bag=5", "bag 5 is out of range (0..4)"), ("?bag=x", "bag 'x' is out of range (0..4)"),
    ("?bag=-1", "bag -1 is out of range (0..4)"), ("?bag=" + "9" * 31, f"bag {'9' * 31} is out of range (0..4)"),
    ("?bag=1&start=-3", "slide map of bag 1"),
])  # fmt: skip
def test_a_typed_bag_number_is_answered_on_the_page(client: TestClient, query: str, says: str) -> None:
    answer = client.get(SLIDES + query)
    assert answer.status_code == 200 and says in html.unescape(answer.text), answer.text


def test_a_dense_split_being_written_links_its_document(client: TestClient) -> None:
    """Its "metadata as JSON" link went to the data route, which answers 409 for a split not complete."""
    page = client.get("/ui/splits/demo/vit-s/writing").text
    assert 'href="/zarr/demo/vit-s/writing/zarr.json"' in page, page
    assert client.get("/zarr/demo/vit-s/writing/zarr.json").json()["attributes"]["featurestore"]["status"] == "writing"


@needs_bags
def test_slide_map_of_a_bag_id_with_a_slash(tmp_path: object) -> None:
    """The data routes serve a percent-encoded "a/b"; the slide map route did not match it (404)."""
    import featurestore
    from featurestore.format.wire import quote_bag_id

    root = str(tmp_path)
    writer = featurestore.open_store(root, mode="a").create_bag_split("d", "e", "s", dim=4)
    for i, bag in enumerate(["a/b", "c"]):
        writer.add_bag(bag, np.ones((3, 4), np.float32) * i, coords=np.arange(6).reshape(3, 2) * 256)
    writer.commit()
    with TestClient(create_app(root, Settings())) as local:
        by_id = local.get(f"/ui/slidemap/d/e/s/{quote_bag_id('a/b')}.png")
        assert by_id.status_code == 200, by_id.text
        assert by_id.content == local.get("/ui/slidemap/d/e/s/0.png").content
