"""Running captures (:class:`CaptureManager`): one at a time in a background thread, at most
``capture_max_per_hour`` per rolling hour, every request counted. Where the agent samples the
target's stacks (the ``stacks`` collector), a capture reads those samples, the minute before
the alert included, and starts no py-spy of its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from functools import partial

from mrc_agent.agent.core.collectors import COLLECTOR_NAMES, process, profiling
from mrc_agent.agent.core.collectors.base import Collector
from mrc_agent.agent.core.collectors.stacks import StacksCollector
from mrc_agent.agent.core.config import AgentConfig, ConfigError
from mrc_agent.agent.core.runner import Runner
from mrc_agent.agent.core.sample import readings
from mrc_agent.agent.tools.capture.store import CaptureStore, _iso
from mrc_agent.agent.tools.diagnose.command import StackHistory, diagnose
from mrc_agent.agent.tools.diagnose.pyspy import PySpyError
from mrc_agent.agent.tools.diagnose.sampling import Borrowed

log = logging.getLogger(__name__)


#: Sampling period of the collectors during a capture: five points a second shows sub-second
#: GPU idle gaps next to the CPU that causes them.
CAPTURE_INTERVAL = 0.2
#: Seconds of the agent's own stack samples before the capture's window that it includes,
#: where the agent samples the target's stacks: the minute that led to the alert.
LOOKBACK_S = 60.0


#: What a capture borrows from the running agent's profiling collector (the CUPTI sampler
#: belongs to it: a second one could not open the same performance monitors).
_PROFILING_METRICS = {spec.name for spec in profiling.METRICS}


class CaptureManager:
    """Starts captures in a background thread, one at a time and at most ``max_per_hour`` per
    rolling hour, and counts what happened to every request."""

    def __init__(self, cfg: AgentConfig, store: CaptureStore, runner: Runner,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.store = store
        self.runner = runner
        self.duration = cfg.capture_duration
        self.max_per_hour = cfg.capture_max_per_hour
        self._clock = clock
        self._lock = threading.Lock()
        self._started: deque[float] = deque()
        self._running: str | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self.counts: Counter[str] = Counter()

    @property
    def running(self) -> str | None:
        return self._running

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def targets(self) -> list[int]:
        return [t.pid for t in self.runner.targets.resolve()]

    def hottest_target(self) -> int | None:
        """The target with the most user CPU in the latest snapshot (the first target when
        none has a reading yet)."""
        targets = self.targets()
        if not targets:
            return None
        cpu = {int(r.labels["pid"]): float(r.value)
               for r in readings(self.runner.latest(), process.CPU_USER_RATIO)
               if isinstance(r.value, (int, float))}
        return max(targets, key=lambda p: cpu.get(p, -1.0))

    def request(self, alert: str, pid: int, duration: float | None = None) -> tuple[str, str]:
        """("accepted", capture id), ("rate-limited", why) or ("error", why) when the
        captures directory cannot take it. ``duration``: this capture's window, else the
        configured one."""
        duration = self.duration if duration is None else duration
        with self._lock:
            now = self._clock()
            while self._started and now - self._started[0] >= 3600:
                self._started.popleft()
            if self._running is not None:
                self.counts["rate_limited"] += 1
                return ("rate-limited", f"capture {self._running} is still running")
            if len(self._started) >= self.max_per_hour:
                self.counts["rate_limited"] += 1
                return ("rate-limited", f"{len(self._started)} captures started in the last "
                                        f"hour (limit {self.max_per_hour})")
            try:
                self.store.prune(room_for=1)
                cid = self.store.create(alert, pid)
            except OSError as exc:
                self.counts["failed"] += 1
                log.warning("cannot start a capture in %s: %s", self.store.root, exc)
                return ("error", f"cannot write to the captures directory: "
                                 f"{exc.strerror or exc}")
            self._started.append(now)
            self._running = cid
            self.counts["accepted"] += 1
            self._thread = threading.Thread(target=self._run, args=(cid, alert, pid, duration),
                                            name="mrc-agent-capture", daemon=True)
            self._thread.start()
        log.info("capture %s started for %s on pid %d (%.3g s)", cid, alert, pid, duration)
        return ("accepted", cid)

    def _collectors(self) -> tuple[list[str], list[Collector]]:
        """The agent's collectors plus process and derived; the profiling counters are read
        from the agent's own sampler when it runs them (one CUPTI session per process), and
        the stacks collector is not built again (its samples are read, :meth:`_history`)."""
        names = [n for n in COLLECTOR_NAMES if n not in ("profiling", "stacks")
                 and (n in ("process", "derived") or self.cfg.collectors.get(n))]
        extra: list[Collector] = []
        if self.cfg.collectors.get("profiling"):
            extra.append(Borrowed("profiling", self.runner.latest, _PROFILING_METRICS))
        return names, extra

    def _history(self, pid: int) -> StackHistory | None:
        """The agent's own stack samples of ``pid``, where its stacks collector runs: the
        capture reads them (from :data:`LOOKBACK_S` before its window) and starts no py-spy."""
        for c in self.runner.collectors:
            if isinstance(c, StacksCollector):
                return StackHistory(partial(c.history, pid), 1.0 / self.cfg.stacks_interval,
                                    LOOKBACK_S)
        return None

    def _run(self, cid: str, alert: str, pid: int, duration: float) -> None:
        out = os.path.join(self.store.root, cid)
        names, extra = self._collectors()
        try:
            result = diagnose(self.cfg, pid, out, duration, CAPTURE_INTERVAL,
                              collectors=names, extra=extra, cancel=self._cancel,
                              history=self._history(pid))
            size = self.store.bytes_of(cid)
            if size > self.store.max_bytes:
                # Alone it is over what the captures may use: the limits would delete it at
                # once, so say so instead of reporting a capture nobody can fetch.
                shutil.rmtree(out, ignore_errors=True)
                self.count("too_large")
                log.warning("capture %s was %d bytes, more than the %d the captures may use "
                            "(--capture-max-bytes): deleted", cid, size, self.store.max_bytes)
                return
            self.store.update(cid, status="completed", verdict=result.verdict,
                              summary=result.report["summary"], finished_at=_iso(time.time()))
            self.count("completed")
            log.info("capture %s: %s", cid, result.verdict)
        except (PySpyError, ConfigError, OSError) as exc:
            self.store.update(cid, status="failed", error=str(exc), finished_at=_iso(time.time()))
            self.count("failed")
            log.warning("capture %s failed: %s", cid, exc)
        except Exception as exc:  # a capture's bug must not take the agent down
            self.store.update(cid, status="failed", error=f"{type(exc).__name__}: {exc}",
                              finished_at=_iso(time.time()))
            self.count("failed")
            log.exception("capture %s failed", cid)
        finally:
            with self._lock:
                self._running = None
                self.store.prune()

    def prune(self) -> None:
        """Apply retention and limits now, sparing the running capture."""
        with self._lock:
            self.store.prune(keep=[self._running] if self._running else [])

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the running capture, if any, to finish."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, timeout: float = 20.0) -> None:
        """Cut a running capture short (its report covers the part sampled) and wait."""
        self._cancel.set()
        self.wait(timeout)

