"""``mrc-agent report`` on real parts, checked in a real browser.

A real Prometheus on loopback (1 s scrapes) scrapes a real agent — watching a busy-spinning
process, replaying the synthetic ``starved`` trace with the profiling collector on — and the
reference service under the load generator. The report is rendered from that Prometheus by the
real CLI, then opened in headless Chromium (Debian ``chromium``): ``--dump-dom`` gives the DOM
the browser built, and the assertions read what is drawn there (path points, where the threshold
line sits on the axis, the heatmap cells in order) against what the test knows is true (what
the load generator sent, what Prometheus holds). ``--format png`` goes through Chromium's
``--screenshot`` and must give a PNG that is not blank.

The pure helpers (durations, axis steps, legends, colours) are unit-tested at the bottom, with
the flag errors (exit 2) and an unreachable Prometheus (exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from mrc_agent.agent.core.units import parse_duration
from mrc_agent.agent.tools.report.charts import chart_specs, heatmap_query
from mrc_agent.agent.tools.report.data import legend_for
from mrc_agent.agent.tools.report.prom import rate_interval
from mrc_agent.agent.tools.report.svg import heat_colour, nice_step, time_ticks, y_domain
from mrc_agent.alerts.config import DEFAULT
from tests.conftest import BUSY, REPO, AgentProcess, Procs
from tests.e2e_harness import Prometheus, free_port, wait_until
from tests.integration.test_service import Service

#: The heatmap's fixed order, spelled out: rows <1MP, 1-4MP, >4MP; columns 0-50, 50-100, 100+.
CELL_ORDER = [f"{r}|{c}" for r in ("<1MP", "1-4MP", ">4MP") for c in ("0-50", "50-100", "100+")]
GOLDEN_PANELS = ["cpu", "pcie", "nvlink", "compute-instructions", "gpu-utilisation",
                 "starvation"]
#: Per panel, a raw series whose presence in Prometheus means the panel must have data.
EVIDENCE = {
    "cpu": "mrc_process_cpu_user_ratio",
    "pcie": "mrc_gpu_pcie_rx_bytes_per_second",
    "nvlink": "mrc_gpu_nvlink_tx_bytes_total",
    "compute-instructions": "mrc_gpu_sm_instructions_executed_total",
    "gpu-utilisation": "mrc_gpu_utilization_ratio",
    "starvation": "mrc_gpu_starved",
    "heatmap": "mrc_request_duration_seconds_count",
}
LOAD_SECONDS = 15.0
MIN_POINTS = 5  # 2 s steps over >= 15 s of scraped data


# -- Chromium --------------------------------------------------------------------------------

def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        raise AssertionError("chromium is required (Debian package chromium)")
    return path


def chromium(*args: str, timeout: float = 60.0) -> str:
    """Run headless Chromium (own profile, no network, own process group killed at the end)."""
    with tempfile.TemporaryDirectory(prefix="test-report-chromium-") as profile:
        cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
               *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.returncode == 0, f"chromium exited {proc.returncode}"
        return out.decode()


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    text: str = ""

    def all(self, tag: str | None = None, cls: str | None = None) -> list[Node]:
        found = []
        for child in self.children:
            if (tag is None or child.tag == tag) and (
                    cls is None or cls in child.attrs.get("class", "").split()):
                found.append(child)
            found.extend(child.all(tag, cls))
        return found

    def by_id(self, id_: str) -> Node:
        hits = [n for n in self.all() if n.attrs.get("id") == id_]
        assert len(hits) == 1, (id_, len(hits))
        return hits[0]

    def full_text(self) -> str:
        return self.text + "".join(c.full_text() for c in self.children)


_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr"}


class _DomBuilder(HTMLParser):
    """The serialised DOM Chromium dumps, back into a tree (stdlib only)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs}, self.stack[-1])
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs},
                                            self.stack[-1]))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].text += data


def rendered_dom(html_path: Path) -> Node:
    """The DOM headless Chromium built from the report."""
    text = chromium("--dump-dom", html_path.resolve().as_uri())
    assert "data-report=\"mrc\"" in text, text[:500]
    builder = _DomBuilder()
    builder.feed(text)
    return builder.root


