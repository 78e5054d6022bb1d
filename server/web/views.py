"""The pages, as functions from what they show to :class:`~server.web.markup.Html`. No I/O here:
``server.web.routes`` reads the store and hands the results in."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import numpy as np

from featurestore.errors import InvalidMetadata
from featurestore.format import lineage
from server.web import plots
from server.web.catalog import BAGS, SplitRow
from server.web.markup import Html, compact_json, figure, h, join, page, size_text

NOT_RECORDED = "not recorded"
QUANTIZATION_ROWS = (
    ("values", "values measured", "d"),
    ("abs_max", "largest |value|", ".6g"),
    ("max_abs_error", "max abs error", ".3g"),
    ("max_rel_error", "max rel error (|x| \u2265 2\u207b\u00b9\u2074)", ".3g"),
    ("rms_error", "rms error", ".3g"),
    ("rel_rms_error", "rel rms error", ".3g"),
    ("overflow_count", "overflow (beyond \u00b165504)", "d"),
    ("nan_count", "NaN", "d"),
    ("inf_count", "Inf", "d"),
)
# an int8 split's codes are clipped at +-127 instead (0 unless a scale fell below float32's range)
SATURATION_ROW = ("saturation_count", "saturated (codes clipped at \u00b1127)")


def split_href(row: SplitRow | tuple[str, str, str]) -> str:
    key = row.key if isinstance(row, SplitRow) else row
    return "/ui/splits/" + "/".join(quote(part, safe="") for part in key)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]" if shape else ""


def _short(value: Any, keep: int = 12) -> Html:
    """A long hash cut to ``keep`` characters; the whole value in the tooltip."""
    if value in (None, ""):
        return h('<span class="muted">{}</span>', NOT_RECORDED)
    text = str(value)
    if len(text) <= keep:
        return h("<code>{}</code>", text)
    return h('<code title="{}">{}\u2026</code>', text, text[:keep])


def _status(status: str) -> Html:
    return h('<span class="badge {}">{}</span>', "ok" if status == "complete" else "warn", status)


def _catalog_shape(row: SplitRow) -> str:
    """A dense split's ``[N, ...]``; a bag split's counts, named (its rows are ragged)."""
    if row.kind == BAGS and len(row.shape) == 3:
        if row.status != "complete":  # bags and patches are counted by the commit
            return f"bags, dim {row.shape[2]}"
        bags, patches = row.shape[0], row.shape[1]
        return f"{bags:,} bag{'s' * (bags != 1)}, {patches:,} patch{'es' * (patches != 1)}, dim {row.shape[2]}"
    return _shape(row.shape)


def coords_text(unit: str | None, patch_size_level0: Any, bag_patch_size: Any = None) -> str:
    """How a bag split's coordinates read: their unit, and the patch size when it was recorded
    (the split's, else the shown bag's own: slide extraction records one per slide)."""
    patch = (f", patch size at level 0 {patch_size_level0}" if patch_size_level0 is not None
             else f", patch size at level 0 {bag_patch_size} for this slide (per slide)"
             if bag_patch_size is not None else "")
    return f"{unit or 'no unit'}{patch}"


def _stored(row: SplitRow) -> Html:
    """The storage figure; what it leaves out in the tooltip."""
    return h('<span title="{}">{}</span>', "; ".join(row.size.notes), row.size.stored_text(notes=False))


# ---------------------------------------------------------------------- catalog
def catalog_page(rows: Sequence[SplitRow], store_name: str) -> Html:
    if not rows:
        return page("store", h('<h1>{}</h1><p class="muted">This store holds no splits yet.</p>', store_name))
    data = sum(r.size.data or 0 for r in rows)
    stored = sum(r.size.stored or 0 for r in rows)
    datasets = sorted({r.dataset for r in rows})
    encoders = sorted({(r.dataset, r.encoder) for r in rows})
    parts = [h('<h1>{}</h1><p class="summary">{} datasets \u00b7 {} encoders \u00b7 {} splits \u00b7 {} of data '
               '\u00b7 {}{} on storage</p>', store_name, len(datasets), len(encoders), len(rows), size_text(data),
               "at least " if any(r.size.floor for r in rows) else "", size_text(stored))]
    for dataset in datasets:
        parts.append(h('<section class="dataset" id="ds-{}"><h2>{}</h2>', dataset, dataset))
        for ds, encoder in encoders:
            if ds != dataset:
                continue
            mine = [r for r in rows if r.dataset == dataset and r.encoder == encoder]
            parts.append(h('<h3>{} <span class="muted">/ {}</span></h3>', dataset, encoder))
            parts.append(_catalog_table(mine))
        parts.append(Html("</section>"))
    return page("store", join(parts))


def _catalog_table(rows: Sequence[SplitRow]) -> Html:
    head = Html("<thead><tr><th>split</th><th>kind</th><th>shape</th><th>dtype</th><th>data</th><th>on storage</th>"
                "<th>status</th><th>generation</th><th>cache key</th><th>encoder spec</th>"
                "<th>weights</th><th>preprocessing</th></tr></thead>")
    body = []
    for r in rows:
        if r.error:
            body.append(h('<tr class="damaged"><td><a href="{}">{}</a></td><td colspan="11">'
                          '<span class="badge bad">unreadable</span> {}</td></tr>', split_href(r), r.split, r.error))
            continue
        pre = compact_json(r.preprocessing, 160) if r.preprocessing is not None else ""
        body.append(h(
            '<tr><td><a href="{}">{}</a></td><td>{}</td><td class="num">{}</td><td>{}</td><td class="num">{}</td>'
            '<td class="num">{}</td><td>{}</td><td>{}</td><td>{}</td><td class="wrap">{}</td>'
            '<td>{}</td><td class="pre" title="{}">{}</td></tr>',
            split_href(r), r.split, r.kind, _catalog_shape(r), r.dtype, r.size.data_text(), _stored(r),
            _status(r.status), _short(r.generation, 13), _short(r.cache_key), r.encoder_spec or "",
            _short(r.weights_hash), compact_json(r.preprocessing, 2000) if pre else "", pre,
        ))  # fmt: skip
    return h('<div class="scroll"><table class="catalog">{}<tbody>{}</tbody></table></div>', head, join(body))


# ---------------------------------------------------------------------- one split
def _pairs(items: Sequence[tuple[str, Any]]) -> Html:
    return h('<table class="pairs"><tbody>{}</tbody></table>',
             join(h("<tr><th>{}</th><td>{}</td></tr>", k, v) for k, v in items))


def _json_block(value: Any) -> Html:
    """Short values on one line, longer ones indented."""
    if value is None:
        return _short(None)
    text = compact_json(value, 10_000)
    if len(text) <= 100:
        return h("<code>{}</code>", text)
    return h("<pre>{}</pre>", json.dumps(value, indent=2, sort_keys=True, default=str))


def overview(row: SplitRow) -> Html:
    m = row.metadata
    enc = m.get("encoder") if isinstance(m.get("encoder"), dict) else {}
    labels = m.get("labels")
    items: list[tuple[str, Any]] = [
        ("kind", "bags (ragged per-slide bags)" if row.kind == BAGS else row.kind),
        ("status", _status(row.status)),
        ("shape", _catalog_shape(row)),
        ("dtype", f"{row.dtype}{_int8_scales(row)} (source {m.get('source_dtype') or NOT_RECORDED})"),
        ("data", row.size.data_text()),
        ("on storage", row.size.stored_text()),
    ]
    # a chunk is stored whole: why a split smaller than one chunk takes more than its data
    items.append(("chunks", f"{m.get('chunk_rows'):,} {'patches' if row.kind == BAGS else 'samples'} per chunk, "
                  f"stored whole (the last one padded), compressor {m.get('compressor') or 'none'}"))
    if row.kind != BAGS:
        items.append(("labels", f"{labels.get('dtype')}, shape {_shape(labels.get('shape', [])) or '[] (one per sample)'}"
                      if isinstance(labels, dict) else "none"))
        items.append(("sample ids", "yes" if m.get("ids") else "no"))
    items += [
        ("generation", _short(row.generation, 13)),
        ("cache key", h("<code>{}</code>", row.cache_key) if row.cache_key else _short(None)),
        ("encoder", h("<code>{}</code>", enc.get("name") or row.encoder)),
        ("encoder spec", h("<code>{}</code>", enc.get("spec")) if enc.get("spec") else _short(None)),
        ("weights hash", h("<code>{}</code>", enc.get("weights_hash")) if enc.get("weights_hash") else _short(None)),
        ("created", f"{m.get('created')} by featurestore {(m.get('creator') or {}).get('version', '?')}"),
        ("completed", m.get("completed") or "not yet"),
    ]
    if m.get("lineage") is not None:
        items.append(("derived from", _lineage(row)))
    for name, key in (("token layout", "token_layout"), ("preprocessing", "preprocessing")):
        if m.get(key) is not None:  # a bag split of imported features has neither: no row
            items.append((name, _json_block(m.get(key))))
    other = {k: v for k, v in enc.items() if k not in ("name", "spec", "weights_hash")}
    if other:
        items.append(("encoder details", _json_block(other)))
    return _pairs(items)


def _lineage(row: SplitRow) -> Html:
    """The derived split's source and how it was computed, and whether it is still current."""
    source: dict[str, Any] = {}
    try:
        record = lineage.of(row.metadata) or {}
        text, source = lineage.describe(record), record.get("source") or {}
    except InvalidMetadata as error:
        text = str(error)
    if all(isinstance(source.get(k), str) for k in ("dataset", "encoder", "split")):
        text = h('{} (<a href="/ui/splits/{}/{}/{}">the source split</a>)', text, source["dataset"],
                 source["encoder"], source["split"])
    if row.stale:
        return h('{} <span class="error">STALE: {}</span>', text, row.stale)
    return h("{} (current)", text)


