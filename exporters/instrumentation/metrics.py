"""Request-side golden metrics for an MRC service: the instrumentation library a service imports.

A FastAPI/Starlette service that takes an image and a text prompt and runs a vision-language model
creates one :class:`MRCMetrics` at startup and wraps each request in ``metrics.request(...)``::

    metrics = MRCMetrics()                      # a fresh CollectorRegistry, never the global one
    ...
    with metrics.request(prompt_chars=len(prompt)) as r:
        with r.stage("decode"):
            image = decode(data)
        r.set_image(image.width, image.height)  # resolution is known only after decode
        with r.stage("generate"):
            ...                                 # r.first_token() at the first token
        r.tokens(n_output)
    # on exit: duration, TTFT, TPOT observed; mrc_requests_total{outcome} incremented

The metric names and labels are a contract that dashboards, alerts and users depend on; they are
declared once, in ``FAMILIES`` below, and listed in ``docs/instrumentation.md``. Bucket
boundaries and label edges live in :mod:`exporters.instrumentation.buckets`. Every series (all
prompt-length x resolution combinations, stages, outcomes, chain steps) is created in the
constructor, so it exists from the first scrape, and the hot path addresses series by list
index, never by label lookup.

Two value stores render the same exposition (a test compares them):

* single process — ``_LocalStore``: plain floats under one lock, rendered by a custom collector
  on the registry. A request's observations are written in one update when it ends, which keeps a
  fully tracked request at a few microseconds (prometheus-client's metric objects take a lock and
  validate on every call: about 1 us per histogram observation).
* multiprocess (several uvicorn/gunicorn workers) — ``_PromStore``: prometheus-client's own
  metrics, whose values live in memory-mapped files in ``PROMETHEUS_MULTIPROC_DIR``. That variable
  must be in the environment *before the process starts* (prometheus-client picks its value store
  when first imported; :func:`multiprocess_enabled` refuses a mismatch). Gauges merge across
  workers with ``livesum`` (in flight, queued) and ``livemax`` (model info), and the exposition is
  built by ``MultiProcessCollector`` on a fresh registry per scrape —
  :mod:`exporters.instrumentation.asgi` does that. The launcher empties the directory before
  starting the workers (:func:`prepare_multiproc_dir`), and each worker calls
  :func:`mark_process_dead` as it exits so its live gauges stop counting. prometheus-client's
  ``Info`` does not work in multiprocess mode, so ``mrc_model_info`` is a gauge set to 1 in
  both modes: one type, one query, whatever the mode.

This module imports neither torch nor the agent: the caller passes the peak GPU memory it measured.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import Any, Literal, Protocol, get_args

from prometheus_client import values as _prom_values
from prometheus_client.metrics import Counter, Gauge, Histogram
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import mark_process_dead as _mark_process_dead
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from exporters.instrumentation import buckets

Stage = Literal["fetch", "decode", "preprocess", "ocr", "prefill", "generate", "postprocess"]
Outcome = Literal["ok", "client_error", "overloaded", "timeout", "error"]
ChainBreakStep = Literal["ocr", "fetch", "preprocess"]

#: The ``stage`` label values, in chain order.
STAGES: tuple[str, ...] = get_args(Stage)
#: The ``outcome`` label values of ``mrc_requests_total``.
OUTCOMES: tuple[str, ...] = get_args(Outcome)
#: The ``step`` label values of ``mrc_chain_breaks_total``: the intermediate steps whose output
#: feeds the model — the image could not be fetched, preprocessing gave nothing usable, or OCR
#: found no text. A step outside this set is a programming error (ValueError), never a new series.
CHAIN_BREAK_STEPS: tuple[str, ...] = get_args(ChainBreakStep)
#: Label names of ``mrc_model_info``.
MODEL_INFO_LABELS = ("model_id", "revision", "dtype", "quantization", "device",
                     "attention_backend")
#: Outcomes whose latency is observed: requests the service took on. ``overloaded`` (refused before
#: any work) and ``client_error`` (bad input) are only counted, so a flood of instant 4xx answers
#: cannot make the latency distribution look better exactly when things go wrong.
LATENCY_OUTCOMES = frozenset({"ok", "timeout", "error"})

_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_enabled() -> bool:
    """Whether prometheus-client runs in multiprocess mode in this process.

    Raises ``RuntimeError`` when the environment and prometheus-client disagree: the variable was
    set after prometheus-client was imported (values would silently stay per process), or removed
    after (values could not be written).
    """
    env = bool(os.environ.get(_ENV))
    store = _prom_values.ValueClass is not _prom_values.MutexValue
    if env and not store:
        raise RuntimeError(f"{_ENV} was set after prometheus_client was imported; set it in the "
                           "environment before the process starts")
    if store and not env:
        raise RuntimeError(f"prometheus_client runs in multiprocess mode but {_ENV} is unset")
    return env


def prepare_multiproc_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Create the multiprocess directory and delete stale ``*.db`` files from a previous run.

    Call it in the launcher, once, before any worker starts (never from a worker: it would delete
    the files of the workers already running). ``path`` defaults to ``$PROMETHEUS_MULTIPROC_DIR``.
    """
    raw = path if path is not None else os.environ.get(_ENV)
    if not raw:
        raise ValueError(f"no multiprocess directory given and {_ENV} is unset")
    d = Path(raw)
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("*.db"):
        f.unlink()
    return d


