"""What a central store pays for a fleet of MRC pods: series, ingested samples per second, its
memory, and the time of the fleet rules and of every dashboard query, for 10, 100 and 1000 pods
of 1 and 8 GPUs, side by side in one run; then the knobs that cut the series, measured at one
size.

Each pod is two scrape targets with the expositions a pod really serves: the agent's collectors
on a fake NVML shaped like an H200 HGX (18 NVLink links per GPU, GPM; the series-budget test's
exposition) and the instrumentation library's ``MRCMetrics`` (every series exists from the first
scrape). A child process serves them on loopback, the same bytes for every pod (the pod is the
target's label, as Kubernetes discovery would add it), so the store compresses the values better
than a real fleet's: memory here is a floor, series and samples are exact. The store is a real
Prometheus (Debian's 2.42) scraping every target every 15 s and evaluating the generated rules
(``alerts/generated/mrc-rules.yaml``) every 15 s.

Knobs (at ``--knob-pods`` pods of 1 GPU): dropping the per-link NVLink counters at scrape
(``metric_relabel_configs``), four prompt-length x resolution cells instead of nine
(``MRCMetrics(prompt_edges=(100,), resolution_edges_mp=(4.0,))``), and the per-fleet split:
only the recorded ``mrc_pod:``/``mrc_model:``/``mrc_service:`` series leave the cluster (what
the central store of docs/fleet.md then holds per pod, counted from the full run's rules).

    python3 benchmarks/bench_fleet.py [--sizes 10,100,1000] [--gpus 1,8] [--out FILE]

About 12 minutes at the default sizes on the project's 2-core machine; needs ~6 GB of memory at
1000 pods of 8 GPUs. Exits 1 only when it cannot measure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from support import free_port as _free_port
from support import rss_mb, stop

REPO = Path(__file__).resolve().parent.parent


SCRAPE = 15  # seconds, the PodMonitor's interval
QUERY_TIMEOUT = 60.0  # seconds a dashboard query may take before it counts as timed out
RULES = REPO / "alerts" / "generated" / "mrc-rules.yaml"
NVLINK_LINK = "mrc_gpu_nvlink_link_(tx|rx)_bytes_total"


def _agent_exposition(gpus: int) -> str:
    """The agent's exposition for a pod given every GPU of an H200 node of ``gpus`` GPUs.

    The agent reports its targets' GPUs only (docs/attribution.md), so the watched process is
    one started with ``NVIDIA_VISIBLE_DEVICES=all`` in its environment, as the device plugin
    sets it for such a pod: the child that builds the exposition watches itself."""
    from prometheus_client.parser import text_string_to_metric_families

    code = ("import os, sys\n"
            "from tests.e2e.test_series_budget import _nvml_exposition\n"
            "sys.stdout.write(_nvml_exposition(int(sys.argv[1]), os.getpid()))\n")
    text = _from_tests(code, str(gpus), env={**os.environ, "NVIDIA_VISIBLE_DEVICES": "all"})
    reported = {s.labels["uuid"] for f in text_string_to_metric_families(text)
                if f.name == "mrc_gpu_utilization_ratio" for s in f.samples}
    if len(reported) != gpus:
        raise SystemExit(f"bench_fleet: the agent reported {len(reported)} of {gpus} GPUs")
    return text


def _from_tests(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Runs ``code`` in a child whose working directory is the repository's root, where the
    test suite's helpers import as ``tests.*`` (as pytest imports them), and returns its
    output."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True).stdout


def _expositions(cells: int) -> dict[str, bytes]:
    """name -> exposition: agent-1gpu, agent-8gpu, service (9 or 4 cells)."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from mrc_agent.exporters.instrumentation import MRCMetrics

    out = {f"agent-{g}gpu": _agent_exposition(g).encode() for g in (1, 8)}
    registry = CollectorRegistry()
    kwargs: dict[str, Any] = {}
    if cells == 4:
        kwargs = {"prompt_edges": (100,), "resolution_edges_mp": (4.0,)}
    m = MRCMetrics(registry, **kwargs)
    m.set_model_info(model_id="llava-1.5-7b", revision="main", dtype="float16", device="cuda")
    for chars, w, h in ((20, 800, 600), (80, 2000, 1500), (300, 4000, 3000)):
        with m.request(prompt_chars=chars, width=w, height=h) as r:
            with r.queued():
                pass
            r.first_token()
            r.tokens(16, 700)
    out["service"] = generate_latest(registry)
    return out


