"""What the image_url fetch tests share: a resolver with fixed answers that records its lookups,
and one that must never be asked."""

from __future__ import annotations

from collections.abc import Sequence


class FakeResolver:
    """Maps names to fixed answers and records every lookup."""

    def __init__(self, answers: dict[str, Sequence[str]]) -> None:
        self.answers = answers
        self.calls: list[str] = []
        self.ports: list[int] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.calls.append(host)
        self.ports.append(port)
        if host not in self.answers:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return self.answers[host]


async def no_dns(host: str, port: int) -> Sequence[str]:
    raise AssertionError(f"resolver must not be called for {host!r}")