def mark_process_dead(pid: int | None = None) -> None:
    """Drop the live gauges (in flight, queued, model info) of an exited worker; no-op otherwise.

    Call it from the worker's shutdown (lifespan) with no argument, or from a process manager's
    child-exit hook with the child's pid. Counters and histograms of dead workers are kept, as
    they must be for ``rate()``.
    """
    if multiprocess_enabled():
        _mark_process_dead(os.getpid() if pid is None else pid)


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
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):  # starlette/fastapi HTTPException, without importing them
        return outcome_for_status(status)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    return "error"


@dataclass(frozen=True)
class _Family:
    """One metric of the contract: everything both value stores need to create or render it."""

    name: str
    kind: Literal["histogram", "counter", "gauge"]
    help: str
    labelnames: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    #: How prometheus-client merges this gauge across workers in multiprocess mode.
    mp_mode: Literal["livesum", "livemax"] = "livesum"


_REQ_LABELS = ("prompt_length", "resolution")
REQUEST_DURATION = _Family(
    "mrc_request_duration_seconds", "histogram",
    "Time from the arrival of a request to its answer, queueing included, for requests the "
    "service took on (outcomes ok, timeout and error).",
    _REQ_LABELS, buckets.REQUEST_DURATION_BUCKETS)
TIME_TO_FIRST_TOKEN = _Family(
    "mrc_time_to_first_token_seconds", "histogram",
    "Time from the arrival of a request to the first generated token; the SLA is 0.5 seconds.",
    _REQ_LABELS, buckets.TIME_TO_FIRST_TOKEN_BUCKETS)
TIME_PER_OUTPUT_TOKEN = _Family(
    "mrc_time_per_output_token_seconds", "histogram",
    "Mean time per generated token after the first one, per request.",
    _REQ_LABELS, buckets.TIME_PER_OUTPUT_TOKEN_BUCKETS)
STAGE_DURATION = _Family(
    "mrc_stage_duration_seconds", "histogram",
    "Time spent in one stage of the reasoning chain (fetch, decode, preprocess, ocr, prefill, "
    "generate, postprocess).",
    ("stage",), buckets.STAGE_DURATION_BUCKETS)
REQUESTS_IN_FLIGHT = _Family(
    "mrc_requests_in_flight", "gauge",
    "Requests being processed now, not counting those waiting in the queue.")
REQUESTS_QUEUED = _Family(
    "mrc_requests_queued", "gauge", "Requests waiting in the queue for a processing slot now.")
REQUESTS = _Family(
    "mrc_requests_total", "counter",
    "Requests answered, by outcome (ok, client_error, overloaded, timeout, error).",
    ("outcome",))
PEAK_GPU_MEMORY = _Family(
    "mrc_request_peak_gpu_memory_bytes", "histogram",
    "Peak GPU memory allocated while serving one request, model weights included (CUDA only).",
    (), buckets.PEAK_GPU_MEMORY_BUCKETS)
