"""Benchmark: from the onset of starvation to the page, on the shipped rules, a real Prometheus
and a real Alertmanager.

Run as ``python3 benchmarks/bench_page.py [--interval 15s] [--out
benchmarks/results/page.md]``; about 7 minutes. A measurement, not a test: it prints a Markdown
table, writes it to ``--out`` and exits 0 however long the page took (1 when it cannot measure:
no prometheus or prometheus-alertmanager, or no page within 9 minutes).

**Set-up.** A replayed GPU is busy for 20 s, then idle to the end. A real Python process sleeps
until 150 s (so the alert's 2-minute window is full when starvation begins) and then runs a
pure-Python pixel loop on its one thread (``target:pil_to_tensor``, holding the GIL), writing
down when it began: that moment is the onset of starvation (CPU hot while the GPU idles). A
real agent (``mrc-agent run --interval 0.1``, with the stacks collector where austin is
installed) watches it; a real Prometheus scrapes it and evaluates the generated rules
(``alerts.build.rule_file`` with the shipped thresholds) every ``--interval`` (15 s, the
shipped PodMonitor's); a real Alertmanager with the generated configuration (page group wait
10 s) sends the page to a webhook receiver here.

**Measured**, each from the onset, on one clock (Unix time): the agent's ``mrc_gpu_starved``
first 1 (its ``/metrics`` read every 0.1 s); Prometheus's first scraped 1; ``MRCGPUStarved``
pending and firing (Prometheus's alerts API every 0.5 s); the page received. Beside them, what
the rules make of it: ``mrc_gpu_starved`` must average 80 % over 2 minutes (96 s starved), then
hold for ``for: 2m``; evaluation, scrape and group wait add up to one interval each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import yaml
from support import free_port, host, report, wait_http

from mrc_agent.agent.core.stacks import StacksUnavailable, find_austin
from mrc_agent.alerts.alertmanager import alertmanager_config
from mrc_agent.alerts.build import rule_file
from mrc_agent.alerts.config import DEFAULT
from mrc_agent.alerts.webhook import WebhookReceiver

#: The GPU busy, then idle; the target hot from HOT_AT_S: by then the series has 2.5 minutes of
#: history, so the alert's 2-minute window is full of samples when starvation begins, as on an
#: agent that has run for a while (a younger series averages over fewer samples).
BUSY_S, HOT_AT_S, TRACE_S = 20.0, 150.0, 900.0
PAGE_TIMEOUT_S = 540.0
ALERT = "MRCGPUStarved"

#: The target: idle until HOT_AT_S after it starts, then a pure-Python pixel loop.
TARGET = textwrap.dedent("""
    import sys, time
    start, hot_at, out = time.time(), float(sys.argv[1]), sys.argv[2]

    def pil_to_tensor(pixels):
        return [p / 255.0 for p in pixels]

    time.sleep(hot_at)
    with open(out, "w") as f:
        f.write(repr(time.time()))
    pixels = list(range(256)) * 16  # 4096: small enough to stay in pymalloc, user CPU
    while time.time() - start < 1200:
        pil_to_tensor(pixels)
