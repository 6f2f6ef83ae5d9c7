"""Target discovery: which processes the agent watches this interval.

Targets come from explicit PIDs, a pidfile (re-read every interval, so a restarted service that
rewrites it is followed) and a command-line regex (re-matched every interval, so a restarted
service is picked up; every match is its own target). Only the command lines of PIDs not seen
before are read, which keeps discovery cheap at 10 Hz.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from mrc_agent.agent.core.files import describe, read_bounded
from mrc_agent.agent.core.hw.procfs import ProcessGone, ProcFS, is_pid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """A process to watch and how it was found (``pid``, ``pidfile`` or ``process_name``)."""

    pid: int
    source: str


class PidfileError(Exception):
    """The pidfile cannot be read or does not hold a PID."""


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
    ) -> None:
        self._pids = list(dict.fromkeys(pids or []))
        self._pidfile = pidfile
        self._regex = re.compile(process_name) if process_name else None
        self._procfs = procfs or ProcFS()
        # The agent's own command line contains the regex: never match ourselves.
        self._self_pid = os.getpid() if self_pid is None else self_pid
        self._cmdlines: dict[int, str] = {}
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
        matches = []
        for pid in live:
            if pid == self._self_pid:
                continue
            cmd = self._cmdlines.get(pid)
            if cmd is None:
                try:
                    cmd = self._procfs.cmdline(pid)
                except ProcessGone:
                    continue
                if not cmd:
                    # Kernel threads have an empty cmdline; a process being exec'd may too:
                    # do not cache it so it is read again next interval.
                    continue
                self._cmdlines[pid] = cmd
            if self._regex.search(cmd):
                matches.append(pid)
        return matches