def _int8_scales(row: SplitRow) -> str:
    if row.dtype != "int8":
        return ""
    return f" codes \u00d7 float32 scales per {'bag and channel' if row.kind == BAGS else 'chunk and position'}"


def quantization(report: Any) -> Html:
    if not isinstance(report, dict) or not report:
        return h('<p class="muted">No quantization report recorded.</p>')
    exact = " (exact)" if report.get("exact") else ""
    head = h('<p class="conversion"><code>{}</code> \u2192 <code>{}</code>{}</p>',
             report.get("source_dtype") or "unknown", report.get("stored_dtype") or "", exact)
    cells = []
    for key, label, spec in QUANTIZATION_ROWS:
        if key == "overflow_count" and report.get("stored_dtype") == "int8":  # int8 has no float16 range
            key, label = SATURATION_ROW
        value = report.get(key)
        flag = "bad" if key in ("overflow_count", "saturation_count", "nan_count", "inf_count") and value else ""
        cells.append(h('<tr class="{}"><th>{}</th><td class="num">{}</td></tr>', flag, label,
                       figure(value, "," if spec == "d" else spec)))
    return h('{}<table class="pairs quant"><tbody>{}</tbody></table>', head, join(cells))


def channels(stats: Any) -> Html:
    if not isinstance(stats, dict) or not stats.get("mean"):
        return h('<p class="muted">No per-channel statistics recorded.</p>')
    mean = np.asarray(stats.get("mean") or [], np.float64)
    std = np.asarray(stats.get("std") or [], np.float64)
    parts = [h('<p class="muted">{} values per channel: every stored token of every sample (every patch of every bag).</p>',
               f"{stats.get('count', '?'):,}" if isinstance(stats.get("count"), int) else stats.get("count", "?")),
             plots.channel_plot(mean, f"mean per channel ({len(mean)} channels)", "mean")]
    if len(std):
        parts.append(plots.channel_plot(std, "std per channel", "std"))
    if len(mean) > 5:
        top = np.argsort(-np.abs(np.nan_to_num(mean)))[:5]
        parts.append(h('<p class="note">Largest |mean|: {}</p>', join(
            (h("<code>ch {}</code> {}", int(i), figure(float(mean[i]), ".4g")) for i in top), ", ")))
    return join(parts)


