"""``mrc-agent report``: the golden triangle and the latency heatmap from a live Prometheus, as one
self-contained HTML file (inline SVG, no scripts, no network, no external CSS or fonts) or a PNG
of it, for people without Grafana.

The report runs the dashboards' own expressions (``dashboards.queries.PanelQueries``, with Grafana's
macros replaced by :func:`mrc_agent.dashboards.queries.substitute_macros`) and draws the alerts'
threshold lines from the same :class:`mrc_agent.alerts.config.Config`, so the report, the dashboards
and the pages show the same numbers against the same lines.

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

* :mod:`~mrc_agent.agent.tools.report.prom`: the Prometheus HTTP client, its errors, result parsing
and
  Grafana's ``$__rate_interval``;
* :mod:`~mrc_agent.agent.tools.report.charts`: the chart specs and the heatmap's query;
* :mod:`~mrc_agent.agent.tools.report.data`: the collected series, charts, heatmap and report, and
  :func:`collect`;
* :mod:`~mrc_agent.agent.tools.report.svg`: formatting, axes, ticks, colours, the charts and the
heatmap
  as SVG;
* :mod:`~mrc_agent.agent.tools.report.page`: the CSS and the whole HTML page, and its height;
* :mod:`~mrc_agent.agent.tools.report.chromium`: headless Chromium for ``--format png``;
* :mod:`~mrc_agent.agent.tools.report.options`: the validated flags;
* :mod:`~mrc_agent.agent.tools.report.command`: the command.

Durations (``1h30m``) are parsed and written by :mod:`mrc_agent.agent.core.units`.

The package exports the command (:func:`run_report_command`); the rest is imported from its
room.
"""

from __future__ import annotations

from mrc_agent.agent.tools.report.command import run_report_command

__all__ = ["run_report_command"]
