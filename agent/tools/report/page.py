"""The page: its inline CSS, the header (range, Prometheus, generation time, live
compute-to-memory source, the panels without data or whose query failed) around the charts and
the heatmap as one self-contained HTML document, and an estimate of its height for the PNG.
"""

from __future__ import annotations

from mrc_agent.agent import __version__
from mrc_agent.agent.core.units import format_duration
from mrc_agent.agent.tools.report.charts import SOURCE_GPM, SOURCE_PROFILING
from mrc_agent.agent.tools.report.data import Report
from mrc_agent.agent.tools.report.prom import DEFAULT_SCRAPE_INTERVAL_S
from mrc_agent.agent.tools.report.svg import (
    CHART_H,
    HEAT_CELL_H,
    HEAT_TOP,
    _attr,
    _utc,
    render_chart_panel,
    render_heatmap_panel,
)
from mrc_agent.dashboards.queries import RESOLUTION_ORDER

_CSS = """
*{box-sizing:border-box}
body{margin:0;padding:20px 24px;width:1280px;background:#fff;color:#1d2127;
 font:13px/1.4 "DejaVu Sans","Liberation Sans",Arial,sans-serif}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:18px 0 8px;
 border-bottom:1px solid #d6d9de;padding-bottom:4px}h3{font-size:14px;margin:0}
header dl{display:grid;grid-template-columns:190px 1fr;gap:2px 12px;margin:0}
header dt{color:#58606b}header dd{margin:0}
ul.inline{margin:0;padding:0;list-style:none}ul.inline li{display:inline}
ul.inline li+li:before{content:"\\00a0\\00b7\\00a0";color:#58606b}
.grid{display:grid;grid-template-columns:600px 600px;gap:14px 16px}
.panel{margin:0;padding:10px;border:1px solid #d6d9de;border-radius:4px;background:#fff}
.desc{margin:2px 0 6px;color:#58606b;font-size:12px;min-height:34px}
.note{margin:4px 0 0;color:#8a4b00;font-size:12px}
.source{margin:4px 0 0;color:#3b424c;font-size:12px;font-style:italic}
svg text{font:11px "DejaVu Sans","Liberation Sans",Arial,sans-serif;fill:#3b424c}
svg text.no-data{font-size:16px;fill:#8a9099}svg text.threshold-label{fill:#d0021b}
svg.heatmap text.value{font-size:15px;font-weight:bold;fill:#111}
svg.heatmap text.no-data{font-size:13px}
ul.legend{margin:4px 0 0;padding:0;list-style:none;font-size:12px}
ul.legend li{margin:1px 0}.swatch{display:inline-block;width:16px;height:3px;
 vertical-align:middle;margin-right:6px}.stats{color:#58606b}
.bad{color:#b00020;font-weight:bold}.good{color:#2e7d32}
"""


def _source_text(report: Report) -> str:
    if report.source_error:
        return f"unknown (query failed: {report.source_error})"
    if not report.sources:
        return "unknown (no mrc_agent_compute_memory_source_info: no agent in the selection)"
    words = {SOURCE_PROFILING: "profiling counters (CUPTI PM sampling): true SM instructions "
             "per DRAM byte", SOURCE_GPM: "GPM activity proxy (not an instruction count)",
             "none": "none"}
    return "; ".join(f"{words.get(s, s)}" + (f" (reason: {r})" if r and r != "ok" else "")
                     for s, r in report.sources)