@dataclass(frozen=True)
class Picture:
    """One picture to show: which split, its image URL, and why not when there is none."""

    row: SplitRow
    src: str | None
    why_not: str = ""


def pictures(row: SplitRow, sample: int, shown: Sequence[Picture]) -> Html:
    n = row.shape[0] if row.shape else 0
    form = h('<form class="pick" method="get" action="{}"><label>sample <input type="number" name="sample" '
             'min="0" max="{}" value="{}"></label> <button type="submit">show</button> '
             '<span class="muted">of {} (0..{})</span></form>', split_href(row), max(n - 1, 0), sample, n, max(n - 1, 0))
    figures = []
    for pic in shown:
        caption = h("<figcaption><code>{}</code> \u00b7 {}</figcaption>", pic.row.encoder, pic.row.dtype)
        if pic.src:
            figures.append(h('<figure><a href="{}"><img src="{}" alt="PCA of sample {} of {}" class="pixel"></a>{}</figure>',
                             pic.src, pic.src, sample, pic.row.path, caption))
        else:
            figures.append(h('<figure class="none"><p class="muted">{}</p>{}</figure>', pic.why_not, caption))
    note = h('<p class="muted">Red, green, blue: the first three principal components of the sample\'s '
             "patch tokens (fitted on that sample alone), one square per token in grid order; each "
             "component spans its 1st..99th percentile. Same dataset and split under other encoders "
             "are shown beside it.</p>")
    return h('{}{}<div class="gallery">{}</div>', form, note, join(figures))


