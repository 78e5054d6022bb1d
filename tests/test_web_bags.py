"""The web page of bag splits in-process (``TestClient(create_app(...))``): the catalog row and the
split page, sizes, optional metadata left out, per-slide patch sizes, slide maps (by position, by
bag id, by saved attention beside PC1, from a bounded sample), their errors, unfinished splits, and
typed bag numbers. Dense splits, sign-in and the rest of the page: tests/test_web.py."""

from __future__ import annotations

import html
import os
import re
import sys

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from server import Settings, create_app  # noqa: E402
from server.web.png import decode_png  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import served_store  # noqa: E402
from _web_fixtures import BAG_IDS, make_web_store, slide  # noqa: E402

HAS_BAGS = int(hasattr(__import__("featurestore").FeatureStore, "open_bags"))
needs_bags = pytest.mark.skipif(not HAS_BAGS, reason="bag splits (branch bags) are not in this tree")
SLIDES = "/ui/splits/demo/vit-s/slides"


store_path, client = served_store(make_web_store, "web")


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


@needs_bags
@pytest.mark.parametrize(("query", "says"), [
    ("?bag=5", "bag 5 is out of range (0..4)"), ("?bag=x", "bag 'x' is out of range (0..4)"),
    ("?bag=-1", "bag -1 is out of range (0..4)"), ("?bag=" + "9" * 31, f"bag {'9' * 31} is out of range (0..4)"),
    ("?bag=1&start=-3", "slide map of bag 1"),
])  # fmt: skip
def test_a_typed_bag_number_is_answered_on_the_page(client: TestClient, query: str, says: str) -> None:
    answer = client.get(SLIDES + query)
    assert answer.status_code == 200 and says in html.unescape(answer.text), answer.text


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
