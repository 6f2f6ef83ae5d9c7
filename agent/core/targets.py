"""Target discovery: which processes the agent watches this interval.

Targets come from explicit PIDs, a pidfile (re-read every interval, so a restarted service that
rewrites it is followed) and a command-line regex (re-matched every interval, so a restarted
service is picked up; every match is its own target). Discovery runs at up to 10 Hz, so a
command line is cached per PID; since ``exec`` keeps the PID and changes the command line, the
cache is re-read on a schedule:

* a PID's command line is read again :data:`FIRST_RECHECK_S` after it was first read, which
  catches a service started by fork and exec (``subprocess``, a supervisor) whose child the
  agent read before the exec, with the parent's command line;
* then once every :data:`REFRESH_S`, at a phase fixed per PID (so a node's processes are not
  all re-read in one pass), which catches an entrypoint script that runs ``exec`` on the
  server minutes later, and a matched process that execs something else.

An empty command line on a re-read (a zombie, a process mid-exec) keeps the cached one.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from mrc_agent.agent.core.hw.procfs import ProcessGone, ProcFS, is_pid
from mrc_agent.exporters.files import describe, read_bounded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """A process to watch and how it was found (``pid``, ``pidfile`` or ``process_name``)."""

    pid: int
    source: str


class PidfileError(Exception):
    """The pidfile cannot be read or does not hold a PID."""


#: Seconds after a PID's first read at which its command line is read again (the fork-exec
#: window is milliseconds; one busy interval or a few are covered).
FIRST_RECHECK_S = 1.0
#: Seconds between later re-reads of a cached command line.
REFRESH_S = 5.0


def next_refresh(pid: int, now: float) -> float:
    """When ``pid``'s command line is next re-read after ``now``: once every
    :data:`REFRESH_S`, at a phase of that period fixed per PID (golden-ratio spread), so the
    re-reads of many processes fall evenly on different passes whenever they were first seen."""
    phase = (pid * 0.6180339887) % 1.0
    return (math.floor(now / REFRESH_S + phase) + 1 - phase) * REFRESH_S


#: A pidfile's first line is a PID; more than this is not read.
PIDFILE_READ_BYTES = 64


def read_pidfile(path: str) -> int:
    """The PID in ``path`` (first line, surrounding whitespace allowed). Only a regular file is
    read, without blocking, and only its first bytes."""
    try:
        data = read_bounded(path, PIDFILE_READ_BYTES, "pidfile", truncate=True)
    except OSError as exc:
        raise PidfileError(f"cannot read pidfile {path}: {describe(exc)}") from exc
    text = data.decode("utf-8", errors="replace")
    first = text.strip().split("\n", 1)[0].strip()
    if not is_pid(first):
        raise PidfileError(f"pidfile {path} does not hold a PID (found {first[:20]!r})")
    return int(first)


class TargetResolver:
    """Resolves the configured target selectors to the live processes of this interval."""

    def __init__(
        self,
        pids: list[int] | None = None,
        pidfile: str | None = None,
        process_name: str | None = None,
        procfs: ProcFS | None = None,
        self_pid: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pids = list(dict.fromkeys(pids or []))
        self._pidfile = pidfile
        self._regex = re.compile(process_name) if process_name else None
        self._procfs = procfs or ProcFS()
        # The agent's own command line contains the regex: never match ourselves.
        self._self_pid = os.getpid() if self_pid is None else self_pid
        self._clock = clock
        #: PID -> (command line, monotonic time of its next re-read).
        self._cmdlines: dict[int, tuple[str, float]] = {}
        self._pidfile_error: str | None = None

    @property
    def configured(self) -> bool:
        return bool(self._pids or self._pidfile or self._regex)

    def resolve(self) -> list[Target]:
        found: dict[int, Target] = {}
        for pid in self._pids:
            found.setdefault(pid, Target(pid, "pid"))
        if self._pidfile:
            try:
                pid = read_pidfile(self._pidfile)
                if self._pidfile_error:
                    log.info("pidfile %s readable again (pid %d)", self._pidfile, pid)
                self._pidfile_error = None
                found.setdefault(pid, Target(pid, "pidfile"))
            except PidfileError as exc:
                if str(exc) != self._pidfile_error:  # say it once, not every interval
                    log.warning("%s; no target from the pidfile until it is", exc)
                self._pidfile_error = str(exc)
        if self._regex is not None:
            for pid in self._match():
                found.setdefault(pid, Target(pid, "process_name"))
        return list(found.values())

    def _match(self) -> list[int]:
        assert self._regex is not None
        live = self._procfs.pids()
        live_set = set(live)
        for gone in [p for p in self._cmdlines if p not in live_set]:
            del self._cmdlines[gone]
        now = self._clock()
        matches = []
        for pid in live:
            if pid == self._self_pid:
                continue
            cached = self._cmdlines.get(pid)
            if cached is None or now >= cached[1]:
                cmd = self._read_cmdline(pid, cached, now)
                if cmd is None:
                    continue
            else:
                cmd = cached[0]
            if self._regex.search(cmd):
                matches.append(pid)
        return matches

    def _read_cmdline(self, pid: int, cached: tuple[str, float] | None,
                      now: float) -> str | None:
        """Read (or re-read) ``pid``'s command line into the cache; None when it has none
        yet and none is cached."""
        try:
            cmd = self._procfs.cmdline(pid)
        except ProcessGone:
            return None
        if cached is None:
            if not cmd:
                # Kernel threads have an empty cmdline; a process being exec'd may too:
                # do not cache it so it is read again next interval.
                return None
            self._cmdlines[pid] = (cmd, now + FIRST_RECHECK_S)
            return cmd
        if not cmd:
            cmd = cached[0]  # a zombie or mid-exec: keep what it was
        elif cmd != cached[0]:
            log.debug("pid %d has a new command line (exec): %.200s", pid, cmd)
        self._cmdlines[pid] = (cmd, next_refresh(pid, now))
        return cmd
