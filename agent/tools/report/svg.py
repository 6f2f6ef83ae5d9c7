"""Hand-written SVG: number, time and value formatting, axes and ticks, the golden-triangle
charts with their legends and threshold lines, and the latency heatmap with its colour scale.
Every drawn element carries stable ids, classes and ``data-*`` attributes for the tests.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from mrc_agent.agent.tools.report.charts import HEATMAP_QUANTILE, HEATMAP_TITLE
from mrc_agent.agent.tools.report.data import ChartData, HeatmapData
from mrc_agent.dashboards.queries import PROMPT_LENGTH_ORDER, RESOLUTION_ORDER

_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
#: The smallest value span an axis is drawn for; below, the span is taken as empty.
_MIN_SPAN = 1e-300


def _num(v: float, digits: int = 3) -> str:
    text = f"{v:.{digits}g}"
    if "e" in text and abs(v) < 1e15:  # 1e+03 reads as 1000; 1e+200 stays short
        text = f"{v:.0f}"
    return text


def format_value(v: float, unit: str) -> str:
    """A value as the axis and the legend show it: ``95 %``, ``50 GB/s``, ``3.33``."""
    if unit == "percentunit":
        pct = v * 100
        return f"{pct:.0f} %" if abs(pct) >= 10 or pct == 0 else f"{pct:.2g} %"
    if unit == "Bps":
        for size, prefix in _SI:
            if abs(v) >= size:
                return f"{_num(v / size)} {prefix}B/s"
        return f"{_num(v)} B/s"
    for size, prefix in _SI:
        if abs(v) >= size:
            return f"{_num(v / size)}{prefix}"
    return _num(v)


def format_ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:,.0f} ms" if abs(ms) < 1e15 else f"{ms:.3g} ms"


def _utc(t: float, fmt: str = "%Y-%m-%d %H:%M:%S UTC") -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime(fmt)


def nice_step(raw: float) -> float:
    """The smallest 1-2-2.5-5 x 10^k at or above ``raw``."""
    if raw <= 0:
        return 1.0
    exp = math.floor(math.log10(raw))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        step = m * 10.0 ** exp
        if step >= raw * (1 - 1e-9):
            return step
    return 10.0 ** (exp + 1)


_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
               43200, 86400, 172800, 604800)


def time_ticks(x0: float, x1: float, most: int = 6) -> list[float]:
    span = max(x1 - x0, 1e-3)
    step = next((s for s in _TIME_STEPS if span / s <= most), _TIME_STEPS[-1])
    first = math.ceil(x0 / step) * step
    return [first + i * step for i in range(int((x1 - first) // step) + 1)]


def _attr(value: object) -> str:
    return html.escape(str(value), quote=True)


#: Grafana's classic palette, so a line has the colour it has on the dashboard.
PALETTE = ("#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9",
           "#705da0", "#508642", "#cca300")
THRESHOLD_COLOUR = "#d0021b"

# Chart geometry (px): the SVG's size and the plot box inside it.
CHART_W, CHART_H = 580, 250
PLOT_L, PLOT_R, PLOT_T, PLOT_B = 68, 14, 14, 32


@dataclass(frozen=True)
class _Axes:
    x0: float
    x1: float
    y0: float
    y1: float

    @property
    def left(self) -> float:
        return PLOT_L

    @property
    def right(self) -> float:
        return CHART_W - PLOT_R

    @property
    def top(self) -> float:
        return PLOT_T

    @property
    def bottom(self) -> float:
        return CHART_H - PLOT_B

    def x(self, t: float) -> float:
        return self.left + (t - self.x0) / (self.x1 - self.x0) * (self.right - self.left)

    def y(self, v: float) -> float:
        v = min(max(v, self.y0), self.y1)
        return self.bottom - (v - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top)


def y_domain(values: Sequence[float], threshold: float | None,
             fixed_max: float | None) -> tuple[float, float, float]:
    """(low, high, tick step): from 0 (or the lowest value) to a nice value above the data,
    the threshold line and the panel's fixed maximum."""
    lo = min(0.0, min(values, default=0.0))
    hi = max([*values, 0.0])
    if threshold is not None:
        hi = max(hi, threshold * 1.1)
    if fixed_max is not None:
        hi = max(hi, fixed_max)
    # lo <= 0 <= hi. A span too small for a float to divide into ticks (5e-324, a denormal a
    # server may send) is drawn as an empty one.
    if hi - lo <= _MIN_SPAN:
        hi = lo + 1.0
    step = nice_step((hi - lo) / 5)
    low, high = math.floor(lo / step) * step, math.ceil(hi / step - 1e-9) * step
    if not (math.isfinite(low) and math.isfinite(high) and high > low):
        return 0.0, 1.0, 0.2  # values past what the axes can hold (prom.MAX_SAMPLE)
    return low, high, step


