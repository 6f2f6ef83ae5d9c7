"""The MRC instrumentation library: label buckets at their edges, what the request tracker
observes, the contract of names and labels, promtool on the exposition, and no torch import."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys

import httpx
import pytest
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from mrc_agent.exporters.instrumentation import (
    CHAIN_BREAK_STEPS,
    OUTCOMES,
    STAGES,
    MRCMetrics,
    buckets,
    metrics_app,
    metrics_endpoint,
    metrics_route,
    outcome_for_status,
)
from tests.conftest import REPO

PROMPTS = ("0-50", "50-100", "100+")
RESOLUTIONS = ("<1MP", "1-4MP", ">4MP")


@pytest.fixture
def m() -> MRCMetrics:
    return MRCMetrics(CollectorRegistry())


def value(m: MRCMetrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    assert v is not None, f"no sample {name}{labels}"
    return v


# --- buckets -------------------------------------------------------------------------------


@pytest.mark.parametrize(("chars", "want"), [
    (0, "0-50"), (49, "0-50"), (50, "50-100"), (99, "50-100"), (100, "100+"), (10_000, "100+"),
])
def test_prompt_length_bucket_is_half_open(chars: int, want: str) -> None:
    assert buckets.prompt_length_bucket(chars) == want


@pytest.mark.parametrize(("w", "h", "want"), [
    (0, 0, "<1MP"), (999, 1000, "<1MP"), (1000, 1000, "1-4MP"), (1024, 1024, "1-4MP"),
    (1999, 2000, "1-4MP"), (2000, 2000, ">4MP"), (4000, 3000, ">4MP"),
])
def test_resolution_bucket_is_half_open_in_whole_pixels(w: int, h: int, want: str) -> None:
    assert buckets.resolution_bucket(w, h) == want


def test_custom_edges_name_their_values_consistently() -> None:
    assert buckets.prompt_length_values((20, 200, 1000)) == ("0-20", "20-200", "200-1000",
                                                             "1000+")
    assert buckets.prompt_length_bucket(200, (20, 200, 1000)) == "200-1000"
    assert buckets.resolution_values((0.5, 2, 8)) == ("<0.5MP", "0.5-2MP", "2-8MP", ">8MP")
    assert buckets.resolution_bucket(1000, 500, (0.5, 2, 8)) == "0.5-2MP"
    assert buckets.prompt_length_values() == PROMPTS
    assert buckets.resolution_values() == RESOLUTIONS


@pytest.mark.parametrize("edges", [(), (100, 50), (50, 50), (0, 10), (-1, 5)])
def test_bad_edges_are_rejected(edges: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        buckets.prompt_length_values(edges)
    with pytest.raises(ValueError):
        MRCMetrics(resolution_edges_mp=edges)


def test_bucket_boundaries_are_sorted_and_ttft_has_the_sla() -> None:
    assert buckets.TTFT_SLA_SECONDS == 0.5
    assert 0.5 in buckets.TIME_TO_FIRST_TOKEN_BUCKETS
    for b in (buckets.REQUEST_DURATION_BUCKETS, buckets.TIME_TO_FIRST_TOKEN_BUCKETS,
              buckets.TIME_PER_OUTPUT_TOKEN_BUCKETS, buckets.STAGE_DURATION_BUCKETS,
              buckets.PEAK_GPU_MEMORY_BUCKETS):
        assert list(b) == sorted(set(b))
    assert buckets.REQUEST_DURATION_BUCKETS[0] <= 0.05
    assert buckets.REQUEST_DURATION_BUCKETS[-1] >= 60


# --- series exist from the start -----------------------------------------------------------


def test_all_label_children_exist_before_any_request(m: MRCMetrics) -> None:
    for p in PROMPTS:
        for r in RESOLUTIONS:
            for name in ("mrc_request_duration_seconds", "mrc_time_to_first_token_seconds",
                         "mrc_time_per_output_token_seconds"):
                assert value(m, name + "_count", prompt_length=p, resolution=r) == 0
            assert value(m, "mrc_time_to_first_token_seconds_bucket", prompt_length=p,
                         resolution=r, le="0.5") == 0
    for s in STAGES:
        assert value(m, "mrc_stage_duration_seconds_count", stage=s) == 0
    for o in OUTCOMES:
        assert value(m, "mrc_requests_total", outcome=o) == 0
    for step in CHAIN_BREAK_STEPS:
        assert value(m, "mrc_chain_breaks_total", step=step) == 0
    assert value(m, "mrc_requests_in_flight") == 0
    assert value(m, "mrc_requests_queued") == 0
    assert value(m, "mrc_cache_lookups_total") == 0
    assert value(m, "mrc_cache_hits_total") == 0
    assert value(m, "mrc_request_peak_gpu_memory_bytes_count") == 0


def test_metrics_go_to_a_fresh_registry_not_the_global_one() -> None:
    from prometheus_client import REGISTRY

    a, b = MRCMetrics(), MRCMetrics()  # would raise "Duplicated timeseries" on a shared one
    assert a.registry is not b.registry
    assert REGISTRY.get_sample_value("mrc_requests_total", {"outcome": "ok"}) is None


# --- the tracker ---------------------------------------------------------------------------


def test_tracker_observes_duration_ttft_tpot_stages_and_outcome(m: MRCMetrics) -> None:
    with m.request(prompt_chars=60) as r:
        assert value(m, "mrc_requests_in_flight") == 1
        with r.stage("decode"):
            pass
        r.set_image(2000, 1000)
        with r.stage("generate"):
            r.first_token()
            r.first_token()  # ignored: the first one counts
            r.tokens(11)
        r.peak_gpu_memory(3 * 2**30)
    labels = {"prompt_length": "50-100", "resolution": "1-4MP"}
    assert value(m, "mrc_request_duration_seconds_count", **labels) == 1
    assert value(m, "mrc_time_to_first_token_seconds_count", **labels) == 1
    assert value(m, "mrc_time_to_first_token_seconds_bucket", le="0.5", **labels) == 1
    assert value(m, "mrc_time_per_output_token_seconds_count", **labels) == 1
    total = value(m, "mrc_request_duration_seconds_sum", **labels)
    ttft = value(m, "mrc_time_to_first_token_seconds_sum", **labels)
    assert 0 < ttft <= total < 1
    for s in ("decode", "generate"):
        assert value(m, "mrc_stage_duration_seconds_count", stage=s) == 1
    assert value(m, "mrc_stage_duration_seconds_count", stage="ocr") == 0
    assert value(m, "mrc_requests_total", outcome="ok") == 1
    assert value(m, "mrc_requests_in_flight") == 0
    assert value(m, "mrc_request_peak_gpu_memory_bytes_count") == 1
    assert value(m, "mrc_request_peak_gpu_memory_bytes_bucket", le=floatToGoString(4 * 2**30)) == 1
    assert value(m, "mrc_request_peak_gpu_memory_bytes_bucket", le=floatToGoString(2 * 2**30)) == 0
    # the other eight combinations saw nothing
    others = [(p, r) for p in PROMPTS for r in RESOLUTIONS if (p, r) != ("50-100", "1-4MP")]
    assert all(value(m, "mrc_request_duration_seconds_count", prompt_length=p, resolution=r) == 0
               for p, r in others)


def test_tpot_is_time_after_first_token_per_remaining_token(
        m: MRCMetrics, monkeypatch: pytest.MonkeyPatch) -> None:
    # where the tracker looks up perf_counter
    import mrc_agent.exporters.instrumentation.metrics as mm

    clock = iter([10.0, 10.2, 11.2, 11.5])  # enter, first token, 11 tokens done, exit
    monkeypatch.setattr(mm, "perf_counter", lambda: next(clock))
    with m.request(prompt_chars=10, width=10, height=10) as r:
        r.first_token()
        r.tokens(11)
    labels = {"prompt_length": "0-50", "resolution": "<1MP"}
    assert value(m, "mrc_time_to_first_token_seconds_sum", **labels) == pytest.approx(0.2)
    assert value(m, "mrc_time_per_output_token_seconds_sum", **labels) == pytest.approx(0.1)
    assert value(m, "mrc_request_duration_seconds_sum", **labels) == pytest.approx(1.5)


def test_no_tpot_without_two_tokens_and_no_ttft_without_first_token(m: MRCMetrics) -> None:
    with m.request(prompt_chars=1, width=1, height=1) as r:
        r.first_token()
        r.tokens(1)
    with m.request(prompt_chars=1, width=1, height=1) as r:
        r.tokens(5)
    labels = {"prompt_length": "0-50", "resolution": "<1MP"}
    assert value(m, "mrc_request_duration_seconds_count", **labels) == 2
    assert value(m, "mrc_time_to_first_token_seconds_count", **labels) == 1
    assert value(m, "mrc_time_per_output_token_seconds_count", **labels) == 0
    assert value(m, "mrc_request_peak_gpu_memory_bytes_count") == 0  # never passed: not observed


def test_exception_escaping_the_block_counts_as_error(m: MRCMetrics) -> None:
    with pytest.raises(RuntimeError), m.request(prompt_chars=5, width=10, height=10) as r, \
            r.stage("preprocess"):
        raise RuntimeError("boom")
    assert value(m, "mrc_requests_total", outcome="error") == 1
    assert value(m, "mrc_requests_total", outcome="ok") == 0
    assert value(m, "mrc_stage_duration_seconds_count", stage="preprocess") == 1
    assert value(m, "mrc_requests_in_flight") == 0
    # an error is a request the service took on: its latency counts
    assert value(m, "mrc_request_duration_seconds_count", prompt_length="0-50",
                 resolution="<1MP") == 1


def test_an_outcome_set_before_the_exception_wins(m: MRCMetrics) -> None:
    with pytest.raises(ValueError), m.request(prompt_chars=5) as r:
        r.outcome = "client_error"
        raise ValueError("not an image")
    assert value(m, "mrc_requests_total", outcome="client_error") == 1
    assert value(m, "mrc_requests_total", outcome="error") == 0


@pytest.mark.parametrize(("exc", "want"), [
    (TimeoutError(), "timeout"), (asyncio.TimeoutError(), "timeout"),
    (type("HTTPException", (Exception,), {"status_code": 429})(), "overloaded"),
    (type("HTTPException", (Exception,), {"status_code": 422})(), "client_error"),
    (asyncio.CancelledError(), "error"),
])
def test_escaping_exceptions_map_to_outcomes(m: MRCMetrics, exc: BaseException,
                                             want: str) -> None:
    with pytest.raises(type(exc)), m.request():
        raise exc
    assert value(m, "mrc_requests_total", outcome=want) == 1


def test_rejections_are_counted_but_not_observed_as_latency(m: MRCMetrics) -> None:
    for status in (429, 413):
        with m.request(prompt_chars=5, width=10, height=10) as r:
            r.set_status(status)
    assert value(m, "mrc_requests_total", outcome="overloaded") == 1
    assert value(m, "mrc_requests_total", outcome="client_error") == 1
    assert value(m, "mrc_request_duration_seconds_count", prompt_length="0-50",
                 resolution="<1MP") == 0


def test_unknown_labels_at_exit_count_the_request_only(m: MRCMetrics) -> None:
    with m.request(prompt_chars=5) as r:  # image never decoded
        r.outcome = "timeout"
    assert value(m, "mrc_requests_total", outcome="timeout") == 1
    assert sum(value(m, "mrc_request_duration_seconds_count", prompt_length=p, resolution=res)
               for p in PROMPTS for res in RESOLUTIONS) == 0


def test_stage_names_outcomes_and_steps_are_validated(m: MRCMetrics) -> None:
    with m.request() as r:
        with pytest.raises(ValueError, match="unknown stage"):
            r.stage("tokenize")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown outcome"):
            r.outcome = "success"  # type: ignore[assignment]
        with pytest.raises(ValueError):
            r.tokens(-1)
    with pytest.raises(ValueError, match="unknown stage"):
        m.observe_stage("Decode", 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown chain step"):
        m.chain_break("generate")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        m.request(width=10)
    assert m.registry.get_sample_value("mrc_stage_duration_seconds_count",
                                       {"stage": "tokenize"}) is None


def test_a_tracker_cannot_be_entered_twice(m: MRCMetrics) -> None:
    t = m.request()
    with t:
        pass
    with pytest.raises(RuntimeError), t:
        pass


def test_a_stage_timed_after_its_request_ended_is_still_recorded(m: MRCMetrics) -> None:
    with m.request() as r:
        pass
    with r.stage("postprocess"):
        pass
    assert value(m, "mrc_stage_duration_seconds_count", stage="postprocess") == 1


def test_queued_moves_a_request_out_of_in_flight(m: MRCMetrics) -> None:
    with m.request() as r:
        with r.queued():
            assert value(m, "mrc_requests_queued") == 1
            assert value(m, "mrc_requests_in_flight") == 0
        assert value(m, "mrc_requests_queued") == 0
        assert value(m, "mrc_requests_in_flight") == 1
    with m.queued():
        assert value(m, "mrc_requests_queued") == 1
    with m.in_flight():
        assert value(m, "mrc_requests_in_flight") == 1
    assert value(m, "mrc_requests_queued") == 0 and value(m, "mrc_requests_in_flight") == 0


def test_abandoned_preprocess_threads_per_pool(m: MRCMetrics) -> None:
    for pool in ("header", "decode"):
        assert value(m, "mrc_preprocess_abandoned_threads", pool=pool) == 0  # from the start
    m.abandoned_threads("header", +1)
    m.abandoned_threads("header", +1)
    m.abandoned_threads("decode", +1)
    m.abandoned_threads("header", -1)
    assert value(m, "mrc_preprocess_abandoned_threads", pool="header") == 1
    assert value(m, "mrc_preprocess_abandoned_threads", pool="decode") == 1
    with pytest.raises(ValueError, match="unknown preprocess pool 'ocr'"):
        m.abandoned_threads("ocr", 1)  # type: ignore[arg-type]


def test_cache_chain_breaks_and_model_info(m: MRCMetrics) -> None:
    m.cache_lookup(hit=True)
    m.cache_lookup(hit=False)
    m.chain_break("ocr")
    assert value(m, "mrc_cache_lookups_total") == 2
    assert value(m, "mrc_cache_hits_total") == 1
    assert value(m, "mrc_chain_breaks_total", step="ocr") == 1
    info = {"model_id": "tiny-llava", "revision": "abc", "dtype": "float16",
            "quantization": "nf4", "device": "cuda:0", "attention_backend": "flash"}
    m.set_model_info(**info)
    assert value(m, "mrc_model_info", **info) == 1
    m.set_model_info(**{**info, "attention_backend": "math"})
    assert value(m, "mrc_model_info", **info) == 0  # replaced: kept at 0, as in multiprocess mode
    assert value(m, "mrc_model_info", **{**info, "attention_backend": "math"}) == 1
    with pytest.raises(ValueError):
        m.set_model_info(model_id="")


def test_custom_edges_bind_all_their_combinations() -> None:
    m = MRCMetrics(prompt_edges=(20, 200, 1000), resolution_edges_mp=(0.5, 2))
    assert len(m.prompt_length_values) * len(m.resolution_values) == 12
    with m.request(prompt_chars=200, width=1000, height=500):
        pass
    assert value(m, "mrc_request_duration_seconds_count", prompt_length="200-1000",
                 resolution="0.5-2MP") == 1
    assert value(m, "mrc_request_duration_seconds_count", prompt_length="1000+",
                 resolution=">2MP") == 0


def test_outcome_for_status() -> None:
    assert [outcome_for_status(c) for c in (200, 400, 413, 422, 429, 500, 503, 504)] == [
        "ok", "client_error", "client_error", "client_error", "overloaded", "error",
        "overloaded", "timeout"]


# --- exposition ----------------------------------------------------------------------------


def _exercised() -> MRCMetrics:
    m = MRCMetrics()
    m.set_model_info(model_id="tiny-llava", revision="r1", dtype="float32", device="cpu",
                     attention_backend="math")
    for chars, (w, h) in [(10, (640, 480)), (70, (1920, 1080)), (300, (4000, 3000))]:
        with m.request(prompt_chars=chars, width=w, height=h) as r:
            for s in STAGES:
                with r.stage(s):  # type: ignore[arg-type]
                    pass
            r.first_token()
            r.tokens(8)
            r.peak_gpu_memory(5e9)
    m.cache_lookup(True)
    m.chain_break("ocr")
    return m


def test_promtool_check_metrics_is_clean() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not on PATH: install Debian's prometheus package"
    from prometheus_client import generate_latest

    body = generate_latest(_exercised().registry)
    res = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                         timeout=30)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (
        res.stdout.decode() + res.stderr.decode())


def test_metrics_app_negotiates_openmetrics_and_gzip() -> None:
    m = _exercised()

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=metrics_app(m.registry))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [
                await c.get("/metrics", headers={"Accept": "text/plain"}),
                await c.get("/metrics",
                            headers={"Accept": "application/openmetrics-text; version=1.0.0"}),
                await c.get("/metrics", headers={"Accept-Encoding": "gzip"}),
                await c.post("/metrics"),
            ]

    text, om, gz, post = asyncio.run(go())
    assert text.headers["content-type"].startswith("text/plain")
    assert 'mrc_requests_total{outcome="ok"} 3.0' in text.text
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
    assert gz.headers["content-encoding"] == "gzip"
    assert "mrc_model_info" in gz.text  # httpx undid the gzip
    assert post.status_code == 405


def test_metrics_route_serves_get_and_head_in_a_starlette_app() -> None:
    from starlette.applications import Starlette

    m = _exercised()
    app = Starlette(routes=[metrics_route(m.registry)])

    async def go() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/metrics"), await c.head("/metrics")

    get, head = asyncio.run(go())
    assert get.status_code == 200 and "mrc_cache_hits_total 1.0" in get.text
    assert head.status_code == 200


def test_metrics_endpoint_refuses_to_serve_the_global_registry_implicitly() -> None:
    with pytest.raises(ValueError, match="registry"):
        metrics_endpoint(None)


# --- dependencies --------------------------------------------------------------------------


def test_exporters_import_neither_torch_nor_agent() -> None:
    code = ("import sys, mrc_agent.exporters.instrumentation, mrc_agent.exporters.exposition.http\n"
            "assert 'mrc_agent.exporters.instrumentation.metrics' in sys.modules\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'\n"
            "             or m == 'mrc_agent.agent' or m.startswith('mrc_agent.agent.'))\n"
            "print(','.join(bad))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"exporters imported {res.stdout.strip()}"


@pytest.mark.parametrize("edges, message", [
    ((50.5, 100), "must be whole characters, got (50.5, 100)"),
    ((0.5, 100), "must be whole characters, got (0.5, 100)"),  # was "positive, got (0, 100)"
])
def test_prompt_edges_are_checked_as_given(edges: tuple[float, ...], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        MRCMetrics(CollectorRegistry(), prompt_edges=edges)  # type: ignore[arg-type]


def test_queue_time_is_the_time_spent_queued_and_zero_with_a_free_slot(
        m: MRCMetrics, monkeypatch: pytest.MonkeyPatch) -> None:
    import mrc_agent.exporters.instrumentation.metrics as mm

    # enter, queued from 1.0 to 1.75, exit; then a request whose slot was free (0 s queued)
    clock = iter([0.0, 1.0, 1.75, 2.0, 5.0, 6.0, 6.0, 7.0, 8.0, 9.0])
    monkeypatch.setattr(mm, "perf_counter", lambda: next(clock))
    for _ in range(2):
        with m.request(prompt_chars=1, width=1, height=1) as r, r.queued():
            pass
    with m.request(prompt_chars=1, width=1, height=1):  # never admitted: refused, cache hit
        pass
    assert value(m, "mrc_request_queue_time_seconds_count") == 2
    assert value(m, "mrc_request_queue_time_seconds_sum") == pytest.approx(0.75)
    assert value(m, "mrc_request_queue_time_seconds_bucket", le="0.001") == 1
    assert value(m, "mrc_request_queue_time_seconds_bucket", le="0.5") == 1
    assert value(m, "mrc_request_queue_time_seconds_bucket", le="1.0") == 2
    assert value(m, "mrc_requests_queued") == 0


def test_queue_time_of_a_request_cancelled_while_queued_is_observed(m: MRCMetrics) -> None:
    with pytest.raises(TimeoutError), m.request(prompt_chars=1, width=1, height=1) as r, \
            r.queued():
        raise TimeoutError
    assert value(m, "mrc_request_queue_time_seconds_count") == 1
    assert value(m, "mrc_requests_total", outcome="timeout") == 1
    assert value(m, "mrc_requests_queued") == 0 and value(m, "mrc_requests_in_flight") == 0


def test_token_counters_add_what_the_model_processed_and_generated(m: MRCMetrics) -> None:
    with m.request(prompt_chars=1, width=1, height=1) as r:
        r.tokens(7, 600)
    with m.request(prompt_chars=1, width=1, height=1) as r:
        r.tokens(3)  # the prompt's tokens not given: only the generated ones count
    with m.request(prompt_chars=1, width=1, height=1):
        pass  # the model never ran (a cache hit)
    assert value(m, "mrc_prompt_tokens_total") == 600
    assert value(m, "mrc_generation_tokens_total") == 10
    with pytest.raises(ValueError, match="prompt token count must be >= 0, got -1"), \
            m.request() as r:
        r.tokens(1, -1)
    assert value(m, "mrc_generation_tokens_total") == 10