CACHE_LOOKUPS = _Family("mrc_cache_lookups_total", "counter", "Lookups in the answer cache.")
CACHE_HITS = _Family("mrc_cache_hits_total", "counter",
                     "Lookups in the answer cache that found an answer.")
CHAIN_BREAKS = _Family(
    "mrc_chain_breaks_total", "counter",
    "Requests in which an intermediate step of the chain failed or gave nothing usable, by step "
    "(ocr, fetch, preprocess).",
    ("step",))
MODEL_INFO = _Family(
    "mrc_model_info", "gauge",
    "Always 1; the labels describe the model being served and the attention backend actually "
    "selected.",
    MODEL_INFO_LABELS, mp_mode="livemax")
#: Every metric of the contract, in exposition order.
FAMILIES = (REQUEST_DURATION, TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, STAGE_DURATION,
            REQUESTS_IN_FLIGHT, REQUESTS_QUEUED, REQUESTS, PEAK_GPU_MEMORY, CACHE_LOOKUPS,
            CACHE_HITS, CHAIN_BREAKS, MODEL_INFO)

#: A series: its family and label values. Stores address series by their index in a list of these.
_Series = tuple[_Family, tuple[str, ...]]


class _Store(Protocol):
    """Where the values live. Every method is one atomic update; ids index the series lists."""

    def observe(self, hid: int, value: float) -> None: ...
    def count(self, *cids: int) -> None: ...
    def gauge_add(self, gid: int, delta: float) -> None: ...
    def gauge_move(self, src: int, dst: int) -> None: ...
    def finish(self, gid: int, cid: int, observations: list[tuple[int, float]]) -> None: ...
    def set_info(self, old: tuple[str, ...] | None, new: tuple[str, ...]) -> None: ...


class _LocalStore:
    """Single-process values: plain floats under one lock, rendered by ``collect()``.

    prometheus-client's metric objects take a lock and validate on every call (about 1 us per
    histogram observation); one lock per update and a ``bisect`` keep a fully tracked request
    several times cheaper, and a request's final observations are one update.
    """

    def __init__(self, hist: list[_Series], counters: list[_Series],
                 gauges: list[_Series]) -> None:
        self._lock = threading.Lock()
        self._hist, self._counters, self._gauges = hist, counters, gauges
        self._bounds = [f.buckets for f, _ in hist]
        self._hcounts = [[0.0] * (len(f.buckets) + 1) for f, _ in hist]  # last: above all
        self._hsums = [0.0] * len(hist)
        self._c = [0.0] * len(counters)
        self._g = [0.0] * len(gauges)
        self._info: dict[tuple[str, ...], float] = {}

    def observe(self, hid: int, value: float) -> None:
        with self._lock:
            # bisect_left: the first bound >= value, i.e. Prometheus' ``value <= le``.
            self._hcounts[hid][bisect_left(self._bounds[hid], value)] += 1.0
            self._hsums[hid] += value

    def count(self, *cids: int) -> None:
        with self._lock:
            for cid in cids:
                self._c[cid] += 1.0

    def gauge_add(self, gid: int, delta: float) -> None:
        with self._lock:
            self._g[gid] += delta

    def gauge_move(self, src: int, dst: int) -> None:
        with self._lock:
            self._g[src] -= 1.0
            self._g[dst] += 1.0

    def finish(self, gid: int, cid: int, observations: list[tuple[int, float]]) -> None:
        with self._lock:
            self._g[gid] -= 1.0
            self._c[cid] += 1.0
            for hid, value in observations:
                self._hcounts[hid][bisect_left(self._bounds[hid], value)] += 1.0
                self._hsums[hid] += value

    def set_info(self, old: tuple[str, ...] | None, new: tuple[str, ...]) -> None:
        with self._lock:
            if old is not None and old != new:
                self._info[old] = 0.0  # as in multiprocess mode, where it cannot be removed
            self._info[new] = 1.0

    def describe(self) -> list[Metric]:
        return [self._family(f) for f in FAMILIES]

    def collect(self) -> list[Metric]:
        with self._lock:
            hcounts = [list(c) for c in self._hcounts]
            hsums, c, g, info = list(self._hsums), list(self._c), list(self._g), dict(self._info)
        out = {f.name: self._family(f) for f in FAMILIES}
        for hid, (f, lv) in enumerate(self._hist):
            hist = out[f.name]
            assert isinstance(hist, HistogramMetricFamily)
            cumulative, acc = [], 0.0
            for bound, n in zip((*f.buckets, math.inf), hcounts[hid], strict=True):
                acc += n
                cumulative.append((floatToGoString(bound), acc))
            hist.add_metric(list(lv), cumulative, hsums[hid])
        for cid, (f, lv) in enumerate(self._counters):
            counter = out[f.name]
            assert isinstance(counter, CounterMetricFamily)
            counter.add_metric(list(lv), c[cid])
        for gid, (f, lv) in enumerate(self._gauges):
            gauge = out[f.name]
            assert isinstance(gauge, GaugeMetricFamily)
            gauge.add_metric(list(lv), g[gid])
        model = out[MODEL_INFO.name]
        assert isinstance(model, GaugeMetricFamily)
        for lv, v in info.items():
            model.add_metric(list(lv), v)
        return list(out.values())

    @staticmethod
    def _family(f: _Family) -> Metric:
        labels = list(f.labelnames)
        if f.kind == "histogram":
            return HistogramMetricFamily(f.name, f.help, labels=labels)
        if f.kind == "counter":
            return CounterMetricFamily(f.name, f.help, labels=labels)
        return GaugeMetricFamily(f.name, f.help, labels=labels)


