"""End to end on real parts: processes → agent / reference service → Prometheus (1 s scrape and
evaluation) → Alertmanager → a webhook receiver standing in for the pager; and every dashboard
query run against a real Prometheus scraping the agent and the service under load.

The rules are the generated ones, built with the shipped config except for the GPU counter
rate window (10 s instead of 1 m: enough samples at a 1 s scrape, and the NVLink rule's
"counter existed one window ago" guard then costs 10 s, not 60), the receivers' URLs, the page
group wait (1 s) and the CPU-saturation threshold (``CPU_LINE``, a tenth of a core instead of
95 %: a spinner on a loaded 2-core CI machine gets a share of a core, not a whole one, and one
sample under the line restarts the `for`). Every alert keeps its real `for`, and every other
alert its real threshold; that the shipped 95 % pages at its `for` and not below is the promtool
unit test's job (``alerts/tests/MRCProcessCPUUserSaturated.yaml``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import yaml

from mrc_agent.alerts.alertmanager import alertmanager_config
from mrc_agent.alerts.build import rule_file
from mrc_agent.alerts.config import DEFAULT, Config
from mrc_agent.alerts.webhook import WebhookReceiver
from mrc_agent.dashboards.build import all_queries, template_queries
from mrc_agent.dashboards.queries import substitute_macros
from tests.conftest import BUSY, AgentProcess, Procs
from tests.e2e.test_stacks_e2e import PANEL as STACKS_PANEL
from tests.e2e_harness import (
    Alertmanager,
    Prometheus,
    put_load,
    replay_trace,
    wait_until,
    watched_service,
)

#: The CPU-saturation line the paging test builds its rules with: what a busy loop certainly
#: holds in every 0.5 s sampling window however loaded the machine is (a tenth of a core, five
#: ticks of fifty; a fair share of two cores is above it while under twenty processes spin),
#: so the alert's `for` runs unbroken from the first sample on.
CPU_LINE = 0.1


def _config(webhook: str) -> Config:
    thresholds = replace(DEFAULT.thresholds, rate_window="10s", cpu_user_ratio=CPU_LINE)
    return replace(DEFAULT, thresholds=thresholds, page_webhook_url=webhook,
                   ticket_webhook_url=webhook, page_group_wait="1s")


@dataclass
class Paging:
    prometheus: Prometheus
    webhook: WebhookReceiver
    started: float  # when the agent's first sample of the spinner was scraped


@pytest.fixture(scope="module")
def paging(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Paging]:
    """A busy-spinning target watched by an agent that also replays a low-NVLink trace; the
    rules page at ``CPU_LINE`` of a core, which the spinner holds however loaded the machine."""
    tmp = tmp_path_factory.mktemp("e2e-paging")
    procs = Procs()
    webhook = WebhookReceiver()
    stack: list[Any] = []
    try:
        cfg = _config(webhook.url)
        rules = tmp / "rules.yaml"
        rules.write_text(yaml.safe_dump(rule_file(cfg)))
        am = Alertmanager(tmp / "am", alertmanager_config(cfg))
        stack.append(am)
        spinner = procs.spawn(BUSY, 600.0)
        agent = AgentProcess("--pid", str(spinner.pid), "--interval", "0.5", "--gpu-backend",
                             f"replay:{replay_trace(tmp, 'low_nvlink')}")
        stack.append(agent)
        prom = Prometheus(tmp / "prom", {"whatever-the-job-is-called":
                                         [f"127.0.0.1:{agent.port}"]}, [rules], am.url)
        stack.append(prom)
        wait_until(lambda: prom.query("mrc_process_cpu_user_ratio")["data"]["result"], 30,
                   what="the spinner's CPU ratio in Prometheus")
        yield Paging(prom, webhook, time.monotonic())
    finally:
        for part in reversed(stack):
            part.stop()
        webhook.stop()
        procs.close()


def _fired(paging: Paging, name: str, timeout: float) -> tuple[dict[str, Any], float]:
    alert = wait_until(lambda: next(iter(paging.webhook.alerts(name)), None), timeout, 0.5,
                       f"{name} delivered to the webhook")
    return alert, time.monotonic() - paging.started


def _held_before_firing(prom: Prometheus, name: str) -> tuple[float, float]:
    """From Prometheus's own ALERTS series: when ``name`` first fired (Unix time), and how
    long the unbroken pending run right before it lasted. Read on Prometheus's clock, so a
    test process that was slow to notice the first sample cannot skew it."""
    series = prom.query(f'ALERTS{{alertname="{name}"}}[15m]')["data"]["result"]
    times = {state: sorted(float(t) for r in series if r["metric"]["alertstate"] == state
                           for t, _ in r["values"]) for state in ("pending", "firing")}
    firing_at = times["firing"][0]
    run = [t for t in times["pending"] if t < firing_at]
    since = run[-1]
    for earlier in reversed(run[:-1]):  # back over evaluations 1 s apart, to a gap
        if since - earlier > 2.5:
            break
        since = earlier
    return firing_at, firing_at - since


def test_cpu_saturated_target_pages_oncall(paging: Paging) -> None:
    for_s = 30
    alert, _ = _fired(paging, "MRCProcessCPUUserSaturated", for_s + 60)
    assert alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["runbook_url"].endswith("/MRCProcessCPUUserSaturated.md")
    # The rules this Prometheus evaluates are the ones built with the test's line.
    assert f"(threshold {CPU_LINE * 100:g}%)" in alert["annotations"]["description"], alert
    # Fired after exactly its `for` of pending (to an evaluation interval), and paged within
    # a few evaluation and group_wait intervals of firing. A sample under the line on a
    # loaded machine restarts the `for`, as it should: the held time is still the `for`.
    firing_at, held = _held_before_firing(paging.prometheus, "MRCProcessCPUUserSaturated")
    assert for_s - 0.5 <= held <= for_s + 3, held
    assert time.time() - firing_at <= 30


def test_low_nvlink_trace_pages_oncall(paging: Paging) -> None:
    for_s, window_s = 60, 10
    alert, after = _fired(paging, "MRCNVLinkBandwidthLow", for_s + 2 * window_s + 40)
    assert alert["labels"]["severity"] == "critical"
    assert alert["labels"]["uuid"].startswith("GPU-synthetic")
    assert after >= for_s - 2


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """The reference service under the load generator, an agent watching it with every GPU
    source (a replayed busy trace with NVML, GPM and profiling fields), both scraped."""
    tmp = tmp_path_factory.mktemp("e2e-dash")
    stack: list[Any] = []
    try:
        service, agent = watched_service(tmp, stack)
        prom = Prometheus(tmp / "prom", {"agent": [f"127.0.0.1:{agent.port}"],
                                         "service": [f"127.0.0.1:{service.port}"]})
        stack.append(prom)
        put_load(service.url, 40.0, seed=3)
        time.sleep(3)  # the last answers scraped
        yield prom
    finally:
        for part in reversed(stack):
            part.stop()


#: Panels whose source cannot exist on this CPU-only test stack: the service measures peak
#: GPU memory only on CUDA; a replayed trace carries PCIe totals, not the NVML byte counters
#: whose late reads are dropped intervals (the panel's expression is the alert's, which
#: alerts/tests/MRCAgentPCIeBytesUnderCounted.yaml runs on series that grow). Everything else
#: must return data.
NO_DATA_HERE = {"Peak GPU memory per request", "PCIe intervals dropped"}
#: Queries of an inference engine's own metrics (the mrc:engine_* rules): no engine runs here,
#: tests/integration/test_engine_dashboard.py runs them on expositions written from the
#: engines' sources.
ENGINE_QUERY = "mrc:engine_"
#: The stacks panel (STACKS_PANEL) shows time while the GPU idles, and this trace is busy
#: throughout: tests/e2e/test_stacks_e2e.py runs its query on a starved trace and a real target.


def test_every_dashboard_query_returns_data(loaded: Prometheus) -> None:
    empty, failed = [], []
    for dashboard, panel, expr in all_queries():
        query = substitute_macros(expr, range_s=300, rate_interval_s=20, interval_s=5)
        body = loaded.query(query)
        if body.get("status") != "success":
            failed.append((dashboard, panel, query, body.get("error")))
        elif (not body["data"]["result"] and panel not in NO_DATA_HERE
              and panel != STACKS_PANEL and ENGINE_QUERY not in expr):
            empty.append((dashboard, panel, query))
    assert not failed, failed
    assert not empty, "\n".join(f"{d} / {p}: {q}" for d, p, q in empty)


def test_template_variables_find_values(loaded: Prometheus) -> None:
    import httpx

    for dashboard, name, query in template_queries():
        if not query.startswith("label_values("):
            continue
        inner = query[len("label_values("):-1]
        metric, _, label = inner.rpartition(",")
        metric = substitute_macros(metric.strip(), range_s=300, rate_interval_s=20)
        r = httpx.get(loaded.url + f"/api/v1/label/{label.strip()}/values",
                      params={"match[]": metric}, timeout=10).json()
        assert r["status"] == "success", (dashboard, name, r)
        if name == "gpu":
            assert r["data"], (dashboard, name, query)
