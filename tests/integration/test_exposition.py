"""Exposition: the snapshot collector, a golden /metrics for a fixed fake device, the
catalogue, and promtool's lint on the real agent's output."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import CollectorRegistry

from mrc_agent.agent.core.catalog import CATALOG
from mrc_agent.agent.core.collectors.base import Collector, TargetState
from mrc_agent.agent.core.collectors.derived import DerivedCollector
from mrc_agent.agent.core.collectors.gpm import GpmCollector
from mrc_agent.agent.core.collectors.gpu import GpuCollector
from mrc_agent.agent.core.collectors.profiling import ProfilingCollector
from mrc_agent.agent.core.hw.replay import ReplayBackend
from mrc_agent.agent.core.sample import Sample, Snapshot
from mrc_agent.agent.tools.reference_docs import render, render_settings
from mrc_agent.exporters.exposition.snapshot import MetricSpec, SnapshotCollector
from tests.conftest import BUSY, DATA, REPO, Procs, parse_metrics, series
from tests.support import pass_view, run_pass

GOLDEN = DATA / "golden_gpu_metrics.txt"
FIXED_TRACE = DATA / "fixed_device.jsonl"


def _fixed_snapshot() -> Snapshot:
    clock_t = [50.0]
    backend = ReplayBackend(str(FIXED_TRACE), clock=lambda: clock_t[0])
    collectors: list[Collector] = [GpuCollector(backend), GpmCollector(backend),
                                   ProfilingCollector(backend), DerivedCollector()]
    samples: list[Sample] = []
    for now in (50.0, 50.5, 51.0):
        clock_t[0] = now
        view = pass_view(now, (4242,), processes={4242: TargetState(4242, "python", 1.0, 1.0)})
        _, samples = run_pass(view, collectors)
    return Snapshot(1, 51.0, tuple(samples))


def _registry(snap: Snapshot) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(CATALOG, lambda: snap))
    return registry


def test_golden_exposition_for_a_fixed_fake_device() -> None:
    text = generate_latest(_registry(_fixed_snapshot())).decode()
    if os.environ.get("MRC_REGEN_GOLDEN") == "1":  # regenerate on purpose only
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_openmetrics_has_units_and_eof() -> None:
    text = generate_openmetrics(_registry(_fixed_snapshot())).decode()
    assert text.endswith("# EOF\n")
    assert "# UNIT mrc_gpu_memory_used_bytes bytes" in text
    assert "mrc_gpu_nvlink_tx_bytes_total{" in text


def test_every_spec_is_exposed_even_without_samples() -> None:
    specs = [MetricSpec("x_total", "counter", "A counter."), MetricSpec("y", "gauge", "Y.")]
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(specs, lambda: Snapshot(1, 0, (("y", (), 2.0),))))
    text = generate_latest(registry).decode()
    assert "# TYPE x_total counter" in text and "y 2.0" in text
    with pytest.raises(ValueError):
        SnapshotCollector(specs + specs[:1], lambda: Snapshot(1, 0, ()))


def test_catalogue_matches_the_code() -> None:
    assert (REPO / "docs" / "metrics.md").read_text() == render(), (
        "regenerate with: mrc-agent catalog --out docs/metrics.md")
    assert (REPO / "docs" / "settings.md").read_text() == render_settings(), (
        "regenerate with: mrc-agent catalog --settings --out docs/settings.md")
    names = [s.name for s in CATALOG]
    assert len(names) == len(set(names))
    for s in CATALOG:
        assert s.name.startswith("mrc_") and ":" not in s.name
        assert (s.kind == "counter") == s.name.endswith("_total")
        assert s.help.endswith(".")


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is required (Debian package 'prometheus'; .ci/run installs it)")
    return path


def test_real_agent_serves_clean_metrics(agent_factory, procs: Procs, promtool: str) -> None:
    busy = procs.spawn(BUSY)
    agent = agent_factory("--pid", str(busy.pid), "--interval", "0.2",
                          "--gpu-backend", f"replay:{FIXED_TRACE}", "--collector", "profiling")
    with httpx.Client(base_url=agent.url, timeout=5) as client:
        assert client.get("/healthz").status_code == 200
        for _ in range(50):
            if client.get("/readyz").status_code == 200:
                break
            import time

            time.sleep(0.1)
        assert client.get("/readyz").status_code == 200
        import time

        time.sleep(0.6)
        text = client.get("/metrics").text
        om = client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")
        gz = client.get("/metrics", headers={"Accept-Encoding": "gzip"})
        assert gz.headers.get("content-encoding") == "gzip" and "mrc_agent_targets" in gz.text
        assert client.get("/nope").status_code == 404
        assert client.post("/metrics").status_code == 405
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True)
    assert lint.returncode == 0 and lint.stdout + lint.stderr == "", lint.stdout + lint.stderr
    m = parse_metrics(text)
    # Counted at all: the exact ratio logic is pinned by the fixture trees (test_process_fixtures),
    # and a busy loop on a loaded 2-core machine may get far less than a core.
    assert series(m, "mrc_process_cpu_user_ratio", pid=str(busy.pid))[0] > 0.1
    assert series(m, "mrc_gpu_sm_instructions_executed_total")
    assert series(m, "mrc_agent_compute_memory_source_info", source="cupti_pm_sampling")
    assert series(m, "mrc_agent_collector_success", collector="profiling") == [1.0]
