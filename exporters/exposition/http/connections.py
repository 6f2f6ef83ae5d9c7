"""The exposition server's connection policy: which connections are open, which of them wait
for a request, and which one the cap closes to make room.

At the cap (:attr:`~mrc_agent.exporters.exposition.limits.Limits.max_connections`), of the
client address holding the most connections, the one that has waited longest for a request to
finish arriving — idle between requests, or part-way through its request head — is closed;
one whose request is being answered never is. A head that has not arrived whole costs the
server nothing to drop, and protecting it would let a client that sends request lines alone
hold every slot; choosing by address first means a flood from a few addresses that reconnects
as fast as it is closed (5,000 a second on loopback) closes its own connections, not a
scraper's kept-alive one idle between two scrapes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from mrc_agent.exporters.pacing import TokenBucket


@dataclass
class Conn:
    writer: asyncio.StreamWriter
    #: Its client address's request budget, shared with that address's other connections.
    budget: TokenBucket
    #: Its client address (:func:`~mrc_agent.exporters.exposition.checks.peer_key`).
    who: str = ""
    #: Set when the cap closes it, so that a connection waiting for its address's budget
    #: ends at once instead of holding its task and transport until the wait is over.
    evicted: asyncio.Event = field(default_factory=asyncio.Event)


class Connections:
    """The open connections, and the waiting ones by client address, each address's oldest
    first (so the one to close is found without a scan)."""

    def __init__(self, cap: int, held_by: Callable[[str], int]) -> None:
        self.cap = cap
        #: How many connections a client address holds (the pacing table counts them).
        self._held_by = held_by
        self._open: dict[int, Conn] = {}
        self._waiting: dict[str, dict[int, Conn]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def all(self) -> list[Conn]:
        return list(self._open.values())

    def admit(self, make: Callable[[], Conn]) -> Conn | None:
        """A new connection, after making room for it; None when every open connection is
        being answered (the caller then closes the new one)."""
        self._make_room()
        if len(self._open) >= self.cap:
            return None
        conn = make()
        self._open[id(conn)] = conn
        return conn

    def waits(self, conn: Conn) -> None:
        """``conn`` waits for its next request (or the rest of its head): evictable."""
        self.answers(conn)
        self._waiting.setdefault(conn.who, {})[id(conn)] = conn

    def answers(self, conn: Conn) -> None:
        """``conn``'s request head is whole: it is being answered, and is kept."""
        queue = self._waiting.get(conn.who)
        if queue is not None:
            queue.pop(id(conn), None)
            if not queue:
                del self._waiting[conn.who]

    def closed(self, conn: Conn) -> None:
        self._open.pop(id(conn), None)
        self.answers(conn)

    def _make_room(self) -> None:
        if len(self._open) < self.cap or not self._waiting:
            return
        # Every address in the table has a waiting connection (empty ones are dropped).
        who = max(self._waiting, key=self._held_by)
        oldest = next(iter(self._waiting[who].values()))
        oldest.writer.close()
        oldest.evicted.set()
        self.closed(oldest)
