"""What many tests share: a clock the test moves by hand, and a free loopback port."""

from __future__ import annotations

import socket


class Clock:
    """A clock the test sets by hand: ``now`` (also readable and settable as ``t``) is what
    every call returns, on whatever time base the code under test expects."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    @property
    def t(self) -> float:
        return self.now

    @t.setter
    def t(self, value: float) -> None:
        self.now = value


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
