"""The web page in a real headless Chromium, against a real ``featurestore serve`` on loopback
(opt-in: ``FEATURESTORE_BROWSER_TESTS=1``; ``bash tests/browser/run.sh`` installs the browser and
runs it). Signs in with the form, follows the links to a split and to a picture, opens a bag's
slide map, checks every page's console for errors and that every image decoded, and saves a
screenshot of each page to ``FEATURESTORE_BROWSER_SHOTS`` (default: the test's tmp dir).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("FEATURESTORE_BROWSER_TESTS", "0") in ("", "0"):
    pytest.skip("browser test is opt-in: FEATURESTORE_BROWSER_TESTS=1 (bash tests/browser/run.sh)",
                allow_module_level=True)  # fmt: skip

pytest.importorskip("websockets.sync.client")
pytest.importorskip("uvicorn")

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from cdp import Browser, find_chromium  # noqa: E402
from _web_fixtures import XSS, make_web_store  # noqa: E402

from featurestore.testing.serving import serve_subprocess  # noqa: E402

TOKEN = "browser-test-token-0123456789"


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("FEATURESTORE_BROWSER_SHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = make_web_store(str(tmp_path_factory.mktemp("browser") / "store"))
    with serve_subprocess(store, env={"FEATURESTORE_TOKEN": TOKEN}) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = find_chromium()
    if executable is None:
        pytest.fail("no chromium on PATH: run 'sudo bash tests/browser/install.sh' (FEATURESTORE_BROWSER_TESTS=1)")
    page = Browser(executable)
    try:
        yield page
    finally:
        page.close()


def _images(browser: Browser) -> list[list[object]]:
    return browser.evaluate("Array.from(document.images).map(i => [i.getAttribute('src'), i.naturalWidth, i.naturalHeight])")


def test_sign_in_catalog_split_and_picture(server: str, browser: Browser, shots: Path) -> None:
    # 1. no cookie yet: the page answers 401 with the sign-in form (the 401 itself is the only error)
    browser.navigate(server + "/")
    assert browser.evaluate("document.title").startswith("sign in")
    assert all("401" in e for e in browser.console_errors()), browser.console_errors()
    browser.screenshot(str(shots / "01-sign-in.png"), full_page=False)
    browser.evaluate(f"document.querySelector('input[name=token]').value = {TOKEN!r}")
    browser.click("form.login button[type=submit]")
    assert browser.url() == server + "/"
    assert browser.evaluate("document.querySelector('h1').textContent") == "Feature store"
    assert browser.evaluate("document.cookie") == ""  # HttpOnly: no script can read it
    assert browser.console_errors() == []
    browser.screenshot(str(shots / "02-catalog.png"))

    # 2. follow the link to a split: plots inline, both encoders' pictures decoded
    browser.click('a[href="/ui/splits/demo/vit-s/train"]')
    assert browser.url() == server + "/ui/splits/demo/vit-s/train"
    assert browser.evaluate("document.querySelectorAll('svg.plot').length") == 2
    images = _images(browser)
    assert [src for src, _, _ in images] == ["/ui/pca/demo/vit-s/train/0.png", "/ui/pca/demo/vit-s-bf16/train/0.png"]
    assert all(w == 384 and h == 384 for _, w, h in images), images
    assert browser.console_errors() == []
    browser.screenshot(str(shots / "03-split.png"))

    # 3. another sample through the form, then the picture itself
    browser.evaluate("document.querySelector('input[name=sample]').value = 7")
    browser.click("form.pick button[type=submit]")
    assert browser.url().endswith("/ui/splits/demo/vit-s/train?sample=7")
    assert _images(browser)[0][0] == "/ui/pca/demo/vit-s/train/7.png"
    browser.click("figure a")
    assert browser.url() == server + "/ui/pca/demo/vit-s/train/7.png"
    assert browser.evaluate("document.contentType") == "image/png"
    assert browser.evaluate("document.images[0].naturalWidth") == 384
    assert browser.console_errors() == []
    browser.screenshot(str(shots / "04-picture.png"), full_page=False)


def test_bag_split_page(server: str, browser: Browser, shots: Path) -> None:
    browser.navigate(server + "/")
    if not browser.evaluate("!!document.querySelector('a[href=\"/ui/splits/demo/vit-s/slides\"]')"):
        pytest.skip("no bag split in this tree (branch bags not merged)")
    browser.click('a[href="/ui/splits/demo/vit-s/slides"]')
    assert browser.evaluate("document.querySelectorAll('svg.plot.hist').length") == 1
    browser.click('table.bags a[href$="bag=2&start=0"]')
    images = _images(browser)
    assert images == [["/ui/slidemap/demo/vit-s/slides/2.png", 512, images[0][2]]] and images[0][2] > 100
    assert browser.console_errors() == []
    browser.screenshot(str(shots / "05-bags.png"))


def test_markup_in_metadata_stays_text(server: str, browser: Browser, shots: Path) -> None:
    browser.navigate(server + "/ui/splits/markup/enc/split")
    assert browser.evaluate("document.scripts.length") == 0
    assert XSS in browser.evaluate("document.body.innerText")
    assert not [e for e in browser.events if e.get("method") == "Page.javascriptDialogOpening"]
    assert browser.console_errors() == []
    browser.screenshot(str(shots / "06-markup.png"))


def test_token_in_the_address_once(server: str, browser: Browser) -> None:
    browser.send("Network.clearBrowserCookies")
    browser.navigate(server + "/ui/splits/demo/vit-s/val?token=" + TOKEN)
    assert browser.url() == server + "/ui/splits/demo/vit-s/val"  # redirected without it
    assert TOKEN not in browser.evaluate("document.documentElement.outerHTML")
    assert browser.console_errors() == []
    browser.send("Network.clearBrowserCookies")
    browser.navigate(server + "/ui/splits/demo/vit-s/val")
    assert browser.evaluate("document.title").startswith("sign in")
