"""The sample model, defined once: a metric's definition (:class:`MetricSpec`, built by
:func:`counter`, :func:`gauge`, :func:`info` and :func:`histogram`), one sample
(:data:`Sample`), a histogram's value (:class:`HistogramValue`) and one sampling pass's
immutable :class:`Snapshot`; and the prometheus-client custom collector that turns the latest
snapshot into metric families.

A scrape never touches hardware: the sampler builds an immutable snapshot of plain tuples on its
own clock, and :class:`SnapshotCollector` only groups those tuples into families when Prometheus
asks. The same :class:`MetricSpec` list drives the exposition and the generated metric
catalogue, so the two cannot disagree. The agent reads snapshots through
:mod:`mrc_agent.agent.core.sample`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

Kind = Literal["counter", "gauge", "histogram", "info"]

#: Units a metric name may end in; used to emit the OpenMetrics ``# UNIT`` line.
_UNITS = ("seconds", "bytes", "ratio", "watts", "hertz", "bytes_per_second", "celsius")


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its exposed name, kind, help text and label names (in order).

    ``name`` is the name as it appears in the exposition: counters end in ``_total``,
    info metrics in ``_info``. ``collector`` names the collector that produces it.
    """

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    collector: str = ""
    buckets: tuple[float, ...] = ()

    @property
    def family_name(self) -> str:
        """The name prometheus-client expects (without ``_total`` / ``_info``)."""
        if self.kind == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        if self.kind == "info" and self.name.endswith("_info"):
            return self.name[: -len("_info")]
        return self.name

    @property
    def unit(self) -> str:
        """The base unit the name ends in, or ``""``."""
        base = self.family_name
        for unit in sorted(_UNITS, key=len, reverse=True):
            if base.endswith("_" + unit):
                return unit
        return ""


def counter(collector: str, name: str, labels: tuple[str, ...], help_: str) -> MetricSpec:
    """A counter produced by ``collector`` (``name`` ends in ``_total``)."""
    return MetricSpec(name, "counter", help_, labels, collector)


def gauge(collector: str, name: str, labels: tuple[str, ...], help_: str) -> MetricSpec:
    return MetricSpec(name, "gauge", help_, labels, collector)


def info(collector: str, name: str, labels: tuple[str, ...], help_: str) -> MetricSpec:
    """An info metric (``name`` ends in ``_info``); its sample value is a dict of labels."""
    return MetricSpec(name, "info", help_, labels, collector)


def histogram(collector: str, name: str, labels: tuple[str, ...], help_: str,
              buckets: tuple[float, ...]) -> MetricSpec:
    return MetricSpec(name, "histogram", help_, labels, collector, buckets)


@dataclass
class HistogramValue:
    """Cumulative histogram state: ``counts[i]`` observations ≤ ``bounds[i]``, plus +Inf."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        """Record one observation."""
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def copy(self) -> HistogramValue:
        return HistogramValue(self.bounds, list(self.counts), self.total, self.sum)


#: A sample's value: a float; a :class:`HistogramValue` for histograms; a dict of info labels
#: for info metrics.
Value = float | HistogramValue | dict[str, str]
#: One sample: (metric name, label values in the spec's label order, value).
Sample = tuple[str, tuple[str, ...], Value]


@dataclass(frozen=True)
class Snapshot:
    """What one sampling pass produced. ``seq`` grows with every snapshot published, so that
    a render of it can be cached under it."""

    seq: int
    timestamp: float
    samples: tuple[Sample, ...]


EMPTY = Snapshot(seq=0, timestamp=0.0, samples=())


def _family(spec: MetricSpec) -> Metric:
    labels = list(spec.labels)
    unit = spec.unit
    if spec.kind == "counter":
        return CounterMetricFamily(spec.family_name, spec.help, labels=labels, unit=unit)
    if spec.kind == "gauge":
        return GaugeMetricFamily(spec.family_name, spec.help, labels=labels, unit=unit)
    if spec.kind == "histogram":
        return HistogramMetricFamily(spec.family_name, spec.help, labels=labels, unit=unit)
    return InfoMetricFamily(spec.family_name, spec.help, labels=labels)


def _fmt_bound(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class SnapshotCollector(Collector):
    """A custom collector that exposes whatever snapshot ``source()`` returns.

    Every spec is exposed with its HELP/TYPE even without samples, so a scrape shows the full
    catalogue; samples whose name has no spec are a programming error and raise.
    """

    def __init__(self, specs: Sequence[MetricSpec], source: Callable[[], Snapshot]) -> None:
        self._specs = {s.name: s for s in specs}
        if len(self._specs) != len(specs):
            raise ValueError("duplicate metric names in specs")
        self._source = source

    def describe(self) -> Iterable[Metric]:
        # Returning families here lets the registry check name clashes at registration time.
        return [_family(s) for s in self._specs.values()]

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for name, labels, value in self._source().samples:
            family = families.get(name)
            if family is None:
                family = families[name] = _family(self._specs[name])
            if isinstance(value, HistogramValue):
                pairs = zip(value.bounds, value.counts, strict=True)
                buckets = [(_fmt_bound(b), c) for b, c in pairs]
                buckets.append(("+Inf", value.total))
                family.add_metric(list(labels), buckets, value.sum)  # type: ignore[attr-defined]
            else:
                family.add_metric(list(labels), value)  # type: ignore[attr-defined]
        for name in self._specs:
            yield families.get(name) or _family(self._specs[name])
