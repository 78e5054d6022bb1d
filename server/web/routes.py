"""The web page's routes: ``/`` (and ``/ui``) the catalog, ``/ui/splits/{dataset}/{encoder}/{split}``
one split, ``/ui/pca/.../{index}.png`` and ``/ui/slidemap/.../{bag}.png`` (a position or a bag id) pictures,
``/ui/static/...`` the stylesheet and icon, ``/ui/login`` and ``/ui/logout`` (see ``session``).

Plain ``def`` handlers (FastAPI runs them in its thread pool: store reads and pictures do not
block the event loop). A domain error on a page is answered as an HTML page with the status code
``server/errors.py`` gives it; on a picture, as the usual JSON error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from importlib import resources
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode

import numpy as np
from fastapi import APIRouter, FastAPI, Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from featurestore.errors import FeatureStoreError
from featurestore.format import wire
from featurestore.format.names import NAME_PATTERN, validate_name
from server import routes_bags  # noqa: F401 - registers the bag_id path convertor the slide map route uses
from server.errors import NotFound, relative_to_store, status_for
from server.state import StoreState
from server.web import session, views
from server.web.catalog import BAGS, Catalog, SplitRow
from server.web.figures import Figures
from server.web.markup import Html, h, join
from server.web.png import MEDIA_TYPE
from server.web.security import PAGE_HEADERS

router = APIRouter(include_in_schema=False)
Name = Annotated[str, Path(description=f"matches {NAME_PATTERN}")]
STATIC_TYPES = {"style.css": "text/css; charset=utf-8", "favicon.svg": "image/svg+xml"}
MAX_COMPARED = 3  # other encoders shown beside a split's picture
BAGS_PER_PAGE = 100
PICTURE_HEADERS = {"Cache-Control": "private, max-age=60", "X-Content-Type-Options": "nosniff"}
# ASCII digits (int() takes any script's), within int()'s 4300-digit limit: a long number is a
# position out of range (416), never an id lookup.
_POSITION = re.compile(r"-?[0-9]{1,4300}")


@dataclass
class Web:
    state: StoreState
    catalog: Catalog
    figures: Figures
    static: dict[str, bytes]


def install(app: FastAPI, state: StoreState) -> None:
    """Add the page to ``app`` (called by ``create_app`` unless ``FEATURESTORE_UI=false``)."""
    app.state.web = Web(state, Catalog(state.store), Figures(state), {})
    app.include_router(router)
    if state.settings.token_value() is not None:
        session.redact_access_log()


def web_of(request: Request) -> Web:
    web: Web = request.app.state.web
    return web


def _html(body: Html, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=PAGE_HEADERS)


def _error_page(web: Web, error: FeatureStoreError) -> HTMLResponse:
    return _html(views.error_page(status_for(error), _clean(web, str(error))), status_for(error))


def _clean(web: Web, message: str) -> str:
    """A message fit for a page: no credentials, and the store named by nothing but "the store"."""
    return relative_to_store(wire.redact(message), web.state.private_paths)


# ---------------------------------------------------------------------- catalog
@router.get("/", response_class=HTMLResponse)
@router.get("/ui", response_class=HTMLResponse)
@router.get("/ui/", response_class=HTMLResponse)
def catalog(request: Request) -> HTMLResponse:
    web = web_of(request)
    try:
        rows = [_cleaned(web, row) for row in web.catalog.rows()]
    except FeatureStoreError as error:
        return _error_page(web, error)
    return _html(views.catalog_page(rows, "Feature store"))


def _cleaned(web: Web, row: SplitRow) -> SplitRow:
    return row if row.error is None else replace(row, error=_clean(web, row.error))


# ---------------------------------------------------------------------- one split
@router.get("/ui/splits/{dataset}/{encoder}/{split}", response_class=HTMLResponse)
def split_page(request: Request, dataset: Name, encoder: Name, split: Name, sample: str = "0", bag: str = "0",
               start: str = "0") -> HTMLResponse:  # fmt: skip
    # The numbers come from the page's own form: text a person typed (empty, "abc", "-1") is
    # answered on the page (out of range), not with the API's JSON 400.
    web = web_of(request)
    try:
        key = (validate_name(dataset, "dataset"), validate_name(encoder, "encoder"), validate_name(split, "split"))
        row = _cleaned(web, web.catalog.row(*key))
        if row.kind == BAGS:
            extra = _bags(web, row, _number(bag), max(_number(start), 0), bag)
            json_href = _bags_json_href(request, key)
        else:  # [N, D] (embeddings, pooled features): no tokens to picture, the channel plots show them
            tokens = row.shape is None or len(row.shape) != 2
            shown = _dense_pictures(web, row, _number(sample), sample)
            extra = Html(f"<section><h2>Pictures</h2>{shown}</section>" if tokens else "")
            # The data route serves complete splits only: a split being written shows its document
            json_href = (wire.SPLIT.format(dataset=dataset, encoder=encoder, split=split) if row.status == "complete"
                         else _zarr_document(key))
        stats = None if row.error else web.catalog.channel_stats(*key)
    except FeatureStoreError as error:
        return _error_page(web, error)
    return _html(views.split_page(row, extra, json_href, stats))


def _number(text: str) -> int:
    """A position typed into the page: empty is 0, anything but a whole number -1 (out of range)."""
    text = text.strip()
    if not text:
        return 0
    return int(text) if _POSITION.fullmatch(text) else -1


def _bags_json_href(request: Request, key: tuple[str, str, str]) -> str:
    """The bag listing route where the server has it (SPEC: ``GET /v1/bags/...``), else the
    split's own document through the raw Zarr routes."""
    if any(getattr(r, "path", "").startswith("/v1/bags/") for r in request.app.routes):
        return "/v1/bags/" + "/".join(key)
    return _zarr_document(key)


