"""Where the values of the MRC request metrics live: one store per mode, the same exposition.

:class:`~mrc_agent.exporters.instrumentation.metrics.MRCMetrics` lists every series of the contract
(:mod:`mrc_agent.exporters.instrumentation.families`) once, at construction, and hands the lists to
a store; from then on the hot path addresses a series by its index in those lists, never by label
lookup. Two value stores render the same exposition (a test compares them):

* single process — ``_LocalStore``: plain floats under one lock, rendered by a custom collector
  on the registry. A request's observations are written in one update when it ends, which keeps a
  fully tracked request at a few microseconds (prometheus-client's metric objects take a lock and
  validate on every call: about 1 us per histogram observation).
* multiprocess (several uvicorn/gunicorn workers) — ``_PromStore``: prometheus-client's own
  metrics, whose values live in memory-mapped files in ``PROMETHEUS_MULTIPROC_DIR``. That variable
  must be in the environment *before the process starts* (prometheus-client picks its value store
  when first imported;
  :func:`~mrc_agent.exporters.instrumentation.multiprocess.multiprocess_enabled` refuses a
  mismatch). Gauges merge across workers with ``livesum`` (in flight, queued) and ``livemax`` (model
  info), and the exposition is built by ``MultiProcessCollector`` on a fresh registry per scrape —
  :mod:`mrc_agent.exporters.instrumentation.asgi` does that. The launcher empties the directory
  before starting the workers
  (:func:`~mrc_agent.exporters.instrumentation.multiprocess.prepare_multiproc_dir`), and each worker
  calls :func:`~mrc_agent.exporters.instrumentation.multiprocess.mark_process_dead` as it exits so
  its live gauges stop counting. prometheus-client's ``Info`` does not work in multiprocess mode, so
  ``mrc_model_info`` is a gauge set to 1 in both modes: one type, one query, whatever the mode.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from typing import Any, Protocol

from prometheus_client.metrics import Counter, Gauge, Histogram
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from mrc_agent.exporters.instrumentation.families import FAMILIES, MODEL_INFO, Family

#: A series: its family and label values. Stores address series by their index in a list of these.
_Series = tuple[Family, tuple[str, ...]]


def empty_family(f: Family) -> Metric:
    """The family ``f`` with no series yet, of its kind."""
    labels = list(f.labelnames)
    if f.kind == "histogram":
        return HistogramMetricFamily(f.name, f.help, labels=labels)
    if f.kind == "counter":
        return CounterMetricFamily(f.name, f.help, labels=labels)
    return GaugeMetricFamily(f.name, f.help, labels=labels)


class _Store(Protocol):
    """Where the values live. Every method is one atomic update; ids index the series lists."""

    def observe(self, hid: int, value: float) -> None: ...
    def count(self, *cids: int) -> None: ...
    def gauge_add(self, gid: int, delta: float) -> None: ...
    def gauge_move(self, src: int, dst: int) -> None: ...
    def finish(self, gid: int, cid: int, observations: list[tuple[int, float]],
               increments: list[tuple[int, float]]) -> None: ...
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

    def finish(self, gid: int, cid: int, observations: list[tuple[int, float]],
               increments: list[tuple[int, float]]) -> None:
        with self._lock:
            self._g[gid] -= 1.0
            self._c[cid] += 1.0
            for other, amount in increments:
                self._c[other] += amount
            for hid, value in observations:
                self._hcounts[hid][bisect_left(self._bounds[hid], value)] += 1.0
                self._hsums[hid] += value

    def set_info(self, old: tuple[str, ...] | None, new: tuple[str, ...]) -> None:
        with self._lock:
            if old is not None and old != new:
                self._info[old] = 0.0  # as in multiprocess mode, where it cannot be removed
            self._info[new] = 1.0

    def describe(self) -> list[Metric]:
        return [empty_family(f) for f in FAMILIES]

    def collect(self) -> list[Metric]:
        with self._lock:
            hcounts = [list(c) for c in self._hcounts]
            hsums, c, g, info = list(self._hsums), list(self._c), list(self._g), dict(self._info)
        out = {f.name: empty_family(f) for f in FAMILIES}
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

    def finish(self, gid: int, cid: int, observations: list[tuple[int, float]],
               increments: list[tuple[int, float]]) -> None:
        self._g[gid].dec()
        self._c[cid].inc()
        for other, amount in increments:
            self._c[other].inc(amount)
        for hid, value in observations:
            self._h[hid].observe(value)

    def set_info(self, old: tuple[str, ...] | None, new: tuple[str, ...]) -> None:
        if old is not None and old != new:
            # Removing a child is not implemented for memory-mapped values; 0 marks it stale.
            self._model.labels(*old).set(0)
        self._model.labels(*new).set(1)
