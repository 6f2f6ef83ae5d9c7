"""The contract of the MRC request metrics: every name, label and label value, declared once.

Dashboards, alerts and users depend on these names and labels; ``docs/instrumentation.md`` lists
them. A metric is a :class:`Family` (name, type, help, label names, histogram buckets, how its gauge
merges across workers); ``FAMILIES`` holds them all, in exposition order, and both value stores
(:mod:`mrc_agent.exporters.instrumentation.stores`) create or render exactly these. Bucket
boundaries and label edges live in :mod:`mrc_agent.exporters.instrumentation.buckets`. The label
values of ``stage``, ``outcome`` and ``step`` are the literal types below, so a typo is a type error
before it is a ``ValueError``; :func:`outcome_for_status` maps an HTTP answer to an outcome.

Plain data and two small functions: this module imports no prometheus-client itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal, get_args

from mrc_agent.exporters.instrumentation import buckets

Stage = Literal["receive", "fetch", "decode", "preprocess", "ocr", "prefill", "generate",
                "postprocess"]
Outcome = Literal["ok", "client_error", "overloaded", "timeout", "error"]
ChainBreakStep = Literal["ocr", "fetch", "preprocess"]
PreprocessPool = Literal["header", "decode"]
MeterStage = Literal["request", "response", "finish"]

#: The ``stage`` label values, in chain order.
STAGES: tuple[str, ...] = get_args(Stage)
#: The ``outcome`` label values of ``mrc_requests_total``.
OUTCOMES: tuple[str, ...] = get_args(Outcome)
#: The ``step`` label values of ``mrc_chain_breaks_total``: the intermediate steps whose output
#: feeds the model — the image could not be fetched, preprocessing gave nothing usable, or OCR
#: found no text. A step outside this set is a programming error (ValueError), never a new series.
CHAIN_BREAK_STEPS: tuple[str, ...] = get_args(ChainBreakStep)
#: The ``pool`` label values of ``mrc_preprocess_abandoned_threads``: the service's thread pools
#: that parse image headers and decode images under a timeout.
PREPROCESS_POOLS: tuple[str, ...] = get_args(PreprocessPool)
#: The ``stage`` label values of ``mrc_meter_errors_total``: where in an exchange the OpenAI
#: meter's own reading failed (the request body, the answer, or the exchange's end).
METER_STAGES: tuple[str, ...] = get_args(MeterStage)
#: Label names of ``mrc_model_info``.
MODEL_INFO_LABELS = ("model_id", "revision", "dtype", "quantization", "device",
                     "attention_backend")
#: Outcomes whose latency is observed: requests the service took on. ``overloaded`` (refused before
#: any work) and ``client_error`` (bad input) are only counted, so a flood of instant 4xx answers
#: cannot make the latency distribution look better exactly when things go wrong.
LATENCY_OUTCOMES = frozenset({"ok", "timeout", "error"})


def outcome_for_status(status_code: int) -> Outcome:
    """Map an HTTP status to an outcome: 429/503 overloaded, 504 timeout, 4xx client_error,
    5xx error, anything else ok."""
    if status_code < 400:
        return "ok"
    if status_code in (429, 503):
        return "overloaded"
    if status_code == 504:
        return "timeout"
    if status_code < 500:
        return "client_error"
    return "error"


def _outcome_for_exception(exc: BaseException | None) -> Outcome:
    """The outcome of a request ended by ``exc`` escaping its block, when none was set."""
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):  # starlette/fastapi HTTPException, without importing them
        return outcome_for_status(status)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    return "error"


@dataclass(frozen=True)
class Family:
    """One metric of the contract: everything both value stores need to create or render it."""

    name: str
    kind: Literal["histogram", "counter", "gauge"]
    help: str
    labelnames: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    #: How prometheus-client merges this gauge across workers in multiprocess mode.
    mp_mode: Literal["livesum", "livemax"] = "livesum"


_REQ_LABELS = ("prompt_length", "resolution")
REQUEST_DURATION = Family(
    "mrc_request_duration_seconds", "histogram",
    "Time from the arrival of a request to its answer, queueing included, for requests the "
    "service took on (outcomes ok, timeout and error).",
    _REQ_LABELS, buckets.REQUEST_DURATION_BUCKETS)
TIME_TO_FIRST_TOKEN = Family(
    "mrc_time_to_first_token_seconds", "histogram",
    "Time from the arrival of a request to the first generated token; the SLA is 0.5 seconds.",
    _REQ_LABELS, buckets.TIME_TO_FIRST_TOKEN_BUCKETS)
TIME_PER_OUTPUT_TOKEN = Family(
    "mrc_time_per_output_token_seconds", "histogram",
    "Mean time per generated token after the first one, per request.",
    _REQ_LABELS, buckets.TIME_PER_OUTPUT_TOKEN_BUCKETS)
STAGE_DURATION = Family(
    "mrc_stage_duration_seconds", "histogram",
    "Time spent in one stage of the reasoning chain (receive: the request body arriving; fetch, "
    "decode, preprocess, ocr, prefill, generate, postprocess).",
    ("stage",), buckets.STAGE_DURATION_BUCKETS)
REQUESTS_IN_FLIGHT = Family(
    "mrc_requests_in_flight", "gauge",
    "Requests being processed now, not counting those waiting in the queue.")
REQUESTS_QUEUED = Family(
    "mrc_requests_queued", "gauge", "Requests waiting in the queue for a processing slot now.")
REQUESTS = Family(
    "mrc_requests_total", "counter",
    "Requests answered, by outcome (ok, client_error, overloaded, timeout, error).",
    ("outcome",))
PEAK_GPU_MEMORY = Family(
    "mrc_request_peak_gpu_memory_bytes", "histogram",
    "Peak of the serving process's allocated GPU memory during one request's generation: model "
    "weights, that request's activations and KV cache, and whatever concurrent requests held on "
    "the device meanwhile, so not that request's share alone (CUDA only).",
    (), buckets.PEAK_GPU_MEMORY_BUCKETS)
QUEUE_TIME = Family(
    "mrc_request_queue_time_seconds", "histogram",
    "Time a request waited for a processing slot before its work began (0 with a slot free), "
    "for requests admitted to a slot.",
    (), buckets.QUEUE_TIME_BUCKETS)
PROMPT_TOKENS = Family(
    "mrc_prompt_tokens_total", "counter",
    "Prompt tokens (text and image) the model processed, for requests it ran.")
GENERATION_TOKENS = Family(
    "mrc_generation_tokens_total", "counter",
    "Tokens the model generated, for requests it ran.")
CACHE_LOOKUPS = Family("mrc_cache_lookups_total", "counter", "Lookups in the answer cache.")
CACHE_HITS = Family("mrc_cache_hits_total", "counter",
                     "Lookups in the answer cache that found an answer.")
CHAIN_BREAKS = Family(
    "mrc_chain_breaks_total", "counter",
    "Requests in which an intermediate step of the chain failed or gave nothing usable, by step "
    "(ocr, fetch, preprocess).",
    ("step",))
MODEL_INFO = Family(
    "mrc_model_info", "gauge",
    "Always 1; the labels describe the model being served and the attention backend actually "
    "selected.",
    MODEL_INFO_LABELS, mp_mode="livemax")
PREPROCESS_ABANDONED_THREADS = Family(
    "mrc_preprocess_abandoned_threads", "gauge",
    "Image header and decode threads written off because their job overran its timeout and "
    "still running it, by pool (header, decode); past a fixed number per pool, new images get "
    "503 until they finish.",
    ("pool",))
REQUEST_IMAGES = Family(
    "mrc_request_images", "histogram",
    "Images per request, as the request carried them (the resolution label is the largest's).",
    (), buckets.REQUEST_IMAGES_BUCKETS)
METER_ERRORS = Family(
    "mrc_meter_errors_total", "counter",
    "Failures of the OpenAI meter's own reading of an exchange, by stage (request, response, "
    "finish); the request was still passed on, answered and counted, without the values the "
    "failure cost.",
    ("stage",))
#: Every metric of the contract, in exposition order.
FAMILIES = (REQUEST_DURATION, TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, STAGE_DURATION,
            REQUESTS_IN_FLIGHT, REQUESTS_QUEUED, REQUESTS, PEAK_GPU_MEMORY, CACHE_LOOKUPS,
            CACHE_HITS, CHAIN_BREAKS, MODEL_INFO, QUEUE_TIME, PROMPT_TOKENS, GENERATION_TOKENS,
            PREPROCESS_ABANDONED_THREADS, REQUEST_IMAGES, METER_ERRORS)