def split_page(row: SplitRow, body_extra: Html, json_href: str, channel_stats: Any = None) -> Html:
    crumbs = [(row.dataset, f"/#ds-{row.dataset}"), (row.encoder, None), (row.split, None)]
    parts = [h('<h1>{} <span class="muted">/ {} / {}</span></h1>', row.dataset, row.encoder, row.split)]
    if row.error:
        parts.append(h('<p class="error">This split cannot be read: {}</p>', row.error))
        return page(row.path, join(parts), crumbs)
    m = row.metadata
    parts += [
        h('<div class="cols"><section><h2>Overview</h2>{}<p><a href="{}">metadata as JSON</a></p></section>'
          "<section><h2>Precision</h2>{}</section></div>", overview(row), json_href, quantization(m.get("quantization"))),
        body_extra,
        h("<section><h2>Channels</h2>{}</section>", channels(channel_stats)),
    ]
    extra = {k: v for k, v in m.items() if k not in _KNOWN}
    if extra:
        parts.append(h("<section><h2>Other metadata</h2>{}</section>", _json_block(extra)))
    return page(row.path, join(parts), crumbs)


_KNOWN = frozenset({
    "format", "format_version", "status", "dataset", "encoder_name", "split", "num_samples", "sample_shape",
    "logical_dtype", "source_dtype", "chunk_rows", "compressor", "labels", "ids", "encoder", "preprocessing",
    "token_layout", "cache_key", "quantization", "channel_stats", "creator", "created", "completed", "generation",
    "kind", "bags", "lineage",
})  # fmt: skip


