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
declared once, in :mod:`mrc_agent.exporters.instrumentation.families`, and listed in
``docs/instrumentation.md``. Bucket boundaries and label edges live in
:mod:`mrc_agent.exporters.instrumentation.buckets`. Every series (all prompt-length x resolution
combinations, stages, outcomes, chain steps) is created in the constructor, so it exists from the
first scrape, and the hot path addresses series by list index, never by label lookup. The values
live in one of two stores, single process or multiprocess, that render the same exposition:
:mod:`mrc_agent.exporters.instrumentation.stores` explains both, and
:mod:`mrc_agent.exporters.instrumentation.multiprocess` the rules of multiprocess mode.

This module imports neither torch nor the agent: the caller passes the peak GPU memory it measured.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from pathlib import Path
from time import perf_counter
from types import TracebackType

from prometheus_client.registry import CollectorRegistry

from mrc_agent.exporters.instrumentation import buckets
from mrc_agent.exporters.instrumentation.families import (
    CACHE_HITS,
    CACHE_LOOKUPS,
    CHAIN_BREAK_STEPS,
    CHAIN_BREAKS,
    GENERATION_TOKENS,
    LATENCY_OUTCOMES,
    METER_ERRORS,
    METER_STAGES,
    OUTCOMES,
    PEAK_GPU_MEMORY,
    PREPROCESS_ABANDONED_THREADS,
    PREPROCESS_POOLS,
    PROMPT_TOKENS,
    QUEUE_TIME,
    REQUEST_DURATION,
    REQUEST_IMAGES,
    REQUESTS,
    REQUESTS_IN_FLIGHT,
    REQUESTS_QUEUED,
    STAGE_DURATION,
    STAGES,
    TIME_PER_OUTPUT_TOKEN,
    TIME_TO_FIRST_TOKEN,
    ChainBreakStep,
    MeterStage,
    Outcome,
    PreprocessPool,
    Stage,
    _outcome_for_exception,
    outcome_for_status,
)
from mrc_agent.exporters.instrumentation.multiprocess import _ENV, multiprocess_enabled
from mrc_agent.exporters.instrumentation.stores import _LocalStore, _PromStore, _Series, _Store


