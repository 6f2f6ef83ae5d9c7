"""``mrc-agent report``: the golden triangle and the latency heatmap from a live Prometheus, as one
self-contained HTML file (inline SVG, no scripts, no network, no external CSS or fonts) or a PNG
of it, for people without Grafana.

The report runs the dashboards' own expressions (``dashboards.queries.Queries``, with Grafana's
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
"""

from __future__ import annotations

import contextlib
import html
import http.client
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from agent import __version__
from agent.core.config import ConfigError
from alerts.config import Config
from dashboards.queries import (
    PROMPT_LENGTH_ORDER,
    RESOLUTION_ORDER,
    Queries,
    Query,
    substitute_macros,
)

#: Exit code when Prometheus cannot be reached or does not answer like Prometheus (bad flags
#: are code 2, from cli.py).
EXIT_UNREACHABLE = 1
#: Prometheus refuses a range query that would return more points per series than this.
MAX_POINTS = 11_000
#: Series drawn per chart at most: a fleet-wide selector would otherwise draw a thousand lines
#: nobody can read and a file nobody can open. The ones with the highest peaks are kept.
MAX_SERIES_PER_CHART = 10
#: Answers larger than this are refused (a selector matching a whole fleet over a long range).
MAX_BODY_BYTES = 64 << 20
#: Grafana's default when it cannot know the scrape interval.
DEFAULT_SCRAPE_INTERVAL_S = 15.0
#: Chromium's viewport width for ``--format png``; the page is laid out for it.
PAGE_WIDTH_PX = 1280

_DURATION = re.compile(r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?"
                       r"(?:(\d+)ms)?")
_DURATION_UNITS = (365 * 86400.0, 7 * 86400.0, 86400.0, 3600.0, 60.0, 1.0, 0.001)


# -- flags -------------------------------------------------------------------------------------

def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration (``1h30m``, ``5m``, ``500ms``) or a plain number."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        m = _DURATION.fullmatch(text)
        if not text or m is None:
            raise ValueError(f"{text!r} is not a duration such as 1h, 5m, 15s or 500ms") from None
        seconds = sum(int(g) * unit for g, unit in zip(m.groups(), _DURATION_UNITS, strict=True)
                      if g is not None)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{text!r} must be a positive duration")
    return seconds


def format_duration(seconds: float) -> str:
    """``seconds`` as a short Prometheus-style duration (``1h30m``, ``2s``, ``250ms``)."""
    ms = round(seconds * 1000)
    if ms % 1000:
        return f"{ms}ms" if ms < 60_000 else f"{seconds:g}s"
    s = ms // 1000
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size:
            parts.append(f"{s // size}{unit}")
            s %= size
    return "".join(parts)


@dataclass(frozen=True)
class ReportOptions:
    """The validated flags of ``mrc-agent report``."""

    prometheus: str
    out: Path
    range_s: float
    step_s: float
    cfg: Config
    fmt: str = "html"
    timeout_s: float = 10.0
    chromium: str | None = None


def options_from_args(args: Any) -> ReportOptions:
    """Validate the CLI flags; raises :class:`ConfigError` (exit code 2) with one clear line."""
    from alerts.build import BuildError, config_for

    url = (args.prometheus or "").strip().rstrip("/")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"--prometheus {args.prometheus!r} is not an http(s) URL such as "
                          "http://prometheus:9090")
    try:
        range_s = parse_duration(args.range)
    except ValueError as exc:
        raise ConfigError(f"--range {exc}") from None
    try:
        step_s = parse_duration(args.step)
    except ValueError as exc:
        raise ConfigError(f"--step {exc}") from None
    if step_s < 0.001:
        raise ConfigError("--step must be at least 1ms")
    if step_s > range_s:
        raise ConfigError(f"--step {args.step} is longer than --range {args.range}")
    points = range_s / step_s + 1
    if points > MAX_POINTS:
        raise ConfigError(f"--range {args.range} at --step {args.step} is {points:.0f} points per "
                          f"series; Prometheus allows {MAX_POINTS}: use a longer --step")
    try:
        cfg = config_for(args.selector)
    except BuildError as exc:
        raise ConfigError(str(exc)) from None
    out = Path(args.out)
    fmt = args.format or ("png" if out.suffix.lower() == ".png" else "html")
    if not out.name or out.is_dir():
        raise ConfigError(f"--out {args.out!r} must be a file path")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {args.out!r}: directory {str(out.parent)!r} does not exist")
    timeout = float(args.timeout)
    if not 0 < timeout <= 300:
        raise ConfigError("--timeout must be > 0 and at most 300 seconds")
    chromium = None
    if fmt == "png":
        chromium = find_chromium(args.chromium)
        if chromium is None:
            raise ConfigError("--format png needs Chromium (Debian package chromium); none "
                              "found: install it or pass --chromium PATH")
    return ReportOptions(url, out, range_s, step_s, cfg, fmt, timeout, chromium)


