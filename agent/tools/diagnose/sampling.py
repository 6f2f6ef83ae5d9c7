"""The in-process sampling loop's extra collectors: :class:`IdleWindows` (the GPU idle windows
from the finest utilisation points), :class:`_Watched` (keeps each collector's reason for having no
data), :class:`Borrowed` (samples from the running agent's sampler), and :func:`runnable` (the
hottest thread's share of the window running or ready to run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mrc_agent.agent.core.collectors.base import Collector, PassView, Update
from mrc_agent.agent.core.collectors.derived import IdleTracker
from mrc_agent.agent.core.collectors.gpu import NO_READINGS, GpuReadings
from mrc_agent.agent.core.hw.base import GPUIdentity, SourceUnavailable
from mrc_agent.agent.core.sample import Snapshot


class _WindowTracker(IdleTracker):
    """The derived collector's idle tracker, also keeping each completed window and the points."""

    def __init__(self, threshold: float) -> None:
        super().__init__(threshold)
        self.windows: list[tuple[float, float]] = []
        self.points: list[tuple[float, float]] = []

    def feed(self, points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
        last = self.last_t
        for point in points:  # the ones the tracker takes: each later than the last taken
            if last is None or point[0] > last:
                self.points.append(point)
                last = point[0]
        closed = super().feed(points)
        self.windows += closed
        return closed


class IdleWindows:
    """A collector that only watches: GPU idle windows from the finest utilisation points of
    the pass (the gpu collector's :class:`GpuReadings`), from ``start`` on."""

    name = "idle_windows"

    def __init__(self, threshold: float, start: float) -> None:
        self.threshold = threshold
        self.start = start
        self.trackers: dict[GPUIdentity, _WindowTracker] = {}

    def update(self, view: PassView) -> Update:
        for gpu, points in (view.get(GpuReadings) or NO_READINGS).util_points.items():
            tracker = self.trackers.setdefault(gpu, _WindowTracker(self.threshold))
            tracker.feed([p for p in points if p[0] >= self.start])
        return Update([])


class _Watched:
    """Keeps the reason a collector gave for having no data, for the report."""

    def __init__(self, inner: Collector) -> None:
        self.inner = inner
        self.name = inner.name
        self.reason = ""

    def update(self, view: PassView) -> Update:
        try:
            out = self.inner.update(view)
        except Exception as exc:
            self.reason = _reason(exc)
            raise
        self.reason = _reason(out.error) if out.error is not None else ""
        return out


def _reason(exc: Exception) -> str:
    if isinstance(exc, SourceUnavailable):
        return exc.detail or exc.reason
    return f"{type(exc).__name__}: {exc}"


class Borrowed:
    """Samples taken from another sampler's latest snapshot (the running agent's profiling
    counters: one CUPTI session per process, so a capture reads the agent's)."""

    def __init__(self, name: str, source: Callable[[], Snapshot], metrics: set[str]) -> None:
        self.name = name
        self._source = source
        self._metrics = metrics

    def update(self, view: PassView) -> Update:
        out = [s for s in self._source().samples if s[0] in self._metrics]
        if not out:
            raise SourceUnavailable("not_sampled", "the agent's sampler has no such samples")
        return Update(out)


#: Above this share of stolen CPU the correction below would mostly be guesswork.
MAX_STEAL_CORRECTION = 0.5


def steal_ratio(before: list[int], after: list[int]) -> float:
    """The share of the node's CPU time the hypervisor took (``steal``) between two
    :meth:`~mrc_agent.agent.core.hw.procfs.ProcFS.cpu_ticks` readings; 0 when either is missing."""
    if len(before) < 8 or len(after) < 8:
        return 0.0
    deltas = [max(b - a, 0) for a, b in zip(before, after, strict=True)]
    total = sum(deltas)
    return deltas[7] / total if total else 0.0


def runnable(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]],
             seconds: float, steal: float = 0.0) -> dict[str, float] | None:
    """The hottest thread's share of the window spent running or ready to run.

    User CPU alone undercounts a thread on a node short of CPU: it wants a whole core but is
    granted less. Time on the run queue is demand too, so a thread runnable ~100 % of the
    window is CPU-bound whatever the node gave it. A thread born in the window counts from
    zero.

    On a virtual machine the hypervisor also takes CPU (``steal``): while its vCPU is taken,
    a running thread is neither on a CPU nor queued by the kernel's clocks, so its on-CPU time
    is scaled by ``1 / (1 - steal)``, the node's stolen share over the window (at most
    :data:`MAX_STEAL_CORRECTION`), as if it had run where it was running; ``steal_ratio`` says
    how much was corrected."""
    if not after or seconds <= 0:
        return None
    best = (0.0, 0.0)
    for tid, (cpu, wait) in after.items():
        cpu0, wait0 = before.get(tid, (0, 0))
        d_cpu, d_wait = max(cpu - cpu0, 0) / 1e9, max(wait - wait0, 0) / 1e9
        if d_cpu + d_wait > sum(best):
            best = (d_cpu, d_wait)
    steal = min(max(steal, 0.0), MAX_STEAL_CORRECTION)
    on_cpu = best[0] / (1.0 - steal)
    return {"runnable_ratio": min((on_cpu + best[1]) / seconds, 1.0),
            "on_cpu_ratio": min(on_cpu / seconds, 1.0),
            "waiting_ratio": min(best[1] / seconds, 1.0),
            "steal_ratio": steal}

