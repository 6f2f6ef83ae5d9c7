"""What the benchmarks share: a free loopback port, waiting for a server to answer, and writing
the report. Imported as ``support``: a benchmark runs as ``python3 benchmarks/NAME.py``, which
puts this folder first on ``sys.path``."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


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


def report(text: str, out: Path | None) -> None:
    """Print the report, and write it to ``out`` too when given."""
    print(text)
    if out:
        out.write_text(text + "\n")
