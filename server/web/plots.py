"""Inline SVG plots (no script, no image request): per-channel mean and std of a split, and a
histogram (bag lengths). Coordinates are rounded to 0.1 px and channels are binned to at most
``MAX_POINTS`` points (the min..max of each bin drawn as a band), so a 3072-channel plot stays a
few KiB of markup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from server.web.markup import Html, h, join

MAX_POINTS = 360
WIDTH, HEIGHT = 720, 180
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 22, 30


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten) covering ``[lo, hi]``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks, value = [], first
    while value <= hi + step * 0.5 and len(ticks) < 4 * count:
        ticks.append(round(value, 12))
        value += step
    return ticks


def _label(value: float) -> str:
    if value and abs(value) >= 1000 and float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.3g}" if value else "0"


def _frame(title: str, xs: tuple[float, float], ys: list[float], x_label: str, cls: str, data: str) -> tuple[Html, float, float, float, float]:
    """The SVG's opening, axes, grid and labels; returns it and the data-to-pixel mapping."""
    lo, hi = ys[0], ys[-1]
    x0, x1 = xs
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    sx = plot_w / max(x1 - x0, 1e-12)
    sy = plot_h / max(hi - lo, 1e-12)
    parts = [h('<svg class="plot {}" viewBox="0 0 {} {}" width="{}" height="{}" role="img" '
               'aria-label="{}" {}><title>{}</title>', cls, WIDTH, HEIGHT, WIDTH, HEIGHT, title,
               Html(data), title),
             h('<text class="title" x="{}" y="14">{}</text>', LEFT, title)]
    for tick in ys:
        y = TOP + plot_h - (tick - lo) * sy
        parts.append(h('<line class="grid" x1="{}" x2="{}" y1="{:.1f}" y2="{:.1f}"/>'
                       '<text class="tick" x="{}" y="{:.1f}" text-anchor="end">{}</text>',
                       LEFT, WIDTH - RIGHT, y, y, LEFT - 6, y + 4, _label(tick)))
    parts.append(h('<text class="tick" x="{}" y="{}" text-anchor="middle">{}</text>',
                   LEFT + plot_w / 2, HEIGHT - 6, x_label))
    parts.append(h('<rect class="axes" x="{}" y="{}" width="{}" height="{}"/>', LEFT, TOP, plot_w, plot_h))
    return join(parts), sx, sy, x0, lo


def _points(xs: np.ndarray, ys: np.ndarray, sx: float, sy: float, x0: float, lo: float) -> str:
    px = LEFT + (xs - x0) * sx
    py = TOP + (HEIGHT - TOP - BOTTOM) - (ys - lo) * sy
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(px, py))


def channel_plot(values: Sequence[float], title: str, cls: str = "") -> Html:
    """One value per channel (e.g. the mean of each channel), by channel index. More channels
    than ``MAX_POINTS`` are binned: the line is each bin's mean, the band its min..max."""
    v = np.asarray(values, np.float64)
    finite = v[np.isfinite(v)]
    if len(finite) == 0:
        return h('<p class="muted">{}: no finite values</p>', title)
    n = len(v)
    bins = min(n, MAX_POINTS)
    edges = np.linspace(0, n, bins + 1).astype(np.int64)
    ok = np.isfinite(v)
    starts = edges[:-1]
    lo_b = np.fmin.reduceat(np.where(ok, v, np.nan), starts)
    hi_b = np.fmax.reduceat(np.where(ok, v, np.nan), starts)
    with np.errstate(invalid="ignore", divide="ignore"):
        mid = np.add.reduceat(np.where(ok, v, 0.0), starts) / np.add.reduceat(ok.astype(np.float64), starts)
    centre = (edges[:-1] + edges[1:] - 1) / 2.0
    ticks = nice_ticks(float(finite.min()), float(finite.max()))
    data = f'data-channels="{n}"'
    frame, sx, sy, x0, lo = _frame(title, (0.0, float(max(n - 1, 1))), ticks, f"channel (0..{n - 1})", cls, data)
    keep = np.isfinite(mid)
    parts = [frame]
    if bins < n:
        band = _points(np.concatenate([centre[keep], centre[keep][::-1]]),
                       np.concatenate([hi_b[keep], lo_b[keep][::-1]]), sx, sy, x0, lo)
        parts.append(h('<polygon class="band" points="{}"/>', band))
    parts.append(h('<polyline class="line" points="{}"/>', _points(centre[keep], mid[keep], sx, sy, x0, lo)))
    return Html(join(parts) + "</svg>")


def histogram(values: Sequence[int] | np.ndarray, title: str, x_label: str, bins: int = 40, cls: str = "") -> Html:
    """Counts of ``values`` in up to ``bins`` equal bins, as bars."""
    v = np.asarray(values, np.float64)
    if len(v) == 0:
        return h('<p class="muted">{}: nothing to show</p>', title)
    lo, hi = float(v.min()), float(v.max())
    if hi == lo:
        hi = lo + 1
    # whole numbers (lengths): never more bins than distinct values could fill
    counts, edges = np.histogram(v, bins=max(1, min(bins, int(hi - lo) + 1)), range=(lo, hi))
    ticks = nice_ticks(0.0, float(max(counts.max(), 4)))  # whole counts: at least 0..4
    data = f'data-count="{len(v)}"'
    frame, sx, sy, x0, base = _frame(title, (lo, hi), ticks, x_label, f"hist {cls}", data)
    parts = [frame]
    plot_bottom = HEIGHT - BOTTOM
    for count, a, b in zip(counts, edges[:-1], edges[1:]):
        if count:
            x, w = LEFT + (a - x0) * sx, max((b - a) * sx - 1, 1)
            parts.append(h('<rect class="bar" x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}">'
                           "<title>{}\u2013{}: {}</title></rect>",
                           x, plot_bottom - count * sy, w, count * sy, _label(a), _label(b), int(count)))
    for tick in nice_ticks(lo, hi):
        if lo <= tick <= hi:
            parts.append(h('<text class="tick" x="{:.1f}" y="{}" text-anchor="middle">{}</text>',
                           LEFT + (tick - x0) * sx, plot_bottom + 12, _label(tick)))
    return Html(join(parts) + "</svg>")
