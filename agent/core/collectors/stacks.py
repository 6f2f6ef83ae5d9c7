"""Stacks collector: what each target's Python ran, by function, joined with its GPU's state.

Each target is sampled from outside by an austin child (:mod:`mrc_agent.agent.core.stacks`),
whose samples carry their own times. Each pass, the samples up to the latest GPU utilisation
point of the target's GPUs are joined with the GPU timeline at that point's granularity (the
hardware activity timeline's 20 ms where profiling has one, else NVML's sample period, about
1/6 s; the replayed trace's spacing): a sample of the target's hottest
thread (the one that ran most, decayed over about ten seconds) adds its seconds to
``mrc_process_function_seconds_total`` under its innermost function and the GPU's state then:

* ``busy``: a GPU of the target above the idle threshold;
* ``idle``: every GPU of the target at or below it;
* ``starved``: idle, while the target was starved (``mrc_gpu_starved``: its CPU hot);
* ``unknown``: no GPU reading covered the sample (a sample older than the GPU timeline kept).

Only running time is sampled (austin ``--sleepless``): the time the hottest thread waited is in
no series. Function labels are the first ``top_k`` functions seen per target, plus ``other``: a
series once exported stays, so the counters never move between labels.

The collector is on by default. Without austin, without ptrace rights on a target, or for a
target that is not Python, the target's ``mrc_process_stacks_available`` is 0 with the reason,
said once in the log (once for the agent where austin is missing, once per target otherwise),
and the rest of the agent runs on.

The samples' whole stacks stay with the sampler for a while: :meth:`StacksCollector.history`
hands them to the on-alert captures (:mod:`mrc_agent.agent.tools.capture`), which then start
no sampler of their own.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from mrc_agent.agent.core.collectors.base import (
    PROC,
    BuildContext,
    CollectorDef,
    PassView,
    Processes,
    Update,
)
from mrc_agent.agent.core.collectors.derived import Starvation
from mrc_agent.agent.core.collectors.gpu import NO_READINGS, GpuReadings
from mrc_agent.agent.core.collectors.profiling import HardwareActivity, timelines
from mrc_agent.agent.core.hw.base import GPUIdentity
from mrc_agent.agent.core.sample import Sample, counter, gauge
from mrc_agent.agent.core.stacks import (
    StackSample,
    StackSampler,
    StacksUnavailable,
    find_austin,
)

log = logging.getLogger(__name__)

NAME = "stacks"
OTHER_FUNCTION = "other"
#: Seconds of GPU timeline kept for the join; older samples are ``unknown``.
KEEP_S = 120.0
#: Half-life, seconds, of the non-idle time that decides a target's hottest thread.
HOT_HALF_LIFE_S = 10.0
#: Seconds before a sampler that failed (not for want of rights or of Python) is tried again.
RETRY_S = 30.0

FUNCTION_SECONDS = counter(
    NAME, "mrc_process_function_seconds_total", (*PROC, "function", "gpu_state"),
    "Wall-clock seconds the target's hottest thread ran in each innermost Python function "
    "(module:qualname; other past the top K), by the state of the target's GPUs at the time "
    "(busy, idle, starved, unknown), from continuous stack samples.")
AVAILABLE = gauge(
    NAME, "mrc_process_stacks_available", (*PROC, "reason"),
    "1 while the target's stacks are sampled (reason ok), else 0 with why: missing (no "
    "austin), permission (no ptrace rights), not_python, gone or failed.")
METRICS = (FUNCTION_SECONDS, AVAILABLE)


class Sampler(Protocol):
    error: StacksUnavailable | None

    def start(self) -> None: ...

    def running(self) -> bool: ...

    def take(self) -> list[StackSample]: ...

    def history(self, since: float) -> list[StackSample]: ...

    def stop(self) -> None: ...


SamplerFactory = Callable[[int], Sampler]


@dataclass
class _Target:
    process: str
    sampler: Sampler | None = None
    pending: list[StackSample] = field(default_factory=list)
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    slots: set[str] = field(default_factory=set)
    heat: dict[str, float] = field(default_factory=dict)
    heat_t: float | None = None
    starved: list[tuple[float, bool]] = field(default_factory=list)
    reason: str = "ok"
    retry_at: float = 0.0


class StacksCollector:
    name = NAME

    def __init__(self, factory: SamplerFactory | None, idle_util: float, top_k: int = 5,
                 unavailable: StacksUnavailable | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._factory = factory
        self._unavailable = unavailable
        self.idle_util = idle_util
        self.top_k = top_k
        self._clock = clock
        self._targets: dict[int, _Target] = {}
        self._points: dict[GPUIdentity, list[tuple[float, float]]] = {}
        self._said: set[tuple[int, str]] = set()

    # -- the GPU timeline --------------------------------------------------------------------
    def _feed_points(self, now: float, readings: GpuReadings,
                     hardware: HardwareActivity | None) -> None:
        for gpu, points in timelines(readings, hardware).items():
            kept = self._points.setdefault(gpu, [])
            last = kept[-1][0] if kept else float("-inf")
            kept.extend(p for p in points if p[0] > last)
            cut = bisect.bisect_left(kept, (now - KEEP_S, float("-inf")))
            if cut:
                del kept[:cut]

    def _state(self, gpus: list[GPUIdentity], t: float, starved: list[tuple[float, bool]]
               ) -> str:
        utils = []
        for gpu in gpus:
            points = self._points.get(gpu) or []
            i = bisect.bisect_left(points, (t, float("-inf")))
            if i == len(points) or (i == 0 and points[0][0] - t > 1.0):
                continue  # no reading covers t
            utils.append(points[i][1])
        if not utils:
            return "unknown"
        if max(utils) > self.idle_util:
            return "busy"
        j = bisect.bisect_left(starved, (t, False))
        if j < len(starved) and starved[j][1]:
            return "starved"
        return "idle"

    # -- one pass ----------------------------------------------------------------------------
    def update(self, view: PassView) -> Update:
        readings = view.get(GpuReadings) or NO_READINGS
        self._feed_points(view.now, readings, view.get(HardwareActivity))
        starvation = view.get(Starvation)
        processes = view.get(Processes)
        # The targets the process collector read this pass, by the name it read.
        live = {pid: state.process
                for pid, state in (processes.by_pid if processes else {}).items()}
        for pid in [p for p in self._targets if p not in live]:
            gone = self._targets.pop(pid)
            if gone.sampler is not None:
                gone.sampler.stop()
            self._said = {k for k in self._said if k[0] != pid}
        out: list[Sample] = []
        for pid, process in live.items():
            st = self._targets.get(pid)
            if st is None:
                st = self._targets[pid] = _Target(process)
            self._run_sampler(pid, st)
            starved = starvation.by_pid.get(pid) if starvation is not None else None
            if starved is not None:
                st.starved.append((view.now, starved))
                cut = bisect.bisect_left(st.starved, (view.now - KEEP_S, False))
                del st.starved[:cut]
            if st.sampler is not None:
                st.pending.extend(st.sampler.take())
            gpus = sorted(readings.gpus_of_pid.get(pid) or self._points, key=lambda g: g.labels)
            self._join(st, gpus)
            labels = (str(pid), st.process)
            out.append((AVAILABLE.name, (*labels, st.reason), 1.0 if st.reason == "ok" else 0.0))
            for (function, state), seconds in st.seconds.items():
                out.append((FUNCTION_SECONDS.name, (*labels, function, state), seconds))
        return Update(out)

    def _run_sampler(self, pid: int, st: _Target) -> None:
        if self._factory is None:
            err = self._unavailable or StacksUnavailable("missing", "austin is not installed")
            self._say(pid, err)
            st.reason = err.reason
            return
        if st.sampler is not None and not st.sampler.running():
            st.pending.extend(st.sampler.take())
            err = st.sampler.error or StacksUnavailable("failed", "austin stopped")
            st.sampler.stop()
            st.sampler = None
            st.reason = err.reason
            self._say(pid, err)
            retry = RETRY_S if err.reason in ("failed", "gone") else float("inf")
            st.retry_at = self._clock() + retry
        if st.sampler is None and self._clock() >= st.retry_at:
            sampler = self._factory(pid)
            try:
                sampler.start()
            except OSError as e:
                err = StacksUnavailable("failed", f"austin did not start: {e}")
                st.reason = err.reason
                st.retry_at = self._clock() + RETRY_S
                self._say(pid, err)
                return
            st.sampler = sampler
            st.reason = "ok"

    def _say(self, pid: int, err: StacksUnavailable) -> None:
        if self._factory is None:
            # No austin: the agent's condition, not the target's; said once, for the first.
            pid = 0
        if (pid, err.reason) not in self._said:
            self._said.add((pid, err.reason))
            if pid:
                log.warning("no stacks for pid %d: %s", pid, err)
            else:
                log.warning("no stacks for any target: %s; the other collectors run on", err)

    def _join(self, st: _Target, gpus: list[GPUIdentity]) -> None:
        horizon = min((self._points[g][-1][0] for g in gpus if self._points.get(g)),
                      default=None)
        if horizon is None:
            # No GPU timeline at all: the samples older than it could ever cover are unknown.
            horizon = self._clock() - KEEP_S
        ready = [s for s in st.pending if s.t <= horizon]
        if not ready:
            return
        st.pending = [s for s in st.pending if s.t > horizon]
        now = ready[-1].t
        if st.heat_t is not None:
            decay = 0.5 ** (max(now - st.heat_t, 0.0) / HOT_HALF_LIFE_S)
            st.heat = {k: v * decay for k, v in st.heat.items() if v * decay > 1e-3}
        st.heat_t = now
        for s in ready:
            st.heat[s.thread] = st.heat.get(s.thread, 0.0) + s.seconds
        hottest = max(st.heat, key=lambda k: (st.heat[k], k))
        for s in ready:
            if s.thread != hottest:
                continue
            function = self._slot(st, s.function)
            key = (function, self._state(gpus, s.t, st.starved))
            st.seconds[key] = st.seconds.get(key, 0.0) + s.seconds

    def _slot(self, st: _Target, function: str) -> str:
        if function in st.slots:
            return function
        if len(st.slots) < self.top_k:
            st.slots.add(function)
            return function
        return OTHER_FUNCTION

    def history(self, pid: int, since: float) -> list[StackSample] | None:
        """``pid``'s kept samples taken at ``since`` (monotonic) or later, whole stacks and
        all, while its stacks are sampled; None when they are not (no austin, no rights, not
        Python, not a target). What the on-alert captures read, from their own thread."""
        st = self._targets.get(pid)
        sampler = st.sampler if st is not None else None
        if sampler is None or not sampler.running():
            return None
        return sampler.history(since)

    def close(self) -> None:
        for st in self._targets.values():
            if st.sampler is not None:
                st.sampler.stop()
        self._targets.clear()


def _build(ctx: BuildContext) -> StacksCollector:
    try:
        exe = find_austin(ctx.stacks.austin)
    except StacksUnavailable as e:
        return StacksCollector(None, ctx.thresholds.idle_util, ctx.stacks.top_k, unavailable=e)
    interval = ctx.stacks.interval

    def factory(pid: int) -> Sampler:
        return StackSampler(exe, pid, interval)

    return StacksCollector(factory, ctx.thresholds.idle_util, ctx.stacks.top_k)


DEFINITION = CollectorDef(
    name=NAME, default_on=True, factory=_build, metrics=METRICS,
    reads=(Processes, GpuReadings, HardwareActivity, Starvation),
    description="What each target's Python ran, by function and GPU state (austin samples).")
