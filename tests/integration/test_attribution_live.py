"""GPU attribution end to end: a real ``mrc-agent run`` replaying a 2-GPU trace
(``tests/data/fixed_device.jsonl``: GPU-fixed-0000 and GPU-fixed-0001) and watching a real child
process, whose environment or place on a GPU's process list decides which GPU's series the
agent exports; and ``mrc-agent doctor`` saying so per target.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mrc_agent.agent.core.config import AgentConfig
from mrc_agent.agent.tools.doctor import run_doctor
from tests.conftest import DATA, parse_metrics, series
from tests.e2e_harness import wait_until

TRACE = DATA / "fixed_device.jsonl"
GPU0, GPU1 = "GPU-fixed-0000", "GPU-fixed-0001"
Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def child() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts sleeping Python children with the given GPU variables (and none inherited)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(**gpu_env: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")}
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             env={**env, **gpu_env})
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
        p.wait()


def _scrape(agent: Any) -> Metrics:
    """The first exposition in which the attribution has been decided."""
    def ready() -> Metrics | None:
        m = parse_metrics(httpx.get(agent.url + "/metrics", timeout=5).text)
        return m if series(m, "mrc_agent_watched_gpus") else None

    result: Metrics = wait_until(ready, 20, 0.2, "the agent's first pass")
    return result


def _uuids(m: Metrics) -> set[str]:
    return {dict(labels)["uuid"] for _, labels in m if "uuid" in dict(labels)}


def test_only_the_gpu_in_the_targets_environment_is_exported(agent_factory: Any,
                                                             child: Any) -> None:
    target = child(NVIDIA_VISIBLE_DEVICES=GPU1)
    agent = agent_factory("--pid", str(target.pid), "--interval", "0.2",
                          "--gpu-backend", f"replay:{TRACE}", "--collector", "profiling")
    m = _scrape(agent)
    assert _uuids(m) == {GPU1}  # gpu, gpm, profiling and derived series alike
    assert series(m, "mrc_gpu_utilization_ratio", uuid=GPU1) == [0.95]
    assert series(m, "mrc_agent_watched_gpus", mode="targets") == [1.0]
    assert series(m, "mrc_agent_gpu_attribution_info", uuid=GPU1, source="environ") == [1.0]
    # GPU 0 is the only one with GPM and profiling fields in this trace: they run, and are
    # filtered, not failed.
    assert series(m, "mrc_agent_collector_success", collector="gpm") == [1.0]
    assert not series(m, "mrc_gpu_sm_active_ratio")


def test_gpus_all_exports_both(agent_factory: Any, child: Any) -> None:
    target = child(NVIDIA_VISIBLE_DEVICES=GPU1)
    agent = agent_factory("--pid", str(target.pid), "--interval", "0.2",
                          "--gpu-backend", f"replay:{TRACE}", "--gpus", "all")
    m = _scrape(agent)
    assert _uuids(m) == {GPU0, GPU1}
    assert series(m, "mrc_agent_watched_gpus", mode="all") == [2.0]
    assert series(m, "mrc_gpu_sm_active_ratio", uuid=GPU0)


def test_a_target_on_a_gpus_process_list_gets_that_gpu(agent_factory: Any, child: Any,
                                                       tmp_path: Path) -> None:
    """No GPU variable in its environment; the trace's process list of GPU 1 holds it."""
    target = child()
    trace = tmp_path / "trace.jsonl"
    rows = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    for row in rows:
        if row["gpu"] == 1:
            row["processes"] = {str(target.pid): 3e9, "1": 1e9}  # and someone else's
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    agent = agent_factory("--pid", str(target.pid), "--interval", "0.2",
                          "--gpu-backend", f"replay:{trace}")
    m = _scrape(agent)
    assert _uuids(m) == {GPU1}
    assert series(m, "mrc_agent_gpu_attribution_info", uuid=GPU1, source="nvml_process")
    assert series(m, "mrc_gpu_process_memory_used_bytes", pid=str(target.pid)) == [3e9]
    assert not series(m, "mrc_gpu_process_memory_used_bytes", pid="1")


def test_without_information_every_gpu_is_exported_and_the_state_says_so(
        agent_factory: Any, child: Any) -> None:
    target = child()
    agent = agent_factory("--pid", str(target.pid), "--interval", "0.2",
                          "--gpu-backend", f"replay:{TRACE}")
    m = _scrape(agent)
    assert _uuids(m) == {GPU0, GPU1}
    assert series(m, "mrc_agent_watched_gpus", mode="unknown") == [2.0]


def test_doctor_says_each_targets_gpus_and_their_source(child: Any) -> None:
    inside = child(NVIDIA_VISIBLE_DEVICES=f"{GPU0},{GPU1}", CUDA_VISIBLE_DEVICES="1")
    silent = child()
    out = io.StringIO()
    cfg = AgentConfig(pids=[inside.pid, silent.pid], gpu_backend=f"replay:{TRACE}")
    assert run_doctor(cfg, set(), True, out=out) == 0, out.getvalue()
    lines = out.getvalue().splitlines()
    assert any(f"GPUs of target {inside.pid}" in ln and f"1 {GPU1} (environ)" in ln
               for ln in lines), lines
    assert any(f"GPUs of target {silent.pid}" in ln and "no information: neither variable set"
               in ln for ln in lines), lines
    assert any("GPU attribution" in ln and "reporting GPU(s) 1" in ln for ln in lines), lines
