"""What a collector is, and how one is registered.

A collector is a name and ``update(ctx)`` returning fresh samples. It raises on failure, or
:class:`mrc_agent.agent.core.hw.base.SourceUnavailable` when its source does not apply here; the
runner owns health and timing. Collectors run in a fixed order each pass and leave what later
collectors need (target CPU, GPU utilisation) in the shared :class:`SampleContext`.

Each collector module ends with one :class:`CollectorDef`: its name, whether it is on by default,
its factory, the metrics it emits and the collectors it reads from (``after``), side by side with
the code that emits them (node_exporter's ``registerCollector`` beside its descriptors).
:mod:`mrc_agent.agent.core.collectors` lists them and checks the order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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


@dataclass
class TargetState:
    """What the process collector learned about one target this pass."""

    pid: int
    process: str
    user_ratio: float | None = None
    hottest_thread_user_ratio: float | None = None
    #: Its GPU variables and namespace PID, for GPU attribution (read once per process).
    view: TargetView | None = None


@dataclass
class SampleContext:
    """Shared state of one sampling pass."""

    now: float  # monotonic seconds
    wall: float  # Unix seconds
    targets: list[Target]
    #: Filled by the process collector, keyed by PID.
    processes: dict[int, TargetState] = field(default_factory=dict)
    #: Filled by the gpu collector: latest utilisation and fine-grained points per GPU.
    gpu_util: dict[GPUIdentity, float] = field(default_factory=dict)
    gpu_util_points: dict[GPUIdentity, list[tuple[float, float]]] = field(default_factory=dict)
    #: GPUs on which each target PID holds memory.
    gpus_of_pid: dict[int, set[GPUIdentity]] = field(default_factory=dict)
    #: Filled by the runner: whether each collector run so far this pass succeeded.
    succeeded: dict[str, bool] = field(default_factory=dict)
    #: Filled by the profiling collector: (reason, detail) of its source, "ok" when it works.
    profiling_status: tuple[str, str] = ("not_requested", "")
    #: Filled by the derived collector: whether each target PID was starved this pass
    #: (absent while none of its GPUs gave a reading).
    starved: dict[int, bool] = field(default_factory=dict)
    #: The GPUs reported this pass (agent.core.attribution): the gpu collector's decision
    #: (its last one when it failed this pass), or :meth:`decide_gpus`'s.
    attribution: Attribution | None = None

    def target_views(self) -> list[TargetView]:
        """Each target's view, as the process collector read it (an empty one where it did
        not: the collector is off, or the target went this pass)."""
        out = []
        for t in self.targets:
            state = self.processes.get(t.pid)
            view = state.view if state is not None else None
            out.append(view or TargetView(t.pid, why="not read (process collector off or "
                                                     "target gone)"))
        return out

    def decide_gpus(self, setting: str, gpus: Sequence[GPUIdentity]) -> Attribution:
        """This pass's decision. Where the gpu collector made none (it is off, or failed
        before it ever decided) the first collector with GPUs makes it from the targets'
        environments and ``gpus`` alone: without NVML's process lists, but never every GPU
        of the node while a target says which are its own."""
        if self.attribution is None:
            self.attribution = attribution_rule.decide(
                setting, self.target_views(), [DeviceSample(gpu=g) for g in gpus])
        return self.attribution


class Collector(Protocol):
    name: str

    def update(self, ctx: SampleContext) -> list[Sample]:
        """Sample the source and return the samples of this pass."""
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


#: Runs once per pass after every collector, with the filled context; returns more samples.
PassFinisher = Callable[[SampleContext], list[Sample]]


@dataclass(frozen=True)
class CollectorDef:
    """One collector's registration."""

    name: str
    description: str
    default_on: bool
    factory: Callable[[BuildContext], Collector]
    metrics: tuple[MetricSpec, ...]
    #: Collectors whose context entries this one reads; they must come earlier in the order.
    after: tuple[str, ...] = ()


def check_order(defs: Sequence[CollectorDef]) -> tuple[CollectorDef, ...]:
    """``defs`` unchanged, after checking names are unique and every ``after`` comes first."""
    seen: set[str] = set()
    for d in defs:
        if d.name in seen:
            raise ValueError(f"collector {d.name!r} registered twice")
        missing = [a for a in d.after if a not in seen]
        if missing:
            raise ValueError(f"collector {d.name!r} reads {missing} and must come after them")
        seen.add(d.name)
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
