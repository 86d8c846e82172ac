"""Rules a course figure must follow to read well, and the small helpers that make them easy to follow.

The same checks run in the unit tests (on every figure a widget draws) and in the browser test::

    check_layout(fig)             -> [] or a list of problems; check_layout(fig, strict=True) raises
    check_mpl_layout(fig)         the same idea for a static matplotlib figure (texts inside the axes,
                                  off the lines; legend off the data; labelled axes)
    contrast_ratio(fg, bg)        WCAG 2 contrast of two colours (1 … 21); text needs >= 4.5
    text_color(bg)                "black" or "white", whichever reads better on ``bg`` (always >= 4.5)
    nice_ticks / aligned_ticks    round, evenly spaced ticks for a secondary axis, on the primary's grid
    label_style(*descriptions)    an ipywidgets ``style`` wide enough for every description
    widget_width(label, options)  a widget width that shows the longest option in full

The rules of ``check_layout`` (plotly figures: a ``dict``, ``go.Figure`` or ``go.FigureWidget``):

(a) **Axis titles.** Every cartesian axis that a visible trace is drawn on has a title, both y axes where
    there are two. Axes drawn with ``visible=False`` (a grid of squares) need none, and axes tied together
    with ``matches`` (shared subplot axes) count as one: one of them must carry the title.
(b) **The legend stays off the plot.** A legend is shown when ``showlegend`` is true, or (plotly's
    default) when two or more traces would appear in it. A shown legend must be anchored outside the
    plotting domain, in paper coordinates: to the right (``x >= 1`` with ``xanchor="left"``) or above
    (``y >= 1`` with ``yanchor="bottom"``). Left and below are refused too: tick labels and axis titles
    live there, and plotly does not move them out of the legend's way. To the right is refused when an
    axis sits on the right side (its ticks and title would be under the legend). Above is refused when
    an annotation sits above the plot (subplot titles), and needs ``margin.t >= 80`` when the figure
    has a title, so title and legend each get a row.
(c) **Distinct legend names.** No two entries of a shown legend have the same name.
(d) **Round ticks on a secondary axis.** An axis ``overlaying`` another one fixes its ticks itself:
    ``tickmode="linear"`` with a ``range`` and a ``dtick`` of at most two significant digits (``tick0`` a
    multiple of it), or ``tickmode="array"`` with evenly spaced ``tickvals`` like that. If it draws a grid,
    its range spans as many ticks as the axis it overlays (when that one's ticks are fixed too), so the
    two grids coincide.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "aligned_ticks",
    "check_layout",
    "check_mpl_layout",
    "contrast_ratio",
    "delta_e",
    "hits",
    "inside",
    "label_style",
    "legend_above",
    "legend_right",
    "line_pixels",
    "nice_ticks",
    "padded",
    "relative_luminance",
    "text_color",
    "text_px",
    "widget_width",
]

# ---- colours -------------------------------------------------------------------------------
_NAMED = {
    "white": "#ffffff",
    "black": "#000000",
    "gray": "#808080",
    "grey": "#808080",
    "red": "#ff0000",
    "green": "#008000",
    "blue": "#0000ff",
    "orange": "#ffa500",
    "transparent": "#ffffff",
}


def _rgb(color: str | Sequence[float]) -> tuple[float, float, float]:
    """A colour as (r, g, b) in 0..1: '#rgb', '#rrggbb', 'rgb(...)', 'rgba(...)', a few names, or a tuple."""
    if not isinstance(color, str):
        vals = [float(v) for v in list(color)[:3]]
        return tuple(v / 255 if max(vals) > 1 else v for v in vals)  # type: ignore[return-value]
    c = _NAMED.get(color.strip().lower(), color.strip().lower())
    if c.startswith("#"):
        h = c[1:]
        if len(h) in (3, 4):
            h = "".join(ch * 2 for ch in h[:3])
        return tuple(int(h[i : i + 2], 16) / 255 for i in (0, 2, 4))  # type: ignore[return-value]
    m = re.fullmatch(r"rgba?\(([^)]*)\)", c)
    if m:
        parts = [float(p) for p in m.group(1).replace("/", ",").split(",") if p.strip()][:3]
        return tuple(p / 255 for p in parts)  # type: ignore[return-value]
    from matplotlib.colors import to_rgb  # any other CSS name

    return to_rgb(c)


def relative_luminance(color: str | Sequence[float]) -> float:
    """WCAG 2 relative luminance (0 black … 1 white)."""

    def lin(v: float) -> float:
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(v) for v in _rgb(color))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(fg: str | Sequence[float], bg: str | Sequence[float]) -> float:
    """WCAG 2 contrast ratio of two colours, from 1 (same) to 21 (black on white). Body text needs 4.5."""
    a, b = relative_luminance(fg), relative_luminance(bg)
    return (max(a, b) + 0.05) / (min(a, b) + 0.05)


def text_color(bg: str | Sequence[float]) -> str:
    """'black' or 'white', whichever contrasts more with ``bg``: at least 4.58:1 on any background."""
    return "white" if contrast_ratio("white", bg) >= contrast_ratio("black", bg) else "black"


def _lab(color: str | Sequence[float]) -> tuple[float, float, float]:
    def lin(v: float) -> float:
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(v) for v in _rgb(color))
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116

    fx, fy, fz = f(x), f(y), f(z)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def delta_e(c1: str | Sequence[float], c2: str | Sequence[float]) -> float:
    """CIE76 colour difference in CIELAB: about 2 is just noticeable; below 20, two categories look alike."""
    return math.dist(_lab(c1), _lab(c2))


# ---- ticks ---------------------------------------------------------------------------------
_MANTISSAS = (1.0, 2.0, 2.5, 5.0, 10.0)


def nice_ticks(top: float, intervals: int = 4, integer: bool = False) -> tuple[float, float]:
    """``(range_top, dtick)``: the smallest round step (1, 2, 2.5 or 5 × 10^k) with ``intervals`` steps
    reaching ``top``; ``integer`` keeps the step a whole number (counts of things)."""
    if intervals < 1:
        raise ValueError(f"intervals must be >= 1, got {intervals}")
    raw = max(float(top), 0.0) / intervals
    if raw <= 0:
        return float(intervals), 1.0
    exp = math.floor(math.log10(raw))
    for e in (exp, exp + 1):
        for m in _MANTISSAS:
            step = m * 10.0**e
            if step + 1e-12 * step < raw or (integer and (step < 1 or step != int(step))):
                continue
            step = round(step, 12)
            return round(step * intervals, 12), step
    return float(math.ceil(raw)) * intervals, float(math.ceil(raw))  # integer steps below 1


def padded(top: float, headroom: float = 0.04) -> list[float]:
    """``[0, top · (1 + headroom)]``: a line at the top tick stays in view. Pad both y axes alike, so their
    grids still coincide."""
    return [0.0, top * (1 + headroom)]


def aligned_ticks(
    left_max: float,
    right_max: float,
    left_integer: bool = False,
    right_integer: bool = False,
    intervals: Iterable[int] = (4, 5, 3, 6),
) -> dict[str, tuple[float, float]]:
    """Round ticks for two y axes sharing one grid: the same number of intervals on both, each a round step.

    Returns ``{"left": (top, dtick), "right": (top, dtick)}``; the number of intervals is the one (of
    ``intervals``) that wastes least of the plot's height above the data.
    """
    best = None
    for n in intervals:
        lt, ld = nice_ticks(left_max, n, left_integer)
        rt, rd = nice_ticks(right_max, n, right_integer)
        fill = min(left_max / lt if lt else 1.0, right_max / rt if rt else 1.0)
        if best is None or fill > best[0] + 1e-9:
            best = (fill, (lt, ld), (rt, rd))
    assert best is not None
    return dict(left=best[1], right=best[2])


# ---- legends -------------------------------------------------------------------------------
def legend_right(**kw: Any) -> dict[str, Any]:
    """A vertical legend to the right of the plot (plotly widens the right margin for it)."""
    return dict(orientation="v", x=1.02, xanchor="left", y=1.0, yanchor="top", **kw)


def legend_above(**kw: Any) -> dict[str, Any]:
    """A horizontal legend in a row above the plot (give ``margin.t`` room for it, and for a title)."""
    return dict(orientation="h", x=0.0, xanchor="left", y=1.02, yanchor="bottom", **kw)


# ---- widgets -------------------------------------------------------------------------------
_NARROW = set("il.,:;|!'ijtfr ()[]·/")
_WIDE = set("mwMW@%")


def text_px(text: str, font_px: float = 13.0) -> float:
    """An upper bound of ``text``'s width in pixels in a sans-serif font (calibrated on DejaVu Sans,
    the widest of the usual ones)."""
    em = 0.0
    for ch in text:
        em += 1.0 if ch in _WIDE else 0.4 if ch in _NARROW else 0.78 if ch.isupper() or ch.isdigit() else 0.62
    return em * font_px


def label_style(*descriptions: str, **extra: Any) -> dict[str, Any]:
    """An ipywidgets ``style`` whose ``description_width`` shows the longest description in full, so a
    column of controls lines up without cutting a label ("GPU memory (…")."""
    width = max((text_px(d) for d in descriptions), default=0.0)
    return {"description_width": f"{math.ceil(width) + 12}px", **extra}


def widget_width(description_width: str | float, options: Iterable[str], control_px: float = 40.0) -> str:
    """The CSS width of a dropdown whose longest option shows in full (``control_px``: the arrow and padding)."""
    label = float(str(description_width).removesuffix("px") or 0) if description_width != "initial" else 0.0
    longest = max((text_px(str(o)) for o in options), default=0.0)
    return f"{math.ceil(label + longest + control_px) + 4}px"


# ---- the plotly checks ---------------------------------------------------------------------
def _as_dict(fig: Any) -> dict[str, Any]:
    """A figure as plain data; a dict (e.g. ``{data, layout}`` read from a page's DOM) as plotly.py reads it."""
    if isinstance(fig, dict):
        import plotly.graph_objects as go

        try:
            return go.Figure(fig, skip_invalid=True).to_dict()
        except (ValueError, TypeError):  # a shape plotly.py cannot hold: check it as it is
            return {"data": list(fig.get("data") or []), "layout": dict(fig.get("layout") or {})}
    return fig.to_dict()


def _title(ax: dict[str, Any]) -> str:
    t = ax.get("title")
    if isinstance(t, dict):
        t = t.get("text")
    return (t or "").strip() if isinstance(t, str) else ""


def _axis_key(ref: str) -> str:
    """'x' -> 'xaxis', 'y2' -> 'yaxis2'."""
    return f"{ref[0]}axis{ref[1:]}"


def _round_step(step: float) -> bool:
    """At most two significant digits: 1, 2, 2.5, 5, 12, 0.25 … but not 12.3 or 2.47."""
    if not step > 0 or not math.isfinite(step):
        return False
    scaled = step / 10 ** (math.floor(math.log10(step)) - 1)  # two digits before the point
    return abs(scaled - round(scaled)) < 1e-6


def _whole(x: float, step: float) -> bool:
    return abs(x / step - round(x / step)) < 1e-6


def _fixed_intervals(ax: dict[str, Any]) -> float | None:
    """How many tick intervals the range of an axis with fixed ticks spans (None when its ticks float)."""
    rng: Any = ax.get("range")  # [low, high] as plotly stores it, None for an end left to autorange
    has_range = bool(rng) and None not in rng
    if ax.get("tickmode") == "linear" and ax.get("dtick") and has_range:
        return round((rng[1] - rng[0]) / float(ax["dtick"]), 6)
    vals = ax.get("tickvals")
    if ax.get("tickmode") == "array" and vals and len(vals) > 1:
        return round((rng[1] - rng[0]) / (vals[1] - vals[0]), 6) if has_range else float(len(vals) - 1)
    return None


def _anchor(value: float, anchor: str, low: str, high: str) -> str:
    if anchor and anchor != "auto":
        return anchor
    return low if value <= 1 / 3 else high if value >= 2 / 3 else "middle"


_LEGENDLESS = {
    "pie",
    "sunburst",
    "treemap",
    "icicle",
    "funnelarea",
    "table",
    "parcoords",
    "parcats",
    "sankey",
    "indicator",
}


def check_layout(fig: Any, strict: bool = False) -> list[str]:
    """The problems of a plotly figure against rules (a)-(d) above (an empty list: it reads well).

    ``strict=True`` raises ``AssertionError`` listing them instead.
    """
    d = _as_dict(fig)
    layout, data = d.get("layout", {}), [t for t in d.get("data", []) if t.get("visible", True) is not False]
    problems: list[str] = []
    label = _title(layout) or "figure"

    # (a) axis titles
    used: dict[str, list[str]] = {}
    for t in data:
        if t.get("type", "scatter") in _LEGENDLESS or t.get("type", "scatter").endswith(
            ("3d", "geo", "mapbox", "polar", "ternary")
        ):
            continue
        for ref in (t.get("xaxis", "x"), t.get("yaxis", "y")):
            used.setdefault(_axis_key(ref), []).append(t.get("name") or t.get("type", "scatter"))
    axes = {k: v for k, v in layout.items() if re.fullmatch(r"[xy]axis\d*", k)}
    for key in sorted(used):
        ax = axes.get(key, {})
        if ax.get("visible", True) is False or _title(ax):
            continue
        group = {key}
        changed = True
        while changed:  # axes linked by `matches`, either way, are one axis
            changed = False
            for k, a in axes.items():
                m = a.get("matches")
                if (k in group and m and _axis_key(m) not in group) or (m and _axis_key(m) in group and k not in group):
                    group |= {k, _axis_key(m)}
                    changed = True
        if not any(_title(axes.get(k, {})) for k in group):
            problems.append(f"{label}: {key} shows data ({', '.join(map(str, used[key][:3]))}) but has no title")

    # (b) legend placement, (c) names
    entries = [t for t in data if t.get("showlegend", True) is not False and t.get("type") not in _LEGENDLESS]
    legend = layout.get("legend", {}) or {}
    shown = layout.get("showlegend")
    if shown is None:
        shown = len(entries) > 1
    if shown and legend.get("visible", True) is not False and entries:
        horizontal = legend.get("orientation", "v") == "h"
        x = legend.get("x", 0.0 if horizontal else 1.02)
        y = legend.get("y", -0.1 if horizontal else 1.0)
        xanchor = _anchor(x, legend.get("xanchor", "left"), "left", "right")
        yanchor = _anchor(y, legend.get("yanchor", "top" if horizontal else "auto"), "bottom", "top")
        where = f"legend at x={x:g} ({xanchor}), y={y:g} ({yanchor})"
        right_axes = [
            k
            for k, a in axes.items()
            if k.startswith("y") and a.get("side") == "right" and a.get("visible", True) is not False and k in used
        ]
        if legend.get("xref", "paper") != "paper" or legend.get("yref", "paper") != "paper":
            problems.append(f"{label}: {where} is placed in container coordinates; use paper coordinates")
        elif x >= 1 and xanchor == "left":
            if right_axes:
                problems.append(
                    f"{label}: {where} sits on the right-side axis {right_axes[0]} (its ticks and "
                    f"title); put the legend above the plot"
                )
        elif y >= 1 and yanchor == "bottom":
            above = [
                a.get("text", "")
                for a in layout.get("annotations", []) or []
                if a.get("yref", "y").startswith("paper") and (a.get("y") or 0) >= 1
            ]
            if above:
                problems.append(
                    f"{label}: {where} collides with the annotation {above[0]!r} above the plot; "
                    f"put the legend to the right"
                )
            top = (layout.get("margin") or {}).get("t", 100)
            if _title(layout) and top < 80:
                problems.append(f"{label}: {where} and the title share a top margin of {top}px; give it >= 80")
        elif (x <= 0 and xanchor == "right") or (y <= 0 and yanchor == "top"):
            problems.append(
                f"{label}: {where} is left of or below the plot, over tick labels and axis titles; "
                f"put it to the right (x>=1, xanchor='left') or above (y>=1, yanchor='bottom')"
            )
        else:
            problems.append(
                f"{label}: {where} lies on the plotting area; anchor it outside: to the right "
                f"(x>=1, xanchor='left') or above (y>=1, yanchor='bottom')"
            )
        names: dict[str, int] = {}
        for t in entries:
            n = str(t.get("name", ""))
            names[n] = names.get(n, 0) + 1
        for n, k in names.items():
            if k > 1:
                problems.append(f"{label}: {k} legend entries are called {n!r}")

    # (d) round ticks on secondary axes
    for key, ax in axes.items():
        over = ax.get("overlaying")
        if not over or key not in used or ax.get("visible", True) is False:
            continue
        rng = ax.get("range")
        if ax.get("tickmode") == "array" and ax.get("tickvals"):
            vals = [float(v) for v in ax["tickvals"]]
            steps = {round(b - a, 9) for a, b in itertools.pairwise(vals)}
            if len(steps) > 1 or not all(_round_step(s) and _whole(v, s) for s in steps for v in vals):
                problems.append(f"{label}: {key} tick values {vals} are not evenly spaced round numbers")
        elif ax.get("tickmode") == "linear" and ax.get("dtick") and rng and None not in rng:
            step = float(ax["dtick"])
            if not (_round_step(step) and _whole(float(ax.get("tick0", 0) or 0), step)):
                problems.append(f"{label}: {key} range {rng} with dtick {step:g} does not give round ticks")
        else:
            problems.append(
                f"{label}: {key} (a secondary axis) leaves its ticks to plotly, which picks uneven "
                f"ones; set range and dtick (tickmode='linear'), see aligned_ticks()"
            )
            continue
        base = axes.get(_axis_key(over), {})
        if ax.get("showgrid", True) is not False and _fixed_intervals(base) not in (None, _fixed_intervals(ax)):
            problems.append(
                f"{label}: {key} draws a grid of {_fixed_intervals(ax):g} intervals over "
                f"{_axis_key(over)}'s {_fixed_intervals(base):g}; align them or set showgrid=False"
            )
    if strict and problems:
        raise AssertionError("figure does not read well:\n  " + "\n  ".join(problems))
    return problems


# ---- the matplotlib check ------------------------------------------------------------------
def line_pixels(ax: Any) -> list[Any]:
    """Every line and marker of a matplotlib axes as display-pixel points, each segment sampled every
    pixel (so a box lying between two vertices still meets the segment). Call after a draw."""
    import numpy as np

    paths = []
    for line in ax.lines:
        if not line.get_visible():
            continue
        xy = line.get_transform().transform(np.column_stack(line.get_data()).astype(float))
        xy = xy[np.isfinite(xy).all(axis=1)]
        if len(xy) > 1 and line.get_linestyle() not in ("None", "", " ", "none"):
            pts = [xy[:1]]
            for a, b in itertools.pairwise(xy):
                n = max(2, int(np.hypot(*(b - a))) + 1)
                pts.append(a + (b - a) * np.linspace(0, 1, n)[1:, None])
            xy = np.concatenate(pts)
        paths.append(xy)
    return paths


def inside(b: Any, box: Any, slack: float = 0.5) -> bool:
    """Whether bounding box ``b`` lies within ``box`` (matplotlib ``Bbox``es, display pixels)."""
    return b.x0 >= box.x0 - slack and b.x1 <= box.x1 + slack and b.y0 >= box.y0 - slack and b.y1 <= box.y1 + slack


def hits(b: Any, paths: Sequence[Any]) -> bool:
    """Whether any point of ``paths`` (from ``line_pixels``) lies in bounding box ``b``."""
    return any(((xy[:, 0] > b.x0) & (xy[:, 0] < b.x1) & (xy[:, 1] > b.y0) & (xy[:, 1] < b.y1)).any() for xy in paths)


def check_mpl_layout(fig: Any, strict: bool = False) -> list[str]:
    """The problems of a static matplotlib figure: an axis with data and no label; a text (annotation)
    leaving its axes, crossing a drawn line or marker, or overlapping another text; a legend covering a
    line or a text."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems: list[str] = []
    for ax in fig.axes:
        name = ax.get_title() or "axes"
        if not (ax.lines or ax.collections or ax.patches or ax.images):
            continue
        if ax.xaxis.get_visible() and not ax.get_xlabel().strip():
            problems.append(f"{name}: the x axis has no label")
        if ax.yaxis.get_visible() and not ax.get_ylabel().strip():
            problems.append(f"{name}: the y axis has no label")
        box = ax.get_window_extent(renderer)
        paths = line_pixels(ax)
        texts = [t for t in ax.texts if t.get_visible() and t.get_text().strip()]
        boxes = [t.get_window_extent(renderer) for t in texts]
        for t, b in zip(texts, boxes):
            what = f"{name}: the label {t.get_text()!r}"
            if not inside(b, box):
                problems.append(f"{what} runs past the axes")
            if hits(b, paths):
                problems.append(f"{what} is drawn over a line or a point")
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                if boxes[i].overlaps(boxes[j]):
                    problems.append(f"{name}: the labels {texts[i].get_text()!r} and {texts[j].get_text()!r} overlap")
        leg = ax.get_legend()
        if leg is not None and leg.get_visible():
            lb = leg.get_window_extent(renderer)
            if hits(lb, paths):
                problems.append(f"{name}: the legend covers a line or a point")
            if any(lb.overlaps(b) for b in boxes):
                problems.append(f"{name}: the legend covers a label")
    if strict and problems:
        raise AssertionError("figure does not read well:\n  " + "\n  ".join(problems))
    return problems
