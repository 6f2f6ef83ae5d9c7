"""Continuous stack sampling of a target from outside it: one `austin`_ child per target, its
samples streamed, parsed into a timeline the ``stacks`` collector joins with the GPU's.

Why austin and not py-spy, which ``diagnose`` and the captures use: both read the target's
memory without stopping it; but py-spy writes its samples only when a recording ends, and
without their times in any format (``raw`` and ``flamegraph`` are totals, ``speedscope`` an
order, ``chrometrace`` merges a thread's samples into spans that stay open while it waits), so a
GPU idle window could only be joined with a whole window's totals. austin streams each sample
as it takes it. What austin 3 does not tell is which thread holds the GIL: no GIL series comes
from here (docs/stacks.md).

austin runs ``--sleepless``: a thread is printed only at the ticks it was running, each sample
standing for the interval since the one before. (``--full`` would also print waiting threads,
but it reads the target's memory use at every tick: on the reference service, with torch's
mappings, that cost 5 % of a core at 10 Hz and printed no sample at all.) A sample line is
``P<pid>;T<iid>:<tid>;<file>:<function>:<line>;... <microseconds>``, outermost frame first,
written to a terminal so that it arrives as it is taken: its time is its arrival. The
collector names the innermost frame by module and qualified function (:func:`function_name`),
never by line or path; the whole stack is kept too, for a while (:data:`MAX_HISTORY`), so
that the on-alert captures read the samples the agent already took, the minutes before the
alert included, instead of attaching a sampler of their own.

.. _austin: https://github.com/P403n1x87/austin
"""

from __future__ import annotations

import collections
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

from mrc_agent.exporters.files import find_executable

log = logging.getLogger(__name__)

#: Samples kept per target while they wait to be joined (a minute at 10 Hz of 100 threads).
MAX_PENDING = 60_000
#: Samples kept per target for the captures, whole stacks and all (ten minutes of five running
#: threads at 10 Hz; a few MB, since a stack seen again is the same tuple).
MAX_HISTORY = 30_000
#: What austin prints for a frame it could not read (the target changed it while it read).
INVALID_FRAME = ":INVALID:"
#: Parsed innermost frames remembered, so a hot function is named once; and whole stacks, so
#: that a stack seen again is kept once.
_NAME_CACHE = 4096

_SITE = re.compile(r"/(?:site|dist)-packages/(.+)$")
_STDLIB = re.compile(r"/lib/python3(?:\.\d+)?/(.+)$")


