"""What the report drew: :class:`Series`, :class:`ChartData`, :class:`HeatmapData` and the whole
:class:`Report`, and :func:`collect`, which runs every query of the report against Prometheus.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mrc_agent.agent.tools.report.charts import HEATMAP_TITLE, ChartSpec, chart_specs, heatmap_query
from mrc_agent.agent.tools.report.prom import (
    DEFAULT_SCRAPE_INTERVAL_S,
    PromClient,
    QueryError,
    _value,
    labels_of,
    rate_interval,
)
from mrc_agent.dashboards.queries import (
    PROMPT_LENGTH_ORDER,
    RESOLUTION_ORDER,
    PanelQueries,
    Query,
    substitute_macros,
)

if TYPE_CHECKING:
    from mrc_agent.agent.tools.report.options import ReportOptions


#: Series drawn per chart at most: a fleet-wide selector would otherwise draw a thousand lines
#: nobody can read and a file nobody can open. The ones with the highest peaks are kept.
MAX_SERIES_PER_CHART = 10


@dataclass
class Series:
    legend: str
    points: list[tuple[float, float | None]]

    @property
    def finite(self) -> list[float]:
        return [v for _, v in self.points if v is not None]


@dataclass
class ChartData:
    spec: ChartSpec
    series: list[Series] = field(default_factory=list)
    empty_queries: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dropped: int = 0

    @property
    def status(self) -> str:
        if any(s.finite for s in self.series):
            return "ok"
        return "error" if self.errors else "no-data"


@dataclass
class HeatmapData:
    #: P90 in seconds by (resolution, prompt_length); NaN answers (no requests) are left out.
    cells: dict[tuple[str, str], float] = field(default_factory=dict)
    #: Bucket values outside the fixed 3 x 3 order (a service with custom edges).
    other: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.cells:
            return "ok"
        return "error" if self.errors else "no-data"


@dataclass
class Report:
    prometheus: str
    version: str | None
    selector: str
    start: float
    end: float
    step_s: float
    rate_interval_s: float
    scrape_interval_s: float | None
    generated_at: float
    sources: list[tuple[str, str]]
    source_error: str | None
    charts: list[ChartData]
    heatmap: HeatmapData
    latency_max_s: float

    @property
    def no_data(self) -> list[tuple[str, str]]:
        """(panel key, title) of every panel that drew nothing although its queries ran."""
        out = [(c.spec.key, c.spec.title) for c in self.charts if c.status == "no-data"]
        if self.heatmap.status == "no-data":
            out.append(("heatmap", HEATMAP_TITLE))
        return out

    @property
    def failed(self) -> list[tuple[str, str, str]]:
        out = [(c.spec.key, c.spec.title, "; ".join(c.errors)) for c in self.charts if c.errors]
        if self.heatmap.errors:
            out.append(("heatmap", HEATMAP_TITLE, "; ".join(self.heatmap.errors)))
        return out


_LEGEND_VAR = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def legend_for(template: str, labels: dict[str, str]) -> str:
    """Grafana's legend format: ``{{label}}`` replaced, empty labels dropped, spaces tidied."""
    text = _LEGEND_VAR.sub(lambda m: labels.get(m.group(1), ""), template)
    text = re.sub(r"\(\s*\)", "", text)
    text = " ".join(text.split())
    if text:
        return text
    shown = {k: v for k, v in labels.items() if k != "__name__"}
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items())) + "}"


def points(values: Any) -> list[tuple[float, float | None]]:
    """A range result's ``[[time, "value"], ...]`` as (time, value) pairs; a malformed point (not
    a pair, a time that is not a finite number) is dropped, a value that is not a finite number
    is a gap (None). What a server sends never ends in a traceback."""
    out: list[tuple[float, float | None]] = []
    for point in values if isinstance(values, list) else []:
        if not isinstance(point, (list, tuple)) or len(point) != 2:
            continue
        t = _value(point[0])
        if t is not None:
            out.append((t, _value(point[1])))
    return out


def collect(client: PromClient, opts: ReportOptions, now: float | None = None) -> Report:
    """Run every query of the report against Prometheus. Raises :class:`Unreachable`."""
    version = client.version()
    scrape = client.scrape_interval()
    rate_s = rate_interval(opts.step_s, scrape or DEFAULT_SCRAPE_INTERVAL_S)
    end = math.floor((time.time() if now is None else now) / opts.step_s) * opts.step_s
    start = end - opts.range_s

    def expr(query: Query) -> str:
        return substitute_macros(query.expr, range_s=opts.range_s, rate_interval_s=rate_s,
                                 interval_s=opts.step_s)

    q = PanelQueries(opts.cfg)
    sources: list[tuple[str, str]] = []
    source_error = None
    try:
        for r in client.query(expr(q.compute_memory_source), end):
            labels = labels_of(r)
            pair = (labels.get("source", "none"), labels.get("reason", ""))
            if pair not in sources:
                sources.append(pair)
    except QueryError as exc:
        source_error = str(exc)

    charts = []
    for spec in chart_specs(opts.cfg, (s for s, _ in sources)):
        data = ChartData(spec)
        for query in spec.queries:
            try:
                result = client.query_range(expr(query), start, end, opts.step_s)
            except QueryError as exc:
                data.errors.append(f"{query.legend or query.expr}: {exc}")
                continue
            found = [Series(legend_for(query.legend, labels_of(r)), points(r.get("values")))
                     for r in result]
            if not any(s.finite for s in found):
                data.empty_queries.append(legend_for(query.legend, {}) or query.expr)
            data.series.extend(found)
        if len(data.series) > MAX_SERIES_PER_CHART:
            peak = sorted(data.series, key=lambda s: max(s.finite, default=-math.inf),
                          reverse=True)[:MAX_SERIES_PER_CHART]
            keep = {id(s) for s in peak}
            data.dropped = len(data.series) - len(peak)
            data.series = [s for s in data.series if id(s) in keep]
        charts.append(data)

    heat = HeatmapData()
    try:
        for r in client.query(expr(heatmap_query(opts.cfg)), end):
            labels = labels_of(r)
            res, prompt = labels.get("resolution", ""), labels.get("prompt_length", "")
            point = points([r.get("value")])
            value = point[0][1] if point else None
            if res not in RESOLUTION_ORDER or prompt not in PROMPT_LENGTH_ORDER:
                heat.other.append(f"{res} x {prompt}")
            elif value is not None:
                heat.cells[(res, prompt)] = value
    except QueryError as exc:
        heat.errors.append(str(exc))

    return Report(opts.prometheus, version, opts.cfg.selector, start, end, opts.step_s, rate_s,
                  scrape, time.time(), sources, source_error, charts, heat,
                  opts.cfg.thresholds.latency_p99_seconds)

