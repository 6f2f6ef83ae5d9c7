"""Thin adapter over Linux ``/proc``: per-process and per-thread CPU ticks, memory, threads,
context switches, command lines, and what GPU attribution needs (the GPU variables of the
initial environment, the PID in each PID namespace).

Reads the files directly instead of going through psutil because the agent samples at up to
10 Hz and every target's threads are read each pass. The files read every pass (``stat``,
``status``, each thread's ``stat``) are kept open and re-read with ``pread`` at offset 0, which
procfs answers with fresh content: ``open()`` was a third of a pass's CPU before. A kept file
that stops answering (the process exited, or its PID now belongs to another process) is closed
and opened once afresh. The semantics follow ``pidstat -u``: user time is
``utime - guest_time`` (guest time is counted inside utime by the kernel and pidstat takes it
out), in clock ticks of ``SC_CLK_TCK``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mrc_agent.exporters.files import read_fd

#: Linux's PID_MAX_LIMIT: no PID is larger.
PID_MAX = 1 << 22
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class ProcessGone(Exception):
    """The process (or thread) no longer exists, or its files cannot be read."""


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` the agent uses."""

    pid: int
    comm: str
    user_ticks: int  # utime - guest_time, like pidstat's %usr
    system_ticks: int
    num_threads: int
    start_ticks: int  # starttime: ticks after boot; with pid it identifies one process
    rss_bytes: int
    state: str = "R"  # R, S, D, ... ; Z (zombie) and X (dead) have exited

    @property
    def exited(self) -> bool:
        """A zombie or dead process: it has exited and only waits to be reaped."""
        return self.state in ("Z", "X")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError) as exc:
        raise ProcessGone(f"{path}: {exc.strerror or exc}") from exc
    except OSError as exc:  # ESRCH while the process exits
        raise ProcessGone(f"{path}: {exc}") from exc


def parse_stat(pid: int, raw: bytes) -> ProcStat:
    """Parse the content of ``/proc/PID/stat``.

    ``comm`` may hold spaces and parentheses, so the fields are split after the *last* ``)``.
    """
    open_paren = raw.find(b"(")
    close_paren = raw.rfind(b")")
    if open_paren < 0 or close_paren < 0:
        raise ProcessGone(f"/proc/{pid}/stat: unexpected format")
    comm = raw[open_paren + 1 : close_paren].decode("utf-8", "replace")
    fields = raw[close_paren + 2 :].split()
    # fields[0] is field 3 (state) of proc(5); field N is fields[N - 3].
    utime, stime = int(fields[11]), int(fields[12])
    guest = int(fields[40]) if len(fields) > 40 else 0  # field 43, guest_time
    return ProcStat(
        pid=pid,
        comm=comm,
        user_ticks=max(utime - guest, 0),
        system_ticks=stime,
        num_threads=int(fields[17]),
        start_ticks=int(fields[19]),
        rss_bytes=int(fields[21]) * PAGE_SIZE,
        state=fields[0].decode("ascii", "replace"),
    )


#: Large enough for /proc/PID/status (about 1.5 KB); stat lines are a few hundred bytes.
_READ_SIZE = 16384
#: At most this much of ``/proc/PID/environ`` is read. The kernel caps a process's arguments
#: and environment together at a quarter of its stack limit (2 MiB under the usual 8 MiB);
#: a pod's environment, service links included, is tens of KB. Read once per process.
ENVIRON_READ_BYTES = 1 << 20