class StacksUnavailable(Exception):
    """Stacks cannot be sampled for a target; ``reason`` is a short code (``missing``,
    ``permission``, ``not_python``, ``gone``, ``failed``), the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def find_austin(explicit: str | None = None) -> str:
    """The austin executable (:func:`~mrc_agent.exporters.files.find_executable`: explicit,
    beside this Python from the ``diagnose`` extra's ``austin-dist``, or on ``PATH``)."""
    try:
        return find_executable("austin", explicit, package="austin-dist")
    except FileNotFoundError as e:
        raise StacksUnavailable("missing", str(e)) from None


def module_of(path: str) -> str:
    """A frame's module from its file, with no directory of the machine in it:
    ``.../site-packages/PIL/Image.py`` -> ``PIL.Image``; the standard library likewise;
    any other file by its name alone (``/srv/app/preprocess.py`` -> ``preprocess``)."""
    if path.startswith("<"):
        return path  # <frozen runpy>, <string>
    m = _SITE.search(path) or _STDLIB.search(path)
    rel = m.group(1) if m else path.rsplit("/", 1)[-1]
    if rel.endswith(".py"):
        rel = rel[:-3]
    parts = [p for p in rel.split("/") if p]
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or "?"


#: Code objects Python 3.11 runs as frames of their own inside a function; 3.12 inlines the
#: comprehensions (PEP 709). Their time is the enclosing function's.
_INNER = re.compile(r"(?:\.<locals>\.<(?:listcomp|dictcomp|setcomp|genexpr|lambda)>)+$")


def function_name(frame: str) -> str:
    """``file:qualname:line`` -> ``module:qualname`` (``PIL.Image:Image.resize``). A
    comprehension, generator expression or lambda inside a function is named as that function
    (``f.<locals>.<listcomp>`` -> ``f``), as Python 3.12 names an inlined comprehension."""
    head, sep, line = frame.rpartition(":")
    if not sep or not line.isdigit():
        head = frame
    path, sep, qualname = head.rpartition(":")
    if not sep:
        return head[:128]
    return f"{module_of(path)}:{_INNER.sub('', qualname)}"[:128]


@dataclass(frozen=True, slots=True)
class StackSample:
    """One running thread's sample: the monotonic time it was taken at, the seconds it stands
    for, the thread, its innermost function, and its whole stack as austin printed it
    (``file:qualname:line`` frames, outermost first; frames austin could not read are left
    out)."""

    t: float
    seconds: float
    thread: str
    function: str
    frames: tuple[str, ...] = ()


class SampleParser:
    """austin's ``--pipe --sleepless`` output, line by line, into :class:`StackSample` s. A
    sample's time is the time its line arrived (passed in); the seconds it stands for are
    austin's delta, at most ``max_seconds`` (a thread's first sample may carry the time since
    austin started)."""

    def __init__(self, max_seconds: float = 1.0) -> None:
        self.max_seconds = max_seconds
        self._names: dict[str, str] = {}
        self._stacks: dict[str, tuple[str, ...]] = {}
        self.bad_lines = 0

    def line(self, text: str, arrived: float) -> StackSample | None:
        if not text.startswith("P"):
            return None  # metadata (# key: value) and blank lines
        body, sep, metrics = text.rstrip("\n").rpartition(" ")
        first = body.find(";")
        second = body.find(";", first + 1)
        if not sep or first < 0 or second < 0:
            self.bad_lines += 1  # no thread, or a thread with no Python frame
            return None
        try:
            micros = int(metrics.split(",", 1)[0])
        except ValueError:
            self.bad_lines += 1
            return None
        end = len(body)
        leaf = body[body.rfind(";") + 1:]
        while leaf == INVALID_FRAME:  # a frame austin could not read: the one that called it
            end = body.rfind(";", 0, end)
            start = body.rfind(";", 0, end)
            if start < second:
                self.bad_lines += 1
                return None
            leaf = body[start + 1:end]
        function = self._names.get(leaf)
        if function is None:
            if len(self._names) >= _NAME_CACHE:
                self._names.clear()
            function = self._names[leaf] = function_name(leaf)
        seconds = min(max(micros, 0) / 1e6, self.max_seconds)
        return StackSample(arrived, seconds, sys.intern(body[first + 1:second]), function,
                           self._stack(body[second + 1:end]))

    def _stack(self, text: str) -> tuple[str, ...]:
        stack = self._stacks.get(text)
        if stack is None:
            if len(self._stacks) >= _NAME_CACHE:
                self._stacks.clear()
            stack = self._stacks[text] = tuple(
                sys.intern(f) for f in text.split(";") if f and f != INVALID_FRAME)
        return stack


def _die_with_parent() -> None:
    """In the child: SIGTERM when the agent dies, however it dies (Linux prctl)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def may_read(pid: int, proc: str = "/proc") -> bool:
    """Whether this process may read ``pid``'s memory: opening ``/proc/PID/mem`` makes the
    kernel's ptrace access check (uid, capabilities, Yama), the one austin has to pass. austin
    itself says "not a Python process" when it is refused."""
    try:
        with open(f"{proc}/{pid}/mem", "rb"):
            return True
    except PermissionError:
        return False
    except OSError:
        return True  # gone, or no /proc: austin's own message says which


def explain(stderr: str, pid: int, readable: bool = True) -> StacksUnavailable:
    """Why austin could not sample ``pid``, from its stderr (its exit codes are not
    documented) and from whether the agent may read the target's memory at all."""
    text = stderr.strip()
    low = text.lower()
    first = next((ln.strip().lstrip("\U0001f47e\U0001f6d1 ") for ln in text.splitlines()
                  if ln.strip()), "no output")
    if "permission" in low or "not permitted" in low or not readable:
        return StacksUnavailable(
            "permission", f"austin cannot read pid {pid}: permission denied. Run as root or as "
            "the target's user with kernel.yama.ptrace_scope=0; in Kubernetes the pod needs "
            "CAP_SYS_PTRACE and shareProcessNamespace: true")
    if "not a python" in low or ("python" in low and "cannot" in low):
        return StacksUnavailable("not_python", f"pid {pid} is not a Python process austin "
                                               f"can read (austin: {first})")
    if "no such process" in low or "cannot attach" in low:
        return StacksUnavailable("gone", f"pid {pid} is gone (austin: {first})")
    return StacksUnavailable("failed", f"austin failed on pid {pid}: {first}")


class StackSampler:
    """One austin child streaming a target's samples; a reader thread parses them into a
    bounded queue that :meth:`take` empties. The child is started by :meth:`start` and
    stopped by :meth:`stop`; :attr:`error` is set when it could not sample."""

    def __init__(self, exe: str, pid: int, interval: float,
                 clock: collections.abc.Callable[[], float] = time.monotonic) -> None:
        self.exe, self.pid, self.interval = exe, pid, interval
        self._clock = clock
        self._samples: collections.deque[StackSample] = collections.deque(maxlen=MAX_PENDING)
        self._history: collections.deque[StackSample] = collections.deque(maxlen=MAX_HISTORY)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._err: IO[str] | None = None
        self.error: StacksUnavailable | None = None

    def start(self) -> None:
        import pty
        import tempfile
        import tty

        micros = max(int(self.interval * 1e6), 1000)
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        # A terminal for austin's output: stdio writes it line by line there, where a pipe
        # would hold 4 KiB (seconds of samples) back. Raw: no CR is added to the lines.
        main, child = pty.openpty()
        tty.setraw(child)
        try:
            self._proc = subprocess.Popen(
                [self.exe, "--pipe", "--sleepless", f"--interval={micros}", "--timeout=1s",
                 f"--pid={self.pid}"],
                stdin=subprocess.DEVNULL, stdout=child, stderr=self._err,
                preexec_fn=_die_with_parent)
        except OSError:
            os.close(main)
            raise
        finally:
            os.close(child)
        out = open(main, encoding="utf-8", errors="replace", newline="\n")  # noqa: SIM115
        self._reader = threading.Thread(target=self._read, args=(self._proc, out),
                                        name=f"mrc-agent-stacks-{self.pid}", daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[bytes], out: IO[str]) -> None:
        parser = SampleParser(max_seconds=3 * self.interval)
        clock = self._clock
        try:
            for text in out:
                sample = parser.line(text, clock())
                if sample is None:
                    continue
                with self._lock:
                    self._samples.append(sample)  # the oldest go first past MAX_PENDING
                    self._history.append(sample)
        except OSError:
            pass  # EIO: the terminal's other end closed, austin has ended
        finally:
            out.close()
        rc = proc.wait()
        if self.error is None and not self._stopping and rc != 0:
            self.error = explain(self._stderr(), self.pid, may_read(self.pid))

    def _stderr(self) -> str:
        if self._err is None:
            return ""
        try:
            self._err.seek(0)
            return self._err.read(64 * 1024)
        except (OSError, ValueError):
            return ""

    def running(self) -> bool:
        """Until the reader has read austin's last line and, when it failed, said why: a
        child that has just exited is still running here, so that :attr:`error` is set by
        the time this says False."""
        reader = self._reader
        if reader is not None:
            return reader.is_alive()
        return self._proc is not None and self._proc.poll() is None

    def take(self) -> list[StackSample]:
        with self._lock:
            out = list(self._samples)
            self._samples.clear()
        return out

    def history(self, since: float) -> list[StackSample]:
        """The samples kept (at most :data:`MAX_HISTORY`) taken at ``since`` or later, taken
        or not: what a capture reads."""
        with self._lock:
            return [s for s in self._history if s.t >= since]

    def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        if self._err is not None:
            self._err.close()
            self._err = None
