"""The sampling runner: calls every enabled collector on the agent's own clock, times it,
isolates its failures, and publishes one immutable snapshot per pass.

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

from agent import __version__
from agent.core.collectors.base import Collector, SampleContext
from agent.core.collectors.gpu import ProfilingCollector
from agent.core.hw.base import SourceUnavailable
from agent.core.targets import TargetResolver
from exporters.exposition.snapshot import EMPTY, Sample, Snapshot

log = logging.getLogger(__name__)


class Runner:
    def __init__(
        self,
        collectors: Sequence[Collector],
        targets: TargetResolver,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
    ) -> None:
        self.collectors = list(collectors)
        self.targets = targets
        self.interval = interval
        self._clock = clock
        self._wallclock = wallclock
        self._snapshot = EMPTY
        self._seq = 0
        self._samples_total = 0
        self._overruns = 0
        self._said: dict[str, str] = {}  # collector -> last reason logged
        self._ok: dict[str, bool] = {}  # collector -> last pass succeeded
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()

    # -- snapshot -----------------------------------------------------------------------------
    def latest(self) -> Snapshot:
        return self._snapshot

    def version(self) -> int:
        return self._snapshot.seq

    # -- one pass -----------------------------------------------------------------------------
    def sample_once(self) -> Snapshot:
        started = time.perf_counter()
        now = self._clock()
        ctx = SampleContext(now=now, wall=self._wallclock(), targets=self.targets.resolve())
        samples: list[Sample] = []
        health: list[Sample] = []
        for collector in self.collectors:
            t0 = time.perf_counter()
            success, available = 1.0, 1.0
            try:
                samples.extend(collector.update(ctx))
                self._say(collector.name, "")
            except SourceUnavailable as exc:
                success, available = 0.0, 0.0
                self._say(collector.name, f"not available here: {exc}", logging.INFO)
            except Exception as exc:  # one collector's failure never fails the pass
                success = 0.0
                self._say(collector.name, f"failed: {type(exc).__name__}: {exc}",
                          logging.WARNING)
            self._ok[collector.name] = bool(success)
            name = (collector.name,)
            health.append(("mrc_agent_collector_success", name, success))
            health.append(("mrc_agent_collector_available", name, available))
            health.append(("mrc_agent_collector_duration_seconds", name,
                           time.perf_counter() - t0))
        self._samples_total += 1
        self._seq += 1
        agent: list[Sample] = [
            ("mrc_agent_build_info", (),
             {"version": __version__, "python": platform.python_version()}),
            ("mrc_agent_samples_total", (), float(self._samples_total)),
            ("mrc_agent_sample_overruns_total", (), float(self._overruns)),
            ("mrc_agent_sample_duration_seconds", (), time.perf_counter() - started),
            ("mrc_agent_last_sample_timestamp_seconds", (), ctx.wall),
            ("mrc_agent_interval_seconds", (), self.interval),
            ("mrc_agent_targets", (), float(len(ctx.processes))),
            ("mrc_agent_compute_memory_source_info", self._compute_memory_source(), {}),
        ]
        snap = Snapshot(seq=self._seq, timestamp=ctx.wall, samples=tuple(agent + health + samples))
        self._snapshot = snap
        self.ready.set()
        return snap

    def _compute_memory_source(self) -> tuple[str, str]:
        """(source, reason) for the compute-to-memory signal: never pass one off as the other."""
        profiling = next((c for c in self.collectors if isinstance(c, ProfilingCollector)), None)
        reason = profiling.status[0] if profiling else "not_requested"
        if reason == "ok":
            return ("cupti_pm_sampling", "ok")
        return ("gpm_activity_proxy" if self._ok.get("gpm") else "none", reason)

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
            except Exception:  # keep sampling whatever happens; the error is in the log
                log.exception("sampling pass failed")
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
