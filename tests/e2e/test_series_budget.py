"""The series budget per pod (docs/fleet.md), counted from the real expositions.

* The agent: a real ``mrc-agent run`` on loopback with the manifest's collectors, watching one
  real process, replaying a 1-GPU and an 8-GPU trace; and, in process, the same collectors on
  a hand-written fake NVML shaped like an H200 HGX node (18 NVLink links per GPU, GPM), which
  is the exposition a real node gives — the replay format has no per-link counters.
* The reference service: a real uvicorn server with the embedded model
  (``tests/integration/test_service``'s ``Service``), before and after traffic.
* The fleet recording rules: a real Prometheus scraping both with the labels the
  PodMonitor gives (namespace, pod), evaluating the generated rules.

Counts are samples per scrape (one per series, histogram buckets included), per metric family,
via prometheus-client's parser. The numbers and the budgets live in the table in
docs/fleet.md; this test parses it. The "measured" column must equal what is measured here
(``MRC_REGEN_BUDGET=1`` rewrites that column, on purpose only); the budget column is a ceiling
nobody rewrites automatically. Cardinality must not grow with traffic (50 distinct prompts and
images, bad inputs, unknown paths) or with restarts of the target (new PIDs).
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pynvml
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mrc_agent.agent.core.collectors import DEFAULT_ON, PASS_FINISHERS
from mrc_agent.agent.core.config import AgentConfig
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.core.hw.sources import Sources
from mrc_agent.agent.core.runner import Runner
from mrc_agent.agent.core.targets import TargetResolver
from mrc_agent.agent.core.wiring import build_collectors, build_registry
from mrc_agent.agent.tools.simgpu.nvml import gpu, nvlink
from mrc_agent.agent.tools.tracegen import write_trace
from mrc_agent.alerts import rules
from mrc_agent.alerts.build import rule_file
from mrc_agent.alerts.config import DEFAULT
from mrc_agent.reference_service.loadgen import make_photo
from tests.conftest import REPO
from tests.e2e_harness import Prometheus, wait_until
from tests.integration.test_service import Service
from tests.nvml_support import EventNvml

DOC = REPO / "docs" / "fleet.md"
BEGIN, END = "<!-- series-budget:begin -->", "<!-- series-budget:end -->"
#: The agent's arguments in deploy/base/deployment.yaml that decide what it exports.
AGENT_ARGS = ("--interval", "0.2", "--collector", "stacks")
#: The stacks collector's per-function series: at most (top K + other) x 4 GPU states per
#: target, as many as the target's Python has run so far; budgeted apart (docs/fleet.md).
PER_FUNCTION = "mrc_process_function_seconds"


def counted(fams: dict[str, int]) -> int:
    """The series a scrape carries, less the stacks collector's per-function ones."""
    return sum(n for f, n in fams.items() if f != PER_FUNCTION)
H200_LINKS = 18


# --- counting ----------------------------------------------------------------------------------


def families(text: str) -> Counter[str]:
    """Samples per metric family in one exposition."""
    out: Counter[str] = Counter()
    for fam in text_string_to_metric_families(text):
        out[fam.name] += len(fam.samples)
    return out


