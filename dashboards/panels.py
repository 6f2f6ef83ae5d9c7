"""Panel constructors over grafanalib, and the one place where grafanalib's gaps are filled.

grafanalib (0.7.1) models the panels of Grafana 8: it has no current heatmap or bar-gauge
panel, no way to write some options current Grafana requires (``legend.showLegend``, the stat
panel's ``wideLayout``/``showPercentChange``, a table's ``cellOptions``/``inspect``/
``frameIndex``), and it writes fields that Grafana dropped long ago (``span``, ``height``,
``error``, ``rows``, ``style``, a target's ``step``/``intervalFactor``, a threshold step's
``op``/``yaxis``/``index``...). Every workaround lives in this module, so the dashboard modules
only say *what* to show:

* ``extraJson`` (grafanalib's documented escape hatch) adds the missing options, in the panel
  constructors below and nowhere else;
* :class:`HeatmapPanel` and :class:`BarGaugePanel` subclass grafanalib's ``Panel`` for the
  current panel types, :class:`PromTarget` its ``Target`` for the current Prometheus query model;
* :func:`current_json` turns grafanalib's output into current dashboard JSON: it drops the legacy
  fields listed in ``_LEGACY_*`` (explicitly, never "whatever the schema does not know", so the
  schema test still sees every real mistake), drops unset (``None``) values and sets the schema
  version.

Thresholds are built with :func:`above`/:func:`below` from the alert config's values; runbook
links with :func:`runbook`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import attr
from grafanalib._gen import DashboardEncoder
from grafanalib.core import (
    Dashboard,
    DashboardLink,
    GridPos,
    Panel,
    RowPanel,
    Stat,
    Table,
    Target,
    Template,
    Templating,
    Threshold,
    Time,
    TimeSeries,
)

from mrc_agent.alerts.config import Config
from mrc_agent.dashboards.queries import Query

#: The dashboard JSON schema version written (the vendored schema's default); Grafana migrates
#: older dashboards up to its own on load, so writing the current one skips every migration.
SCHEMA_VERSION = 41

#: Every panel and query reads the data source the ``$datasource`` variable selects.
DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}

TAGS = ["mrc", "mrc-agent"]


class Alerts:
    """Names of the alerts (alerts/rules.py) whose runbooks the panels link to."""

    CPU_SATURATED = "MRCProcessCPUUserSaturated"
    NVLINK_LOW = "MRCNVLinkBandwidthLow"
    MEMORY_BOUND = "MRCGPUMemoryBound"
    MEMORY_BOUND_GPM = "MRCGPUMemoryBoundGPMProxy"
    STARVED = "MRCGPUStarved"
    TTFT_FAST_BURN = "MRCTimeToFirstTokenSLOFastBurn"
    TTFT_SLOW_BURN = "MRCTimeToFirstTokenSLOSlowBurn"
    LATENCY = "MRCRequestLatencyP99High"
    ERRORS = "MRCRequestErrorRateHigh"
    CHAIN_BREAKS = "MRCChainBreakRateHigh"
    PCIE_UNDER_COUNTED = "MRCAgentPCIeBytesUnderCounted"


# -- fields grafanalib writes that current Grafana does not have --------------------------

_LEGACY_DASHBOARD_KEYS = frozenset(
    {"__inputs", "rows", "style", "sharedCrosshair", "hideControls", "gnetId", "id"})
_LEGACY_PANEL_KEYS = frozenset(
    {"editable", "error", "height", "span", "minSpan",
     # the Grafana 7 table's top-level options, now under fieldConfig/options
     "columns", "fontSize", "mappings", "color"})
#: A row panel has only these fields; grafanalib gives it every field of a graph panel.
_ROW_KEYS = frozenset({"type", "collapsed", "title", "datasource", "gridPos", "id", "panels",
                       "repeat"})
_LEGACY_TARGET_KEYS = frozenset({"query", "target", "metric", "step", "intervalFactor"})
_LEGACY_TEMPLATE_KEYS = frozenset({"useTags", "tagsQuery", "tagValuesQuery", "auto", "auto_min",
                                   "auto_count"})
_THRESHOLD_STEP_KEYS = frozenset({"color", "value"})


# -- queries --------------------------------------------------------------------------------

class PromTarget(Target):
    """A Prometheus query in the current query model (``range``/``instant``, a data source ref)."""

    def to_json_data(self) -> dict[str, Any]:
        data: dict[str, Any] = super().to_json_data()
        for key in _LEGACY_TARGET_KEYS:
            data.pop(key, None)
        if not data["interval"]:
            del data["interval"]
        data.update(datasource=DATASOURCE, editorMode="code", range=not self.instant)
        return data


def _targets(queries: Sequence[Query], instant: bool = False,
             fmt: str = "time_series") -> list[PromTarget]:
    return [PromTarget(expr=q.expr, legendFormat=q.legend, refId=chr(ord("A") + i),
                       instant=instant, format=fmt)
            for i, q in enumerate(queries)]


# -- thresholds and links -----------------------------------------------------------------

def above(value: float, color: str = "red") -> list[Threshold]:
    """Threshold steps for a value that is bad at or above ``value``."""
    return [Threshold("green", 0, 0.0), Threshold(color, 1, float(value))]


def below(value: float) -> list[Threshold]:
    """Threshold steps for a value that is bad below ``value``."""
    return [Threshold("red", 0, 0.0), Threshold("green", 1, float(value))]


def base(color: str = "green") -> list[Threshold]:
    """A single base step: the panel colours nothing by value."""
    return [Threshold(color, 0, 0.0)]


def runbook(cfg: Config, *alerts: str) -> list[DashboardLink]:
    """Panel links to the runbooks of ``alerts`` (``{runbook_base}/<alert>.md``)."""
    return [DashboardLink(type="link", title=f"Runbook: {alert}",
                          uri=f"{cfg.runbook_base}/{alert}.md", icon="doc",
                          tooltip=f"What to check and fix when {alert} fires",
                          targetBlank=True, keepTime=False)
            for alert in alerts]


# -- panels ---------------------------------------------------------------------------------

@dataclass
class Cell:
    """A panel and the grid cell it takes (24 columns wide, ``h`` rows of 30 px)."""

    panel: Panel
    w: int = 12
    h: int = 8


@dataclass
class Section:
    """A row title and the panels under it, laid out left to right."""

    title: str
    cells: list[Cell] = field(default_factory=list)


def _common(title: str, description: str, links: Iterable[DashboardLink]) -> dict[str, Any]:
    # maxDataPoints=None: Grafana's default (one point per pixel), not grafanalib's 100. The
    # grid position is a placeholder until _layout() places the panel.
    return dict(title=title, description=description, dataSource=DATASOURCE,
                links=list(links), maxDataPoints=None, gridPos=GridPos(h=1, w=1, x=0, y=0))


def timeseries(title: str, queries: Sequence[Query], unit: str, *, description: str,
               thresholds: Sequence[Threshold] = (), links: Iterable[DashboardLink] = (),
               stack: bool = False, min_value: int | None = None,
               max_value: int | None = None, overrides: Sequence[dict[str, Any]] = (),
               w: int = 12, h: int = 8) -> Cell:
    """A time series panel; ``thresholds`` beyond the base step are drawn as dashed lines."""
    steps = list(thresholds) or base()
    panel = TimeSeries(
        **_common(title, description, links),
        targets=_targets(queries), unit=unit,
        thresholds=steps, thresholdsStyleMode="dashed" if len(steps) > 1 else "off",
        fillOpacity=40 if stack else 10, lineWidth=1, showPoints="never",
        stacking={"mode": "normal" if stack else "none", "group": "A"},
        tooltipMode="multi", tooltipSort="desc",
        legendDisplayMode="list", legendPlacement="bottom",
        valueMin=min_value, valueMax=max_value, overrides=list(overrides),
        extraJson={"options": {"legend": {"showLegend": True}}},
    )
    return Cell(panel, w, h)


def stat(title: str, queries: Sequence[Query], unit: str, *, description: str,
         thresholds: Sequence[Threshold] = (), links: Iterable[DashboardLink] = (),
         text_mode: str = "auto", color_mode: str = "value", graph_mode: str = "none",
         instant: bool = True, w: int = 6, h: int = 4) -> Cell:
    """A stat panel showing the last value of each series (instant queries by default)."""
    panel = Stat(
        **_common(title, description, links),
        targets=_targets(queries, instant=instant), format=unit,
        thresholds=list(thresholds) or base(), color={"mode": "thresholds"},
        reduceCalc="lastNotNull", textMode=text_mode, colorMode=color_mode,
        graphMode=graph_mode, noValue="no data",
        extraJson={"options": {"wideLayout": True, "showPercentChange": False,
                               "percentChangeColorMode": "standard"}},
    )
    return Cell(panel, w, h)


def table(title: str, queries: Sequence[Query], unit: str, *, description: str,
          transformations: Sequence[dict[str, Any]] = (),
          thresholds: Sequence[Threshold] = (), links: Iterable[DashboardLink] = (),
          colour_cells: bool = False, colour_scale: tuple[str, float, float] | None = None,
          overrides: Sequence[dict[str, Any]] = (), w: int = 12, h: int = 8) -> Cell:
    """A table of instant query results.

    ``colour_cells`` colours each cell's background: by ``thresholds``, or with
    ``colour_scale=(scheme, min, max)`` on a continuous ``scheme`` between ``min`` and ``max``.
    """
    custom: dict[str, Any] = {"inspect": False}
    defaults: dict[str, Any] = {"custom": custom}
    if colour_cells:
        # applyToRow makes the option unambiguous among the schema's cell-option shapes.
        custom["cellOptions"] = {"type": "color-background", "mode": "gradient",
                                 "applyToRow": False}
        defaults["color"] = {"mode": "thresholds"}
    if colour_scale is not None:
        scheme, lo, hi = colour_scale
        defaults.update(color={"mode": scheme}, min=lo, max=hi)
    panel = Table(
        **_common(title, description, links),
        targets=_targets(queries, instant=True, fmt="table"), unit=unit,
        thresholds=list(thresholds) or base(), transformations=list(transformations),
        overrides=list(overrides),
        extraJson={"fieldConfig": {"defaults": defaults},
                   "options": {"frameIndex": 0, "cellHeight": "sm"}},
    )
    return Cell(panel, w, h)


@attr.s
class HeatmapPanel(Panel):
    """Grafana's current heatmap panel (grafanalib's ``Heatmap`` is the pre-9 one) for
    pre-bucketed Prometheus histograms (``format: heatmap``, no client-side calculation)."""

    unit = attr.ib(default="short")
    y_unit = attr.ib(default="s")

    def to_json_data(self) -> dict[str, Any]:
        return self.panel_json({
            "type": "heatmap",
            "fieldConfig": {
                "defaults": {"unit": self.unit, "custom": {
                    "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                    "scaleDistribution": {"type": "linear"}}},
                "overrides": [],
            },
            "options": {
                "calculate": False,
                "cellGap": 1,
                "color": {"mode": "scheme", "scheme": "Oranges", "fill": "dark-orange",
                          "scale": "exponential", "exponent": 0.5, "steps": 64,
                          "reverse": False},
                "exemplars": {"color": "rgba(255,0,255,0.7)"},
                "filterValues": {"le": 1e-9},
                "legend": {"show": True},
                "rowsFrame": {"layout": "auto"},
                "showValue": "never",
                "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": False},
                "yAxis": {"axisPlacement": "left", "reverse": False, "unit": self.y_unit},
                "cellValues": {"unit": self.unit},
                "selectionMode": "x",
            },
        })


@attr.s
class BarGaugePanel(Panel):
    """Grafana's current bar gauge (grafanalib's ``BarGauge`` writes Grafana 6 options)."""

    unit = attr.ib(default="short")

    def to_json_data(self) -> dict[str, Any]:
        return self.panel_json({
            "type": "bargauge",
            "fieldConfig": {
                "defaults": {"unit": self.unit, "color": {"mode": "thresholds"}, "min": 0},
                "overrides": [],
            },
            "options": {
                "displayMode": "gradient", "valueMode": "color", "namePlacement": "auto",
                "showUnfilled": True, "sizing": "auto", "minVizWidth": 8, "minVizHeight": 16,
                "maxVizHeight": 300, "orientation": "vertical",
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False,
                           "calcs": []},
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            },
        })


def heatmap(title: str, query: Query, unit: str, y_unit: str, *, description: str,
            links: Iterable[DashboardLink] = (), w: int = 12, h: int = 8) -> Cell:
    """A heatmap of a Prometheus histogram's buckets over time (``unit``: the cell counts)."""
    kwargs = _common(title, description, links)
    kwargs.update(targets=_targets([query], fmt="heatmap"), thresholds=base())
    panel = HeatmapPanel(unit=unit, y_unit=y_unit, **kwargs)
    return Cell(panel, w, h)