def _path(axes: _Axes, points: list[tuple[float, float | None]]) -> tuple[str, int]:
    """An SVG path ``d`` through the finite points, broken at gaps; and the number of points."""
    parts: list[str] = []
    drawing = False
    count = 0
    for t, v in points:
        if v is None or not axes.x0 <= t <= axes.x1:
            drawing = False
            continue
        parts.append(f"{'L' if drawing else 'M'}{axes.x(t):.1f} {axes.y(v):.1f}")
        drawing = True
        count += 1
    return " ".join(parts), count


def render_chart(chart: ChartData, x0: float, x1: float) -> str:
    spec = chart.spec
    values = [v for s in chart.series for v in s.finite]
    threshold = spec.threshold.value if spec.threshold else None
    lo, hi, ystep = y_domain(values, threshold, spec.y_max)
    axes = _Axes(x0, x1, lo, hi)
    sid = f"chart-{spec.key}"
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="{sid}" '
           f'data-chart="{spec.key}" data-status="{chart.status}" '
           f'data-series-count="{sum(1 for s in chart.series if s.finite)}" '
           f'data-unit="{spec.unit}" data-y-min="{lo:g}" data-y-max="{hi:g}" '
           f'data-x-start="{x0:.3f}" data-x-end="{x1:.3f}" '
           f'data-plot-left="{axes.left:g}" data-plot-right="{axes.right:g}" '
           f'data-plot-top="{axes.top:g}" data-plot-bottom="{axes.bottom:g}" '
           f'width="{CHART_W}" height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}" '
           f'role="img" aria-label="{_attr(spec.title)}">']
    out.append(f'<rect class="plot" x="{axes.left}" y="{axes.top}" '
               f'width="{axes.right - axes.left}" height="{axes.bottom - axes.top}" '
               'fill="#fcfcfd" stroke="#c8ccd2"/>')
    # Y axis: grid lines and labels.
    out.append('<g class="axis y-axis">')
    n = round((hi - lo) / ystep)
    for i in range(n + 1):
        v = lo + i * ystep
        y = axes.y(v)
        out.append(f'<line class="grid" x1="{axes.left}" x2="{axes.right}" y1="{y:.1f}" '
                   f'y2="{y:.1f}" stroke="#e3e6ea"/>')
        out.append(f'<text class="tick" data-value="{v:g}" x="{axes.left - 6}" y="{y + 4:.1f}" '
                   f'text-anchor="end">{_attr(format_value(v, spec.unit))}</text>')
    mid = (axes.top + axes.bottom) / 2
    out.append(f'<text class="axis-label" x="12" y="{mid:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 12 {mid:.1f})">{_attr(spec.axis_label)}</text>')
    out.append("</g>")
    # X axis: time ticks (UTC).
    out.append('<g class="axis x-axis">')
    fmt = "%H:%M:%S" if x1 - x0 <= 3 * 3600 else "%m-%d %H:%M" if x1 - x0 > 86400 else "%H:%M"
    for t in time_ticks(x0, x1):
        x = axes.x(t)
        out.append(f'<line class="tick-mark" x1="{x:.1f}" x2="{x:.1f}" y1="{axes.bottom}" '
                   f'y2="{axes.bottom + 4}" stroke="#8a9099"/>')
        # Labels at the plot's ends are anchored inwards so that none is cut off.
        anchor = ("end" if x > axes.right - 28 else "start" if x < axes.left + 28
                  else "middle")
        out.append(f'<text class="tick" data-time="{t:.0f}" x="{x:.1f}" y="{axes.bottom + 17}" '
                   f'text-anchor="{anchor}">{_utc(t, fmt)}</text>')
    out.append("</g>")
    # Series.
    for i, series in enumerate(chart.series):
        d, count = _path(axes, series.points)
        if not count:
            continue
        colour = PALETTE[i % len(PALETTE)]
        dash = (' stroke-dasharray="7 4"' if spec.dashed_suffix
                and series.legend.endswith(spec.dashed_suffix) else "")
        out.append(f'<path class="series" id="{sid}-s{i}" data-series="{_attr(series.legend)}" '
                   f'data-points="{count}" d="{d}" fill="none" stroke="{colour}" '
                   f'stroke-width="1.8" stroke-linejoin="round" stroke-linecap="round"{dash}/>')
    # Threshold line, drawn over the series so it is never hidden.
    if spec.threshold is not None:
        y = axes.y(spec.threshold.value)
        out.append(f'<line class="threshold" id="{sid}-threshold" '
                   f'data-value="{spec.threshold.value:g}" x1="{axes.left}" x2="{axes.right}" '
                   f'y1="{y:.1f}" y2="{y:.1f}" stroke="{THRESHOLD_COLOUR}" stroke-width="1.5" '
                   'stroke-dasharray="6 4"/>')
        out.append(f'<text class="threshold-label" x="{axes.right - 4}" y="{y - 4:.1f}" '
                   f'text-anchor="end" fill="{THRESHOLD_COLOUR}" stroke="#fcfcfd" '
                   'stroke-width="3" paint-order="stroke">'
                   f'{_attr(spec.threshold.label)}</text>')
    if chart.status != "ok":
        word = "query failed" if chart.status == "error" else "no data"
        out.append(f'<text class="no-data" x="{(axes.left + axes.right) / 2:.1f}" '
                   f'y="{mid:.1f}" text-anchor="middle">{word}</text>')
    out.append("</svg>")
    return "".join(out)