""")


def write_trace(path: Path) -> None:
    """The GPU: busy for BUSY_S, then idle, in the replay format at 0.1 s."""
    with path.open("w") as f:
        for k in range(int(TRACE_S * 10)):
            t = k / 10
            util = 0.97 if t < BUSY_S else 0.0
            f.write(json.dumps({"t": t, "gpu": 0, "uuid": "GPU-synthetic-0000",
                                "name": "NVIDIA H200 (synthetic)", "gpu_util": util,
                                "mem_used_bytes": 6e10, "mem_total_bytes": 143771000832})
                    + "\n")


def spawn(args: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, **kw)


def starved_now(url: str, pid: int) -> bool:
    try:
        text = httpx.get(url, timeout=1).text
    except httpx.HTTPError:
        return False
    return any(line.startswith("mrc_gpu_starved{") and f'pid="{pid}"' in line
               and float(line.rsplit(" ", 1)[1]) == 1.0 for line in text.splitlines())


def first_scraped(prom: str, pid: int) -> float | None:
    q = f'mrc_gpu_starved{{pid="{pid}"}}[15m]'
    res = httpx.get(prom + "/api/v1/query", params={"query": q}, timeout=5).json()
    times = [float(t) for r in res["data"]["result"] for t, v in r["values"] if v == "1"]
    return min(times) if times else None


def measure(tmp: Path, interval: str) -> dict[str, Any]:
    trace = tmp / "gpu.jsonl"
    write_trace(trace)
    pager = WebhookReceiver("/page")
    cfg = replace(DEFAULT, page_webhook_url=pager.url, ticket_webhook_url=pager.url)
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rule_file(cfg)))
    (tmp / "am.yaml").write_text(yaml.safe_dump(alertmanager_config(cfg)))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        am_port, prom_port, agent_port = free_port(), free_port(), free_port()
        procs.append(spawn([shutil.which("prometheus-alertmanager") or "alertmanager",
                            f"--config.file={tmp / 'am.yaml'}", f"--storage.path={tmp / 'am'}",
                            f"--web.listen-address=127.0.0.1:{am_port}",
                            "--cluster.listen-address="], tmp / "am.log"))
        onset_file = tmp / "onset"
        (tmp / "target.py").write_text(TARGET)
        target = spawn([sys.executable, str(tmp / "target.py"), str(HOT_AT_S), str(onset_file)],
                       tmp / "target.log")
        procs.append(target)
        agent_args = ["--pid", str(target.pid), "--interval", "0.1", "--gpu-backend",
                      f"replay:{trace}", "--listen", f"127.0.0.1:{agent_port}"]
        try:
            find_austin()
            agent_args += ["--collector", "stacks"]
            stacks = True
        except StacksUnavailable:
            stacks = False
        procs.append(spawn([sys.executable, "-m", "mrc_agent.agent", "run", *agent_args],
                           tmp / "agent.log"))
        prom_cfg = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(tmp / "rules.yaml")],
            "alerting": {"alertmanagers": [{"static_configs": [
                {"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "mrc-agent", "static_configs": [
                {"targets": [f"127.0.0.1:{agent_port}"]}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
        procs.append(spawn([shutil.which("prometheus") or "prometheus",
                            f"--config.file={tmp / 'prometheus.yml'}",
                            f"--storage.tsdb.path={tmp / 'tsdb'}",
                            f"--web.listen-address=127.0.0.1:{prom_port}"], tmp / "prom.log"))
        agent_url, prom = f"http://127.0.0.1:{agent_port}", f"http://127.0.0.1:{prom_port}"
        wait_http(agent_url + "/metrics", "the agent", 60, procs[-2])
        wait_http(prom + "/-/ready", "Prometheus", 60, procs[-1])
        wait_http(f"http://127.0.0.1:{am_port}/-/ready", "Alertmanager", 60, procs[0])
        marks: dict[str, float] = {}
        deadline = time.monotonic() + HOT_AT_S + PAGE_TIMEOUT_S
        next_alerts = 0.0
        while time.monotonic() < deadline and not pager.arrivals(ALERT):
            if "flagged" not in marks and starved_now(agent_url + "/metrics", target.pid):
                marks["flagged"] = time.time()
            if time.monotonic() >= next_alerts:
                next_alerts = time.monotonic() + 0.5
                alerts = httpx.get(prom + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
                for a in alerts:
                    if a["labels"].get("alertname") == ALERT:
                        marks.setdefault(a["state"], time.time())
            time.sleep(0.1)
        paged = next(iter(pager.arrivals(ALERT)), None)
        if paged is None or not onset_file.exists():
            raise SystemExit(f"no page within {PAGE_TIMEOUT_S:g} s of the onset")
        marks["paged"] = paged[0]
        scraped = first_scraped(prom, target.pid)
        if scraped is not None:
            marks["scraped"] = scraped
        onset = float(onset_file.read_text())
        return {"onset": onset, "marks": marks, "stacks": stacks,
                "description": paged[1]["annotations"].get("description", "")}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        pager.stop()


def seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]]


def render(result: dict[str, Any], interval: str) -> str:
    t = DEFAULT.thresholds
    window, hold, step = seconds(t.starved_window), seconds(t.starved_for), seconds(interval)
    wait = seconds(DEFAULT.page_group_wait)
    rows = [("the agent's `mrc_gpu_starved` first 1", "flagged", "one agent pass (0.1 s)"),
            ("Prometheus's first scraped 1", "scraped", f"+ one scrape ({interval})"),
            (f"`{ALERT}` pending", "pending",
             f"+ {t.starved_fraction:.0%} of its {t.starved_window} window's samples at 1, "
             "+ one evaluation"),
            (f"`{ALERT}` firing", "firing", f"+ its `for: {t.starved_for}`"),
            ("page received", "paged", f"+ group wait ({DEFAULT.page_group_wait})")]
    onset, marks = result["onset"], result["marks"]
    lines = [
        "# Onset of starvation to the page",
        "",
        "Generated by `python3 benchmarks/bench_page.py`: one run, a real agent at 0.1 s, "
        f"Prometheus scraping and evaluating the generated rules every {interval}, Alertmanager "
        "with the generated configuration. Seconds from the onset (the target's CPU hot while "
        "its GPU idles).",
        "",
        "| step | seconds after the onset | what the rules and settings allow |",
        "| --- | ---: | --- |",
    ]
    for name, key, why in rows:
        got = f"{marks[key] - onset:.2f}" if key in marks else "not seen"
        lines.append(f"| {name} | {got} | {why} |")
    # The window's samples, one a scrape: pending once enough of them are 1 (at 15 s, 7 of 8).
    per_window = round(window / step)
    ones = -(-t.starved_fraction * per_window // 1)
    lower = ones * step - step + hold
    upper = ones * step + 2 * step + hold + wait
    paged = marks["paged"] - onset
    lines += ["", f"- Expected from the rules: pending once {ones:g} of the {per_window:g} "
              f"samples in the {t.starved_window} window are 1 ({t.starved_fraction:.0%} of "
              f"them), firing after the {t.starved_for} `for`, paged after the "
              f"{DEFAULT.page_group_wait} group wait; with scrape and evaluation "
              f"phases, {lower:g}-{upper:g} s. Measured: **{paged:.1f} s**.",
              "- The page's description: " + (f"\"{result['description']}\"" if
                                               result["description"] else "none"),
              f"- The stacks collector {'ran' if result['stacks'] else 'did not run (no austin)'}"
              "; with it the description names the function the hottest thread ran.",
              "", f"{host()}."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", default="15s",
                    help="Prometheus's scrape and evaluation interval (default 15s)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    for tool in ("prometheus", "prometheus-alertmanager"):
        if shutil.which(tool) is None:
            print(f"bench_page: {tool} is not installed", file=sys.stderr)
            return 1
    with tempfile.TemporaryDirectory(prefix="bench-page-") as tmp:
        try:
            result = measure(Path(tmp), args.interval)
        except SystemExit as exc:
            print(f"bench_page: {exc}", file=sys.stderr)
            return 1
    report(render(result, args.interval), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
