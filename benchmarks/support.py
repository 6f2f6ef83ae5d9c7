"""What the benchmarks share: a free loopback port, waiting for a server to answer, stopping a
process, and writing the report. Imported as ``support``: a benchmark runs as ``python3
benchmarks/NAME.py``, which puts this folder first on ``sys.path``."""

from __future__ import annotations

import argparse
import os
import platform
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


def parser(doc: str | None, quick: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring's first paragraph, ``--quick`` (``quick``
    says what it cuts) and ``--out`` (the report also written there)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--out", type=Path, help="also write the table here")
    return ap


def host() -> str:
    """The report's host line: processor architecture, cores, Python."""
    return (f"Host: {platform.machine()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}")


def report(text: str, out: Path | None) -> None:
    """Print the report, and write it to ``out`` too when given (its folder made first: the
    default ``benchmarks/results/`` may not exist in a fresh checkout)."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