def _zarr_document(key: tuple[str, str, str]) -> str:
    """The split's own ``zarr.json`` through the raw Zarr routes."""
    return "/zarr/" + "/".join(key) + "/zarr.json"


def _picture(web: Web, row: SplitRow, sample: int, asked: str | None = None) -> views.Picture:
    if row.error:
        return views.Picture(row, None, "this split cannot be read")
    if row.status != "complete":
        return views.Picture(row, None, f"status {row.status}: pictures need a complete split")
    if row.kind != "dense" or web.figures.grid_of(row.metadata, row.shape[1:]) is None:
        return views.Picture(row, None, f"samples of shape {list(row.shape[1:])} are not a patch grid "
                             f"(token_layout {row.metadata.get('token_layout')!r})")  # fmt: skip
    if not 0 <= sample < row.shape[0]:
        shown = str(sample) if asked is None or _POSITION.fullmatch(asked.strip()) else repr(asked.strip())
        return views.Picture(row, None, f"sample {shown} is out of range (0..{row.shape[0] - 1})")
    return views.Picture(row, "/ui/pca/" + "/".join(row.key) + f"/{sample}.png")


def _dense_pictures(web: Web, row: SplitRow, sample: int, asked: str | None = None) -> Html:
    shown = [_picture(web, row, sample, asked)]
    store = web.state.store
    for other in store.encoders(row.dataset):
        if len(shown) > MAX_COMPARED:
            break
        if other != row.encoder and row.split in store.splits(row.dataset, other):
            twin = _cleaned(web, web.catalog.row(row.dataset, other, row.split))
            if twin.kind == "dense":
                shown.append(_picture(web, twin, sample, asked))
    return views.pictures(row, min(max(sample, 0), max(row.shape[0] - 1, 0)) if row.shape else 0, shown)