def _legend(chart: ChartData) -> str:
    items = []
    for i, series in enumerate(chart.series):
        vals = series.finite
        if not vals:
            continue
        colour = PALETTE[i % len(PALETTE)]
        dashed = bool(chart.spec.dashed_suffix and series.legend.endswith(chart.spec.dashed_suffix))
        style = (f"border-top:3px dashed {colour}" if dashed else f"background:{colour}")
        unit = chart.spec.unit
        items.append(
            f'<li data-series="{_attr(series.legend)}" data-last="{vals[-1]:g}" '
            f'data-max="{max(vals):g}"><span class="swatch" style="{style}"></span>'
            f'{_attr(series.legend)} <span class="stats">last {format_value(vals[-1], unit)}, '
            f'max {format_value(max(vals), unit)}</span></li>')
    return f'<ul class="legend">{"".join(items)}</ul>' if items else ""


def render_chart_panel(chart: ChartData, x0: float, x1: float, source_note: str) -> str:
    spec = chart.spec
    notes = []
    if chart.status == "ok" and chart.empty_queries:
        notes.append("No data for: " + ", ".join(chart.empty_queries) + ".")
    if chart.dropped:
        notes.append(f"{chart.dropped} more series not drawn (lowest peaks); narrow --selector.")
    notes.extend(f"Query failed: {e}" for e in chart.errors)
    notes_html = "".join(f'<p class="note">{_attr(n)}</p>' for n in notes)
    if spec.key.startswith("compute-"):
        notes_html = f'<p class="source">{_attr(source_note)}</p>' + notes_html
    return (f'<figure class="panel chart-panel" id="panel-{spec.key}" data-panel="{spec.key}" '
            f'data-status="{chart.status}"><figcaption><h3>{_attr(spec.title)}</h3>'
            f'<p class="desc">{_attr(spec.description)}</p></figcaption>'
            f'{render_chart(chart, x0, x1)}{_legend(chart)}{notes_html}</figure>')


# -- heatmap -----------------------------------------------------------------------------------

#: Grafana's continuous-GrYlRd: green at 0, yellow halfway, red at the latency alert's value.
_GREEN, _YELLOW, _RED = (115, 191, 105), (250, 222, 42), (242, 73, 92)
HEAT_CELL_W, HEAT_CELL_H, HEAT_LEFT, HEAT_TOP = 150, 64, 84, 30


def heat_colour(value: float, high: float) -> str:
    f = min(max(value / high, 0.0), 1.0) if high > 0 else 1.0
    a, b, g = (_GREEN, _YELLOW, f * 2) if f <= 0.5 else (_YELLOW, _RED, f * 2 - 1)
    r, gg, bb = (round(x + (y - x) * g) for x, y in zip(a, b, strict=True))
    return f"#{r:02x}{gg:02x}{bb:02x}"