# ---------------------------------------------------------------------- bags
def bag_section(row: SplitRow, ids: Sequence[str], lengths: np.ndarray, labels: Sequence[Any] | None,
                chosen: int, map_src: str | None, start: int, per_page: int, *, note: str = "",
                coords: str = "", beside: Html = Html("")) -> Html:
    parts = [h("<section><h2>Bags</h2>{}", plots.histogram(lengths, f"patches per bag ({len(lengths)} bags)",
                                                         "patches in a bag", cls="lengths"))]
    if len(lengths):
        parts.append(h('<p class="muted">median {} \u00b7 min {} \u00b7 max {} patches \u00b7 coordinates: {}</p>',
                       int(np.median(lengths)), int(lengths.min()), int(lengths.max()), coords))
    if 0 <= chosen < len(ids):
        parts.append(h("<h3>slide map of bag <code>{}</code> ({} patches)</h3>", ids[chosen], int(lengths[chosen])))
        if map_src is not None:
            parts.append(h('<div class="gallery"><figure><a href="{}"><img src="{}" alt="slide map of bag {}" '
                           'class="map"></a><figcaption>patches at their coordinates, coloured by the first '
                           "principal component of their features (viridis, 1st..99th percentile). {}"
                           "</figcaption></figure>{}</div>", map_src, map_src, chosen, note, beside))
        elif note:
            parts.append(h('<p class="muted">{}</p>', note))
    elif note:  # a bag number out of range, typed into the address
        parts.append(h('<p class="muted">{}</p>', note))
    rows = []
    stop = min(len(ids), start + per_page)
    for i in range(start, stop):
        href = f"{split_href(row)}?{urlencode({'bag': i, 'start': start})}"
        label = "" if labels is None else labels[i]
        rows.append(h('<tr class="{}"><td class="num">{}</td><td><a href="{}">{}</a></td><td class="num">{}</td><td>{}</td></tr>',
                      "chosen" if i == chosen else "", i, href, ids[i], int(lengths[i]), label))
    nav = []
    if start > 0:
        nav.append(h('<a href="{}?{}">previous</a>', split_href(row), urlencode({"start": max(0, start - per_page)})))
    if stop < len(ids):
        nav.append(h('<a href="{}?{}">next</a>', split_href(row), urlencode({"start": stop})))
    parts.append(h('<table class="bags"><thead><tr><th>#</th><th>bag id</th><th>patches</th><th>label</th></tr></thead>'
                   '<tbody>{}</tbody></table><p class="nav">bags {}..{} of {} {}</p></section>',
                   join(rows), start, max(start, stop - 1), len(ids), join(nav, " \u00b7 ")))
    return join(parts)


@dataclass(frozen=True)
class AttentionFigure:
    """One saved attention map beside a slide map: its picture (``src``) or why there is none."""

    name: str
    src: str | None
    lineage: dict[str, Any] | None
    fold: int | None  # the fold that evaluated the bag
    why_not: str


def attention_figures(shown: Sequence[AttentionFigure]) -> Html:
    figures = []
    for fig in shown:
        probe = (fig.lineage or {}).get("probe") or {}
        run = h("ABMIL on <code>{}</code>, seed {}, {}, saved {}", probe.get("train_split"), probe.get("seed"),
                f"held out in fold {fig.fold} of {probe['folds']}" if probe.get("folds") and fig.fold is not None
                else f"evaluated on {probe.get('eval_split')}", (fig.lineage or {}).get("created"))
        caption = h("<figcaption>attention <code>{}</code>: {}. Colour: the rank of each patch's weight in the "
                    "bag (viridis: yellow most attended).</figcaption>", fig.name, run if fig.lineage else "")
        if fig.src:
            figures.append(h('<figure><a href="{}"><img src="{}" alt="attention map {}" class="map"></a>{}</figure>',
                             fig.src, fig.src, fig.name, caption))
        else:
            figures.append(h('<figure class="none"><p class="muted">{}</p>{}</figure>', fig.why_not, caption))
    return join(figures)


# ---------------------------------------------------------------------- login and errors
def login_page(next_path: str, message: str = "") -> Html:
    body = h('<h1>Sign in</h1><p>This server asks for its token (<code>FEATURESTORE_TOKEN</code>). '
             "It is kept in an HttpOnly cookie for this browser session.</p>{}"
             '<form class="login" method="post" action="/ui/login"><input type="hidden" name="next" value="{}">'
             '<label>token <input type="password" name="token" autocomplete="current-password" autofocus></label> '
             '<button type="submit">sign in</button></form>',
             h('<p class="error">{}</p>', message) if message else Html(""), next_path)
    return page("sign in", body)


def error_page(status: int, message: str) -> Html:
    return page(f"error {status}", h('<h1>{}</h1><p class="error">{}</p><p><a href="/">back to the store</a></p>',
                                     f"Error {status}", message))