def _workers(web: Web, row: SplitRow) -> Html:
    """A split being written by ``--worker`` processes: slides done, claimed, failed, left."""
    from featurestore.core.claim_status import done_text, progress, run_total
    from featurestore.format import layout

    state = progress(web.state.store.storage, layout.split_key(*row.key), run_total(row.metadata))
    if not (state["done"] or state["claimed"] or state["failed"]):
        return Html("")
    eta = "" if state["eta_seconds"] is None else f"; about {state['eta_seconds']:.0f} s to finish"
    claimed = join(h("<li>{} by {} pid {}, lease age {} s{}</li>", c["id"], c["host"], c["pid"], c["lease_age"],
                     " (expired)" if c["expired"] else "") for c in state["claimed"])
    return h('<section><h2>Workers</h2><p id="worker-progress">slides done {}, claimed {}, failed {}, left {}{}</p>'
             "<ul>{}</ul></section>", done_text(state), len(state["claimed"]), len(state["failed"]),
             "?" if state["left"] is None else state["left"], eta, claimed)


def _bags(web: Web, row: SplitRow, chosen: int, start: int, asked: str = "") -> Html:
    if row.status != "complete":  # its bags are not laid out until commit
        return h('<section><h2>Bags</h2><p class="muted">status {}: the bags are listed once the '
                 "split is committed</p></section>{}", row.status, _workers(web, row))
    bags = web.figures.open_bags(*row.key)
    ids = [str(i) for i in bags.ids]
    lengths = np.asarray(bags.lengths, np.int64)
    labels = None if bags.labels is None else [v.item() for v in bags.labels]
    start = min(start, max(len(ids) - 1, 0))
    src, note = None, ""
    if 0 <= chosen < len(ids):
        if lengths[chosen]:
            src = "/ui/slidemap/" + "/".join(row.key) + f"/{chosen}.png"
            rows = web.figures.bag_rows(bags, chosen)
            if rows is not None:
                note = (f"{len(rows)} of {lengths[chosen]} patches shown, evenly spaced "
                        "(FEATURESTORE_UI_MAX_SAMPLE_BYTES caps what one picture reads)")
        else:
            note = "this bag is empty (no patches)"
    elif ids:
        shown = str(chosen) if _POSITION.fullmatch(asked.strip()) else repr(asked.strip())  # as for a sample
        note = f"bag {shown} is out of range (0..{len(ids) - 1})"
    beside = views.attention_figures(_attention(web, row, bags, chosen)) if src is not None else Html("")
    return views.bag_section(row, ids, lengths, labels, chosen, src, start, BAGS_PER_PAGE,
                             note=note, coords=views.coords_text(bags.coords_unit, bags.patch_size_level0,
                                                                 _own_patch_size(bags, chosen, len(ids))),
                             beside=beside)


def _own_patch_size(bags: Any, chosen: int, count: int) -> int | None:
    """The shown bag's own patch size where the split records none (slide extraction: per slide)."""
    if bags.patch_size_level0 is not None or not 0 <= chosen < count:
        return None
    return bags.patch_size_of(chosen)  # type: ignore[no-any-return]


def _attention(web: Web, row: SplitRow, bags: Any, chosen: int) -> list[views.AttentionFigure]:
    """The saved attention maps of bag ``chosen``: a picture for each current map that evaluated
    it, a line saying why not for the others (a stale map is never drawn)."""
    shown = []
    for name, amap, problem in web.figures.attention_maps(bags):
        if amap is None:
            shown.append(views.AttentionFigure(name, None, None, None, _clean(web, problem or "")))
            continue
        if amap.stale is not None:
            shown.append(views.AttentionFigure(name, None, amap.lineage, None, f"stale, not shown: {amap.stale}; "
                                               f"run the probe again with --save-attention {name}"))
            continue
        try:
            fold = int(amap.fold[chosen])
        except FeatureStoreError as error:  # a damaged map: said on the page, the rest still shows
            shown.append(views.AttentionFigure(name, None, amap.lineage, None, _clean(web, str(error))))
            continue
        if fold < 0:
            shown.append(views.AttentionFigure(name, None, amap.lineage, None,
                                               "this bag was not evaluated by that probe run"))
        else:
            src = "/ui/slidemap/" + "/".join(row.key) + f"/{chosen}.png?{urlencode({'attention': name})}"
            shown.append(views.AttentionFigure(name, src, amap.lineage, fold, ""))
    return shown


