"""What the benchmarks share: a free loopback port, waiting for a server to answer, stopping a
process, and writing the report. Imported as ``support``: a benchmark runs as ``python3
benchmarks/NAME.py``, which puts this folder first on ``sys.path``."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_http(url: str, what: str, timeout: float,
              proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``url`` answers 200; SystemExit when ``proc`` (the server) exits first or
    ``timeout`` seconds pass: the benchmark cannot measure."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready within {timeout:g} s")


def stop(proc: subprocess.Popen[Any], timeout: float = 30) -> None:
    """Terminate ``proc`` and reap it, killing it when it outlives ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (``VmRSS``); 0 when the kernel gives none."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def report(text: str, out: Path | None) -> None:
    """Print the report, and write it to ``out`` too when given (its folder made first: the
    default ``benchmarks/results/`` may not exist in a fresh checkout)."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