class _PromStore:
    """Multiprocess values: prometheus-client's own metrics, whose values are memory-mapped files
    that ``MultiProcessCollector`` merges across workers."""

    def __init__(self, registry: CollectorRegistry, hist: list[_Series],
                 counters: list[_Series], gauges: list[_Series]) -> None:
        made: dict[str, Any] = {}
        for f in FAMILIES:
            if f.kind == "histogram":
                made[f.name] = Histogram(f.name, f.help, f.labelnames, registry=registry,
                                         buckets=f.buckets)
            elif f.kind == "counter":
                made[f.name] = Counter(f.name, f.help, f.labelnames, registry=registry)
            else:
                made[f.name] = Gauge(f.name, f.help, f.labelnames, registry=registry,
                                     multiprocess_mode=f.mp_mode)

        def child(s: _Series) -> Any:
            return made[s[0].name].labels(*s[1]) if s[1] else made[s[0].name]

        self._h = [child(s) for s in hist]
        self._c = [child(s) for s in counters]
        self._g = [child(s) for s in gauges]
        self._model = made[MODEL_INFO.name]

    def observe(self, hid: int, value: float) -> None:
        self._h[hid].observe(value)

    def count(self, *cids: int) -> None:
        for cid in cids:
            self._c[cid].inc()

    def gauge_add(self, gid: int, delta: float) -> None:
        self._g[gid].inc(delta)

    def gauge_move(self, src: int, dst: int) -> None:
        self._g[src].dec()
        self._g[dst].inc()

    def finish(self, gid: int, cid: int, observations: list[tuple[int, float]]) -> None:
        self._g[gid].dec()
        self._c[cid].inc()
        for hid, value in observations:
            self._h[hid].observe(value)

    def set_info(self, old: tuple[str, ...] | None, new: tuple[str, ...]) -> None:
        if old is not None and old != new:
            # Removing a child is not implemented for memory-mapped values; 0 marks it stale.
            self._model.labels(*old).set(0)
        self._model.labels(*new).set(1)


