"""What a collector is, and how one is registered.

A collector is a name and ``update(view)`` returning an :class:`Update`: fresh samples and the
typed outputs later collectors read (target CPU, the GPU decision, GPU utilisation). It raises on
failure, or :class:`mrc_agent.agent.core.hw.base.SourceUnavailable` when its source does not
apply here; the runner owns health and timing. Collectors run in a fixed order each pass, and
each sees an immutable :class:`PassView` of the outputs published before it: a pass runs as
phases (targets, then attribution and the device collectors, then the derived signals) that
hand typed values on, not as a shared context that each collector changes.

Each collector module ends with one :class:`CollectorDef`: its name, whether it is on by default,
its factory, the metrics it emits and the output types it reads and publishes, side by side
with the code that emits them (node_exporter's ``registerCollector`` beside its descriptors).
:mod:`mrc_agent.agent.core.collectors` lists them and checks that every output a collector
reads comes from one registered before it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol, TypeVar

from mrc_agent.agent.core import attribution as attribution_rule
from mrc_agent.agent.core.attribution import MODE_TARGETS, Attribution, TargetView
from mrc_agent.agent.core.hw.base import DeviceSample, GPUIdentity, SourceUnavailable
from mrc_agent.agent.core.hw.sources import Sources
from mrc_agent.agent.core.sample import Sample
from mrc_agent.agent.core.targets import Target
from mrc_agent.exporters.exposition.snapshot import MetricSpec

#: Labels of per-target series.
PROC = ("pid", "process")
#: Labels of per-GPU series: index, UUID and model name (e.g. "NVIDIA H200").
GPU = ("gpu", "uuid", "gpu_model")


@dataclass(frozen=True)
class TargetState:
    """What the process collector learned about one target this pass."""

    pid: int
    process: str
    user_ratio: float | None = None
    hottest_thread_user_ratio: float | None = None
    #: Its GPU variables and namespace PID, for GPU attribution (read once per process).
    view: TargetView | None = None


T = TypeVar("T")


@dataclass(frozen=True)
class PassView:
    """What a collector sees of its pass: the pass's clocks and targets, and the typed outputs
    the collectors before it published (:class:`Update`). It is immutable: the runner hands
    each collector a new view with the outputs so far, so no collector changes what another
    reads, and what one reads was published by exactly one earlier collector.

    The outputs, by the phase that publishes them:

    1. targets: :class:`Processes` (the process collector);
    2. attribution and devices: :class:`~mrc_agent.agent.core.attribution.Attribution` (the
       first collector with GPUs decides), the gpu collector's ``GpuReadings``, the gpm
       collector's ``GpmReadings`` and the profiling collector's ``ProfilingStatus``;
    3. derived: the derived collector's ``Starvation``.
    """

    now: float  # monotonic seconds
    wall: float  # Unix seconds
    targets: tuple[Target, ...]
    outputs: Mapping[type, object] = field(default_factory=lambda: MappingProxyType({}))

    def get(self, kind: type[T]) -> T | None:
        """The output of type ``kind`` published this pass, or None (its collector is off,
        comes later, or failed without leaving one)."""
        out = self.outputs.get(kind)
        return out if isinstance(out, kind) else None

    def with_outputs(self, outputs: Sequence[object]) -> PassView:
        """This view with ``outputs`` added (each replacing this pass's one of its type)."""
        if not outputs:
            return self
        merged = dict(self.outputs)
        merged.update((type(o), o) for o in outputs)
        return replace(self, outputs=MappingProxyType(merged))

    def target_views(self) -> list[TargetView]:
        """Each target's view, as the process collector read it (an empty one where it did
        not: the collector is off, or the target went this pass)."""
        processes = self.get(Processes)
        by_pid = processes.by_pid if processes is not None else {}
        out = []
        for t in self.targets:
            state = by_pid.get(t.pid)
            view = state.view if state is not None else None
            out.append(view or TargetView(t.pid, why="not read (process collector off or "
                                                     "target gone)"))
        return out

    def decide_gpus(self, setting: str, gpus: Sequence[GPUIdentity]) -> Attribution:
        """This pass's decision: the one published before (the gpu collector's), or — where
        none was (the gpu collector is off, or failed before it ever decided) — one made from
        the targets' environments and ``gpus`` alone: without NVML's process lists, but never
        every GPU of the node while a target says which are its own. A collector that makes
        one publishes it, so the collectors after it report the same GPUs."""
        decided = self.get(Attribution)
        if decided is None:
            decided = attribution_rule.decide(
                setting, self.target_views(), [DeviceSample(gpu=g) for g in gpus])
        return decided


@dataclass(frozen=True)
class Processes:
    """The targets phase's output: what the process collector read of each target this pass,
    by PID (a target it could not read is absent)."""

    by_pid: Mapping[int, TargetState]


@dataclass(frozen=True)
class Update:
    """One collector's pass: its samples, the typed outputs it publishes to the collectors
    after it, and — for a collector that failed yet leaves something standing (the gpu
    collector's last GPU decision) — the failure, which the runner reports as if raised."""

    samples: list[Sample]
    outputs: tuple[object, ...] = ()
    error: Exception | None = None


class Collector(Protocol):
    name: str

    def update(self, view: PassView) -> Update:
        """Sample the source and return this pass's samples and outputs."""
        ...


@dataclass(frozen=True)
class DerivedThresholds:
    """Thresholds of the derived signals (:mod:`mrc_agent.agent.core.collectors.derived`).

    Why these defaults: ``idle_util`` 0.05 tolerates NVML's sampling jitter on an idle GPU;
    ``starved_cpu`` 0.9 of a core is a thread that can no longer keep up (the GIL caps a
    Python preprocessing thread at 1.0); ``starved_gpu`` 0.2 means the GPU is mostly waiting.
    """

    idle_util: float = 0.05
    starved_cpu: float = 0.9
    starved_gpu: float = 0.2


@dataclass(frozen=True)
class StackSettings:
    """The stacks collector's settings (:mod:`mrc_agent.agent.core.collectors.stacks`): the
    austin executable (None: found beside Python or on PATH), the seconds between two samples
    of a target, and how many functions per target get a label of their own."""

    austin: str | None = None
    interval: float = 0.1
    top_k: int = 5


@dataclass(frozen=True)
class BuildContext:
    """What a collector factory may use: the GPU sources, the derived-signal thresholds,
    which GPUs to report (the ``gpus`` setting) and the stacks collector's settings."""

    sources: Sources = field(default_factory=Sources)
    thresholds: DerivedThresholds = field(default_factory=DerivedThresholds)
    gpus: str = MODE_TARGETS
    stacks: StackSettings = field(default_factory=StackSettings)


#: Runs once per pass after every collector, with the last view; returns more samples.
PassFinisher = Callable[[PassView], list[Sample]]


@dataclass(frozen=True)
class FinisherDef:
    """One pass finisher's registration: its name, the function and the metrics it emits
    (declared beside it, as a collector's are, so the catalogue is assembled from them)."""

    name: str
    finish: PassFinisher
    metrics: tuple[MetricSpec, ...]


@dataclass(frozen=True)
class CollectorDef:
    """One collector's registration."""

    name: str
    description: str
    default_on: bool
    factory: Callable[[BuildContext], Collector]
    metrics: tuple[MetricSpec, ...]
    #: The output types it reads from the pass view; their publishers must come earlier.
    reads: tuple[type, ...] = ()
    #: The output types it publishes (:attr:`Update.outputs`).
    provides: tuple[type, ...] = ()


def check_order(defs: Sequence[CollectorDef]) -> tuple[CollectorDef, ...]:
    """``defs`` unchanged, after checking names are unique and every type a collector reads
    is published by one registered before it."""
    seen: set[str] = set()
    published: set[type] = set()
    for d in defs:
        if d.name in seen:
            raise ValueError(f"collector {d.name!r} registered twice")
        missing = [t.__name__ for t in d.reads if t not in published]
        if missing:
            raise ValueError(f"collector {d.name!r} reads {missing}, which no collector "
                             f"before it publishes")
        seen.add(d.name)
        published.update(d.provides)
    return tuple(defs)


S = TypeVar("S")


def require(source: S | None) -> S:
    """The source, or "not available here" when the GPU backend is 'none'."""
    if source is None:
        raise SourceUnavailable("gpu_backend_none", "the GPU backend is 'none'")
    return source


def field_samples(obj: object, table: Mapping[str, MetricSpec],
                  labels: tuple[str, ...]) -> list[Sample]:
    """One sample per ``attribute -> spec`` entry of ``table`` whose value is not None: a field
    the source left ``None`` is an absent series, never a zero."""
    out: list[Sample] = []
    for attr, spec in table.items():
        value = getattr(obj, attr)
        if value is not None:
            out.append((spec.name, labels, float(value)))
    return out