def histogram_bars(title: str, query: Query, unit: str, *, description: str,
                   links: Iterable[DashboardLink] = (), w: int = 12, h: int = 8) -> Cell:
    """A bar per histogram bucket (``format: heatmap`` de-accumulates the ``le`` buckets)."""
    kwargs = _common(title, description, links)
    kwargs.update(targets=_targets([query], instant=True, fmt="heatmap"), thresholds=base("blue"))
    panel = BarGaugePanel(unit=unit, **kwargs)
    return Cell(panel, w, h)


# -- transformations and overrides (plain Grafana JSON: grafanalib passes them through) ---

def transformation(id_: str, **options: Any) -> dict[str, Any]:
    return {"id": id_, "options": options}


def override_by_type(field_type: str, **properties: dict[str, Any]) -> dict[str, Any]:
    """Field override for every field of ``field_type``; keys use ``__`` for ``.``."""
    return {"matcher": {"id": "byType", "options": field_type},
            "properties": [{"id": k.replace("__", "."), "value": v}
                           for k, v in properties.items()]}


def override_by_regexp(pattern: str, **properties: dict[str, Any]) -> dict[str, Any]:
    """Field override for fields whose name matches ``pattern``."""
    return {"matcher": {"id": "byRegexp", "options": pattern},
            "properties": [{"id": k.replace("__", "."), "value": v}
                           for k, v in properties.items()]}


