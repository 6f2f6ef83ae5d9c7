"""``docs/instrumentation.md``, "Compared with vLLM, TGI, Triton and OpenTelemetry": every
comparison query of the page runs in a real Prometheus that scrapes this project's
instrumentation library (a real ``MRCMetrics`` exposition, requests recorded between scrapes)
and an engine-style exposition with vLLM's and Triton's real metric names (synthetic values),
and returns a finite number for each side. The mapping table names only metrics this project
exports."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from mrc_agent.exporters.instrumentation import FAMILIES, MRCMetrics
from tests.conftest import REPO
from tests.e2e_harness import Prometheus, serve_exposition, wait_until

pytestmark = pytest.mark.prometheus

DOC = REPO / "docs" / "instrumentation.md"


def _section() -> str:
    text = DOC.read_text()
    start = text.index("### Compared with vLLM, TGI, Triton and OpenTelemetry")
    return text[start:text.index("\n## ", start)]


def _queries() -> list[str]:
    (block,) = re.findall(r"```promql\n(.*?)```", _section(), re.S)
    queries: list[str] = []
    for line in block.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line[0].isspace():
            queries[-1] += "\n" + line
        else:
            queries.append(line)
    return queries


class _Engine:
    """vLLM- and Triton-style counters that grow with every scrape."""

    def __init__(self) -> None:
        self.n = 0

    def render(self) -> bytes:
        self.n += 1
        n = self.n
        lines = ["# TYPE vllm:e2e_request_latency_seconds histogram"]
        for le, share in (("0.5", 0.6), ("1.0", 0.9), ("+Inf", 1.0)):
            lines.append(f'vllm:e2e_request_latency_seconds_bucket{{le="{le}"}} {10 * n * share}')
        lines += [f"vllm:e2e_request_latency_seconds_sum {4.0 * n}",
                  f"vllm:e2e_request_latency_seconds_count {10 * n}",
                  "# TYPE vllm:generation_tokens_total counter",
                  f"vllm:generation_tokens_total {320 * n}",
                  "# TYPE nv_inference_queue_duration_us counter",
                  f"nv_inference_queue_duration_us {25000 * n}",
                  "# TYPE nv_inference_request_success counter",
                  f"nv_inference_request_success {10 * n}", ""]
        return "\n".join(lines).encode()


class _Service:
    """The instrumentation library as a service uses it: one more request per scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = MRCMetrics(self.registry)

    def render(self) -> bytes:
        with self.metrics.request(prompt_chars=40, width=1600, height=1200) as r:
            with r.queued():
                time.sleep(0.002)
            r.first_token()
            r.tokens(8, 610)
        return generate_latest(self.registry)


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, float]]:
    service, engine = _Service(), _Engine()
    servers = [serve_exposition(lambda path: service.render()),
               serve_exposition(lambda path: engine.render())]
    p = None
    try:
        p = Prometheus(tmp_path_factory.mktemp("compare"),
                       {"mrc-service": [f"127.0.0.1:{servers[0].server_port}"],
                        "vllm": [f"127.0.0.1:{servers[1].server_port}"]})
        wait_until(lambda: len(p.query("mrc_generation_tokens_total")["data"]["result"]) == 1
                   and p.query("vllm:generation_tokens_total")["data"]["result"], 30,
                   what="both scraped")
        time.sleep(3.5)  # a few more scrapes of both
        yield p, time.time() - 0.5
    finally:
        if p is not None:
            p.stop()
        for s in servers:
            s.shutdown()


def test_the_page_has_the_comparisons() -> None:
    queries = _queries()
    assert len(queries) == 8
    assert sum("vllm:" in q or "nv_inference" in q for q in queries) == 4


@pytest.mark.parametrize("query", _queries())
def test_each_comparison_gives_a_finite_number(prom: tuple[Prometheus, float],
                                               query: str) -> None:
    p, at = prom
    body = p.query(query, at=at)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    assert len(result) == 1, (query, result)
    assert math.isfinite(float(result[0]["value"][1])), (query, result)


def test_the_table_names_only_metrics_this_project_exports() -> None:
    ours = {f.name for f in FAMILIES}
    rows = [line for line in _section().splitlines() if line.startswith("| `mrc_")]
    named = {n for row in rows for n in re.findall(r"`(mrc_[a-z_]+)`", row.split("|")[1])}
    assert named and named <= ours, named - ours
    for name in ("mrc_request_queue_time_seconds", "mrc_prompt_tokens_total",
                 "mrc_generation_tokens_total"):
        assert name in named