def label_sets(text: str) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    return {(s.name, frozenset(s.labels.items()))
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def budget_table() -> dict[str, tuple[int, int]]:
    """``key -> (measured, budget)`` from the table between the markers in docs/fleet.md."""
    text = DOC.read_text()
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    rows = {}
    for line in block.splitlines():
        m = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|[^|]*\|\s*(\d+)\s*\|\s*(\d+)\s*\|", line)
        if m:
            rows[m[1]] = (int(m[2]), int(m[3]))
    return rows


def record(key: str, measured: int) -> None:
    """Check ``measured`` against the doc's row ``key`` (or rewrite the doc's measured
    column with it, under ``MRC_REGEN_BUDGET=1``)."""
    table = budget_table()
    assert key in table, f"docs/fleet.md has no budget row `{key}`"
    doc_measured, budget = table[key]
    assert measured <= budget, f"{key}: {measured} series, over the budget of {budget}"
    if os.environ.get("MRC_REGEN_BUDGET") == "1":
        text = DOC.read_text()
        row = re.compile(rf"(\|\s*`{key}`\s*\|[^|]*\|\s*)\d+(\s*\|)")
        DOC.write_text(row.sub(lambda m: f"{m[1]}{measured}{m[2]}", text, count=1))
        return
    assert measured == doc_measured, (
        f"{key}: measured {measured} series, docs/fleet.md says {doc_measured}; if the change "
        "is intended, rerun with MRC_REGEN_BUDGET=1 and review the diff")


def test_budget_table_is_complete_and_ordered() -> None:
    table = budget_table()
    assert set(table) == {"agent-replay-1gpu", "agent-replay-8gpu", "agent-nvml-1gpu",
                          "agent-nvml-8gpu", "service", "pod-1gpu", "pod-8gpu",
                          "fleet-per-pod", "fleet-per-model"}
    for key, (measured, budget) in table.items():
        assert 0 < measured <= budget, key
    assert table["pod-8gpu"][1] >= table["agent-nvml-8gpu"][1] + table["service"][1]
    podmonitor = yaml.safe_load((REPO / "deploy" / "base" / "podmonitor.yaml").read_text())
    # The PodMonitor's per-scrape limit lets every budgeted scrape through and stops one that
    # has run away (a scrape is one container: the agent's or the service's).
    limit = podmonitor["spec"]["sampleLimit"]
    per_scrape = max(b for k, (_, b) in table.items() if k.startswith(("agent-", "service")))
    assert per_scrape <= limit <= 2 * per_scrape


# --- the agent ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> Iterator[subprocess.Popen[bytes]]:
    """The watched process: a Python process spinning a little (so CPU ratios exist), in a pod
    given every GPU of the node (``NVIDIA_VISIBLE_DEVICES=all`` in its environment, as the
    device plugin sets it), so the agent attributes it every GPU and the counts are per GPU."""
    code = ("import time\nend = time.time() + 300\nwhile time.time() < end:\n"
            "    t = time.time() + 0.01\n    while time.time() < t: pass\n    time.sleep(0.04)\n")
    proc = subprocess.Popen([sys.executable, "-c", code],
                            env={**os.environ, "NVIDIA_VISIBLE_DEVICES": "all"})
    yield proc
    proc.kill()
    proc.wait()


def _trace(tmp: Path, gpus: int) -> Path:
    """A steadily busy trace: every series the replay can give is present all the time (in
    the "starved" pattern the GPM activity quotient is absent while DRAM idles, so a count
    would depend on the moment of the scrape)."""
    path = tmp / f"trace-{gpus}.jsonl"
    with path.open("w") as f:
        write_trace(f, gpus=gpus, duration=12.0, step=0.1, pattern="busy")
    return path


def scrape_settled(url: str) -> str:
    """``/metrics`` once every series is there: two scrapes a second apart with the same label
    sets (rates need two samples; the idle-window tracker needs a pass)."""
    client = httpx.Client(timeout=5)
    wait_until(lambda: client.get(url + "/readyz").status_code == 200, 20, 0.1, "agent ready")
    time.sleep(1.0)
    before = client.get(url + "/metrics").text
    for _ in range(20):
        time.sleep(1.0)
        after = client.get(url + "/metrics").text
        if label_sets(after) == label_sets(before):
            return after
        before = after
    raise AssertionError("the agent's series did not settle")


@pytest.mark.parametrize("gpus", [1, 8])
def test_agent_replay_series_per_gpu_count(gpus: int, target: subprocess.Popen[bytes],
                                           tmp_path: Path, agent_factory: Any) -> None:
    agent = agent_factory("--pid", str(target.pid), *AGENT_ARGS,
                          "--gpu-backend", f"replay:{_trace(tmp_path, gpus)}")
    fams = families(scrape_settled(agent.url))
    gpu_fams = {f: n for f, n in fams.items() if f.startswith("mrc_gpu_")
                and f not in ("mrc_gpu_starved", "mrc_gpu_starved_seconds")}
    # every per-GPU family has the same number of series on each GPU
    for fam, n in gpu_fams.items():
        assert n % gpus == 0, (fam, n)
    record(f"agent-replay-{gpus}gpu", counted(fams))


def _nvml_exposition(gpus: int, pid: int) -> str:
    """The agent's collectors (the manifest's: profiling off) on a fake NVML shaped like an
    H200 HGX: every NVML field supported, 18 NVLink links, GPM, an XID seen, the target on
    GPU 0 — every family the agent exports on a node, on every GPU."""
    gpm = {getattr(pynvml, f"NVML_GPM_METRIC_{name}"): value for name, value in (
        ("SM_UTIL", 80.0), ("SM_OCCUPANCY", 40.0), ("ANY_TENSOR_UTIL", 25.0),
        ("DRAM_BW_UTIL", 50.0), ("PCIE_TX_PER_SEC", 100.0), ("PCIE_RX_PER_SEC", 200.0),
        ("NVLINK_TOTAL_TX_PER_SEC", 3.0), ("NVLINK_TOTAL_RX_PER_SEC", 4.0))}
    fake = EventNvml([gpu(index=i, name="NVIDIA H200", memory={"total": 141 * 2**30,
                                                             "used": 60 * 2**30,
                                                             "reserved": 2**29},
                         nvlink={link: nvlink(1024 * link, 2048) for link in range(H200_LINKS)},
                         gpm=dict(gpm),
                         # the PCIe byte counters: totals, and the rate gauges from them
                         pcie_count={"tx_bytes": 10**9, "rx_bytes": 2 * 10**9,
                                     "value_type": "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG"},
                         compute_processes=[(pid, 50 * 2**30)] if i == 0 else [],
                         xid_events=[79])  # so that mrc_gpu_last_xid exists too
                     for i in range(gpus)])
    cfg = AgentConfig(pids=[pid], collectors={**DEFAULT_ON, "stacks": True})
    nvml = NvmlBackend(lib=fake)  # with its PCIe throughput thread, as in the agent
    src = Sources(device=nvml, gpm=nvml, profiling=None, owned=(nvml,))
    runner = Runner(build_collectors(cfg, src), TargetResolver(cfg.pids), 0.2,
                    finishers=PASS_FINISHERS)
    try:
        # Rates need two passes and the PCIe throughput thread its first reading: sample until
        # every GPU has them (a few passes).
        text = ""
        for _ in range(25):
            runner.sample_once()
            text = generate_latest(build_registry(runner)).decode()
            fams = families(text)
            if fams["mrc_gpu_pcie_rx_bytes_per_second"] == fams["mrc_gpu_sm_active_ratio"] \
                    == gpus:
                break
            time.sleep(0.2)
        return text
    finally:
        nvml.close()


@pytest.mark.parametrize("gpus", [1, 8])
def test_agent_nvml_series_per_gpu_count(gpus: int, target: subprocess.Popen[bytes]) -> None:
    fams = families(_nvml_exposition(gpus, target.pid))
    # the per-link NVLink counters: 2 x 18 per GPU, the largest family on a real node
    assert fams["mrc_gpu_nvlink_link_tx_bytes"] == fams["mrc_gpu_nvlink_link_rx_bytes"] \
        == gpus * H200_LINKS
    assert fams["mrc_gpu_process_memory_used_bytes"] == 1
    for fam in ("mrc_gpu_sm_active_ratio", "mrc_gpu_pcie_rx_bytes_per_second",
                "mrc_gpu_last_xid"):
        assert fams[fam] == gpus, fam
    # Profiling is off in the manifest; the GPM scope series exists for MIG devices only; a
    # function's seconds exist once the target ran Python (at most (K + 1) x 4: docs/fleet.md).
    assert not [f for f, n in fams.items() if n == 0 and not f.startswith(
        ("mrc_gpu_sm_instructions", "mrc_gpu_dram_read", "mrc_gpu_profiling",
         "mrc_gpu_gpm_scope", PER_FUNCTION))], \
        "a family without series"
    assert fams["mrc_process_stacks_available"] == 1
    record(f"agent-nvml-{gpus}gpu", counted(fams))


def test_agent_series_follow_the_live_target_not_its_history(agent_factory: Any,
                                                             tmp_path: Path) -> None:
    """Five restarts of the watched service (five new PIDs): the per-target series are those
    of the live process only, and the total stays what it was."""
    marker = f"mrc-budget-target-{uuid.uuid4().hex[:8]}"
    code = "import time\ntime.sleep(120)\n"

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code, marker])

    proc = start()
    agent = agent_factory("--process-name", marker, *AGENT_ARGS,
                          "--gpu-backend", f"replay:{_trace(tmp_path, 1)}")

    def only(pid: int) -> str | None:
        """The exposition if every `pid` label in it is ``pid`` (and its CPU ratio is there)."""
        text = httpx.get(agent.url + "/metrics", timeout=5).text
        sets = label_sets(text)
        pids = {dict(labels).get("pid") for _, labels in sets} - {None}
        cpu = [ls for n, ls in sets if n == "mrc_process_cpu_user_ratio"]
        return text if pids == {str(pid)} and cpu else None

    seen_pids = []
    try:
        totals = []
        for _restart in range(6):
            seen_pids.append(proc.pid)
            wait_until(partial(only, proc.pid), 20, 0.2, f"agent following pid {proc.pid}")
            time.sleep(0.6)  # a few more passes: nothing of the old PID comes back
            text = only(proc.pid)
            assert text is not None
            # A new process may be caught running Python as it starts (its imports): its
            # per-function series come and go with what it runs, budgeted apart.
            totals.append(counted(families(text)))
            proc.kill()
            proc.wait()
            proc = start()
        assert len(set(seen_pids)) == 6
        assert len(set(totals)) == 1, f"series count changed across restarts: {totals}"
    finally:
        proc.kill()
        proc.wait()


