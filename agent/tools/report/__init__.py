"""``mrc-agent report``: the golden triangle and the latency heatmap from a live Prometheus, as one
self-contained HTML file (inline SVG, no scripts, no network, no external CSS or fonts) or a PNG
of it, for people without Grafana.

The report runs the dashboards' own expressions (``dashboards.queries.PanelQueries``, with Grafana's
macros replaced by :func:`dashboards.queries.substitute_macros`) and draws the alerts' threshold
lines from the same :class:`alerts.config.Config`, so the report, the dashboards and the pages
show the same numbers against the same lines.

* Golden triangle, over the range (``/api/v1/query_range``): process CPU user and hottest thread
  (line at the CPU alert's 95 %), PCIe TX/RX, NVLink TX/RX (line at 50 GB/s), SM instructions per
  DRAM byte (line at 8) or the GPM activity ratio, titled as such, whichever
  ``mrc_agent_compute_memory_source_info`` says is live, GPU utilisation and the starvation
  signal (line at the alert's 80 %).
* The prompt-length x resolution P90 latency heatmap over the whole range (one instant query at
  the end of the range, ``increase(...[range])``), rows and columns in the instrumentation
  library's fixed order, every cell with its value in ms or "no data".
* A header with the range, the Prometheus URL, the generation time, the live compute-to-memory
  source and every panel that had no data or whose query failed: a blank panel is never silent.

Every drawn element carries stable ids, classes and ``data-*`` attributes (``data-series-count``,
``data-points``, ``data-value``, ``data-cell="<1MP|0-50"``) so a test can check what is drawn in
the DOM a real browser built. ``--format png`` screenshots the HTML with headless Chromium.

The rooms, each importing only those before it:

* :mod:`~agent.tools.report.prom`: the Prometheus HTTP client, its errors, result parsing and
  Grafana's ``$__rate_interval``;
* :mod:`~agent.tools.report.charts`: the chart specs and the heatmap's query;
* :mod:`~agent.tools.report.data`: the collected series, charts, heatmap and report, and
  :func:`collect`;
* :mod:`~agent.tools.report.svg`: formatting, axes, ticks, colours, the charts and the heatmap
  as SVG;
* :mod:`~agent.tools.report.page`: the CSS and the whole HTML page, and its height;
* :mod:`~agent.tools.report.chromium`: headless Chromium for ``--format png``;
* :mod:`~agent.tools.report.options`: the validated flags;
* :mod:`~agent.tools.report.command`: the command.

Durations (``1h30m``) are parsed and written by :mod:`agent.core.units`.

Every public name of these rooms is re-exported here, so ``from agent.tools.report import X``
works as it did when the report was one module.
"""

from __future__ import annotations

from agent.tools.report.charts import (
    HEATMAP_QUANTILE,
    HEATMAP_TITLE,
    SOURCE_GPM,
    SOURCE_PROFILING,
    ChartSpec,
    Threshold,
    chart_specs,
    heatmap_query,
)
from agent.tools.report.chromium import (
    PAGE_WIDTH_PX,
    chromium_args,
    find_chromium,
    run_chromium,
    screenshot,
)
from agent.tools.report.command import (
    EXIT_UNREACHABLE,
    run_report,
    run_report_command,
)
from agent.tools.report.data import (
    MAX_SERIES_PER_CHART,
    ChartData,
    HeatmapData,
    Report,
    Series,
    collect,
    legend_for,
)
from agent.tools.report.options import MAX_POINTS, ReportOptions, options_from_args
from agent.tools.report.page import (
    page_height,
    render_html,
)
from agent.tools.report.prom import (
    DEFAULT_SCRAPE_INTERVAL_S,
    MAX_BODY_BYTES,
    PromClient,
    QueryError,
    Unreachable,
    rate_interval,
)
from agent.tools.report.svg import (
    CHART_H,
    CHART_W,
    HEAT_CELL_H,
    HEAT_CELL_W,
    HEAT_LEFT,
    HEAT_TOP,
    PALETTE,
    PLOT_B,
    PLOT_L,
    PLOT_R,
    PLOT_T,
    THRESHOLD_COLOUR,
    format_ms,
    format_value,
    heat_colour,
    nice_step,
    render_chart,
    render_chart_panel,
    render_heatmap,
    render_heatmap_panel,
    time_ticks,
    y_domain,
)

__all__ = [
    "CHART_H",
    "CHART_W",
    "ChartData",
    "ChartSpec",
    "DEFAULT_SCRAPE_INTERVAL_S",
    "EXIT_UNREACHABLE",
    "HEATMAP_QUANTILE",
    "HEATMAP_TITLE",
    "HEAT_CELL_H",
    "HEAT_CELL_W",
    "HEAT_LEFT",
    "HEAT_TOP",
    "HeatmapData",
    "MAX_BODY_BYTES",
    "MAX_POINTS",
    "MAX_SERIES_PER_CHART",
    "PAGE_WIDTH_PX",
    "PALETTE",
    "PLOT_B",
    "PLOT_L",
    "PLOT_R",
    "PLOT_T",
    "PromClient",
    "QueryError",
    "Report",
    "ReportOptions",
    "SOURCE_GPM",
    "SOURCE_PROFILING",
    "Series",
    "THRESHOLD_COLOUR",
    "Threshold",
    "Unreachable",
    "chart_specs",
    "chromium_args",
    "collect",
    "find_chromium",
    "format_ms",
    "format_value",
    "heat_colour",
    "heatmap_query",
    "legend_for",
    "nice_step",
    "options_from_args",
    "page_height",
    "rate_interval",
    "render_chart",
    "render_chart_panel",
    "render_heatmap",
    "render_heatmap_panel",
    "render_html",
    "run_chromium",
    "run_report",
    "run_report_command",
    "screenshot",
    "time_ticks",
    "y_domain",
]
