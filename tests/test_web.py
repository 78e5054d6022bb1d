"""The web page in-process (``TestClient(create_app(...))``): catalog, dense split pages (precision,
channel plots, PCA pictures), escaping, content security policy, status codes, sign-in by cookie,
the access log, typed sample numbers. Bag splits' pages and slide maps: tests/test_web_bags.py;
the pictures themselves: tests/test_web_pictures.py. The real browser test is
tests/browser/test_browser.py (opt-in)."""

from __future__ import annotations

import html
import logging
import os
import re
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from server import Settings, create_app  # noqa: E402
from server.web.markup import h  # noqa: E402
from server.web.session import COOKIE, RedactAccessLog, safe_next, session_value  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import served_store  # noqa: E402
from _web_fixtures import XSS, make_web_store  # noqa: E402

HAS_BAGS = int(hasattr(__import__("featurestore").FeatureStore, "open_bags"))

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


def test_a_dense_split_being_written_links_its_document(client: TestClient) -> None:
    """Its "metadata as JSON" link went to the data route, which answers 409 for a split not complete."""
    page = client.get("/ui/splits/demo/vit-s/writing").text
    assert 'href="/zarr/demo/vit-s/writing/zarr.json"' in page, page
    assert client.get("/zarr/demo/vit-s/writing/zarr.json").json()["attributes"]["featurestore"]["status"] == "writing"