class MRCMetrics:
    """The MRC request metrics on one registry, every series created up front.

    ``registry`` defaults to a fresh ``CollectorRegistry`` (never the global one unless passed).
    ``prompt_edges`` (characters) and ``resolution_edges_mp`` (megapixels) set the label buckets;
    see :mod:`mrc_agent.exporters.instrumentation.buckets` for the ``[lo, hi)`` rule and the
    generated label values. ``resolution_unknown`` adds the ``unknown`` resolution cell, for a
    caller that cannot always see the image (the OpenAI meter: a remote ``image_url``).
    """

    def __init__(self, registry: CollectorRegistry | None = None,
                 prompt_edges: Sequence[int] = buckets.PROMPT_LENGTH_EDGES,
                 resolution_edges_mp: Sequence[float] = buckets.RESOLUTION_EDGES_MP,
                 resolution_unknown: bool = False) -> None:
        self.multiprocess = multiprocess_enabled()
        if self.multiprocess and not Path(os.environ[_ENV]).is_dir():
            raise ValueError(f"{_ENV}={os.environ[_ENV]!r} is not a directory")
        self.registry = registry if registry is not None else CollectorRegistry()
        # Checked as given: int() first would turn 50.5 into 50 and 0.5 into 0 unannounced.
        self.prompt_length_values = buckets.prompt_length_values(tuple(prompt_edges))
        self.prompt_edges = tuple(int(e) for e in prompt_edges)
        self.resolution_edges_mp = tuple(float(e) for e in resolution_edges_mp)
        self.resolution_values = buckets.resolution_values(self.resolution_edges_mp)
        #: Index of the ``unknown`` resolution cell, or None when it was not asked for.
        self.unknown_resolution_index: int | None = None
        if resolution_unknown:
            self.unknown_resolution_index = len(self.resolution_values)
            self.resolution_values += (buckets.RESOLUTION_UNKNOWN,)
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
        self._queue_time_id = len(hist)
        hist.append((QUEUE_TIME, ()))
        self._images_id = len(hist)
        hist.append((REQUEST_IMAGES, ()))
        counters: list[_Series] = [(REQUESTS, (o,)) for o in OUTCOMES]
        self._outcome_ids = {o: i for i, o in enumerate(OUTCOMES)}
        self._lookup_id, self._hit_id = len(counters), len(counters) + 1
        counters += [(CACHE_LOOKUPS, ()), (CACHE_HITS, ())]
        self._break_ids = {s: len(counters) + i for i, s in enumerate(CHAIN_BREAK_STEPS)}
        counters += [(CHAIN_BREAKS, (s,)) for s in CHAIN_BREAK_STEPS]
        self._prompt_tokens_id, self._generation_tokens_id = len(counters), len(counters) + 1
        counters += [(PROMPT_TOKENS, ()), (GENERATION_TOKENS, ())]
        self._meter_error_ids = {s: len(counters) + i for i, s in enumerate(METER_STAGES)}
        counters += [(METER_ERRORS, (s,)) for s in METER_STAGES]
        gauges: list[_Series] = [(REQUESTS_IN_FLIGHT, ()), (REQUESTS_QUEUED, ())]
        self._in_flight_id, self._queued_id = 0, 1
        self._abandoned_ids = {p: len(gauges) + i for i, p in enumerate(PREPROCESS_POOLS)}
        gauges += [(PREPROCESS_ABANDONED_THREADS, (p,)) for p in PREPROCESS_POOLS]

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
        self._count_named(self._break_ids, step, "chain step")

    def meter_error(self, stage: MeterStage) -> None:
        """Count one failure of the OpenAI meter's own reading at ``stage`` (``METER_STAGES``)."""
        self._count_named(self._meter_error_ids, stage, "meter stage")

    def _count_named(self, ids: Mapping[str, int], name: str, what: str) -> None:
        """Count the series of label value ``name`` in ``ids`` (ValueError for another)."""
        try:
            cid = ids[name]
        except KeyError:
            raise ValueError(f"unknown {what} {name!r}; expected one of "
                             f"{', '.join(ids)}") from None
        self._store.count(cid)

    def abandoned_threads(self, pool: PreprocessPool, delta: int) -> None:
        """Add ``delta`` to ``pool``'s threads written off after a timeout: +1 when a job
        overruns and its thread is abandoned, -1 when that job ends and the thread retires."""
        try:
            gid = self._abandoned_ids[pool]
        except KeyError:
            raise ValueError(f"unknown preprocess pool {pool!r}; expected one of "
                             f"{', '.join(PREPROCESS_POOLS)}") from None
        self._store.gauge_add(gid, float(delta))

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
    """Moves a tracked request from in flight to queued for the duration of the block, and adds
    the time it spent there to the request's queue time."""

    __slots__ = ("_t", "_t0")

    def __init__(self, tracker: RequestTracker) -> None:
        self._t = tracker
        self._t0 = 0.0

    def __enter__(self) -> None:
        m = self._t._m
        m._store.gauge_move(m._in_flight_id, m._queued_id)
        self._t0 = perf_counter()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        t = self._t
        t._queue = (t._queue or 0.0) + (perf_counter() - self._t0)
        t._m._store.gauge_move(t._m._queued_id, t._m._in_flight_id)


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

    __slots__ = ("_m", "_p", "_r", "_t0", "_t_first", "_t_last", "_n_in", "_n_out", "_peak",
                 "_queue", "_outcome", "_entered", "_obs", "_images")

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
        self._n_in = 0
        self._n_out = 0
        self._peak: float | None = None
        self._images: int | None = None
        #: Seconds waited for a slot (``queued()`` blocks), None if the request never waited.
        self._queue: float | None = None
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
        try:
            increments = self._final(observations, outcome, end)
        except Exception:
            # Whatever this request's values did (a count no float holds), it leaves in flight
            # and is counted: a gauge stuck one high is wrong for good.
            m._store.finish(m._in_flight_id, m._outcome_ids[outcome], [], [])
            raise
        m._store.finish(m._in_flight_id, m._outcome_ids[outcome], observations, increments)

    def _final(self, observations: list[tuple[int, float]], outcome: Outcome,
               end: float) -> list[tuple[int, float]]:
        """Add the request's observations at exit to ``observations``; its counter
        increments."""
        m = self._m
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
        if self._queue is not None:
            observations.append((m._queue_time_id, self._queue))
        if self._images is not None:
            observations.append((m._images_id, float(self._images)))
        return [(cid, float(n)) for cid, n in ((m._prompt_tokens_id, self._n_in),
                                                (m._generation_tokens_id, self._n_out)) if n]

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

    def set_image_unknown(self) -> None:
        """The request has an image whose size is not known (the ``unknown`` resolution cell,
        which the metrics must have been made with: ``MRCMetrics(resolution_unknown=True)``)."""
        if self._m.unknown_resolution_index is None:
            raise ValueError("these metrics have no unknown resolution cell "
                             "(MRCMetrics(resolution_unknown=True))")
        self._r = self._m.unknown_resolution_index

    def set_image_count(self, n: int) -> None:
        """Set how many images the request carried (observed at exit)."""
        if n < 0:
            raise ValueError(f"image count must be >= 0, got {n}")
        self._images = n

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
        """Context manager: the request waits for a processing slot (queued, not in flight).
        Its time there is the request's ``mrc_request_queue_time_seconds`` (observed at exit;
        enter it even when a slot is free, so that a wait of 0 is observed too)."""
        return _Queued(self)

    def first_token(self) -> None:
        """Mark the first generated token now; later calls are ignored."""
        if self._t_first is None:
            self._t_first = perf_counter()

    def tokens(self, n_output: int, n_prompt: int | None = None, *,
               at: float | None = None) -> None:
        """Mark the end of generation now, with ``n_output`` tokens generated in all and, when
        given, ``n_prompt`` prompt tokens processed (both counted at exit). ``at`` puts the end
        at an earlier ``perf_counter()`` reading instead (a stream's last token, when the usage
        that counts the tokens arrives after it)."""
        if n_output < 0:
            raise ValueError(f"token count must be >= 0, got {n_output}")
        if n_prompt is not None and n_prompt < 0:
            raise ValueError(f"prompt token count must be >= 0, got {n_prompt}")
        self._t_last = perf_counter() if at is None else at
        self._n_out = n_output
        if n_prompt is not None:
            self._n_in = n_prompt

    def peak_gpu_memory(self, nbytes: float) -> None:
        """Record the peak GPU memory measured over this request, in bytes (CUDA only; observed
        at exit). A process-wide reading such as ``torch.cuda.max_memory_allocated`` includes
        what concurrent requests held: the family's help says so."""
        if nbytes < 0:
            raise ValueError(f"peak GPU memory must be >= 0, got {nbytes}")
        self._peak = float(nbytes)