# -- the stack -------------------------------------------------------------------------------

@dataclass
class Stack:
    prometheus: Prometheus
    tmp: Path
    #: Answered requests per (resolution, prompt length) bucket, as the load generator saw them.
    latencies: dict[tuple[str, str], list[float]]


def _trace(tmp: Path) -> Path:
    out = subprocess.run([sys.executable, "-m", "mrc_agent.agent.tools.tracegen",
                          "starved", "1", "20"],
                         capture_output=True, text=True, check=True, cwd=REPO, timeout=30)
    path = tmp / "starved.jsonl"
    path.write_text(out.stdout)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from mrc_agent.reference_service.loadgen import run_load

    tmp = tmp_path_factory.mktemp("report")
    procs = Procs()
    parts: list[Any] = []
    try:
        spinner = procs.spawn(BUSY, 300.0)
        agent = AgentProcess("--pid", str(spinner.pid), "--interval", "0.5", "--gpu-backend",
                             f"replay:{_trace(tmp)}", "--collector", "profiling")
        parts.append(agent)
        # OCR off: this test is about what the report draws, and tesseract on 12 MP photos
        # would make every cell "slow" on a small CI machine without adding anything.
        service = Service(tmp, "--max-queue", "64", "--ocr", "off")
        parts.append(service)
        prom = Prometheus(tmp / "prom", {"agent": [f"127.0.0.1:{agent.port}"],
                                         "service": [f"127.0.0.1:{service.port}"]})
        parts.append(prom)
        wait_until(prom.targets_up, 20, 0.5, "both targets scraped")
        result: dict[str, Any] = {}
        load = threading.Thread(target=lambda: result.update(outcome=asyncio.run(run_load(
            service.url, rate=4.0, duration=LOAD_SECONDS, max_new_tokens=4, seed=3,
            timeout=60.0))), daemon=True)
        load.start()
        load.join(90)
        assert "outcome" in result, "the load generator did not finish"
        time.sleep(2.5)  # the last answers scraped
        yield Stack(prom, tmp, dict(result["outcome"].latencies))
    finally:
        for part in reversed(parts):
            part.stop()
        procs.close()