def render_heatmap(heat: HeatmapData, high_s: float) -> str:
    width = HEAT_LEFT + len(PROMPT_LENGTH_ORDER) * HEAT_CELL_W + 8
    grid_h = HEAT_TOP + len(RESOLUTION_ORDER) * HEAT_CELL_H
    height = grid_h + 64
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap" id="heatmap" '
           f'data-status="{heat.status}" '
           f'data-cell-count="{len(RESOLUTION_ORDER) * len(PROMPT_LENGTH_ORDER)}" '
           f'data-cells-with-data="{len(heat.cells)}" data-colour-max-ms="{high_s * 1000:g}" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{_attr(HEATMAP_TITLE)}">']
    out.append(f'<text class="corner" x="{HEAT_LEFT - 8}" y="{HEAT_TOP - 10}" '
               'text-anchor="end">res \\ prompt</text>')
    for c, col in enumerate(PROMPT_LENGTH_ORDER):
        x = HEAT_LEFT + c * HEAT_CELL_W + HEAT_CELL_W / 2
        out.append(f'<text class="col-label" data-col="{_attr(col)}" x="{x:g}" '
                   f'y="{HEAT_TOP - 10}" text-anchor="middle">{_attr(col)} chars</text>')
    for r, row in enumerate(RESOLUTION_ORDER):
        y = HEAT_TOP + r * HEAT_CELL_H
        out.append(f'<text class="row-label" data-row="{_attr(row)}" x="{HEAT_LEFT - 8}" '
                   f'y="{y + HEAT_CELL_H / 2 + 5:g}" text-anchor="end">{_attr(row)}</text>')
        for c, col in enumerate(PROMPT_LENGTH_ORDER):
            x = HEAT_LEFT + c * HEAT_CELL_W
            value = heat.cells.get((row, col))
            key = f"{row}|{col}"
            if value is None:
                fill, label, status, data_value = "#eceef1", "no data", "no-data", ""
            else:
                fill, label, status = heat_colour(value, high_s), format_ms(value), "ok"
                data_value = f"{value * 1000:.3f}"
            out.append(
                f'<g class="cell" id="cell-{r}-{c}" data-cell="{_attr(key)}" '
                f'data-row="{_attr(row)}" data-col="{_attr(col)}" data-status="{status}" '
                f'data-value="{data_value}" data-unit="ms">'
                f'<rect x="{x + 1}" y="{y + 1}" width="{HEAT_CELL_W - 2}" '
                f'height="{HEAT_CELL_H - 2}" rx="3" fill="{fill}"/>'
                f'<text class="{"value" if value is not None else "no-data"}" '
                f'x="{x + HEAT_CELL_W / 2:g}" y="{y + HEAT_CELL_H / 2 + 5:g}" '
                f'text-anchor="middle">{_attr(label)}</text></g>')
    # Colour scale.
    bar_x, bar_y, bar_w = HEAT_LEFT, grid_h + 18, len(PROMPT_LENGTH_ORDER) * HEAT_CELL_W
    out.append('<defs><linearGradient id="heat-scale-gradient" x1="0" x2="1" y1="0" y2="0">'
               + "".join(f'<stop offset="{f:g}" stop-color="{heat_colour(f * high_s, high_s)}"/>'
                         for f in (0, 0.25, 0.5, 0.75, 1))
               + "</linearGradient></defs>")
    out.append(f'<g class="colour-scale"><rect x="{bar_x}" y="{bar_y}" width="{bar_w}" '
               'height="12" fill="url(#heat-scale-gradient)"/>')
    for f, anchor in ((0, "start"), (0.5, "middle"), (1, "end")):
        label = ("\u2265 " if f == 1 else "") + format_ms(f * high_s)
        out.append(f'<text x="{bar_x + f * bar_w:g}" y="{bar_y + 28}" '
                   f'text-anchor="{anchor}">{_attr(label)}</text>')
    out.append("</g></svg>")
    return "".join(out)


def render_heatmap_panel(heat: HeatmapData, high_s: float, range_text: str) -> str:
    notes = []
    if heat.other:
        notes.append("Buckets outside the fixed order (custom edges?): " + ", ".join(heat.other))
    notes.extend(f"Query failed: {e}" for e in heat.errors)
    notes_html = "".join(f'<p class="note">{_attr(n)}</p>' for n in notes)
    return (f'<figure class="panel heatmap-panel" id="panel-heatmap" data-panel="heatmap" '
            f'data-status="{heat.status}"><figcaption><h3>{_attr(HEATMAP_TITLE)}</h3>'
            f'<p class="desc">P{HEATMAP_QUANTILE * 100:g} request latency over {range_text} per '
            f'image resolution (rows: {", ".join(RESOLUTION_ORDER)}) and prompt length in '
            f'characters (columns: {", ".join(PROMPT_LENGTH_ORDER)}), in ms; green at 0 to red at '
            f'the latency alert\'s {high_s:g} s. Grey cells had no answered requests.</p>'
            f'</figcaption>{render_heatmap(heat, high_s)}{notes_html}</figure>')