def _read_prefix(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path`` from its start."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ProcessGone(f"{path}: {exc.strerror or exc}") from exc
    try:
        return read_fd(fd, limit, 1 << 16)
    except OSError as exc:  # EACCES for another user's process, ESRCH while it exits
        raise ProcessGone(f"{path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def is_pid(text: str) -> bool:
    """Whether ``text`` is a PID written out: ASCII digits (``str.isdigit`` also passes "²",
    which ``int`` refuses), 1 to :data:`PID_MAX`."""
    # The length first: int() of thousands of digits is slow, and refused past 4,300.
    return (0 < len(text) <= len(str(PID_MAX)) and text.isascii() and text.isdigit()
            and 0 < int(text) <= PID_MAX)


class ProcFS:
    """Reads process data below ``root`` (``/proc``; tests may point it elsewhere).

    At most ``max_open`` files are kept open; past that, files are opened per read.
    """

    def __init__(self, root: str = "/proc", max_open: int = 4096) -> None:
        self.root = root
        self._max_open = max_open
        self._fds: dict[str, int] = {}

    def _read_kept(self, path: str) -> bytes:
        fd = self._fds.get(path)
        if fd is not None:
            try:
                data = os.pread(fd, _READ_SIZE, 0)
                if data:
                    return data
            except OSError:
                pass
            self._close(path)
        if len(self._fds) >= self._max_open:
            return _read(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ProcessGone(f"{path}: {exc.strerror or exc}") from exc
        try:
            data = os.pread(fd, _READ_SIZE, 0)
        except OSError as exc:
            os.close(fd)
            raise ProcessGone(f"{path}: {exc.strerror or exc}") from exc
        if not data:
            os.close(fd)
            raise ProcessGone(f"{path}: empty")
        self._fds[path] = fd
        return data

    def _close(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def release(self, pid: int) -> None:
        """Close every kept file of ``pid`` (it is no longer a target)."""
        prefix = f"{self.root}/{pid}/"
        for path in [p for p in self._fds if p.startswith(prefix)]:
            self._close(path)

    def close(self) -> None:
        for path in list(self._fds):
            self._close(path)

    def stat(self, pid: int) -> ProcStat:
        return parse_stat(pid, self._read_kept(f"{self.root}/{pid}/stat"))

    def thread_user_ticks(self, pid: int) -> dict[int, int]:
        """User ticks of every thread of ``pid`` (threads that exit mid-read are skipped)."""
        base = f"{self.root}/{pid}/task"
        try:
            tids = os.listdir(base)
        except OSError as exc:
            raise ProcessGone(f"{base}: {exc.strerror}") from exc
        out: dict[int, int] = {}
        for tid in tids:
            try:
                raw = self._read_kept(f"{base}/{tid}/stat")
                out[int(tid)] = parse_stat(int(tid), raw).user_ticks
            except (ProcessGone, ValueError, IndexError):
                continue
        # Close the kept files of threads that have exited.
        prefix = f"{base}/"
        live = {f"{base}/{tid}/stat" for tid in tids}
        for path in [p for p in self._fds if p.startswith(prefix) and p not in live]:
            self._close(path)
        return out

    def thread_schedstat(self, pid: int) -> dict[int, tuple[int, int]]:
        """Per thread: (nanoseconds on a CPU, nanoseconds runnable but waiting for one), from
        ``/proc/PID/task/TID/schedstat``; empty when the kernel does not keep them."""
        out: dict[int, tuple[int, int]] = {}
        try:
            tids = os.listdir(f"{self.root}/{pid}/task")
        except OSError:
            return out
        for tid in tids:
            try:
                fields = _read(f"{self.root}/{pid}/task/{tid}/schedstat").split()
                out[int(tid)] = (int(fields[0]), int(fields[1]))
            except (ProcessGone, ValueError, IndexError):
                continue  # the thread ended meanwhile
        return out

    def context_switches(self, pid: int) -> tuple[int, int]:
        """(voluntary, involuntary) context switches of the whole process."""
        voluntary = involuntary = 0
        for line in self._read_kept(f"{self.root}/{pid}/status").splitlines():
            if line.startswith(b"voluntary_ctxt_switches:"):
                voluntary = int(line.split()[1])
            elif line.startswith(b"nonvoluntary_ctxt_switches:"):
                involuntary = int(line.split()[1])
        return voluntary, involuntary

    def nspid(self, pid: int) -> tuple[int, ...]:
        """``pid`` in each PID namespace it belongs to, outermost (this ``/proc``'s) first, from
        the ``NSpid`` line of ``/proc/PID/status``; empty on kernels before 4.1."""
        for line in self._read_kept(f"{self.root}/{pid}/status").splitlines():
            if line.startswith(b"NSpid:"):
                try:
                    return tuple(int(f) for f in line.split()[1:])
                except ValueError:
                    return ()
        return ()

    def environ(self, pid: int, names: tuple[str, ...]) -> dict[str, str]:
        """The variables ``names`` as set in the initial environment of ``pid`` (what it was
        started with; later changes inside the process are not visible here). Reads at most
        :data:`ENVIRON_READ_BYTES`; an entry cut off there is dropped. ProcessGone when the
        file cannot be read (another user's process without CAP_SYS_PTRACE, or gone)."""
        raw = _read_prefix(f"{self.root}/{pid}/environ", ENVIRON_READ_BYTES)
        entries = raw.split(b"\0")
        if len(raw) >= ENVIRON_READ_BYTES:
            entries.pop()  # possibly cut in the middle
        wanted = {n.encode(): n for n in names}
        out: dict[str, str] = {}
        for entry in entries:
            key, sep, value = entry.partition(b"=")
            name = wanted.get(key)
            if sep and name is not None and name not in out:
                # The first one wins, as with getenv(3), which is how CUDA reads it.
                out[name] = value.decode("utf-8", "replace")
        return out

    def cmdline(self, pid: int) -> str:
        """The command line with NUL separators turned into spaces."""
        return _read(f"{self.root}/{pid}/cmdline").replace(b"\0", b" ").decode(
            "utf-8", "replace"
        ).strip()

    def pids(self) -> list[int]:
        """All process IDs currently in ``root``."""
        return [int(name) for name in os.listdir(self.root) if name.isdigit()]

    def boot_time(self) -> float:
        """Seconds since the epoch at boot, from ``/proc/stat``'s ``btime``."""
        for line in _read(f"{self.root}/stat").splitlines():
            if line.startswith(b"btime"):
                return float(line.split()[1])
        raise ProcessGone(f"{self.root}/stat: no btime")

    def cpu_ticks(self) -> list[int]:
        """The node's CPU time counters from ``/proc/stat``'s first line (user, nice, system,
        idle, iowait, irq, softirq, steal), in ticks; empty when unreadable."""
        try:
            fields = _read(f"{self.root}/stat").split(b"\n", 1)[0].split()
        except ProcessGone:
            return []
        return [int(v) for v in fields[1:9]] if fields[:1] == [b"cpu"] and len(fields) >= 9 else []