def find_chromium(explicit: str | None = None) -> str | None:
    """The Chromium (or Chrome) executable: ``explicit`` if given and runnable, else on PATH."""
    if explicit:
        found = shutil.which(explicit)
        return found
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


# -- Prometheus HTTP API -----------------------------------------------------------------------

class Unreachable(Exception):
    """Prometheus cannot be reached, or what answered is not the Prometheus HTTP API."""


class QueryError(Exception):
    """Prometheus refused or aborted one query (bad expression, timeout, too many samples)."""


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


class PromClient:
    """A minimal client of the Prometheus HTTP API (stdlib only), every request bounded."""

    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.reached = False

    def get(self, path: str, params: dict[str, str] | None = None) -> Any:
        """``data`` of a successful answer; raises :class:`QueryError` or :class:`Unreachable`."""
        url = self.base_url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        req = urllib.request.Request(url, headers={
            "Accept": "application/json", "User-Agent": f"mrc-agent/{__version__} report"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310
                body = resp.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            # Prometheus answers a bad or aborted query with 400/422/503 and a JSON error body.
            payload = _json(exc.read(1 << 20))
            if isinstance(payload, dict) and payload.get("status") == "error":
                raise QueryError(f"{payload.get('errorType', 'error')}: "
                                 f"{payload.get('error', exc.reason)}") from None
            raise Unreachable(f"HTTP {exc.code} {exc.reason} from {self.base_url}{path}") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                self._timed_out()
            raise Unreachable(str(exc.reason)) from None
        except TimeoutError:
            self._timed_out()
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(str(exc) or type(exc).__name__) from None
        if len(body) > MAX_BODY_BYTES:
            raise QueryError(f"answer larger than {MAX_BODY_BYTES >> 20} MiB: narrow --selector "
                             "or use a longer --step")
        payload = _json(body)
        if not isinstance(payload, dict) or "status" not in payload:
            raise Unreachable(f"{self.base_url}{path} did not answer like the Prometheus HTTP API")
        if payload["status"] != "success":
            raise QueryError(f"{payload.get('errorType', 'error')}: {payload.get('error')}")
        self.reached = True
        return payload.get("data")

    def _timed_out(self) -> NoReturn:
        # Once Prometheus has answered, a timeout is one slow query (a failed panel in the
        # report); before that, nothing answers at that address.
        if self.reached:
            raise QueryError(f"no answer within {self.timeout_s:g} s (raise --timeout or "
                             "narrow --selector)") from None
        raise Unreachable(f"no answer within {self.timeout_s:g} s") from None

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", {"query": expr, "time": f"{at:.3f}"})
        return _result(data, "vector")

    def query_range(self, expr: str, start: float, end: float,
                    step: float) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}",
                                                "end": f"{end:.3f}", "step": f"{step:g}"})
        return _result(data, "matrix")

    def version(self) -> str | None:
        """Prometheus' version, or None where the server does not say (Thanos, Mimir, ...)."""
        try:
            data = self.get("/api/v1/status/buildinfo")
        except QueryError:
            return None
        return str(data.get("version")) if isinstance(data, dict) and data.get("version") else None

    def scrape_interval(self) -> float | None:
        """The longest scrape interval among the active targets, or None when not reported."""
        try:
            data = self.get("/api/v1/targets", {"state": "active"})
        except QueryError:
            return None
        intervals = []
        for target in (data or {}).get("activeTargets", []) if isinstance(data, dict) else []:
            try:
                intervals.append(parse_duration(str(target.get("scrapeInterval", ""))))
            except ValueError:
                continue
        return max(intervals) if intervals else None


