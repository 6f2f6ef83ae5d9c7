"""Process collector: target CPU with ``pidstat -u`` semantics, hottest thread, RSS, threads and
context switches, read from ``/proc``.

Ratios need two readings, so a new target shows its counters at once and its ratios from the
next pass on. A PID whose start time changes is a new process and starts afresh; a target that
vanished, or exited and waits as a zombie, simply stops producing series.

It also leaves, once per process, what GPU attribution reads (the GPU variables of the initial
environment and the innermost-namespace PID, :mod:`mrc_agent.agent.core.attribution`) in its
output, :class:`~mrc_agent.agent.core.collectors.base.Processes`: the pass's targets phase.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType

from mrc_agent.agent.core.attribution import TargetView, read_view
from mrc_agent.agent.core.collectors.base import (
    PROC,
    BuildContext,
    CollectorDef,
    PassView,
    Processes,
    TargetState,
    Update,
)
from mrc_agent.agent.core.hw.procfs import CLK_TCK, ProcessGone, ProcFS, ProcStat
from mrc_agent.agent.core.sample import Sample, counter, gauge

log = logging.getLogger(__name__)

NAME = "process"

CPU_SECONDS = counter(
    NAME, "mrc_process_cpu_seconds_total", PROC + ("mode",),
    "CPU time the target process spent, by mode (user excludes guest time, like pidstat).")
CPU_USER_RATIO = gauge(
    NAME, "mrc_process_cpu_user_ratio", PROC,
    "User CPU seconds per wall second over the last sampling window (1.0 = one core "
    "fully busy, pidstat's %usr / 100).")
CPU_SYSTEM_RATIO = gauge(
    NAME, "mrc_process_cpu_system_ratio", PROC,
    "System CPU seconds per wall second over the last sampling window.")
HOTTEST_THREAD_USER_RATIO = gauge(
    NAME, "mrc_process_hottest_thread_cpu_user_ratio", PROC,
    "User CPU ratio of the busiest thread over the last sampling window; a GIL-bound "
    "preprocessing thread reads about 1.0 even when the process total is spread.")
RESIDENT_MEMORY = gauge(NAME, "mrc_process_resident_memory_bytes", PROC,
                        "Resident set size of the target process.")
THREADS = gauge(NAME, "mrc_process_threads", PROC, "Threads in the target process.")
CONTEXT_SWITCHES = counter(
    NAME, "mrc_process_context_switches_total", PROC + ("kind",),
    "Context switches of the target process, voluntary or involuntary.")
START_TIME = gauge(NAME, "mrc_process_start_time_seconds", PROC,
                   "Start time of the target process, seconds since the Unix epoch.")

METRICS = (CPU_SECONDS, CPU_USER_RATIO, CPU_SYSTEM_RATIO, HOTTEST_THREAD_USER_RATIO,
           RESIDENT_MEMORY, THREADS, CONTEXT_SWITCHES, START_TIME)


@dataclass
class _Prev:
    start_ticks: int
    at: float
    user_ticks: int
    system_ticks: int
    threads: dict[int, int] = field(default_factory=dict)


def ratio(delta_ticks: int, seconds: float) -> float:
    """CPU seconds per wall second from a tick delta (never negative)."""
    if seconds <= 0:
        return 0.0
    return max(delta_ticks, 0) / CLK_TCK / seconds


class ProcessCollector:
    name = NAME

    def __init__(self, procfs: ProcFS | None = None, threads: bool = True) -> None:
        self._procfs = procfs or ProcFS()
        self._threads = threads
        self._prev: dict[int, _Prev] = {}
        # What GPU attribution needs, per PID, with the (start time, command) it was read for:
        # a process's initial environment and namespaces never change, so they are read once.
        self._views: dict[int, tuple[tuple[int, str], TargetView]] = {}
        self._boot_time: float | None = None

    def update(self, view: PassView) -> Update:
        if self._boot_time is None:
            self._boot_time = self._procfs.boot_time()
        out: list[Sample] = []
        seen = set()
        states: dict[int, TargetState] = {}
        for target in view.targets:
            try:
                state, samples = self._one(view.now, target.pid)
                out.extend(samples)
                states[target.pid] = state
                seen.add(target.pid)
            except ProcessGone as exc:
                log.debug("target %d gone: %s", target.pid, exc)
                self._procfs.release(target.pid)
        for pid in [p for p in self._prev if p not in seen]:
            del self._prev[pid]
            self._procfs.release(pid)
        for pid in [p for p in self._views if p not in seen]:
            del self._views[pid]
        return Update(out, (Processes(MappingProxyType(states)),))

    def _one(self, now: float, pid: int) -> tuple[TargetState, list[Sample]]:
        st = self._procfs.stat(pid)
        if st.exited:
            # A zombie has exited: it is no target any more (so "target absent" can fire),
            # even while its parent has not reaped it.
            raise ProcessGone(f"{pid} has exited (state {st.state})")
        voluntary, involuntary = self._procfs.context_switches(pid)
        threads = self._procfs.thread_user_ticks(pid) if self._threads else {}
        labels = (str(pid), st.comm)
        prev = self._prev.get(pid)
        if prev is not None and prev.start_ticks != st.start_ticks:
            prev = None  # the PID was reused by another process
        user_ratio = hottest_ratio = None
        out: list[Sample] = [
            (CPU_SECONDS.name, labels + ("user",), st.user_ticks / CLK_TCK),
            (CPU_SECONDS.name, labels + ("system",), st.system_ticks / CLK_TCK),
            (RESIDENT_MEMORY.name, labels, float(st.rss_bytes)),
            (THREADS.name, labels, float(st.num_threads)),
            (CONTEXT_SWITCHES.name, labels + ("voluntary",), float(voluntary)),
            (CONTEXT_SWITCHES.name, labels + ("involuntary",), float(involuntary)),
            (START_TIME.name, labels, (self._boot_time or 0.0) + st.start_ticks / CLK_TCK),
        ]
        if prev is not None:
            dt = now - prev.at
            user_ratio = ratio(st.user_ticks - prev.user_ticks, dt)
            out.append((CPU_USER_RATIO.name, labels, user_ratio))
            out.append((CPU_SYSTEM_RATIO.name, labels,
                        ratio(st.system_ticks - prev.system_ticks, dt)))
            if self._threads:
                hottest = max(
                    (ticks - prev.threads.get(tid, ticks) for tid, ticks in threads.items()),
                    default=0,
                )
                # A thread born inside the window has no previous reading: its whole
                # lifetime falls in the window, so its ticks count from zero.
                born = [t for tid, t in threads.items() if tid not in prev.threads]
                hottest = max([hottest, *born])
                hottest_ratio = min(ratio(hottest, dt), user_ratio)
                out.append((HOTTEST_THREAD_USER_RATIO.name, labels, hottest_ratio))
        self._prev[pid] = _Prev(st.start_ticks, now, st.user_ticks, st.system_ticks, threads)
        return TargetState(pid, st.comm, user_ratio, hottest_ratio, self._view(pid, st)), out


    def _view(self, pid: int, st: ProcStat) -> TargetView:
        # Keyed by start time (a reused PID is another process) and command (an exec, as in
        # ``sh -c 'exec server'``, may start it afresh with another environment).
        key = (st.start_ticks, st.comm)
        cached = self._views.get(pid)
        if cached is None or cached[0] != key:
            cached = self._views[pid] = (key, read_view(self._procfs, pid))
        return cached[1]


def _build(_ctx: BuildContext) -> ProcessCollector:
    return ProcessCollector()


DEFINITION = CollectorDef(
    name=NAME, default_on=True, factory=_build, metrics=METRICS, provides=(Processes,),
    description="Target process CPU (pidstat -u semantics), hottest thread, memory, threads.")