# ---------------------------------------------------------------------- pictures
@router.get("/ui/pca/{dataset}/{encoder}/{split}/{index}.png")
def pca_png(request: Request, dataset: Name, encoder: Name, split: Name, index: int) -> Response:
    body = web_of(request).figures.pca_png(dataset, encoder, split, index)
    return Response(body, media_type=MEDIA_TYPE, headers=PICTURE_HEADERS)


@router.get("/ui/slidemap/{dataset}/{encoder}/{split}/{bag:bag_id}.png")  # an id may hold "/", as on /v1/bags
def slide_png(request: Request, dataset: Name, encoder: Name, split: Name,
              bag: Annotated[str, Path(description="the bag's position in the split, or its id")],
              attention: Annotated[str | None, Query(description="an attention map's name")] = None) -> Response:
    for name, what in ((dataset, "dataset"), (encoder, "encoder"), (split, "split"), (attention, "attention map")):
        if name is not None:
            validate_name(name, what)
    figures = web_of(request).figures
    # An integer is a position (the page's own links), anything else an id, only ever looked up
    # in the split's id index (BagNotFound: 404); an id of digits only is reached by its position.
    index = int(bag) if _POSITION.fullmatch(bag) else figures.open_bags(dataset, encoder, split).index(bag)
    body = figures.slide_png(dataset, encoder, split, index, attention=attention)
    return Response(body, media_type=MEDIA_TYPE, headers=PICTURE_HEADERS)


# ---------------------------------------------------------------------- static, sign-in
@router.get(session.FAVICON)
def favicon(request: Request) -> Response:
    return static(request, "favicon.svg")


@router.get("/ui/static/{name}")
def static(request: Request, name: str) -> Response:
    media = STATIC_TYPES.get(name)
    if media is None:  # a fixed list: no path from the request ever reaches the file system
        raise NotFound(f"no static file {name[:100]!r}")
    files = web_of(request).static
    if name not in files:
        files[name] = (resources.files("server.web") / "static" / name).read_bytes()
    return Response(files[name], media_type=media,
                    headers={"Cache-Control": "public, max-age=3600", "X-Content-Type-Options": "nosniff"})


@router.get(session.LOGIN, response_class=HTMLResponse)
def login_form(next: str = "/") -> HTMLResponse:  # noqa: A002 - the form field's name
    return _html(views.login_page(session.safe_next(next)))


@router.post(session.LOGIN, response_class=HTMLResponse)
async def login(request: Request) -> Response:
    """The sign-in form's POST (``application/x-www-form-urlencoded``: ``token``, ``next``)."""
    fields = dict(parse_qsl((await request.body()).decode("utf-8", "replace"), keep_blank_values=True))
    target = session.safe_next(fields.get("next"))
    expected = web_of(request).state.settings.token_value()
    if expected is None:
        return RedirectResponse(target, status_code=303, headers=PAGE_HEADERS)
    if not session.matches(fields.get("token"), expected.encode("utf-8")):
        return _html(views.login_page(target, "wrong token"), 401)
    response = RedirectResponse(target, status_code=303, headers=PAGE_HEADERS)
    response.headers.append("Set-Cookie", session.set_cookie(session.session_value(expected),
                                                             secure=request.url.scheme == "https"))  # fmt: skip
    return response


@router.post(session.LOGOUT)
def logout() -> Response:
    response = RedirectResponse(session.LOGIN, status_code=303, headers=PAGE_HEADERS)
    response.headers.append("Set-Cookie", session.clear_cookie())
    return response