class MRCMetrics:
    """The MRC request metrics on one registry, every series created up front.

    ``registry`` defaults to a fresh ``CollectorRegistry`` (never the global one unless passed).
    ``prompt_edges`` (characters) and ``resolution_edges_mp`` (megapixels) set the label buckets;
    see :mod:`exporters.instrumentation.buckets` for the ``[lo, hi)`` rule and the generated
    label values.
    """

    def __init__(self, registry: CollectorRegistry | None = None,
                 prompt_edges: Sequence[int] = buckets.PROMPT_LENGTH_EDGES,
                 resolution_edges_mp: Sequence[float] = buckets.RESOLUTION_EDGES_MP) -> None:
        self.multiprocess = multiprocess_enabled()
        if self.multiprocess and not Path(os.environ[_ENV]).is_dir():
            raise ValueError(f"{_ENV}={os.environ[_ENV]!r} is not a directory")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.prompt_edges = tuple(int(e) for e in prompt_edges)
        self.resolution_edges_mp = tuple(float(e) for e in resolution_edges_mp)
        self.prompt_length_values = buckets.prompt_length_values(self.prompt_edges)
        self.resolution_values = buckets.resolution_values(self.resolution_edges_mp)
        self._pixel_edges = buckets.pixel_edges(self.resolution_edges_mp)

        # Every series, addressed by index: they all exist from the first scrape, and the hot
        # path is list indexing instead of label lookups.
        hist: list[_Series] = []
        self._req_ids: dict[tuple[int, int], tuple[int, int, int]] = {}
        for i, p in enumerate(self.prompt_length_values):
            for j, res in enumerate(self.resolution_values):
                ids = []
                for f in (REQUEST_DURATION, TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN):
                    ids.append(len(hist))
                    hist.append((f, (p, res)))
                self._req_ids[(i, j)] = (ids[0], ids[1], ids[2])
        self._stage_ids: dict[str, int] = {}
        for s in STAGES:
            self._stage_ids[s] = len(hist)
            hist.append((STAGE_DURATION, (s,)))
        self._peak_id = len(hist)
        hist.append((PEAK_GPU_MEMORY, ()))
        counters: list[_Series] = [(REQUESTS, (o,)) for o in OUTCOMES]
        self._outcome_ids = {o: i for i, o in enumerate(OUTCOMES)}
        self._lookup_id, self._hit_id = len(counters), len(counters) + 1
        counters += [(CACHE_LOOKUPS, ()), (CACHE_HITS, ())]
        self._break_ids = {s: len(counters) + i for i, s in enumerate(CHAIN_BREAK_STEPS)}
        counters += [(CHAIN_BREAKS, (s,)) for s in CHAIN_BREAK_STEPS]
        gauges: list[_Series] = [(REQUESTS_IN_FLIGHT, ()), (REQUESTS_QUEUED, ())]
        self._in_flight_id, self._queued_id = 0, 1

        self._store: _Store
        if self.multiprocess:
            self._store = _PromStore(self.registry, hist, counters, gauges)
        else:
            local = _LocalStore(hist, counters, gauges)
            self.registry.register(local)
            self._store = local
        self._model_info_labels: tuple[str, ...] | None = None

    # --- per request -----------------------------------------------------------------------

    def request(self, prompt_chars: int | None = None, width: int | None = None,
                height: int | None = None) -> RequestTracker:
        """A tracker for one request; use it as ``with metrics.request(...) as r:``.

        The clock starts when the block is entered, and the request counts as in flight while
        inside it. Give the prompt length and image size here or later (``r.set_prompt``,
        ``r.set_image``); a request whose labels are still unknown at exit (rejected before its
        image was decoded) is counted in ``mrc_requests_total`` but observed in no histogram.
        """
        return RequestTracker(self, prompt_chars, width, height)

    def prompt_index(self, chars: int) -> int:
        """Index into ``prompt_length_values`` for ``chars`` characters (``[lo, hi)``)."""
        if chars < 0:
            raise ValueError(f"prompt length must be >= 0, got {chars}")
        return bisect_right(self.prompt_edges, chars)

    def resolution_index(self, width: int, height: int) -> int:
        """Index into ``resolution_values`` for a ``width`` x ``height`` image (``[lo, hi)``)."""
        if width < 0 or height < 0:
            raise ValueError(f"image size must be >= 0, got {width}x{height}")
        return bisect_right(self._pixel_edges, width * height)

    # --- outside a request -----------------------------------------------------------------

    def queued(self) -> _GaugeTrack:
        """Context manager counting a request as queued, for code not using ``request()``."""
        return _GaugeTrack(self._store, self._queued_id)

    def in_flight(self) -> _GaugeTrack:
        """Context manager counting a request as in flight, for code not using ``request()``."""
        return _GaugeTrack(self._store, self._in_flight_id)

    def observe_stage(self, stage: Stage, seconds: float) -> None:
        """Record a stage duration measured elsewhere (for example in a worker thread)."""
        self._store.observe(self._stage_id(stage), seconds)

    def cache_lookup(self, hit: bool) -> None:
        """Count one lookup in the answer cache, and a hit when ``hit``."""
        if hit:
            self._store.count(self._lookup_id, self._hit_id)
        else:
            self._store.count(self._lookup_id)

    def chain_break(self, step: ChainBreakStep) -> None:
        """Count an intermediate step that failed or gave nothing usable (``CHAIN_BREAK_STEPS``)."""
        try:
            cid = self._break_ids[step]
        except KeyError:
            raise ValueError(f"unknown chain step {step!r}; expected one of "
                             f"{', '.join(CHAIN_BREAK_STEPS)}") from None
        self._store.count(cid)

    def set_model_info(self, *, model_id: str, revision: str = "unknown", dtype: str = "unknown",
                       quantization: str = "none", device: str = "unknown",
                       attention_backend: str = "unknown") -> None:
        """Describe the model being served; a later call replaces the earlier description.

        ``attention_backend`` is the scaled-dot-product-attention backend actually selected on
        this device (flash, efficient, math), not the one asked for. A replaced description
        stays as a series at 0 (memory-mapped values cannot be removed in multiprocess mode, and
        both modes expose the same series), so select the live one with ``mrc_model_info == 1``.
        """
        new = (model_id, revision, dtype, quantization, device, attention_backend)
        if any(not isinstance(v, str) or not v for v in new):
            raise ValueError(f"model info values must be non-empty strings, got {new}")
        self._store.set_info(self._model_info_labels, new)
        self._model_info_labels = new

    def _stage_id(self, stage: str) -> int:
        try:
            return self._stage_ids[stage]
        except KeyError:
            raise _unknown_stage(stage) from None