def _result(data: Any, kind: str) -> list[dict[str, Any]]:
    if not isinstance(data, dict) or data.get("resultType") != kind:
        got = data.get("resultType") if isinstance(data, dict) else type(data).__name__
        raise QueryError(f"expected a {kind} result, got {got}")
    result = data.get("result") or []
    return [r for r in result if isinstance(r, dict)]


def rate_interval(step_s: float, scrape_s: float) -> float:
    """Grafana's ``$__rate_interval``: max(step + scrape interval, 4 x scrape interval)."""
    return max(step_s + scrape_s, 4 * scrape_s)


def _value(text: Any) -> float | None:
    try:
        v = float(text)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


# -- what the report shows ---------------------------------------------------------------------

@dataclass(frozen=True)
class Threshold:
    value: float
    label: str


@dataclass(frozen=True)
class ChartSpec:
    """One golden-triangle chart: the dashboard panel's title, queries and threshold line."""

    key: str
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str  # "percentunit" | "Bps" | "short"
    axis_label: str
    threshold: Threshold | None = None
    y_max: float | None = None
    #: Legend suffix of the series drawn dashed (the hottest thread, as on the dashboard).
    dashed_suffix: str = ""


#: Compute-to-memory sources, as the agent names them in mrc_agent_compute_memory_source_info.
SOURCE_PROFILING = "cupti_pm_sampling"
SOURCE_GPM = "gpm_activity_proxy"
HEATMAP_TITLE = "P90 latency by resolution x prompt length"
HEATMAP_QUANTILE = 0.9


