"""``docs/dcgm-exporter.md`` on real parts: every PromQL block of the page runs in a real
Prometheus that scrapes a real agent (replaying a synthetic busy H200) and a
dcgm-exporter-style exposition, with the pod labels the operator would add, once per
dcgm-exporter naming: up to 4.8 (``tests/data/dcgm_exporter_synthetic.prom``: percent
utilisation, ``DCGM_FI_PROF_*_ACTIVE``, ``DCGM_FI_PROF_PCIE_TX_BYTES``) and from 4.10
(``tests/data/dcgm_exporter_4.10_synthetic.prom``: the 4.9 names with their 0-1 utilisation,
``…_BYTES_PER_SECOND``). Both files carry the same GPUs and the same quantities, so every query
must give the same answer on both: a query that reads one naming only comes back empty on the
other, one that forgets a unit change comes back a hundredfold off. The page's tables name only
metrics the agent exports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import REPO, AgentProcess
from tests.e2e_harness import Prometheus, serve_exposition, wait_until

DOC = REPO / "docs" / "dcgm-exporter.md"
#: dcgm-exporter's naming -> its exposition.
FIXTURES = {"4.8": REPO / "tests" / "data" / "dcgm_exporter_synthetic.prom",
            "4.10": REPO / "tests" / "data" / "dcgm_exporter_4.10_synthetic.prom"}
POD = {"namespace": "inference", "pod": "vllm-llava-0"}
GPU0, GPU1 = "GPU-synthetic-0000", "GPU-synthetic-0001"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def prom(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("dcgm")
    trace = tmp / "busy.jsonl"
    trace.write_text(subprocess.run(
        [sys.executable, "-m", "mrc_agent.agent.tools.tracegen", "busy", "1", "20"], cwd=REPO,
        capture_output=True, text=True, check=True).stdout)
    body = FIXTURES[request.param].read_bytes()
    dcgm = serve_exposition(lambda path: body)
    agent = AgentProcess("--pid", str(os.getpid()), "--interval", "0.5",
                         "--gpu-backend", f"replay:{trace}")
    p = None
    try:
        p = Prometheus(tmp / "prom", {"agent": [f"127.0.0.1:{agent.port}"],
                                      "dcgm-exporter": [f"127.0.0.1:{dcgm.server_port}"]},
                       labels={"agent": POD})
        wait_until(lambda: p.query("mrc_gpu_utilization_ratio")["data"]["result"]
                   and p.query('{__name__=~"DCGM_FI_DEV_GPU_UTIL.*"}')["data"]["result"]
                   and p.query("mrc_gpu_starved")["data"]["result"], 30,
                   what="both sides scraped")
        time.sleep(2.0)  # a second scrape of both, then evaluate between them
        _AT[:] = [time.time() - 1.0]
        yield p
    finally:
        if p is not None:
            p.stop()
        agent.stop()
        dcgm.shutdown()


#: One evaluation time for every query of a run (set once both sides have been scraped): values
#: compared across queries then come from the same samples.
_AT: list[float] = []


def _run(prom: Prometheus, expr: str) -> list[dict[str, Any]]:
    body = prom.query(expr, at=_AT[0])
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_the_page_has_the_queries_this_test_knows() -> None:
    assert len(_blocks("promql")) == 6


def test_the_fixtures_are_one_gpu_pair_under_two_namings() -> None:
    """Same GPUs, same quantities; only names, units and the renamed labels differ, as the page
    says 4.9 and 4.10 changed them."""
    old, new = (FIXTURES[v].read_text() for v in ("4.8", "4.10"))
    names = {v: set(re.findall(r"^(DCGM_\w+)\{", FIXTURES[v].read_text(), re.M))
             for v in FIXTURES}
    assert names["4.8"] - names["4.10"] == {
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_PROF_PCIE_TX_BYTES"}
    assert names["4.10"] == {
        "DCGM_FI_DEV_GPU_UTIL_RATIO", "DCGM_FI_DEV_BOARD_POWER_WATTS",
        "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", "DCGM_FI_PROF_SM_UTIL_RATIO",
        "DCGM_FI_PROF_DRAM_UTIL_RATIO", "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND"}
    assert 'Hostname="' in old and 'DCGM_FI_DRIVER_VERSION="' in old
    assert 'hostname="' in new and 'DCGM_FI_SYSTEM_DRIVER_VERSION="' in new
    assert "DCGM_FI_DEV_GPU_UTIL{" in old and "} 93\n" in old  # percent up to 4.8
    assert "DCGM_FI_DEV_GPU_UTIL_RATIO{" in new and "} 0.93\n" in new  # a ratio from 4.9


def test_every_query_reads_both_namings() -> None:
    """Each block that names a renamed field names its new name `or` its old one."""
    renamed = {"DCGM_FI_DEV_GPU_UTIL": "DCGM_FI_DEV_GPU_UTIL_RATIO",
               "DCGM_FI_DEV_POWER_USAGE": "DCGM_FI_DEV_BOARD_POWER_WATTS",
               "DCGM_FI_PROF_SM_ACTIVE": "DCGM_FI_PROF_SM_UTIL_RATIO",
               "DCGM_FI_PROF_DRAM_ACTIVE": "DCGM_FI_PROF_DRAM_UTIL_RATIO",
               "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO",
               "DCGM_FI_PROF_PCIE_TX_BYTES": "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND"}
    for block in _blocks("promql"):
        old = set(re.findall(r"\b(DCGM_\w+?)\b(?!_)", block)) & set(renamed)
        assert old, block
        for name in old:
            assert re.search(rf"{renamed[name]}(\{{[^}}]*\}})? or {name}\b", block), (name, block)


def test_utilisation_difference_joins_on_the_uuid(prom: Prometheus) -> None:
    (s,) = _run(prom, _blocks("promql")[0])
    assert s["metric"]["uuid"] == GPU0 and s["metric"]["gpu_model"].startswith("NVIDIA H200")
    agent = float(_run(prom, "mrc_gpu_utilization_ratio")[0]["value"][1])
    assert float(s["value"][1]) == pytest.approx(agent - 0.93, abs=1e-9)


def test_dcgm_pod_attribution_lands_on_the_agents_series(prom: Prometheus) -> None:
    (s,) = _run(prom, _blocks("promql")[1])
    m = s["metric"]
    assert (m["uuid"], m["gpu_pod"], m["gpu_namespace"]) == (GPU0, POD["pod"],
                                                              POD["namespace"])
    assert m["pod"] == POD["pod"], "the agent's own pod label is kept"
    agent = float(_run(prom, "mrc_gpu_utilization_ratio")[0]["value"][1])
    assert float(s["value"][1]) == pytest.approx(agent)


def test_model_name_under_the_agents_label(prom: Prometheus) -> None:
    (s,) = _run(prom, _blocks("promql")[2])
    assert s["metric"] == {"gpu_model": "NVIDIA H200 (synthetic)"}
    assert float(s["value"][1]) == 600 + 70  # watts, the same under both names
    agent_models = {r["metric"]["gpu_model"] for r in _run(prom, "mrc_gpu_power_watts")}
    assert s["metric"]["gpu_model"] in agent_models


def test_dcgm_activity_quotient_per_gpu(prom: Prometheus) -> None:
    got = {r["metric"]["uuid"]: float(r["value"][1]) for r in _run(prom, _blocks("promql")[3])}
    assert got == {GPU0: pytest.approx(2.0), GPU1: pytest.approx(0.5)}


def test_starved_processes_with_what_dcgm_saw_in_their_pod(prom: Prometheus) -> None:
    (s,) = _run(prom, _blocks("promql")[4])
    assert s["metric"] == POD
    starved = max(float(r["value"][1]) for r in _run(prom, "mrc_gpu_starved"))
    assert float(s["value"][1]) == pytest.approx(starved * 0.97)


def test_pcie_difference_joins_on_the_uuid(prom: Prometheus) -> None:
    (s,) = _run(prom, _blocks("promql")[5])
    assert s["metric"]["uuid"] == GPU0
    agent = float(_run(prom, "mrc_gpu_pcie_tx_bytes_per_second")[0]["value"][1])
    assert agent > 0
    assert float(s["value"][1]) == pytest.approx(agent - 140e6)


def test_the_tables_and_the_drop_rule_name_only_what_the_agent_exports() -> None:
    catalogue = set(re.findall(r"^\| `(mrc_[a-z0-9_]+)`", (REPO / "docs" / "metrics.md")
                               .read_text(), re.M))
    named = set(re.findall(r"`(mrc_[a-z0-9_]+)`", DOC.read_text()))
    assert named <= catalogue, sorted(named - catalogue)
    (rule,) = _blocks("yaml")
    (alts,) = re.findall(r"regex: mrc_gpu_\((.*)\)", rule)
    for alt in alts.split("|"):
        assert f"mrc_gpu_{alt}" in catalogue, alt