def _unknown_stage(stage: str) -> ValueError:
    return ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")


class _GaugeTrack:
    """Adds one to a gauge for the duration of the block."""

    __slots__ = ("_store", "_gid")

    def __init__(self, store: _Store, gid: int) -> None:
        self._store, self._gid = store, gid

    def __enter__(self) -> None:
        self._store.gauge_add(self._gid, 1.0)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._store.gauge_add(self._gid, -1.0)


class _StageTimer:
    """Times one stage with ``perf_counter`` (monotonic); recorded even when the stage raises.

    The duration joins the request's other observations, written in one update when the request
    ends; a stage timed after its request ended is written at once.
    """

    __slots__ = ("_tracker", "_hid", "_t0")

    def __init__(self, tracker: RequestTracker, hid: int) -> None:
        self._tracker, self._hid, self._t0 = tracker, hid, 0.0

    def __enter__(self) -> None:
        self._t0 = perf_counter()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        t = self._tracker
        if t._obs is not None:
            t._obs.append((self._hid, perf_counter() - self._t0))
        else:
            t._m._store.observe(self._hid, perf_counter() - self._t0)


class _Queued:
    """Moves a tracked request from in flight to queued for the duration of the block."""

    __slots__ = ("_m",)

    def __init__(self, m: MRCMetrics) -> None:
        self._m = m

    def __enter__(self) -> None:
        self._m._store.gauge_move(self._m._in_flight_id, self._m._queued_id)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._m._store.gauge_move(self._m._queued_id, self._m._in_flight_id)