def chart_specs(cfg: Config, sources: Iterable[str]) -> list[ChartSpec]:
    """The golden-triangle charts, titled as the dashboard's panels; the compute-to-memory chart
    is the one of the live source (both where agents differ, the true counters where none)."""
    q = Queries(cfg)
    t = cfg.thresholds
    live = set(sources)
    cpu = ChartSpec(
        "cpu", "Process CPU user and hottest thread",
        "User CPU of the target process (solid) and of its busiest thread (dashed), as a share "
        f"of one core. The alert fires when the process holds the {t.cpu_user_ratio:.0%} line "
        f"for {t.cpu_user_for}.",
        (q.cpu_user, q.hottest_thread), "percentunit", "share of one core",
        Threshold(t.cpu_user_ratio, f"{t.cpu_user_ratio:.0%} MRCProcessCPUUserSaturated"),
        dashed_suffix="hottest thread")
    pcie = ChartSpec(
        "pcie", "PCIe TX/RX bandwidth",
        "PCIe throughput per GPU as NVML measures it. Host-to-device (RX) carries the decoded "
        "images; no alert fires on PCIe, so no line.",
        (q.pcie_tx, q.pcie_rx), "Bps", "bytes per second")
    nvlink = ChartSpec(
        "nvlink", "NVLink TX/RX bandwidth",
        f"NVLink data bytes per second per GPU. Below the line at "
        f"{t.nvlink_bytes_per_second / 1e9:g} GB/s (TX + RX) for {t.nvlink_for} while the GPU is "
        "busy, a tensor-parallel model starves on transfers.",
        (q.nvlink_tx, q.nvlink_rx, q.nvlink_total), "Bps", "bytes per second",
        Threshold(t.nvlink_bytes_per_second,
                  f"{t.nvlink_bytes_per_second / 1e9:g} GB/s MRCNVLinkBandwidthLow"))
    instructions = ChartSpec(
        "compute-instructions", "SM instructions per DRAM byte (profiling counters)",
        "rate(sm__inst_executed) / rate(dram__bytes_read) from the profiling counters. Below "
        f"the line at {t.instructions_per_dram_byte:g} the kernels are memory-bound.",
        (q.instructions_per_dram_byte,), "short", "instructions per byte",
        Threshold(t.instructions_per_dram_byte,
                  f"{t.instructions_per_dram_byte:g} MRCGPUMemoryBound"))
    gpm = ChartSpec(
        "compute-gpm", "GPM activity ratio (SM activity / DRAM bandwidth utilisation)",
        "The GPM proxy used where the profiling counters are unavailable: SM activity divided by "
        "DRAM bandwidth utilisation. Not an instruction count; its own line is at "
        f"{t.gpm_sm_to_dram_activity:g}.",
        (q.gpm_activity_ratio,), "short", "activity ratio",
        Threshold(t.gpm_sm_to_dram_activity,
                  f"{t.gpm_sm_to_dram_activity:g} MRCGPUMemoryBoundGPMProxy"))
    compute = [s for s, src in ((instructions, SOURCE_PROFILING), (gpm, SOURCE_GPM)) if src in live]
    utilisation = ChartSpec(
        "gpu-utilisation", "GPU utilisation",
        "Share of each NVML sample period during which a kernel ran.",
        (q.gpu_utilization,), "percentunit", "share of time busy", y_max=1.0)
    starvation = ChartSpec(
        "starvation", "GPU starvation signal",
        "100 % while the target's CPU is hot and its GPUs idle, and the share of the last "
        f"{t.starved_window} in that state, which pages above the line at "
        f"{t.starved_fraction:.0%} held for {t.starved_for}.",
        (q.starved, q.starved_share), "percentunit", "share of time starved",
        Threshold(t.starved_fraction, f"{t.starved_fraction:.0%} MRCGPUStarved"), y_max=1.0)
    return [cpu, pcie, nvlink, *(compute or [instructions]), utilisation, starvation]


def heatmap_query(cfg: Config) -> Query:
    return Queries(cfg).latency_quantile_matrix(HEATMAP_QUANTILE)


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

    q = Queries(opts.cfg)
    sources: list[tuple[str, str]] = []
    source_error = None
    try:
        for r in client.query(expr(q.compute_memory_source), end):
            labels = r.get("metric", {})
            pair = (str(labels.get("source", "none")), str(labels.get("reason", "")))
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
            found = [Series(legend_for(query.legend, r.get("metric", {})),
                            [(float(t), _value(v)) for t, v in r.get("values", [])])
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
            labels = r.get("metric", {})
            res, prompt = labels.get("resolution", ""), labels.get("prompt_length", "")
            value = _value((r.get("value") or [None, None])[1])
            if res not in RESOLUTION_ORDER or prompt not in PROMPT_LENGTH_ORDER:
                heat.other.append(f"{res} x {prompt}")
            elif value is not None:
                heat.cells[(res, prompt)] = value
    except QueryError as exc:
        heat.errors.append(str(exc))

    return Report(opts.prometheus, version, opts.cfg.selector, start, end, opts.step_s, rate_s,
                  scrape, time.time(), sources, source_error, charts, heat,
                  opts.cfg.thresholds.latency_p99_seconds)


# -- formatting --------------------------------------------------------------------------------

_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _num(v: float, digits: int = 3) -> str:
    text = f"{v:.{digits}g}"
    if "e" in text:
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
    return f"{seconds * 1000:,.0f} ms"


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


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


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
    if hi <= lo:
        hi = lo + 1.0
    step = nice_step((hi - lo) / 5)
    return math.floor(lo / step) * step, math.ceil(hi / step - 1e-9) * step, step


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


# -- the page ----------------------------------------------------------------------------------

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


# -- PNG ---------------------------------------------------------------------------------------

def chromium_args(chromium: str, user_data_dir: str) -> list[str]:
    """Headless Chromium that stays off the network and keeps its state in ``user_data_dir``."""
    args = [chromium, "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", "--force-device-scale-factor=1",
            f"--user-data-dir={user_data_dir}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--no-sandbox")  # Chromium refuses to run its sandbox as root
    return args


def screenshot(chromium: str, html_path: Path, png_path: Path, height: int,
               timeout_s: float = 60.0) -> None:
    """Render ``html_path`` to ``png_path`` with headless Chromium. Raises RuntimeError."""
    with tempfile.TemporaryDirectory(prefix="mrc-report-chromium-") as profile:
        cmd = [*chromium_args(chromium, profile), f"--window-size={PAGE_WIDTH_PX},{height}",
               f"--screenshot={png_path}", html_path.resolve().as_uri()]
        code, output = run_chromium(cmd, timeout_s)
        if code != 0 or not png_path.is_file() or png_path.stat().st_size == 0:
            tail = output.strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"Chromium exited {code} without a screenshot: {tail[0]}")
    _trim_bottom(png_path)


