"""The *MRC service* dashboard: the request side of an MRC service (``exporters`` metrics).

Latency and time to first token against their SLOs, the engine's own view beside the client's
(its TTFT, queue, KV cache and multimodal cache: alerts/engines.py), throughput and errors, where
a request's time goes (stages), what it costs (peak GPU memory), and the service's state (cache,
chain breaks, in flight and queued, the model and attention backend actually serving).
"""

from __future__ import annotations

from typing import Any

from mrc_agent.alerts.config import Config
from mrc_agent.dashboards.panels import (
    Alerts,
    Section,
    above,
    below,
    dashboard,
    runbook,
    stat,
    table,
    timeseries,
    transformation,
    variables,
)
from mrc_agent.dashboards.queries import PanelQueries

UID = "mrc-service"
TITLE = "MRC service"

QUANTILES = (0.5, 0.9, 0.99)


def build(cfg: Config) -> dict[str, Any]:
    q = PanelQueries(cfg)
    t = cfg.thresholds
    sla_ms = t.ttft_seconds * 1000
    ttft_runbooks = runbook(cfg, Alerts.TTFT_FAST_BURN, Alerts.TTFT_SLOW_BURN)
    latency = Section("Latency and time to first token", [
        timeseries(
            "Request latency P50/P90/P99", [q.request_latency(x) for x in QUANTILES], "s",
            min_value=0, w=8,
            description=(
                "Arrival to answer, queueing included, for requests the service took on (ok, "
                f"timeout, error). The dashed line is the P99 alert's {t.latency_p99_seconds:g} s "
                "(per prompt-length x resolution bucket: see the latency heatmap)."),
            thresholds=above(t.latency_p99_seconds), links=runbook(cfg, Alerts.LATENCY)),
        timeseries(
            "Time to first token P50/P90/P99", [q.ttft(x) for x in QUANTILES], "s",
            min_value=0, w=8,
            description=f"Arrival to first generated token. The dashed line is the {sla_ms:g} ms "
                        "SLA.",
            thresholds=above(t.ttft_seconds), links=ttft_runbooks),
        timeseries(
            f"Requests with first token within {sla_ms:g} ms", [q.ttft_within_sla],
            "percentunit", max_value=1, w=5,
            description=(
                f"bucket le=\"{q.ttft_sla_le}\" / count of the time-to-first-token histogram. "
                f"The SLO is {t.ttft_objective:.0%}: the dashed line."),
            thresholds=below(t.ttft_objective), links=ttft_runbooks),
        stat(
            f"Within {sla_ms:g} ms (selected range)", [q.ttft_within_sla_over_range],
            "percentunit", w=3, h=8, color_mode="background",
            description=f"Share of first tokens within {sla_ms:g} ms over the whole selected "
                        f"range; red below the {t.ttft_objective:.0%} objective.",
            thresholds=below(t.ttft_objective), links=ttft_runbooks),
    ])
    w = t.request_rate_window
    engines = Section("Engine view beside the client's", [
        timeseries(
            "Time to first token: client and engine P50/P99",
            [q.client_ttft(0.5), q.client_ttft(0.99), q.engine_ttft(0.5), q.engine_ttft(0.99)],
            "s", min_value=0, w=12,
            description=(
                "The meter's time to first token, from the request's first byte, beside the "
                "engine's own (vLLM, SGLang: from when its frontend takes the request over), "
                f"per pod, both over {w}. The engine's clock does not see the upload, the "
                "parsing, image fetches and what the server decodes before it starts. TGI has "
                "no TTFT metric. The meter counts streamed answers only, the engine every "
                f"request. The dashed line is the {sla_ms:g} ms SLA. docs/engines.md."),
            thresholds=above(t.ttft_seconds), links=ttft_runbooks),
        timeseries(
            "Time to first token outside the engine (mean)", [q.ttft_outside_engine], "s", w=12,
            description=(
                "Mean client-observed TTFT minus the engine's mean TTFT, per pod, over "
                f"{w}: the time before the engine's clock starts (upload, parsing, image "
                "fetch and decode). Means, because they subtract exactly; quantiles do not. "
                "Empty for TGI (no TTFT metric) and for pods without streamed answers.")),
        timeseries(
            "Engine queue time P50/P99", [q.engine_queue(0.5), q.engine_queue(0.99)], "s",
            min_value=0, w=8,
            description=(
                "Time a request waits in the engine's queue before it is scheduled (vLLM's "
                "WAITING phase, SGLang's queue, TGI's queue; TGI counts successful requests "
                f"only), over {w}.")),
        timeseries(
            "Engine KV-cache usage", [q.engine_kv_usage], "percentunit", min_value=0,
            max_value=1, w=8,
            description=(
                "The fullest KV cache of the pod's engine (vLLM's engine cores, SGLang's "
                "ranks). TGI: the share of its batch token budget the running batch has "
                "reserved, which reaches 100 % when TGI stops admitting, before the cache is "
                "physically full.")),
        timeseries(
            "Engine multimodal-cache hit ratio", [q.engine_mm_hit_ratio], "percentunit",
            min_value=0, max_value=1, w=8,
            description=(
                "Multimodal items found in the engine's cache over items looked up: vLLM's "
                "processor cache, SGLang's EPD encoder cache. A repeated image skips its "
                "preprocessing (vLLM) or its vision encoder (SGLang). TGI has no such metric.")),
    ])
    traffic = Section("Throughput and errors", [
        timeseries("Throughput", [q.throughput], "reqps", min_value=0, w=8,
                   description="Requests answered per second, all outcomes."),
        timeseries(
            "Errors by outcome", [q.errors_by_outcome], "reqps", min_value=0, stack=True, w=8,
            description=(
                "Requests per second not answered ok: client_error (4xx), overloaded (429/503 "
                "from admission control), timeout, error.")),
        timeseries(
            "Error ratio (error or timeout)", [q.error_ratio], "percentunit", min_value=0, w=8,
            description=(
                "Share of requests ending in error or timeout (server-side failures). The "
                f"dashed line is the alert's {t.error_ratio:.0%} (held {t.error_for})."),
            thresholds=above(t.error_ratio), links=runbook(cfg, Alerts.ERRORS)),
    ])
    stages = Section("Where the time goes", [
        timeseries(
            "Stage breakdown (mean seconds per request)", [q.stage_breakdown], "s",
            min_value=0, stack=True, w=12,
            description=(
                "Seconds an average request spends in each stage (fetch, decode, preprocess, "
                "ocr, prefill, generate, postprocess), stacked: the stack is about the mean "
                "request latency. CPU-side stages growing while prefill/generate stay flat "
                "point at preprocessing.")),
        timeseries(
            "Peak GPU memory per request", [q.peak_gpu_memory(x) for x in (0.5, 0.99)],
            "bytes", min_value=0, w=12,
            description="Peak of the process's allocated device memory during one request's "
                        "generation (torch.cuda.max_memory_allocated): weights included, and "
                        "what concurrent requests held meanwhile, so not one request's share; "
                        "its log line's gpu_peak_shared_with is 0 when the peak was its own. "
                        "Empty on CPU-only services."),
    ])
    state = Section("Cache, chain breaks, load and model", [
        timeseries("Cache hit ratio", [q.cache_hit_ratio], "percentunit", min_value=0,
                   max_value=1, w=6,
                   description="Answer-cache lookups that found an answer."),
        timeseries(
            "Chain-break rate", [q.chain_break_ratio], "percentunit", min_value=0, stack=True,
            w=6,
            description=(
                "Chain breaks (an intermediate step gave nothing usable) per answered request, "
                f"by step. The dashed line is the alert's {t.chain_break_ratio:.0%} "
                f"(held {t.chain_break_for})."),
            thresholds=above(t.chain_break_ratio), links=runbook(cfg, Alerts.CHAIN_BREAKS)),
        timeseries("In-flight and queued requests", [q.in_flight, q.queued], "short",
                   min_value=0, w=6,
                   description="Requests being processed and requests waiting for a slot "
                               "(disjoint: together, the requests the service holds)."),
        table(
            "Model and attention backend", [q.model_info], "none", w=6,
            description="The model each pod serves and the SDPA attention backend actually "
                        "selected (mrc_model_info == 1).",
            transformations=[transformation(
                "organize",
                excludeByName={"Time": True, "Value": True, "__name__": True, "job": True,
                               "instance": True},
                indexByName={"pod": 0, "model_id": 1, "attention_backend": 2, "dtype": 3,
                             "quantization": 4, "device": 5, "revision": 6},
                renameByName={"attention_backend": "attention backend", "model_id": "model"})]),
    ])
    return dashboard(
        TITLE, UID,
        "Request side of an MRC service: latency and TTFT against the SLOs, the engine's "
        "view beside the client's, throughput, errors, stages, peak GPU memory, cache, chain "
        "breaks, load and model.",
        variables({"cluster": q.service_variable_query("cluster"),
                   "namespace": q.service_variable_query("namespace"),
                   "pod": q.service_variable_query("pod")}),
        [latency, engines, traffic, stages, state])