# A child from the repository's root (see _from_tests): answers /pod/<i>/<name> with the
# exposition named <name>, read as JSON from its standard input, and prints its port.
_SERVE = """
import json, sys, threading
from tests.e2e_harness import serve_exposition
bodies = {name: text.encode() for name, text in json.load(sys.stdin).items()}
server = serve_exposition(lambda path: bodies.get(path.rsplit("/", 1)[-1]))
print(server.server_port, flush=True)
threading.Event().wait()
"""


@dataclass
class Result:
    label: str
    pods: int
    gpus: int
    series: float = 0.0
    samples_per_s: float = 0.0
    rss_mb: float = 0.0
    rules_ms: dict[str, float] = field(default_factory=dict)
    query_total_ms: float = 0.0
    query_max_ms: float = 0.0
    query_max_panel: str = ""
    query_timeouts: int = 0
    pod_records: float = 0.0


def _q(url: str, expr: str) -> float:
    """The query's first value; NaN when the store does not answer within 120 s (at 1000
    pods of 8 GPUs a 2-core machine may not)."""
    try:
        body = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=120).json()
    except httpx.TimeoutException:
        return math.nan
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def measure(label: str, pods: int, gpus: int, port: int, work: Path,
            drop_links: bool = False, cycles: int = 2) -> Result:
    from mrc_agent.dashboards.build import all_queries
    from mrc_agent.dashboards.queries import substitute_macros

    prom_port = _free_port()
    targets = []
    for i in range(pods):
        for name, pod_port in ((f"agent-{gpus}gpu", 9478), ("service", 8000)):
            # instance and container as Kubernetes discovery would set them: every target of
            # the fleet has a label set of its own.
            targets.append({"targets": [f"127.0.0.1:{port}"],
                            "labels": {"__metrics_path__": f"/pod/{i}/{name}",
                                       "instance": f"10.{i // 250}.{i % 250}.1:{pod_port}",
                                       "container": name.split("-")[0],
                                       "namespace": "inference", "pod": f"mrc-{i}",
                                       "cluster": "gpu-east-1"}})
    job: dict[str, Any] = {"job_name": "mrc", "static_configs": targets}
    if drop_links:
        job["metric_relabel_configs"] = [{"action": "drop", "source_labels": ["__name__"],
                                          "regex": NVLINK_LINK}]
    own = {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{prom_port}"]}]}
    config = {"global": {"scrape_interval": f"{SCRAPE}s", "evaluation_interval": f"{SCRAPE}s"},
              "rule_files": [str(RULES)], "scrape_configs": [job, own]}
    d = work / label
    d.mkdir(parents=True)
    (d / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(d / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([shutil.which("prometheus") or "prometheus",
                             f"--config.file={d / 'prometheus.yml'}",
                             f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{prom_port}"
    res = Result(label, pods, gpus)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        # Wait for every target's first scrape, then `cycles` more intervals.
        while not _q(url, 'count(up{job="mrc"} == 1)') >= 2 * pods:  # NaN: not yet
            time.sleep(1)
        appended0 = _q(url, "prometheus_tsdb_head_samples_appended_total")
        t0 = time.monotonic()
        time.sleep(cycles * SCRAPE)
        res.samples_per_s = (_q(url, "prometheus_tsdb_head_samples_appended_total")
                             - appended0) / (time.monotonic() - t0)
        res.series = _q(url, 'count({job="mrc"})')  # the fleet's, not the store's own
        res.rss_mb = rss_mb(proc.pid)
        groups = httpx.get(url + "/api/v1/rules", timeout=60).json()["data"]["groups"]
        res.rules_ms = {g["name"]: g["evaluationTime"] * 1000 for g in groups}
        res.pod_records = _q(url, 'count({__name__=~"mrc_(pod|model|service):.+"})')
        for dashboard, panel, expr in all_queries():
            q = substitute_macros(expr, range_s=3600, rate_interval_s=60, interval_s=15)
            t = time.perf_counter()
            try:
                httpx.get(url + "/api/v1/query", params={"query": q}, timeout=QUERY_TIMEOUT)
            except httpx.TimeoutException:
                res.query_timeouts += 1
            ms = (time.perf_counter() - t) * 1000
            res.query_total_ms += ms
            if ms > res.query_max_ms:
                res.query_max_ms, res.query_max_panel = ms, f"{dashboard} / {panel}"
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(d / "data", ignore_errors=True)
    return res


def _start_server(bodies: dict[str, bytes]) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-c", _SERVE], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(json.dumps({name: body.decode() for name, body in bodies.items()}))
    p.stdin.close()
    return p, int(p.stdout.readline())


def table(results: list[Result], per_pod: dict[str, int]) -> str:
    lines = [
        f"Machine: {os.cpu_count()} cores; Prometheus "
        f"{subprocess.run(['prometheus', '--version'], capture_output=True, text=True).stdout.split()[2]};"  # noqa: E501
        f" scrape and evaluation every {SCRAPE} s.",
        "",
        "Per pod (exact, from the expositions): " + ", ".join(f"{k} {v}" for k, v in
                                                                per_pod.items()) + ".",
        "",
        "| run | pods | GPUs/pod | series | series/pod | samples/s | RSS MB | RSS KB/series | "
        "rules ms (fleet / all) | 39 dashboard queries ms (sum / max) | recorded mrc_*: series |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rules_all = sum(r.rules_ms.values())
        lines.append(
            f"| {r.label} | {r.pods} | {r.gpus} | {r.series:,.0f} | {r.series / r.pods:,.0f} | "
            f"{r.samples_per_s:,.0f} | {r.rss_mb:,.0f} | {r.rss_mb * 1024 / r.series:.2f} | "
            f"{r.rules_ms.get('mrc-fleet', 0):.1f} / {rules_all:.1f} | "
            f"{r.query_total_ms:,.0f} / {r.query_max_ms:,.0f}"
            f"{f' ({r.query_timeouts} over {QUERY_TIMEOUT:.0f} s)' if r.query_timeouts else ''} | "
            f"{r.pod_records:,.0f} |")
    slowest = max(results, key=lambda r: r.query_max_ms)
    lines += ["", f"Slowest dashboard query: {slowest.query_max_panel} "
              f"({slowest.query_max_ms:,.0f} ms at {slowest.pods} pods x {slowest.gpus} GPUs)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100,1000")
    ap.add_argument("--gpus", default="1,8")
    ap.add_argument("--knob-pods", type=int, default=1000)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if shutil.which("prometheus") is None:
        print("bench_fleet: needs Debian's prometheus package", file=sys.stderr)
        return 1
    from prometheus_client.parser import text_string_to_metric_families

    bodies = _expositions(cells=9)
    coarse = _expositions(cells=4)

    def count(text: bytes) -> int:
        return sum(len(f.samples) for f in text_string_to_metric_families(text.decode()))

    def links(text: bytes) -> int:
        return sum(len(f.samples) for f in text_string_to_metric_families(text.decode())
                   if f.name.startswith("mrc_gpu_nvlink_link_"))

    per_pod = {"agent 1 GPU": count(bodies["agent-1gpu"]),
               "agent 8 GPUs": count(bodies["agent-8gpu"]),
               "of which per-link NVLink (8 GPUs)": links(bodies["agent-8gpu"]),
               "service, 9 cells": count(bodies["service"]),
               "service, 4 cells": count(coarse["service"])}
    work = Path(tempfile.mkdtemp(prefix="mrc-bench-fleet-"))
    results: list[Result] = []
    try:
        server, port = _start_server(bodies)
        for gpus in (int(g) for g in args.gpus.split(",")):
            for pods in (int(p) for p in args.sizes.split(",")):
                results.append(measure(f"{pods}x{gpus}", pods, gpus, port, work))
                print(table(results[-1:], per_pod).splitlines()[-3], flush=True)
        k = args.knob_pods
        results.append(measure(f"{k}x1 links dropped", k, 1, port, work, drop_links=True))
        server.terminate()
        server, port = _start_server(coarse)
        results.append(measure(f"{k}x1 4 cells", k, 1, port, work))
        server.terminate()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = table(results, per_pod)
    print(text)
    if args.out:
        Path(args.out).write_text("# bench_fleet\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