def report(*args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mrc_agent.agent", "report", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout)


def _present(prom: Prometheus, metric: str, selector: str, window: str = "5m") -> bool:
    """Ground truth: does Prometheus hold the series at all (and a request, for the heatmap)?"""
    sel = "{" + selector + "}" if selector else ""
    expr = f"max(max_over_time({metric}{sel}[{window}]))"
    body = prom.query(expr)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    if not result:
        return False
    return metric != EVIDENCE["heatmap"] or float(result[0]["value"][1]) > 0


def _points(d: str) -> int:
    return len(re.findall(r"[ML]\s*-?[\d.]+\s+-?[\d.]+", d))


def _expected_y(svg: Node, value: float) -> float:
    lo, hi = float(svg.attrs["data-y-min"]), float(svg.attrs["data-y-max"])
    top, bottom = float(svg.attrs["data-plot-top"]), float(svg.attrs["data-plot-bottom"])
    return bottom - (value - lo) / (hi - lo) * (bottom - top)


@pytest.fixture(scope="module")
def full(stack: Stack) -> tuple[Node, str]:
    out = stack.tmp / "report.html"
    r = report("--prometheus", stack.prometheus.url, "--out", str(out), "--range", "5m",
               "--step", "2s")
    assert r.returncode == 0, r.stderr
    assert out.is_file()
    return rendered_dom(out), r.stdout


def test_golden_triangle_is_drawn(stack: Stack, full: tuple[Node, str]) -> None:
    dom, _ = full
    panels = [n.attrs["data-panel"] for n in dom.by_id("golden-triangle").all("figure")]
    assert panels == GOLDEN_PANELS
    for key in GOLDEN_PANELS:
        svg = dom.by_id(f"chart-{key}")
        assert svg.tag == "svg" and svg.attrs["data-status"] == "ok", key
        paths = svg.all("path", "series")
        assert paths, key
        assert int(svg.attrs["data-series-count"]) == len(paths), key
        for path in paths:
            n = _points(path.attrs["d"])
            assert n == int(path.attrs["data-points"]), (key, path.attrs["data-series"])
            assert n >= MIN_POINTS, (key, path.attrs["data-series"], n)
        # Axes with labelled ticks on both sides.
        assert len(svg.all("text", "tick")) >= 4, key
        assert not svg.all("text", "no-data"), key
    # The CPU chart: the process and its hottest thread, the line at 95 % of one core, drawn
    # where 95 % is on the chart's own axis.
    cpu = dom.by_id("chart-cpu")
    legends = [p.attrs["data-series"] for p in cpu.all("path", "series")]
    assert any(s.endswith(" process") for s in legends), legends
    assert any(s.endswith(" hottest thread") for s in legends), legends
    for key, value in (("cpu", DEFAULT.thresholds.cpu_user_ratio),
                       ("nvlink", DEFAULT.thresholds.nvlink_bytes_per_second),
                       ("compute-instructions", DEFAULT.thresholds.instructions_per_dram_byte),
                       ("starvation", DEFAULT.thresholds.starved_fraction)):
        svg = dom.by_id(f"chart-{key}")
        line = dom.by_id(f"chart-{key}-threshold")
        assert float(line.attrs["data-value"]) == pytest.approx(value), key
        y1, y2 = float(line.attrs["y1"]), float(line.attrs["y2"])
        assert y1 == y2 and y1 == pytest.approx(_expected_y(svg, value), abs=0.15), key
    assert float(dom.by_id("chart-cpu-threshold").attrs["data-value"]) == 0.95
    assert "95%" in dom.by_id("chart-cpu").full_text()
    # PCIe has no alert, so no line.
    assert not dom.by_id("chart-pcie").all("line", "threshold")
    # The live compute-to-memory source is the profiling counters (the agent says so), so the
    # chart is the instruction ratio, titled as such; the GPM proxy chart is not shown.
    source = dom.by_id("compute-source")
    assert source.attrs["data-sources"] == "cupti_pm_sampling"
    assert "SM instructions per DRAM byte" in dom.by_id("panel-compute-instructions").full_text()
    assert not [n for n in dom.all() if n.attrs.get("id") == "panel-compute-gpm"]


def test_heatmap_cells_in_fixed_order(stack: Stack, full: tuple[Node, str]) -> None:
    dom, _ = full
    cells = dom.by_id("heatmap").all("g", "cell")
    assert [c.attrs["data-cell"] for c in cells] == CELL_ORDER
    hit = {f"{res}|{prompt}": lats for (res, prompt), lats in stack.latencies.items() if lats}
    assert len(hit) >= 4, stack.latencies  # the load's mix reaches most buckets in 15 s
    for cell in cells:
        key = cell.attrs["data-cell"]
        text = cell.full_text().strip()
        if key in hit:
            assert cell.attrs["data-status"] == "ok", key
            value_ms = float(cell.attrs["data-value"])
            # P90 from the service's histogram: within its bucket, below 2x (the widest bucket
            # ratio) the slowest answer the client saw; the cell says the same number.
            assert 0 < value_ms <= 2000 * max(hit[key]) + 50, (key, value_ms, hit[key])
            m = re.fullmatch(r"([\d,]+) ms", text)
            assert m and abs(float(m.group(1).replace(",", "")) - value_ms) <= 0.51, (key, text)
            fill = cell.all("rect")[0].attrs["fill"]
            assert fill != "#eceef1", key
        else:
            assert cell.attrs["data-status"] == "no-data" and text == "no data", key
            assert cell.attrs["data-value"] == ""
    assert int(dom.by_id("heatmap").attrs["data-cells-with-data"]) == sum(
        c.attrs["data-status"] == "ok" for c in cells)


@pytest.mark.parametrize("selector", ["", 'job="agent"', 'job="service"'])
def test_header_and_no_data_list_match_prometheus(stack: Stack, selector: str) -> None:
    out = stack.tmp / f"report-{abs(hash(selector))}.html"
    args = ["--prometheus", stack.prometheus.url, "--out", str(out), "--range", "5m",
            "--step", "2s"]
    before = time.time()
    r = report(*args, *(["--selector", selector] if selector else []))
    assert r.returncode == 0, r.stderr
    dom = rendered_dom(out)
    rng = dom.by_id("time-range")
    assert float(rng.attrs["data-range-seconds"]) == 300
    assert float(rng.attrs["data-step-seconds"]) == 2
    assert before - 3 <= float(rng.attrs["data-end"]) <= time.time()
    assert dom.by_id("prometheus-url").attrs["data-url"] == stack.prometheus.url
    assert before - 2 <= float(dom.by_id("generated-at").attrs["data-epoch"]) <= time.time() + 1
    listed = {li.attrs["data-panel"] for li in dom.by_id("no-data").all("li")}
    if selector == 'job="service"':
        # No agent series: the source is unknown and the charts fall back to the primary
        # compute chart, which has no data like the others.
        assert dom.by_id("compute-source").attrs["data-sources"] == ""
    truth = {key for key, metric in EVIDENCE.items()
             if not _present(stack.prometheus, metric, selector)}
    assert listed == truth, (selector, listed, truth)
    assert int(dom.by_id("no-data").attrs["data-count"]) == len(truth)
    # Every panel in the list says "no data" where it would draw; every other one draws.
    for key in EVIDENCE:
        panel = dom.by_id(f"panel-{key}")
        assert panel.attrs["data-status"] == ("no-data" if key in truth else "ok"), key
    if "heatmap" in truth:
        cells = dom.by_id("heatmap").all("g", "cell")
        assert [c.full_text().strip() for c in cells] == ["no data"] * 9
    if selector == "":
        assert truth == set(), truth  # the trace has PCIe, NVLink and profiling counters
    # The summary line printed by the CLI names the same panels.
    assert r.stdout.startswith(f"wrote {out}:"), r.stdout


def test_something_else_than_prometheus_exits_1(stack: Stack) -> None:
    # The service's port instead of Prometheus': it answers, but not the Prometheus API.
    service = next(t for t in httpx.get(stack.prometheus.url + "/api/v1/targets", timeout=10)
                   .json()["data"]["activeTargets"] if t["labels"]["job"] == "service")
    url = "http://" + service["labels"]["instance"]
    r = report("--prometheus", url, "--out", str(stack.tmp / "wrong.html"), timeout=30)
    assert r.returncode == 1
    line = _one_line(r.stderr)
    assert f"cannot reach Prometheus at {url}" in line and "404" in line, line
    assert not (stack.tmp / "wrong.html").exists()


def test_png_is_a_real_screenshot(stack: Stack) -> None:
    from PIL import Image

    out = stack.tmp / "report.png"
    r = report("--prometheus", stack.prometheus.url, "--out", str(out), "--range", "5m",
               "--step", "2s", "--format", "png")
    assert r.returncode == 0, r.stderr
    keep = os.environ.get("MRC_REPORT_SCREENSHOT")  # for a person to look at
    if keep:
        shutil.copyfile(out, keep)
    with Image.open(out) as img:
        assert img.format == "PNG"
        assert img.width == 1280 and img.height > 1000, img.size
        rgb = img.convert("RGB")
    colours = rgb.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200, len(colours or [])
    white = sum(n for n, c in colours if c == (255, 255, 255))
    assert white < 0.9 * rgb.width * rgb.height
    # The threshold lines' red and the heatmap scale's green end are on the picture (within
    # a small distance: edges are anti-aliased).
    assert colours is not None
    present = [c for _, c in colours if isinstance(c, tuple)]
    for colour in ("#d0021b", heat_colour(0.0, 10.0)):
        want = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
        assert min(sum(abs(a - b) for a, b in zip(c, want, strict=True)) for c in present) <= 12


# -- flags and failures ----------------------------------------------------------------------

def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_unreachable_prometheus_exits_1_with_the_reason(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    r = report("--prometheus", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "r.html"),
               "--timeout", "5", timeout=30)
    assert r.returncode == 1
    line = _one_line(r.stderr)
    assert "cannot reach Prometheus" in line and f"127.0.0.1:{port}" in line
    assert "refused" in line.lower(), line
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("flags, words", [
    (["--range", "5 minutes"], "--range"),
    (["--range", "0s"], "--range"),
    (["--step", "1x"], "--step"),
    (["--range", "30d", "--step", "1s"], "points per series"),
    (["--step", "10m", "--range", "5m"], "longer than --range"),
    (["--selector", "job=agent"], "--selector"),
    (["--format", "jpeg"], "invalid choice"),
    (["--range", "9" * 400 + "d"], "--range"),
    (["--range", "99999d", "--step", "99999d"], "longer than 3650d"),
])
def test_bad_flags_exit_2_in_one_line(tmp_path: Path, flags: list[str], words: str) -> None:
    r = report("--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path / "r.html"), *flags,
               timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert words in _one_line(r.stderr)


def test_bad_url_and_out_exit_2(tmp_path: Path) -> None:
    r = report("--prometheus", "prometheus:9090", "--out", str(tmp_path / "r.html"), timeout=30)
    assert r.returncode == 2 and "--prometheus" in _one_line(r.stderr)
    r = report("--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path / "no" / "r.html"),
               timeout=30)
    assert r.returncode == 2 and "does not exist" in _one_line(r.stderr)


# -- the same queries as the dashboards, and the pure helpers ---------------------------------

def test_report_runs_the_dashboards_queries() -> None:
    pytest.importorskip("grafanalib")
    from mrc_agent.dashboards.build import all_queries

    panels = {(panel, expr) for _, panel, expr in all_queries()}
    for spec in chart_specs(DEFAULT, ["cupti_pm_sampling", "gpm_activity_proxy"]):
        for query in spec.queries:
            assert (spec.title, query.expr) in panels, (spec.title, query.expr)
    assert ("P90 latency by resolution x prompt length", heatmap_query(DEFAULT).expr) in panels


def test_pure_helpers() -> None:
    assert parse_duration("5m") == 300 and parse_duration("1h30m") == 5400
    assert parse_duration("500ms") == 0.5 and parse_duration("15") == 15
    for bad in ("", "5 m", "m", "-5s", "1.5h", "nan"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert [nice_step(x) for x in (0.19, 0.22, 3, 7, 0.0011)] == [0.2, 0.25, 5, 10, 0.002]
    assert y_domain([0.5, 0.7], 0.95, None) == (0, 1.25, 0.25)
    assert y_domain([], None, 1.0) == (0, 1.0, 0.2)
    assert rate_interval(2, 1) == 4 and rate_interval(60, 15) == 75
    assert time_ticks(0, 300) == [0, 60, 120, 180, 240, 300]
    assert legend_for("{{pod}} {{process}} ({{pid}}) process",
                      {"process": "python3", "pid": "7"}) == "python3 (7) process"
    assert legend_for("{{pod}} GPU {{gpu}}", {}) == "GPU"
    assert heat_colour(0, 10) == "#73bf69" and heat_colour(10, 10) == "#f2495c"
    assert heat_colour(99, 10) == heat_colour(10, 10)


def test_malformed_range_points_never_end_in_a_traceback() -> None:
    from mrc_agent.agent.tools.report.data import points

    assert points([[1.0, "0.5"], ["x", "1"], [2, "NaN"], [3], "junk", [4, "oops"], [5, "1e3"]]) \
        == [(1.0, 0.5), (2.0, None), (4.0, None), (5.0, 1000.0)]
    assert points(None) == [] and points({"not": "a list"}) == []
    # Past what an axis can hold: a gap; a denormal is a value, drawn on an axis from 0 to 1.
    assert points([[1, "1.7e308"], [2, "-1e301"], [3, "5e-324"], [4, True]]) == [
        (1.0, None), (2.0, None), (3.0, 5e-324), (4.0, None)]
    assert y_domain([5e-324], None, None) == (0, 1.0, 0.2)
    assert y_domain([1e300, -1e300], None, None) == (-1e300, 1e300, 5e299)


# -- what a server may answer ----------------------------------------------------------------
# A stand-in for Prometheus on loopback answering each API path with a chosen body: the shapes
# and numbers a server (or a proxy in front of one) can send. Each ends in a report with a gap
# or an empty panel where the answer made no sense, never in a traceback.

def _serve_answers(answer: Any) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 whose ``/api/v1/...`` answers are ``answer(path, params)``
    (the ``data`` of a success), in a thread; yields its URL."""
    import json
    import urllib.parse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            url = urllib.parse.urlsplit(self.path)
            params = dict(urllib.parse.parse_qsl(url.query))
            body = json.dumps({"status": "success", "data": answer(url.path, params)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _answers(*, value: Any = "0.5", metric: Any = None, result: Any = None,
             targets: Any = None, version: Any = "2.53.0") -> Any:
    """Prometheus' answers with one part replaced: every sample ``value``, every ``metric``,
    every ``result``, the targets' ``data`` or buildinfo's ``version``."""
    labels = {"resolution": "<1MP", "prompt_length": "0-50", "source": "gpm_activity_proxy",
              "process": "python3", "pid": "7"} if metric is None else metric

    def answer(path: str, params: dict[str, str]) -> Any:
        if path.endswith("/status/buildinfo"):
            return {"version": version}
        if path.endswith("/targets"):
            return {"activeTargets": [{"scrapeInterval": "15s"}]} if targets is None \
                else targets
        if path.endswith("/query_range"):
            start, end = float(params["start"]), float(params["end"])
            rows = [{"metric": labels, "values": [[t, value] for t in (start, (start + end) / 2,
                                                                       end)]}]
            return {"resultType": "matrix", "result": rows if result is None else result}
        rows = [{"metric": labels, "value": [float(params["time"]), value]}]
        return {"resultType": "vector", "result": rows if result is None else result}

    return answer


@pytest.mark.parametrize("answer", [
    _answers(value="1.7e308"),
    _answers(value="-1.7e308"),
    _answers(value="5e-324"),
    _answers(value="-5e-324"),
    _answers(value="1e-310"),
    _answers(value="+Inf"),
    _answers(value=1.7e308),
    _answers(value=None),
    _answers(value=["1"]),
    _answers(metric=["job", "agent"]),
    _answers(metric="job=agent"),
    _answers(metric={"process": 5, "pid": None, "gpu": ["0"], "resolution": {"a": 1},
                     "prompt_length": 1.5, "source": ["x"], "__name__": 7}),
    _answers(metric={"resolution": ["<1MP"], "prompt_length": "0-50"}),
    _answers(result=5),
    _answers(result=[5, "x", None, [1, 2]]),
    _answers(result={"metric": {}}),
    _answers(targets={"activeTargets": 5}),
    _answers(targets={"activeTargets": [5, "x", None, {"scrapeInterval": 7}]}),
    _answers(targets={"activeTargets": [{"scrapeInterval": "99999999999999d"}]}),
    _answers(targets={"activeTargets": [{"scrapeInterval": "9" * 400 + "d"}]}),
    _answers(targets=[1, 2]),
    _answers(targets="targets"),
    _answers(version={"a": 1}),
    _answers(version=["2"]),
], ids=["huge", "huge-negative", "denormal", "denormal-negative", "subnormal", "inf",
        "number-not-text", "null-value", "list-value", "metric-list", "metric-text",
        "label-values-not-text", "heatmap-label-list", "result-number", "result-items",
        "result-mapping", "targets-number", "targets-items", "targets-interval-huge",
        "targets-interval-overflow", "targets-data-list", "targets-data-text",
        "version-mapping", "version-list"])
def test_any_answer_a_server_can_send_renders_or_is_one_line(tmp_path: Path, answer: Any,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    from mrc_agent.agent.cli import main as cli_main

    out = tmp_path / "r.html"
    for url in _serve_answers(answer):
        code = cli_main(["report", "--prometheus", url, "--out", str(out), "--range", "5m",
                         "--step", "15s", "--timeout", "20"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err == "" and captured.out.startswith(f"wrote {out}:"), captured
    page = out.read_text()
    dom = _DomBuilder()
    dom.feed(page)
    panels = {n.attrs["data-panel"]: n.attrs["data-status"] for n in dom.root.all("figure")}
    assert len(panels) == 7 and set(panels.values()) <= {"ok", "no-data", "error"}, panels
    for svg in dom.root.all("svg", "chart"):
        for attr in ("data-y-min", "data-y-max"):
            assert math.isfinite(float(svg.attrs[attr])), svg.attrs
        assert float(svg.attrs["data-y-max"]) > float(svg.attrs["data-y-min"]), svg.attrs
