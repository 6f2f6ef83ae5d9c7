"""The sampling runner: calls every enabled collector on the agent's own clock, times it,
isolates its failures, runs the pass finishers, and publishes one immutable snapshot per pass. It
knows collectors only by the :class:`~mrc_agent.agent.core.collectors.base.Collector` Protocol.

Health belongs here, not in the collectors: ``mrc_agent_collector_success`` and
``mrc_agent_collector_duration_seconds`` are written for each collector on every pass, and an
exception in one collector costs only that collector's series. A reason for unavailability is
logged once when it first appears (and again only when it changes), never once per pass.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable, Sequence

from mrc_agent.agent import __version__
from mrc_agent.agent.core.collectors.base import (
    Collector,
    PassFinisher,
    PassView,
    Processes,
    Update,
)
from mrc_agent.agent.core.hw.base import SourceUnavailable
from mrc_agent.agent.core.sample import EMPTY, Sample, Snapshot, counter, gauge, info
from mrc_agent.agent.core.targets import TargetResolver

log = logging.getLogger(__name__)

#: A pass that has not completed this many intervals after the last one makes the agent
#: not ready (``/readyz`` 503) and, while a collector is stuck, reports that collector failed.
STALE_INTERVALS = 2.0

#: The runner's own metrics: health of each collector and of the sampling loop.
AGENT = "agent"
BUILD_INFO = info(AGENT, "mrc_agent_build_info", (),
                  "Version of the agent and of Python it runs on.")
COLLECTOR_SUCCESS = gauge(
    AGENT, "mrc_agent_collector_success", ("collector",),
    "Whether the collector's last update succeeded (1) or failed or had no data (0).")
COLLECTOR_AVAILABLE = gauge(
    AGENT, "mrc_agent_collector_available", ("collector",),
    "Whether the collector's source applies on this host (0: no GPU, no NVML, no GPM, "
    "no profiling permission, or disabled backend).")
COLLECTOR_DURATION = gauge(AGENT, "mrc_agent_collector_duration_seconds", ("collector",),
                           "Wall time the collector's last update took.")
SAMPLES = counter(AGENT, "mrc_agent_samples_total", (),
                  "Sampling passes completed since the agent started.")
SAMPLE_OVERRUNS = counter(AGENT, "mrc_agent_sample_overruns_total", (),
                          "Sampling ticks skipped because a pass took longer than the interval.")
SAMPLE_DURATION = gauge(AGENT, "mrc_agent_sample_duration_seconds", (),
                        "Wall time the last sampling pass took, all collectors together.")
LAST_SAMPLE_TIMESTAMP = gauge(AGENT, "mrc_agent_last_sample_timestamp_seconds", (),
                              "Unix time at which the snapshot being served was taken.")
INTERVAL = gauge(AGENT, "mrc_agent_interval_seconds", (), "Configured sampling interval.")
TARGETS = gauge(AGENT, "mrc_agent_targets", (),
                "Number of target processes watched in the last sampling pass.")
METRICS = (BUILD_INFO, COLLECTOR_SUCCESS, COLLECTOR_AVAILABLE, COLLECTOR_DURATION, SAMPLES,
           SAMPLE_OVERRUNS, SAMPLE_DURATION, LAST_SAMPLE_TIMESTAMP, INTERVAL, TARGETS)


class Runner:
    def __init__(
        self,
        collectors: Sequence[Collector],
        targets: TargetResolver,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
        *,
        finishers: Sequence[PassFinisher] = (),
    ) -> None:
        self.collectors = tuple(collectors)  # fixed: versions are numbered by position
        self.targets = targets
        self.interval = interval
        self._finishers = list(finishers)
        self._clock = clock
        self._wallclock = wallclock
        self._snapshot = EMPTY
        # Pass k's snapshot is version k * (collectors + 1); a copy served while the pass
        # after it is stuck in collector i is version k * (collectors + 1) + i + 1, so that a
        # reader names each copy without counting anything (reading changes no state).
        self._passes = 0
        self._step = len(self.collectors) + 1
        self._samples_total = 0
        self._overruns = 0
        self._said: dict[str, str] = {}  # collector -> last reason logged
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        # Staleness: the collector being updated now and since when, when the last pass
        # completed, and why the last pass failed ("" when it completed).
        self._running: tuple[str, float, int] | None = None  # (collector, since, its index)
        self._last_end: float | None = None
        self._failed = ""

    # -- snapshot -----------------------------------------------------------------------------
    def latest(self) -> Snapshot:
        """The snapshot to serve: the last pass's, or — while a collector has been stuck for
        more than :data:`STALE_INTERVALS` intervals — a copy of it whose success series says
        that collector failed, so a scrape never shows stale data as healthy. Reading changes
        nothing: the copy is made anew (a render of it is cached by :meth:`version`)."""
        snap = self._snapshot
        stuck = self._stuck()
        if stuck is None:
            return snap
        name, _, index = stuck
        samples = tuple((n, labels, 0.0) if n == COLLECTOR_SUCCESS.name and labels == (name,)
                        else (n, labels, v) for n, labels, v in snap.samples)
        return Snapshot(snap.seq + index + 1, snap.timestamp, samples)

    def version(self) -> int:
        """The version of what :meth:`latest` serves now, without making it."""
        stuck = self._stuck()
        return self._snapshot.seq + (stuck[2] + 1 if stuck is not None else 0)

    # -- staleness ----------------------------------------------------------------------------
    def _stuck(self) -> tuple[str, float, int] | None:
        """(collector, seconds it has run, its index) when the pass in progress is stuck in
        it."""
        running = self._running
        if running is None:
            return None
        name, since, index = running
        seconds = self._clock() - since
        return (name, seconds, index) if seconds > STALE_INTERVALS * self.interval else None

    def not_ready_reason(self) -> str | None:
        """None while sampling is current; else why ``/readyz`` answers 503: no pass yet, the
        last pass failed, or none completed within :data:`STALE_INTERVALS` intervals."""
        if self._last_end is None:
            return "no sample taken yet"
        if self._failed:
            return f"the last sampling pass failed: {self._failed}"
        age = self._clock() - self._last_end
        if age > STALE_INTERVALS * self.interval:
            stuck = self._stuck()
            where = f" (collector {stuck[0]} has run for {stuck[1]:.1f} s)" if stuck else ""
            return f"no sampling pass completed for {age:.1f} s{where}"
        return None

    # -- one pass -----------------------------------------------------------------------------
    def sample_once(self) -> Snapshot:
        started = time.perf_counter()
        now = self._clock()
        view = PassView(now=now, wall=self._wallclock(),
                        targets=tuple(self.targets.resolve()))
        samples: list[Sample] = []
        health: list[Sample] = []
        for index, collector in enumerate(self.collectors):
            t0 = time.perf_counter()
            self._running = (collector.name, self._clock(), index)
            try:
                update = collector.update(view)
            except Exception as exc:  # one collector's failure never fails the pass
                update = Update([], error=exc)
            samples.extend(update.samples)
            view = view.with_outputs(update.outputs)
            success, available = self._health(collector.name, update.error)
            name = (collector.name,)
            health.append((COLLECTOR_SUCCESS.name, name, success))
            health.append((COLLECTOR_AVAILABLE.name, name, available))
            health.append((COLLECTOR_DURATION.name, name, time.perf_counter() - t0))
        self._running = None
        finished: list[Sample] = []
        for finish in self._finishers:
            finished.extend(finish(view))
        processes = view.get(Processes)
        self._samples_total += 1
        self._passes += 1
        seq = self._passes * self._step
        agent: list[Sample] = [
            (BUILD_INFO.name, (), {"version": __version__, "python": platform.python_version()}),
            (SAMPLES.name, (), float(self._samples_total)),
            (SAMPLE_OVERRUNS.name, (), float(self._overruns)),
            (SAMPLE_DURATION.name, (), time.perf_counter() - started),
            (LAST_SAMPLE_TIMESTAMP.name, (), view.wall),
            (INTERVAL.name, (), self.interval),
            (TARGETS.name, (), float(len(processes.by_pid) if processes is not None else 0)),
        ]
        snap = Snapshot(seq=seq, timestamp=view.wall,
                        samples=tuple(agent + finished + health + samples))
        self._snapshot = snap
        self._last_end = self._clock()
        self._failed = ""
        self.ready.set()
        return snap

    def _health(self, collector: str, error: Exception | None) -> tuple[float, float]:
        """(success, available) of a collector whose update ended with ``error`` (None: it
        succeeded); a reason is logged once when it first appears or changes."""
        if error is None:
            self._say(collector, "")
            return 1.0, 1.0
        if isinstance(error, SourceUnavailable):
            self._say(collector, f"not available here: {error}", logging.INFO)
            return 0.0, 0.0
        self._say(collector, f"failed: {type(error).__name__}: {error}", logging.WARNING)
        return 0.0, 1.0

    def _say(self, collector: str, message: str, level: int = logging.INFO) -> None:
        if self._said.get(collector, "") == message:
            return
        if message:
            log.log(level, "collector %s %s", collector, message)
        elif collector in self._said:
            log.info("collector %s recovered", collector)
        self._said[collector] = message

    # -- background loop ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mrc-agent-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_tick = self._clock()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as exc:  # keep sampling whatever happens; /readyz says so
                self._running = None
                why = f"{type(exc).__name__}: {exc}"
                if why != self._failed:  # once per distinct failure, not once per pass
                    log.exception("sampling pass failed")
                self._failed = why
            next_tick += self.interval
            now = self._clock()
            if now > next_tick:
                # Fell behind: count the missed ticks and keep a fixed phase.
                missed = int((now - next_tick) / self.interval) + 1
                self._overruns += missed
                next_tick += missed * self.interval
            self._stop.wait(max(next_tick - now, 0.0))

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for collector in self.collectors:
            # Collectors that own children (the stacks collector's samplers) end them here.
            close = getattr(collector, "close", None)
            if close is not None:
                close()