# -- dashboards -----------------------------------------------------------------------------

def variables(queries: dict[str, str]) -> Templating:
    """``$datasource`` plus one multi-value query variable per ``name -> label_values(...)``."""
    items = [Template(name="datasource", label="Data source", type="datasource",
                      query="prometheus", default=None, regex="")]
    for name, query in queries.items():
        items.append(Template(name=name, label=name, query=query, dataSource=DATASOURCE,
                              includeAll=True, multi=True, allValue=".*", refresh=2))
    return Templating(list=items)


def _layout(sections: Sequence[Section]) -> list[Panel]:
    """Rows and their panels with grid positions, flowing left to right and wrapping at 24."""
    panels: list[Panel] = []
    y = 0
    for section in sections:
        panels.append(RowPanel(title=section.title, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        x, row_h = 0, 0
        for cell in section.cells:
            if x + cell.w > 24:
                y, x, row_h = y + row_h, 0, 0
            panels.append(attr.evolve(cell.panel, gridPos=GridPos(h=cell.h, w=cell.w, x=x, y=y)))
            x += cell.w
            row_h = max(row_h, cell.h)
        y += row_h
    return panels


def dashboard(title: str, uid: str, description: str, templating: Templating,
              sections: Sequence[Section]) -> dict[str, Any]:
    """A whole dashboard as current Grafana JSON (a dict; :func:`render` writes it)."""
    dash = Dashboard(
        title=title, uid=uid, description=description, tags=list(TAGS),
        panels=_layout(sections), templating=templating,
        time=Time("now-1h", "now"), timezone="browser", refresh="30s",
        graphTooltip=1, editable=True, version=1,
        links=[DashboardLink(type="dashboards", title="MRC dashboards", tags=list(TAGS[:1]),
                             asDropdown=True, includeVars=True, keepTime=True)],
    ).auto_panel_ids()
    return current_json(dash)


def current_json(dash: Dashboard) -> dict[str, Any]:
    """grafanalib's dashboard JSON, brought to the current model (see the module docstring)."""
    data: dict[str, Any] = json.loads(json.dumps(dash.to_json_data(), cls=DashboardEncoder))
    for key in _LEGACY_DASHBOARD_KEYS:
        data.pop(key, None)
    data["schemaVersion"] = SCHEMA_VERSION
    data["annotations"] = {"list": [{
        "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts", "type": "dashboard"}]}
    data["timepicker"].pop("time_options", None)
    data["panels"] = [_panel(p) for p in data["panels"]]
    for var in data["templating"]["list"]:
        for key in _LEGACY_TEMPLATE_KEYS:
            var.pop(key, None)
        # grafanalib writes a "current" of None when no default is given; Grafana then picks
        # the first option (All, or the default data source) itself.
        if var.get("current", {}).get("value") is None:
            var.pop("current", None)
    result: dict[str, Any] = _prune(data)
    return result


def _panel(panel: dict[str, Any]) -> dict[str, Any]:
    if panel["type"] == "row":
        row = {k: v for k, v in panel.items() if k in _ROW_KEYS}
        row["panels"] = [_panel(p) for p in row.get("panels", [])]
        return row
    for key in _LEGACY_PANEL_KEYS:
        panel.pop(key, None)
    defaults = panel["fieldConfig"]["defaults"]
    defaults.get("custom", {}).pop("displayMode", None)  # the v8 table's, now cellOptions
    thresholds = defaults.get("thresholds")
    if thresholds is not None:
        thresholds["steps"] = [
            {k: (None if k == "value" and v == "null" else v)
             for k, v in step.items() if k in _THRESHOLD_STEP_KEYS}
            for step in thresholds["steps"]]
    panel.setdefault("fieldConfig", {}).setdefault("overrides", [])
    return panel


def _prune(value: Any, key: str = "") -> Any:
    """Drop ``None`` values, recursively; a threshold step's ``None`` (-Infinity) stays."""
    if isinstance(value, dict):
        if key == "steps_item":
            return value
        return {k: _prune(v, k) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        item_key = "steps_item" if key == "steps" else ""
        return [_prune(v, item_key) for v in value]
    return value


def render(data: dict[str, Any]) -> str:
    """Deterministic text of a dashboard: sorted keys, two-space indent, final newline."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
