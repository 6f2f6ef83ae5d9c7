"""The agent's core sample types: what one sampling pass produces and how consumers read it.

A collector returns :data:`Sample` tuples ``(metric name, label values, value)``, with label values
in the order its :class:`~mrc_agent.exporters.exposition.snapshot.MetricSpec` declares them. The
runner publishes them as one immutable :class:`Snapshot`. Consumers (the exposition, diagnose,
captures, the demo) read a snapshot through the spec — :func:`readings` and :func:`first` — never by
a name literal or a label position.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from mrc_agent.exporters.exposition.snapshot import MetricSpec


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


#: One sample: (metric name, label values in the spec's label order, value).
#: Info metrics carry a ``dict`` of info labels as value.
Value = float | HistogramValue | dict[str, str]
Sample = tuple[str, tuple[str, ...], Value]


@dataclass(frozen=True)
class Snapshot:
    """What one sampling pass produced. ``seq`` grows by one per published snapshot."""

    seq: int
    timestamp: float
    samples: tuple[Sample, ...]


EMPTY = Snapshot(seq=0, timestamp=0.0, samples=())


@dataclass(frozen=True)
class Reading:
    """One sample read through its spec: labels by name."""

    spec: MetricSpec
    labels: dict[str, str]
    value: Value

    def key(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """The values of ``names`` (for example the GPU identity labels), in that order."""
        return tuple(self.labels[n] for n in names)


def readings(samples: Snapshot | tuple[Sample, ...] | list[Sample], spec: MetricSpec,
             **match: str) -> Iterator[Reading]:
    """Every sample of ``spec`` whose labels equal ``match`` (``pid="12"``)."""
    items = samples.samples if isinstance(samples, Snapshot) else samples
    for name, values, value in items:
        if name != spec.name:
            continue
        labels = dict(zip(spec.labels, values, strict=True))
        if all(labels.get(k) == v for k, v in match.items()):
            yield Reading(spec, labels, value)


def first(samples: Snapshot | tuple[Sample, ...] | list[Sample], spec: MetricSpec,
          **match: str) -> float | None:
    """The first float value of ``spec`` matching ``match``, or None."""
    for s in readings(samples, spec, **match):
        if isinstance(s.value, float):
            return s.value
    return None
