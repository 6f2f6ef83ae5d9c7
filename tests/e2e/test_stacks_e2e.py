"""What the serving process ran while its GPU idled, end to end: a real Python target whose
culprit function runs while a replayed GPU starves, a real agent sampling it with austin, a real
Prometheus scraping the agent, and the dashboard panel's and MRCGPUStarved's own queries run
on it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from mrc_agent.alerts.config import DEFAULT
from mrc_agent.alerts.queries import RuleQueries
from mrc_agent.dashboards.build import all_queries
from mrc_agent.dashboards.queries import substitute_macros
from tests.conftest import AgentProcess
from tests.e2e_harness import Prometheus, replay_trace, wait_until

PANEL = "What the serving process ran while its GPU idled"
CULPRIT = "culprit_mod:decode_and_resize"

PROGRAM = textwrap.dedent("""\
    import time

    def decode_and_resize(seconds):
        until = time.monotonic() + seconds
        while time.monotonic() < until:  # CPU-bound Python: the GPU's work waits on it
            pass

    print("ready", flush=True)
    while True:
        decode_and_resize(0.02)
        time.sleep(0.02)  # half a core, whatever else the machine runs
""")


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("stacks-e2e")
    (tmp / "culprit_mod.py").write_text(PROGRAM)
    target = subprocess.Popen([sys.executable, "-c", "import culprit_mod"], cwd=tmp,
                              stdout=subprocess.PIPE, text=True)
    stack: list[Any] = []
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        # Starved: the trace's GPU idles 2.4 s of every 3 while the target holds a tenth of a
        # core or more: half a core on an idle machine, what it certainly still holds on a
        # loaded one (as in test_e2e's paging line).
        agent = AgentProcess("--pid", str(target.pid), "--interval", "0.5",
                             "--gpu-backend", f"replay:{replay_trace(tmp, 'starved')}",
                             "--collector", "stacks", "--stacks-interval", "0.05",
                             "--starvation-cpu-threshold", "0.1")
        stack.append(agent)
        prom = Prometheus(tmp / "prom", {"agent": [f"127.0.0.1:{agent.port}"]})
        stack.append(prom)
        yield prom
    finally:
        for part in reversed(stack):
            part.stop()
        target.kill()
        target.wait()


def _panel_query() -> str:
    expr = next(e for _, panel, e in all_queries() if panel == PANEL)
    return substitute_macros(expr, range_s=300, rate_interval_s=20, interval_s=5)


def test_the_panel_shows_the_culprit_while_the_gpu_idled(scraped: Prometheus) -> None:
    query = _panel_query()

    def culprit_share() -> float | None:
        result = scraped.query(query)["data"]["result"]
        shares = {r["metric"]["function"]: float(r["value"][1]) for r in result}
        return shares.get(CULPRIT) or None

    # Half a core of the culprit while the GPU idles 80 % of the time: about 0.4 of wall time
    # once the rate window is full of it, and never more than the idle time there is.
    share = wait_until(lambda: (s := culprit_share()) is not None and s >= 0.15 and s, 90,
                       1.0, f"{CULPRIT} at 15 % or more of wall time in the panel's query")
    assert share <= 0.85, share
    available = scraped.query("mrc_process_stacks_available")["data"]["result"]
    assert [r["metric"]["reason"] for r in available] == ["ok"]


def test_the_starved_alerts_query_names_the_culprit(scraped: Prometheus) -> None:
    series = wait_until(lambda: scraped.query(
        'mrc_process_function_seconds_total{gpu_state="starved"}')["data"]["result"], 90, 1.0,
        "starved seconds in Prometheus")
    labels = series[0]["metric"]
    # The annotation's Go printf, with %q as Go quotes a string (JSON's quoting here).
    query = RuleQueries(DEFAULT).starved_top_function().replace("%q", "%s") % (
        json.dumps(labels["process"]), json.dumps(labels["instance"]))

    def top() -> str | None:
        result = scraped.query(query)["data"]["result"]
        return result[0]["metric"]["function"] if result else None

    assert wait_until(lambda: top() == CULPRIT and CULPRIT, 90, 1.0,
                      f"{CULPRIT} on top of the starved seconds") == CULPRIT
