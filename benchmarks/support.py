"""What the benchmarks share: a free loopback port. Imported as ``support``: a benchmark runs as
``python3 benchmarks/NAME.py``, which puts this folder first on ``sys.path``."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