def run_chromium(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """Run Chromium in its own process group, so that on a timeout its helpers (zygote,
    renderer) are killed with it; (exit code, stdout + stderr). Raises RuntimeError."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
    except OSError as exc:
        raise RuntimeError(f"cannot run {cmd[0]}: {exc}") from None
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"Chromium did not finish within {timeout_s:g} s") from None
    finally:
        # Gone already when Chromium exited cleanly with its helpers.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, out.decode(errors="replace")


def _trim_bottom(png_path: Path, margin: int = 24) -> None:
    """Cut the blank rows below the content (the viewport is an estimate). Needs Pillow."""
    try:
        from PIL import Image, ImageChops
    except ImportError:
        return
    with Image.open(png_path) as img:
        rgb = img.convert("RGB")
    bg = Image.new("RGB", rgb.size, rgb.getpixel((rgb.width - 1, rgb.height - 1)))
    box = ImageChops.difference(rgb, bg).getbbox()
    if box and box[3] + margin < rgb.height:
        rgb.crop((0, 0, rgb.width, box[3] + margin)).save(png_path)


# -- command -----------------------------------------------------------------------------------

def _summary(report: Report) -> str:
    cells = len(report.heatmap.cells)
    total = len(RESOLUTION_ORDER) * len(PROMPT_LENGTH_ORDER)
    no_data = ", ".join(t for _, t in report.no_data) or "none"
    failed = ("; queries failed: " + ", ".join(t for _, t, _ in report.failed)
              if report.failed else "")
    return (f"{len(report.charts)} charts, heatmap {cells}/{total} cells with data; "
            f"no data: {no_data}{failed}")


def run_report(opts: ReportOptions) -> int:
    """Query, render, write. 0 on success, 1 when Prometheus cannot be reached or the output
    cannot be written (one line on stderr)."""
    client = PromClient(opts.prometheus, opts.timeout_s)
    try:
        report = collect(client, opts)
    except Unreachable as exc:
        print(f"mrc-agent report: error: cannot reach Prometheus at {opts.prometheus}: {exc}",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    page = render_html(report)
    try:
        if opts.fmt == "png":
            assert opts.chromium is not None  # checked in options_from_args
            with tempfile.TemporaryDirectory(prefix="mrc-report-") as tmp:
                html_path = Path(tmp) / "report.html"
                html_path.write_text(page, encoding="utf-8")
                png = Path(tmp) / "report.png"
                screenshot(opts.chromium, html_path, png, page_height(report))
                shutil.copyfile(png, opts.out)
        else:
            opts.out.write_text(page, encoding="utf-8")
    except (OSError, RuntimeError) as exc:
        print(f"mrc-agent report: error: cannot write {opts.out}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {opts.out}: {_summary(report)}")
    return 0


def run_report_command(args: Any) -> int:
    """The CLI entry point; bad flags raise :class:`ConfigError` (exit code 2 in cli.py)."""
    return run_report(options_from_args(args))
