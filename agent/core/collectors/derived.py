"""Derived signals computed in the agent: GPU idle windows, GPU busy time and GPU starvation.

Idle windows come from the finest utilisation points the source gives: the hardware activity
timeline of CUPTI PM sampling where the profiling collector has one for the GPU (a point every
20 ms), else NVML's sample buffer or the replayed trace. So a gap shorter than the agent's
interval still counts. A window is
measured from its first idle point to the first busy point after it (where the buffer runs dry
while the gauge reads idle, from where the next point was due); windows shorter than the
source's own sampling period cannot be seen. Busy time is integrated from the same points
(``mrc_gpu_busy_seconds_total``), so ``rate()`` gives the duty cycle over any window: a gauge
of utilisation scraped every 15-60 s only shows the moments the scrapes happen to land on.

A target is *starved* while its user CPU (whole process or hottest thread) is at or above the
CPU threshold and every GPU it holds memory on (all GPUs when none is attributed) is at or below
the GPU threshold: the CPU-side pipeline is the bottleneck and the GPU waits. A GPU's reading
is NVML's utilisation gauge, or, with a hardware timeline, the mean of its points over the last
:data:`RECENT_S` (the span NVML's gauge covers).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from mrc_agent.agent.core.collectors.base import (
    GPU,
    PROC,
    BuildContext,
    CollectorDef,
    DerivedThresholds,
    PassView,
    Processes,
    Update,
)
from mrc_agent.agent.core.collectors.gpu import NO_READINGS, GpuReadings
from mrc_agent.agent.core.collectors.profiling import HardwareActivity, timelines
from mrc_agent.agent.core.hw.base import GPUIdentity
from mrc_agent.agent.core.sample import HistogramValue, Sample, counter, gauge, histogram

NAME = "derived"

#: Idle-window histogram buckets, seconds. A data-loader or preprocessing stall shows as
#: multi-second gaps; the lowest bucket is about the smallest gap NVML's utilisation sampling
#: (1/6 s on datacenter parts) can resolve, the highest covers a stuck request.
IDLE_WINDOW_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

IDLE_WINDOW = histogram(
    NAME, "mrc_gpu_idle_window_seconds", GPU,
    "Durations of completed GPU idle windows (utilisation at or below the idle threshold), "
    "from sub-second utilisation samples.", IDLE_WINDOW_BUCKETS)
IDLE_CURRENT = gauge(NAME, "mrc_gpu_idle_current_seconds", GPU,
                     "How long the GPU has been idle so far (0 while busy).")
BUSY_SECONDS = counter(
    NAME, "mrc_gpu_busy_seconds_total", GPU,
    "Seconds the GPU was busy (a kernel running), integrated from its utilisation samples at "
    "their own granularity: each sample's utilisation times the time since the one before. "
    "rate() over any window is the duty cycle, whatever the scrape interval.")
STARVED = gauge(
    NAME, "mrc_gpu_starved", PROC,
    "1 while the target's user CPU (process or hottest thread) is at or above the CPU "
    "threshold and the GPUs it uses are at or below the GPU threshold, else 0; absent while "
    "none of those GPUs gives a utilisation reading.")
STARVED_SECONDS = counter(NAME, "mrc_gpu_starved_seconds_total", PROC,
                          "Seconds the target spent in the starved state.")
METRICS = (IDLE_WINDOW, IDLE_CURRENT, BUSY_SECONDS, STARVED, STARVED_SECONDS)


#: The span of a hardware timeline a GPU's starvation reading is the mean of: NVML's sample
#: period on datacenter parts, the span its utilisation gauge covers.
RECENT_S = 1 / 6

#: How many of a GPU's most recent gaps between utilisation points its sample spacing is the
#: median of: one long gap (an agent pause, an idle stretch with an empty buffer) never moves a
#: median of nine, and a source that changes its period is followed within five gaps.
SPACING_GAPS = 9
#: A point's span counts whole up to this many sample spacings: a sample posted late or one
#: step missed still counts, a pause or an idle stretch behind one busy sample does not.
SPAN_CAP_SPACINGS = 2.0


class IdleTracker:
    """Turns a stream of (time, utilisation) points into completed idle-window durations and
    busy seconds.

    A point's utilisation is the share of the time since the point before it during which a
    kernel ran (NVML's sample period, about 1/6 s on datacenter parts; the replayed trace's
    own spacing), so busy time is the sum of utilisation times that span. The first point
    only starts the count. Where a source gives one point per pass (no sample buffer), that
    point stands for the whole pass: an estimate as coarse as the pass.

    A span counts whole up to :data:`SPAN_CAP_SPACINGS` times the GPU's sample spacing (the
    median of its last :data:`SPACING_GAPS` gaps; the first gap, with nothing to compare it
    with, is taken whole); a longer one counts as one spacing, the sample's own period, and the
    rest is not counted busy, so ``rate()`` reads it as idle. Idle rather than unknown because
    NVML keeps posting samples while the agent is paused (the next pass reads them all): a gap
    in its buffer is NVML posting nothing, which it does while the GPU idles. Only a pause
    longer than the buffer holds also loses busy time, and a counter cannot say "unknown".

    :meth:`quiet_pass` takes a pass that brought no new point: an idle gauge then starts an
    idle window (NVML's buffer runs dry while the GPU idles) without moving the last point, so
    samples posted later with earlier stamps still count.
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.idle_since: float | None = None
        self.last_t: float | None = None
        self.histogram = HistogramValue(IDLE_WINDOW_BUCKETS)
        self.busy_seconds = 0.0
        self._gaps: deque[float] = deque(maxlen=SPACING_GAPS)
        #: The idle window running now was started by an idle gauge, not by an idle point.
        self._idle_from_gauge = False

    def spacing(self) -> float | None:
        """The GPU's sample spacing: the median of its recent gaps (None before the first)."""
        return statistics.median_low(self._gaps) if self._gaps else None

    def feed(self, points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
        """Take ``points``, oldest first (ones at or before the last point taken are skipped);
        returns the idle windows they completed, ``(first idle point, first busy point after
        it)``, each also observed in :attr:`histogram`."""
        closed: list[tuple[float, float]] = []
        for t, util in points:
            if self.last_t is not None and t <= self.last_t:
                continue  # already seen
            if self.last_t is not None:
                gap = t - self.last_t
                spacing = self.spacing()
                # Beyond the cap the sample stands for its own period only.
                span = gap if spacing is None or gap <= SPAN_CAP_SPACINGS * spacing else spacing
                self.busy_seconds += min(max(util, 0.0), 1.0) * span
                self._gaps.append(gap)
                if self._idle_from_gauge and util > self.threshold and gap <= span:
                    # The next sample came in time and busy: the buffer had not run dry, the
                    # gauge caught an idle moment inside a busy period. No window.
                    self.idle_since = None
            self._idle_from_gauge = False
            self.last_t = t
            if util <= self.threshold:
                if self.idle_since is None:
                    self.idle_since = t
            elif self.idle_since is not None:
                self.histogram.observe(t - self.idle_since)
                closed.append((self.idle_since, t))
                self.idle_since = None
        return closed

    def quiet_pass(self, now: float, gauge: float) -> None:
        """A pass at ``now`` that brought no new point while the gauge read ``gauge``: idle
        reads as idle from where the next sample was due. Busy seconds are not touched (the
        time counts as idle unless samples for it arrive later)."""
        if self.last_t is None or self.idle_since is not None or gauge > self.threshold:
            return
        spacing = self.spacing() or 0.0
        self.idle_since = min(self.last_t + spacing, now)
        self._idle_from_gauge = True

    def current(self, now: float) -> float:
        return 0.0 if self.idle_since is None else max(now - self.idle_since, 0.0)


@dataclass(frozen=True)
class Starvation:
    """The derived phase's output: whether each target PID was starved this pass (absent
    while none of its GPUs gave a reading)."""

    by_pid: Mapping[int, bool]


class DerivedCollector:
    name = NAME

    def __init__(self, thresholds: DerivedThresholds | None = None) -> None:
        self.thresholds = thresholds or DerivedThresholds()
        self._idle: dict[GPUIdentity, IdleTracker] = {}
        self._starved_seconds: dict[tuple[int, str], float] = {}
        self._last_now: float | None = None

    def update(self, view: PassView) -> Update:
        out: list[Sample] = []
        gpus_read = view.get(GpuReadings) or NO_READINGS
        processes = view.get(Processes)
        starved_now: dict[int, bool] = {}
        hardware = view.get(HardwareActivity)
        util = dict(gpus_read.util)
        for gpu, hw_points in (hardware.points.items() if hardware is not None else ()):
            if hw_points:
                recent = [u for t, u in hw_points if t >= hw_points[-1][0] - RECENT_S]
                util[gpu] = sum(recent) / len(recent)
        for gpu, points in timelines(gpus_read, hardware).items():
            tracker = self._idle.get(gpu)
            if tracker is None:
                tracker = self._idle[gpu] = IdleTracker(self.thresholds.idle_util)
            before = tracker.last_t
            tracker.feed(points)
            gauge = util.get(gpu)
            if tracker.last_t == before and gauge is not None:
                tracker.quiet_pass(view.now, gauge)
            out.append((IDLE_WINDOW.name, gpu.labels, tracker.histogram.copy()))
            out.append((IDLE_CURRENT.name, gpu.labels, tracker.current(view.now)))
            out.append((BUSY_SECONDS.name, gpu.labels, tracker.busy_seconds))
        dt = 0.0 if self._last_now is None else view.now - self._last_now
        self._last_now = view.now
        live = set()
        if util and processes is not None:
            for pid, st in processes.by_pid.items():
                cpu = max(st.user_ratio or 0.0, st.hottest_thread_user_ratio or 0.0)
                if st.user_ratio is None:
                    continue  # no CPU window yet
                gpus = gpus_read.gpus_of_pid.get(pid) or set(util)
                key = (pid, st.process)
                live.add(key)
                labels = (str(pid), st.process)
                # Judged on the target's GPUs that gave a reading this pass: one that gave none
                # (NVML cannot read it, e.g. a MIG parent) is not taken for idle. With no
                # reading at all there is no verdict: the gauge is absent this pass and the
                # counter keeps its total.
                readings = [util[g] for g in gpus if g in util]
                total = self._starved_seconds.get(key, 0.0)
                if readings:
                    starved = cpu >= self.thresholds.starved_cpu and (
                        max(readings) <= self.thresholds.starved_gpu)
                    total += dt if starved else 0.0
                    out.append((STARVED.name, labels, 1.0 if starved else 0.0))
                    starved_now[pid] = starved
                self._starved_seconds[key] = total
                out.append((STARVED_SECONDS.name, labels, total))
        for key in [k for k in self._starved_seconds if k not in live]:
            del self._starved_seconds[key]
        return Update(out, (Starvation(MappingProxyType(starved_now)),))


def _build(ctx: BuildContext) -> DerivedCollector:
    return DerivedCollector(ctx.thresholds)


DEFINITION = CollectorDef(
    name=NAME, default_on=True, factory=_build, metrics=METRICS,
    reads=(Processes, GpuReadings, HardwareActivity), provides=(Starvation,),
    description="GPU idle windows and the GPU-starvation signal, computed in the agent.")