class RequestTracker:
    """Measures one request; made by :meth:`MRCMetrics.request`, used as a context manager.

    On exit it observes the request duration (outcomes in ``LATENCY_OUTCOMES``), the time to first
    token (when ``first_token()`` was called), the time per output token (when ``tokens(n)`` with
    ``n >= 2`` followed ``first_token()``) and the peak GPU memory (when given), and counts the
    outcome. The outcome is the one set (``r.outcome = ...`` or ``r.set_status(code)``); if none
    was set it is ``ok`` on a normal exit, and for an escaping exception: the outcome of its
    ``status_code`` for an HTTPException, ``timeout`` for a ``TimeoutError``, ``error`` otherwise
    (cancellation included). Stage durations are written with the request's final update.
    """

    __slots__ = ("_m", "_p", "_r", "_t0", "_t_first", "_t_last", "_n_out", "_peak", "_outcome",
                 "_entered", "_obs")

    def __init__(self, m: MRCMetrics, prompt_chars: int | None, width: int | None,
                 height: int | None) -> None:
        self._m = m
        self._p = None if prompt_chars is None else m.prompt_index(prompt_chars)
        self._r: int | None = None
        if width is not None and height is not None:
            self._r = m.resolution_index(width, height)
        elif width is not None or height is not None:
            raise ValueError("give both width and height, or neither")
        self._t0 = 0.0
        self._t_first: float | None = None
        self._t_last = 0.0
        self._n_out = 0
        self._peak: float | None = None
        self._outcome: Outcome | None = None
        self._entered = False
        #: Stage durations waiting for the request's final update; None once it is written.
        self._obs: list[tuple[int, float]] | None = []

    def __enter__(self) -> RequestTracker:
        if self._entered:
            raise RuntimeError("a RequestTracker measures one request; make a new one")
        self._entered = True
        self._m._store.gauge_add(self._m._in_flight_id, 1.0)
        self._t0 = perf_counter()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        end = perf_counter()
        m = self._m
        outcome = self._outcome
        if outcome is None:
            outcome = "ok" if et is None else _outcome_for_exception(ev)
        observations = self._obs if self._obs is not None else []
        self._obs = None
        if self._p is not None and self._r is not None:
            duration, ttft, tpot = m._req_ids[(self._p, self._r)]
            if outcome in LATENCY_OUTCOMES:
                observations.append((duration, end - self._t0))
            first = self._t_first
            if first is not None:
                observations.append((ttft, first - self._t0))
                if self._n_out >= 2 and self._t_last > first:
                    observations.append((tpot, (self._t_last - first) / (self._n_out - 1)))
        if self._peak is not None:
            observations.append((m._peak_id, self._peak))
        m._store.finish(m._in_flight_id, m._outcome_ids[outcome], observations)

    @property
    def outcome(self) -> Outcome | None:
        """The outcome set so far, or None (decided at exit)."""
        return self._outcome

    @outcome.setter
    def outcome(self, value: Outcome) -> None:
        if value not in OUTCOMES:
            raise ValueError(f"unknown outcome {value!r}; expected one of {', '.join(OUTCOMES)}")
        self._outcome = value

    def set_status(self, status_code: int) -> None:
        """Set the outcome from the HTTP status the service answers with."""
        self._outcome = outcome_for_status(status_code)

    def set_prompt(self, chars: int) -> None:
        """Set the prompt length in characters, when it was not known at the start."""
        self._p = self._m.prompt_index(chars)

    def set_image(self, width: int, height: int) -> None:
        """Set the image size as received (before any resize); known only after decode."""
        self._r = self._m.resolution_index(width, height)

    def stage(self, stage: Stage) -> _StageTimer:
        """Context manager timing one stage of the chain; ValueError for an unknown stage."""
        try:
            hid = self._m._stage_ids[stage]
        except KeyError:
            raise _unknown_stage(stage) from None
        return _StageTimer(self, hid)

    def observe_stage(self, stage: Stage, seconds: float) -> None:
        """Record a stage duration measured elsewhere (for example inside a worker thread)."""
        self._m.observe_stage(stage, seconds)

    def queued(self) -> _Queued:
        """Context manager: the request waits for a processing slot (queued, not in flight)."""
        return _Queued(self._m)

    def first_token(self) -> None:
        """Mark the first generated token now; later calls are ignored."""
        if self._t_first is None:
            self._t_first = perf_counter()

    def tokens(self, n_output: int) -> None:
        """Mark the end of generation now, with ``n_output`` tokens generated in all."""
        if n_output < 0:
            raise ValueError(f"token count must be >= 0, got {n_output}")
        self._t_last = perf_counter()
        self._n_out = n_output

    def peak_gpu_memory(self, nbytes: float) -> None:
        """Record the peak GPU memory of this request in bytes (CUDA only; observed at exit)."""
        if nbytes < 0:
            raise ValueError(f"peak GPU memory must be >= 0, got {nbytes}")
        self._peak = float(nbytes)
