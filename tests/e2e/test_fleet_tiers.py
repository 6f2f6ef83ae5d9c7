"""The supported fleet topology on real binaries (docs/fleet.md, "Two tiers"): two clusters,
each a Prometheus in agent mode (``deploy/fleet/prometheus-agent.yaml``) that scrapes an MRC
pod of the same name — a real reference service under load and a real agent watching it — and
remote-writes to one central Prometheus (``deploy/fleet/prometheus-central.yaml``) that
evaluates the generated rules (``alerts/generated/mrc-rules.yaml``, as shipped).

The files are used as they are except for what a test machine cannot have: the scrape job's
Kubernetes discovery becomes static targets carrying the labels its relabelling produces, the
remote-write URL points at the central Prometheus on loopback, the intervals are 1 s, and the
central server has no Alertmanager. Both clusters scrape the same two processes: the pods
differ only by the cluster's external label, which is exactly what must keep them apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from mrc_agent.dashboards.build import all_queries
from mrc_agent.dashboards.queries import substitute_macros
from tests.conftest import REPO
from tests.e2e.test_stacks_e2e import PANEL as STACKS_PANEL
from tests.e2e_harness import Prometheus, put_load, wait_until, watched_service

pytestmark = pytest.mark.prometheus

FLEET = REPO / "deploy" / "fleet"
RULES = REPO / "alerts" / "generated" / "mrc-rules.yaml"
CLUSTERS = ("gpu-east-1", "gpu-west-2")
POD = {"namespace": "inference", "pod": "mrc-0"}
#: As in test_e2e: the service measures peak GPU memory only on CUDA, and a replayed trace has
#: no NVML byte counters to drop intervals of.
NO_DATA_HERE = {"Peak GPU memory per request", "PCIe intervals dropped"}
#: Queries of an inference engine's own metrics (the mrc:engine_* rules): no engine runs here,
#: tests/integration/test_engine_dashboard.py runs them on expositions written from the
#: engines' sources.
ENGINE_QUERY = "mrc:engine_"


def _node_config(cluster: str, agent: str, service: str, central: str) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((FLEET / "prometheus-agent.yaml").read_text())
    assert set(config) == {"global", "scrape_configs", "remote_write"}, "agent mode: no rules"
    config["global"].update(scrape_interval="1s", external_labels={"cluster": cluster})
    (job,) = config["scrape_configs"]
    assert "kubernetes_sd_configs" in job
    del job["kubernetes_sd_configs"], job["relabel_configs"]
    job["static_configs"] = [
        {"targets": [agent], "labels": {**POD, "container": "mrc-agent"}},
        {"targets": [service], "labels": {**POD, "container": "server"}},
    ]
    (write,) = config["remote_write"]
    write["url"] = central + "/api/v1/write"
    write["queue_config"]["batch_send_deadline"] = "1s"
    return config


def _central_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((FLEET / "prometheus-central.yaml").read_text())
    assert "scrape_configs" not in config
    config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(RULES)]
    del config["alerting"]
    return config


@pytest.fixture(scope="module")
def central(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("fleet")
    stack: list[Any] = []
    try:
        service, agent = watched_service(tmp, stack)
        store = Prometheus(tmp / "central", {}, config=_central_config(), mode="receiver")
        stack.append(store)
        for cluster in CLUSTERS:
            stack.append(Prometheus(
                tmp / cluster, {}, mode="agent",
                config=_node_config(cluster, f"127.0.0.1:{agent.port}",
                                    f"127.0.0.1:{service.port}", store.url)))
        put_load(service.url, 25.0, seed=5)
        # Every cluster's last scrapes written and evaluated centrally.
        wait_until(lambda: set(_clusters(store, "mrc_model:requests:rate5m")) == set(CLUSTERS), 30,
                   what="both clusters' samples recorded centrally")
        time.sleep(3)
        yield store
    finally:
        for part in reversed(stack):
            part.stop()


def _result(prom: Prometheus, expr: str) -> list[dict[str, Any]]:
    body = prom.query(expr)
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _clusters(prom: Prometheus, expr: str) -> list[str]:
    return sorted(s["metric"].get("cluster", "") for s in _result(prom, expr))


def test_every_target_of_both_clusters_arrives_with_its_cluster(central: Prometheus) -> None:
    up = _result(central, "up")
    assert sorted((s["metric"]["cluster"], s["metric"]["container"]) for s in up) == sorted(
        (c, k) for c in CLUSTERS for k in ("mrc-agent", "server"))
    assert all(s["value"][1] == "1" for s in up)
    for family in ("mrc_process_cpu_user_ratio", "mrc_requests_total"):
        assert set(_clusters(central, family)) == set(CLUSTERS), family


def _fleet_records() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    (fleet,) = [g for g in groups if g["name"] == "mrc-fleet"]
    return [r["record"] for r in fleet["rules"]]


def test_fleet_rules_keep_two_clusters_pods_of_one_name_apart(central: Prometheus) -> None:
    records = _fleet_records()
    assert len(records) >= 10
    for record in records:
        series = _result(central, record)
        by_cluster = {c: [s for s in series if s["metric"].get("cluster") == c]
                      for c in CLUSTERS}
        assert all(by_cluster.values()), (record, series)
        assert len(by_cluster[CLUSTERS[0]]) == len(by_cluster[CLUSTERS[1]]), record
        assert len(series) == sum(map(len, by_cluster.values())), (record, "series without "
                                                                   "cluster")
        if record.startswith("mrc_pod:"):
            assert {(s["metric"]["namespace"], s["metric"]["pod"]) for s in series} == {
                (POD["namespace"], POD["pod"])}
    # What the rules did before they kept the label: one series for the two clusters' pods.
    merged = _result(central, "max by (namespace, pod) (mrc_process_cpu_user_ratio)")
    assert len(merged) == 1
    assert len(_result(central, "mrc_pod:process_cpu_user_ratio:max")) == 2


def test_every_rule_evaluates_centrally_without_error(central: Prometheus) -> None:
    body = httpx.get(central.url + "/api/v1/rules", timeout=10).json()
    rules = [r for g in body["data"]["groups"] for r in g["rules"]]
    assert len(rules) == sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert bad == []


@pytest.mark.parametrize("cluster", [None, CLUSTERS[1]])
def test_every_dashboard_query_returns_data_centrally(central: Prometheus,
                                                      cluster: str | None) -> None:
    """With the cluster variable on "All" and on one cluster: each query's series then all
    come from that cluster."""
    variables = {"cluster": cluster} if cluster else {}
    empty, foreign = [], []
    for dashboard, panel, expr in all_queries():
        query = substitute_macros(expr, range_s=300, rate_interval_s=20, interval_s=5,
                                  vars=variables)
        result = _result(central, query)
        if (not result and panel not in NO_DATA_HERE and ENGINE_QUERY not in expr
                and panel != STACKS_PANEL):  # no idle GPU here: tests/e2e/test_stacks_e2e.py
            empty.append(f"{dashboard} / {panel}: {query}")
        if cluster:
            foreign += [(panel, s["metric"]) for s in result
                        if s["metric"].get("cluster", cluster) != cluster]
    assert not empty, "\n".join(empty)
    assert not foreign