# --- the service -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("mrc-cache"))
    yield svc
    svc.stop()


def _request(url: str, i: int) -> int:
    """Request ``i`` of 50: a distinct prompt and a distinct image, across all nine buckets."""
    w, h = ((320 + i, 240 + i), (1100 + i, 1000), (2050 + i, 2000))[i % 3]
    prompt = f"Question {i} {uuid.uuid4().hex}: " + "is the parcel damaged? " * (i % 3) * 3
    body = {"image": base64.b64encode(make_photo(w, h, seed=i)).decode(),
            "text_prompt": prompt, "max_new_tokens": 2}
    return httpx.post(url + "/mrc", json=body, timeout=120).status_code


def test_service_series_do_not_grow_with_traffic(service: Service) -> None:
    before = httpx.get(service.url + "/metrics", timeout=10).text
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda i: _request(service.url, i), range(50)))
    assert codes.count(200) >= 40, codes
    hostile = [
        httpx.post(service.url + "/mrc", content=os.urandom(64), timeout=10,
                   headers={"Content-Type": "application/json"}).status_code,
        httpx.post(service.url + "/mrc", json={"image": "not-base64-" + uuid.uuid4().hex,
                                               "text_prompt": uuid.uuid4().hex},
                   timeout=10).status_code,
        *(httpx.get(f"{service.url}/{uuid.uuid4().hex}/{i}", timeout=10).status_code
          for i in range(10)),
    ]
    assert all(400 <= c < 500 for c in hostile), hostile
    after = httpx.get(service.url + "/metrics", timeout=10).text
    # the same label sets before and after: every series existed from the start at zero, none
    # carries a prompt, an image, a request id or a path
    assert label_sets(after) == label_sets(before)
    values = {(s.name, frozenset(s.labels.items())): s.value
              for fam in text_string_to_metric_families(after) for s in fam.samples}
    assert sum(v for (n, _), v in values.items() if n == "mrc_requests_total") >= 50
    record("service", sum(families(after).values()))


