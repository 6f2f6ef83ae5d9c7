"""Every dashboard query and template variable parsed by a real Prometheus (Debian's
``prometheus``), and the queries' regex escaping and resolution ranks computed by PromQL's own
engine. The dashboards' other checks: tests/unit/test_dashboards.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from mrc_agent.alerts.config import DEFAULT
from mrc_agent.dashboards.build import all_queries, template_queries
from mrc_agent.dashboards.queries import (
    RESOLUTION_ORDER,
    RESOLUTION_RANK_LABEL,
    PanelQueries,
    _promql_regex_literal,
    substitute_macros,
)
from tests.support import free_port
from tests.unit.test_dashboards import DASHBOARDS, visible_panels


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> dict[str, Any]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body: dict[str, Any] = json.load(resp)
        except urllib.error.HTTPError as exc:  # 400 with a JSON error body
            body = json.load(exc)
        return body


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is required (Debian package 'prometheus'; .ci/run installs it)")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 15s\n")
    port = free_port()
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("prometheus did not become ready:\n"
                            + (tmp / "prometheus.log").read_text(errors="replace")[-2000:])
            time.sleep(0.2)
        yield Prometheus(url)
    finally:
        proc.kill()
        proc.wait()
        log.close()


@pytest.mark.prometheus
def test_every_query_parses_in_a_real_prometheus(prometheus: Prometheus) -> None:
    queries = all_queries()
    assert len(queries) == sum(len(p["targets"]) for d in DASHBOARDS.values()
                               for p in visible_panels(d))
    failed = []
    for dashboard, title, expr in queries:
        body = prometheus.query(substitute_macros(expr))
        if body.get("status") != "success":
            failed.append(f"{dashboard} / {title}: {body.get('error')}\n  {expr}")
    assert not failed, "\n".join(failed)


@pytest.mark.prometheus
def test_every_variable_selector_parses_in_a_real_prometheus(prometheus: Prometheus) -> None:
    for dashboard, name, query in template_queries():
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
        assert m, f"{dashboard} ${name}: {query}"
        body = prometheus.query(substitute_macros(m.group(1)))
        assert body["status"] == "success", (dashboard, name, body)


@pytest.mark.prometheus
def test_resolution_rank_labels_in_a_real_prometheus(prometheus: Prometheus) -> None:
    """The rank the rows are sorted on, computed by PromQL's own regex engine."""
    fake = " or ".join(
        f'label_replace(vector({i}), "resolution", "{r}", "", "")'
        for i, r in enumerate(reversed(RESOLUTION_ORDER)))
    ranked = PanelQueries(DEFAULT)._ranked_by_resolution(fake)
    body = prometheus.query(ranked)
    assert body["status"] == "success", body
    ranks = {s["metric"]["resolution"]: s["metric"][RESOLUTION_RANK_LABEL]
             for s in body["data"]["result"]}
    assert ranks == {r: str(i) for i, r in enumerate(RESOLUTION_ORDER, start=1)}


@pytest.mark.prometheus
def test_regex_literals_match_exactly_in_a_real_prometheus(prometheus: Prometheus) -> None:
    """A bucket value with regex metacharacters, a backslash or a quote still matches itself
    (and only itself) once escaped into a PromQL string."""
    values = ["1.5+MP", "a|b", "(x)*?[y]{2}^$", "back\\slash", 'quo"te']
    for value in values:
        literal = _promql_regex_literal(value)
        for candidate, hit in ((value, True), (value + "x", False), ("a", False)):
            expr = (f'label_replace(label_replace(vector(1), "v", {json.dumps(candidate)}, "", ""),'
                    f' "hit", "yes", "v", "{literal}")')
            body = prometheus.query(expr)
            assert body["status"] == "success", (value, body)
            (series,) = body["data"]["result"]
            assert (series["metric"].get("hit") == "yes") is hit, (value, candidate)
