"""The agent's core sample types: what one sampling pass produces and how consumers read it.

A collector returns :data:`Sample` tuples ``(metric name, label values, value)``, with label values
in the order its :class:`~mrc_agent.exporters.exposition.snapshot.MetricSpec` declares them. The
runner publishes them as one immutable :class:`Snapshot`. Consumers (the exposition, diagnose,
captures, the demo) read a snapshot through the spec — :func:`readings` and :func:`first` — never by
a name literal or a label position.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

# The sample model is defined once, beside the exposition that serves it.
from mrc_agent.exporters.exposition.snapshot import (
    EMPTY,
    HistogramValue,
    MetricSpec,
    Sample,
    Snapshot,
    Value,
    counter,
    gauge,
    histogram,
    info,
)

__all__ = ["EMPTY", "HistogramValue", "MetricSpec", "Reading", "Sample", "Snapshot", "Value",
           "counter", "first", "gauge", "histogram", "info", "readings"]


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