def render_html(report: Report) -> str:
    """The whole report as one self-contained HTML document."""
    finite_t = [t for c in report.charts for s in c.series for t, v in s.points if v is not None]
    x1 = report.end
    x0 = max(report.start, min(finite_t, default=report.start))
    if x1 - x0 < report.step_s:
        x0 = x1 - max(report.step_s, 1.0)
    range_text = f"the last {format_duration(report.end - report.start)}"
    starts_late = x0 > report.start + report.step_s
    charts_from = (f"; charts start at the first sample, {_utc(x0, '%H:%M:%S')} (nothing "
                   "earlier in the range)" if starts_late else "")
    no_data = report.no_data
    failed = report.failed
    if no_data:
        no_data_html = (f'<ul class="inline" id="no-data" data-count="{len(no_data)}">'
                        + "".join(f'<li data-panel="{k}" class="bad">{_attr(t)}</li>'
                                  for k, t in no_data) + "</ul>")
    else:
        no_data_html = ('<ul class="inline" id="no-data" data-count="0"></ul>'
                        '<span class="good">none: every panel has data</span>')
    failed_html = ""
    if failed:
        failed_html = ('<dt>Queries that failed</dt><dd><ul id="failed" '
                       f'data-count="{len(failed)}">'
                       + "".join(f'<li data-panel="{k}" class="bad">{_attr(t)}: {_attr(e)}</li>'
                                 for k, t, e in failed) + "</ul></dd>")
    scrape = (f"{format_duration(report.scrape_interval_s)} scrape interval"
              if report.scrape_interval_s else
              f"scrape interval not reported, {DEFAULT_SCRAPE_INTERVAL_S:g}s assumed")
    version = f" (Prometheus {_attr(report.version)})" if report.version else ""
    sources = ",".join(s for s, _ in report.sources)
    source_text = _source_text(report)
    header = (
        '<header id="report-header"><h1>MRC report: golden triangle and latency heatmap</h1><dl>'
        f'<dt>Time range</dt><dd id="time-range" data-start="{report.start:.0f}" '
        f'data-end="{report.end:.0f}" data-range-seconds="{report.end - report.start:g}" '
        f'data-step-seconds="{report.step_s:g}">{_utc(report.start)} to {_utc(report.end)} '
        f'({range_text}), step {format_duration(report.step_s)}{charts_from}</dd>'
        f'<dt>Prometheus</dt><dd id="prometheus-url" data-url="{_attr(report.prometheus)}">'
        f'{_attr(report.prometheus)}{version}</dd>'
        f'<dt>Selector</dt><dd id="selector">{_attr(report.selector or "(none: every series)")}'
        '</dd>'
        f'<dt>Generated at</dt><dd id="generated-at" data-epoch="{report.generated_at:.0f}">'
        f'{_utc(report.generated_at)} by mrc-agent {_attr(__version__)}</dd>'
        f'<dt>Rate window</dt><dd id="rate-window" data-seconds="{report.rate_interval_s:g}">'
        f'{format_duration(report.rate_interval_s)} (Grafana\'s $__rate_interval: {scrape})</dd>'
        f'<dt>Compute-to-memory source</dt><dd id="compute-source" data-sources="{_attr(sources)}">'
        f'{_attr(source_text)}</dd>'
        f'<dt>Panels with no data</dt><dd>{no_data_html}</dd>{failed_html}</dl></header>')
    source_note = f"Live source: {source_text}."
    charts = "".join(render_chart_panel(c, x0, x1, source_note) for c in report.charts)
    body = (f'{header}<section id="golden-triangle"><h2>Golden triangle '
            f'<small>(times in UTC)</small></h2><div class="grid">{charts}</div></section>'
            f'<section id="latency-heatmap"><h2>Latency by prompt length x resolution</h2>'
            f'{render_heatmap_panel(report.heatmap, report.latency_max_s, range_text)}</section>')
    return ('<!DOCTYPE html><html lang="en" data-report="mrc" '
            f'data-generated-at="{report.generated_at:.0f}"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=1280">'
            f'<title>MRC report {_utc(report.end)}</title><style>{_CSS}</style></head>'
            f'<body>{body}</body></html>\n')


def page_height(report: Report) -> int:
    """A generous estimate of the page's height in px at 1280 px wide (the PNG's viewport);
    the blank bottom is trimmed when Pillow is installed."""
    header = 60 + 22 * 8 + 22 * len(report.failed)
    cards = []
    for c in report.charts:
        legend = sum(1 for s in c.series if s.finite)
        notes = (c.spec.key.startswith("compute-")) + len(c.errors) + bool(c.empty_queries)
        cards.append(40 + 40 + CHART_H + 20 * legend + 36 * notes + 24)
    rows = [max(cards[i:i + 2]) for i in range(0, len(cards), 2)]
    grid = sum(rows) + 14 * len(rows) + 50
    heat = 60 + 40 + HEAT_TOP + len(RESOLUTION_ORDER) * HEAT_CELL_H + 64 + 40
    return header + grid + heat + 200

