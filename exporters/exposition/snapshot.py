"""Snapshot exposition: metric definitions and the prometheus-client custom collector that
turns the latest snapshot of a sampler into metric families.

A scrape never touches hardware: the sampler builds an immutable snapshot of plain tuples on its own
clock (the agent's is :class:`mrc_agent.agent.core.sample.Snapshot`), and :class:`SnapshotCollector`
only groups those tuples into families when Prometheus asks. The same :class:`MetricSpec` list
drives the exposition and the generated metric catalogue, so the two cannot disagree. This module
knows the snapshot only by its shape (:class:`SnapshotLike`), never the agent's types.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

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


#: One sample: (metric name, label values in the spec's label order, value). The value is a
#: float, a histogram value for histograms (cumulative ``counts[i]`` of observations at or below
#: ``bounds[i]``, ``total`` for +Inf and ``sum``), or a dict of info labels for info metrics.
SampleTuple = tuple[str, tuple[str, ...], Any]


class SnapshotLike(Protocol):
    """What the collector reads: the samples of one sampling pass."""

    @property
    def samples(self) -> Sequence[SampleTuple]: ...


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

    def __init__(self, specs: Sequence[MetricSpec], source: Callable[[], SnapshotLike]) -> None:
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
            if self._specs[name].kind == "histogram":
                pairs = zip(value.bounds, value.counts, strict=True)
                buckets = [(_fmt_bound(b), c) for b, c in pairs]
                buckets.append(("+Inf", value.total))
                family.add_metric(list(labels), buckets, value.sum)  # type: ignore[attr-defined]
            else:
                family.add_metric(list(labels), value)  # type: ignore[attr-defined]
        for name in self._specs:
            yield families.get(name) or _family(self._specs[name])
