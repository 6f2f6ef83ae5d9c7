"""Derived signals computed in the agent: GPU idle windows and GPU starvation.

Idle windows come from the finest utilisation points the source gives (NVML's sample buffer or
the replayed trace), so a gap shorter than the agent's interval still counts. A window is
measured from its first idle point to the first busy point after it; windows shorter than the
source's own sampling period cannot be seen.

A target is *starved* while its user CPU (whole process or hottest thread) is at or above the
CPU threshold and every GPU it holds memory on (all GPUs when none is attributed) is at or below
the GPU threshold: the CPU-side pipeline is the bottleneck and the GPU waits.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.core.catalog import IDLE_WINDOW_BUCKETS
from agent.core.collectors.base import SampleContext
from agent.core.hw.base import GPUIdentity
from exporters.exposition.snapshot import HistogramValue, Sample


@dataclass(frozen=True)
class Thresholds:
    """Why these defaults: ``idle_util`` 0.05 tolerates NVML's sampling jitter on an idle GPU;
    ``starved_cpu`` 0.9 of a core is a thread that can no longer keep up (the GIL caps a
    Python preprocessing thread at 1.0); ``starved_gpu`` 0.2 means the GPU is mostly waiting."""

    idle_util: float = 0.05
    starved_cpu: float = 0.9
    starved_gpu: float = 0.2


class IdleTracker:
    """Turns a stream of (time, utilisation) points into completed idle-window durations."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.idle_since: float | None = None
        self.last_t: float | None = None
        self.histogram = HistogramValue(IDLE_WINDOW_BUCKETS)

    def feed(self, points: list[tuple[float, float]]) -> None:
        for t, util in points:
            if self.last_t is not None and t <= self.last_t:
                continue  # already seen
            self.last_t = t
            if util <= self.threshold:
                if self.idle_since is None:
                    self.idle_since = t
            elif self.idle_since is not None:
                self.histogram.observe(t - self.idle_since)
                self.idle_since = None

    def current(self, now: float) -> float:
        return 0.0 if self.idle_since is None else max(now - self.idle_since, 0.0)


class DerivedCollector:
    name = "derived"

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.thresholds = thresholds or Thresholds()
        self._idle: dict[GPUIdentity, IdleTracker] = {}
        self._starved_seconds: dict[tuple[int, str], float] = {}
        self._last_now: float | None = None

    def update(self, ctx: SampleContext) -> list[Sample]:
        out: list[Sample] = []
        for gpu, points in ctx.gpu_util_points.items():
            tracker = self._idle.get(gpu)
            if tracker is None:
                tracker = self._idle[gpu] = IdleTracker(self.thresholds.idle_util)
            tracker.feed(points)
            out.append(("mrc_gpu_idle_window_seconds", gpu.labels, tracker.histogram.copy()))
            out.append(("mrc_gpu_idle_current_seconds", gpu.labels, tracker.current(ctx.now)))
        dt = 0.0 if self._last_now is None else ctx.now - self._last_now
        self._last_now = ctx.now
        live = set()
        if ctx.gpu_util:
            for pid, st in ctx.processes.items():
                cpu = max(st.user_ratio or 0.0, st.hottest_thread_user_ratio or 0.0)
                if st.user_ratio is None:
                    continue  # no CPU window yet
                gpus = ctx.gpus_of_pid.get(pid) or set(ctx.gpu_util)
                gpu_busy = max(ctx.gpu_util.get(g, 0.0) for g in gpus)
                starved = cpu >= self.thresholds.starved_cpu and (
                    gpu_busy <= self.thresholds.starved_gpu)
                key = (pid, st.process)
                live.add(key)
                total = self._starved_seconds.get(key, 0.0) + (dt if starved else 0.0)
                self._starved_seconds[key] = total
                labels = (str(pid), st.process)
                out.append(("mrc_gpu_starved", labels, 1.0 if starved else 0.0))
                out.append(("mrc_gpu_starved_seconds_total", labels, total))
        for key in [k for k in self._starved_seconds if k not in live]:
            del self._starved_seconds[key]
        return out
