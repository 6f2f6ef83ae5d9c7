"""py-spy: find it, run two ``py-spy record --nonblocking`` children over one window (the
flame graph and the raw collapsed stacks), and turn its failures into a :class:`PySpyError` that
says why (missing, permission, not Python) and what to do.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import tempfile
from typing import IO

from mrc_agent.agent.core.hw.procfs import ProcFS
from mrc_agent.exporters.files import find_executable

log = logging.getLogger(__name__)


#: py-spy's default rate. 100 Hz over 10 s is 1000 stacks: enough to rank functions, and cheap
#: for the target under --nonblocking.
PY_SPY_RATE = 100


class PySpyError(Exception):
    """py-spy is missing or cannot attach; ``reason`` is a short code
    (``missing``, ``permission``, ``not_python``, ``failed``), the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def find_py_spy(explicit: str | None = None) -> str:
    """The py-spy executable (:func:`~mrc_agent.exporters.files.find_executable`: explicit,
    beside this Python from the ``diagnose`` extra, or on ``PATH``). Raises
    PySpyError('missing')."""
    try:
        return find_executable("py-spy", explicit, package="py-spy")
    except FileNotFoundError as e:
        raise PySpyError("missing", str(e)) from None


def _ptrace_hint(pid: int) -> str:
    try:
        from mrc_agent.agent.tools.doctor import ptrace_ok

        return ptrace_ok(pid, ProcFS())[1]
    except Exception as exc:  # the hint is best effort; the error itself stands
        log.debug("ptrace check failed: %s", exc)
        return "ptrace permission unknown"


def explain_failure(pid: int, stderr: str) -> PySpyError:
    """Turn py-spy's stderr into a PySpyError that says why and what to do."""
    text = stderr.strip()
    first = next((ln.strip() for ln in text.splitlines()
                  if ln.strip() and not ln.startswith("py-spy>")), "no output")
    if re.search(r"permission denied|operation not permitted|EPERM", text, re.IGNORECASE):
        return PySpyError(
            "permission",
            f"py-spy cannot attach to pid {pid}: permission denied ({_ptrace_hint(pid)}). "
            "Run as root or as the target's user with kernel.yama.ptrace_scope=0; in "
            "Kubernetes the pod needs CAP_SYS_PTRACE (securityContext.capabilities.add: "
            "[SYS_PTRACE]) and shareProcessNamespace: true")
    if "python version" in text or "executable name" in text:
        return PySpyError("not_python", f"py-spy cannot read pid {pid} as a Python process "
                                        f"(py-spy: {first})")
    return PySpyError("failed", f"py-spy failed on pid {pid}: {first}")


class PySpy:
    """Two ``py-spy record`` children over one window: the SVG and the raw stacks.

    py-spy's ``--duration`` is whole seconds, so the children get a cap a little past the
    window and are stopped with SIGINT (on which py-spy writes its output) when it ends.
    """

    def __init__(self, exe: str, pid: int, svg: str, raw: str, duration: float,
                 rate: int = PY_SPY_RATE) -> None:
        self.pid = pid
        self.svg, self.raw = svg, raw
        cap = str(math.ceil(duration) + 2)
        common = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--duration", cap,
                  "--nonblocking"]
        self._errs: list[IO[bytes]] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        for extra in (["--format", "flamegraph", "-o", svg],
                      ["--format", "raw", "--threads", "--function", "-o", raw]):
            # Closed in stop() or kill(): it must outlive this constructor.
            err = tempfile.TemporaryFile()  # noqa: SIM115
            self._errs.append(err)
            self._procs.append(subprocess.Popen(common + extra, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL, stderr=err))

    def _stderr(self, i: int) -> str:
        err = self._errs[i]
        err.seek(0)
        return err.read(64 * 1024).decode("utf-8", "replace")

    def failed_early(self) -> bool:
        """A child already exited with an error (it could not attach)."""
        return any(p.poll() not in (None, 0) for p in self._procs)

    def stop(self, timeout: float = 15.0) -> None:
        """End the window: SIGINT, wait for the files; raises PySpyError if py-spy failed."""
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self._procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        try:
            svg_rc, raw_rc = (p.returncode for p in self._procs)
            svg_err, raw_err = self._stderr(0), self._stderr(1)
        finally:
            for err in self._errs:
                err.close()
        if raw_rc != 0 or not os.path.exists(self.raw):
            raise explain_failure(self.pid, raw_err or svg_err)
        if svg_rc != 0 or not _is_svg(self.svg):
            if "No stack counts" in svg_err or os.path.getsize(self.raw) == 0:
                # No Python code ran during the window: py-spy writes no flame graph then.
                _write_empty_svg(self.svg)
            else:
                raise explain_failure(self.pid, svg_err)

    def kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for err in self._errs:
            err.close()


def _is_svg(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return b"<svg" in head and os.path.getsize(path) > 1024


def _write_empty_svg(path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write('<?xml version="1.0" standalone="no"?>\n'
                '<svg version="1.1" width="640" height="60" xmlns="http://www.w3.org/2000/svg">'
                '<text x="10" y="35" font-family="monospace" font-size="14">No samples: the '
                'target ran no Python code during the window (idle).</text></svg>\n')