# --- the pod and the fleet rules ---------------------------------------------------------------


def test_pod_totals_are_the_sum_of_their_containers(service: Service,
                                                    target: subprocess.Popen[bytes]) -> None:
    """A pod is two scrapes: the service and its agent on the node's NVML."""
    svc = sum(families(httpx.get(service.url + "/metrics", timeout=10).text).values())
    for gpus in (1, 8):
        agent = counted(families(_nvml_exposition(gpus, target.pid)))
        record(f"pod-{gpus}gpu", svc + agent)


def test_fleet_rules_on_the_real_expositions(service: Service, target: subprocess.Popen[bytes],
                                             tmp_path: Path, agent_factory: Any) -> None:
    """The generated rules in a real Prometheus scraping the real agent (8 GPUs) and service
    as one pod: every fleet rule evaluates without error, gives one series per pod or per
    model, and the model join finds the service's model."""
    agent = agent_factory("--pid", str(target.pid), *AGENT_ARGS,
                          "--gpu-backend", f"replay:{_trace(tmp_path, 8)}")
    rules_path = tmp_path / "rules.yaml"
    rules_path.write_text(yaml.safe_dump(rule_file(DEFAULT), sort_keys=False))
    pod = {"namespace": "mrc", "pod": "mrc-0"}
    # Started with no target, then given the two with the labels the PodMonitor adds (the
    # harness has no per-target labels); SIGHUP reloads the configuration.
    prom = Prometheus(tmp_path / "prom", {}, [rules_path], interval="1s")
    config_path = tmp_path / "prom" / "prometheus.yml"
    config = yaml.safe_load(config_path.read_text())
    try:
        config["scrape_configs"] = [
            {"job_name": job, "static_configs": [{"targets": [addr], "labels": pod}]}
            for job, addr in (("mrc-agent", f"127.0.0.1:{agent.port}"),
                              ("mrc", service.url.removeprefix("http://")))]
        config_path.write_text(yaml.safe_dump(config))
        prom.proc.send_signal(signal.SIGHUP)
        fleet = [r["record"] for r in rules.fleet(DEFAULT)["rules"]]

        def evaluated() -> dict[str, Any] | None:
            groups = httpx.get(prom.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
            (group,) = [g for g in groups if g["name"] == "mrc-fleet"]
            done = all(r["lastEvaluation"] > "2000" for r in group["rules"])
            counts = {name: len(prom.query(name)["data"]["result"]) for name in fleet}
            return {"group": group, "counts": counts} if done and all(counts.values()) else None

        result = wait_until(evaluated, 60, 1.0, "every fleet rule recorded")
        for r in result["group"]["rules"]:
            assert r["health"] == "ok", (r["name"], r.get("lastError"))
        per_pod = {k: v for k, v in result["counts"].items() if k.startswith("mrc_pod:")}
        assert set(per_pod.values()) == {1}, per_pod
        model = prom.query("mrc_model:model_info:count")["data"]["result"]
        assert len(model) == 1 and model[0]["value"][1] == "1"
        assert model[0]["metric"]["model_id"]
        record("fleet-per-pod", sum(per_pod.values()))
        record("fleet-per-model",
               sum(v for k, v in result["counts"].items() if k.startswith("mrc_model:")))
    finally:
        prom.stop()
