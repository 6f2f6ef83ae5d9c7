"""The queue of slow credential checks (bcrypt) in front of the exposition server's one check
thread: fair between clients, and bounded.

A bcrypt check costs tens to hundreds of milliseconds by design. With one first-come queue, 48
connections sending wrong passwords put a correct login behind 48 checks (11.7 s at cost 12,
past Prometheus's 10 s scrape timeout). Here each client address has a queue of its own and
the thread takes the addresses in turn, oldest check first within one: a login from another
address waits for the check running and at most one check per other waiting address. Within
one address every connection has at most one check waiting (a connection's requests are
answered one after another), so connections of that address are taken in turn as well.

Bounded twice: an address may have ``per_peer`` checks waiting or running and all addresses
together ``total``; past either the server answers 503 at once (its own state, not the
client's fault) and queues nothing, so a flood costs at most ``total`` waiting connections and
one thread. An IPv6 client is counted by its /64, the block one host is usually given; an
IPv4-mapped address as the IPv4 address it is.

One thread, not two: bcrypt releases the GIL and a second thread would halve the wait of a
queue served in turn, but it would also let a flood burn a second core of the node the agent
shares with the inference service; with per-address turns the wait of another address is
already one or two checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


def peer_key(peername: object) -> str:
    """Whom a connection counts as for fairness: its IPv4 address or its IPv6 /64."""
    host = peername[0] if isinstance(peername, tuple) and peername else peername
    try:
        addr = ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return str(host)
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


@dataclass
class _Job:
    check: Callable[[], bool]
    future: asyncio.Future[tuple[bool, float]]


class CheckQueue:
    """Runs ``check`` callables in one thread, taking client addresses in turn. Lives on the
    server's event loop: every method but :meth:`close` is called from there."""

    def __init__(self, per_peer: int, total: int) -> None:
        self.per_peer, self.total = per_peer, total
        self._waiting: dict[str, deque[_Job]] = {}  # address -> its waiting jobs, oldest first
        self._held: dict[str, int] = {}  # address -> checks waiting or running
        # Address -> the turn it last had, while it holds a check: the next turn goes to the
        # waiting address that had one longest ago (a new one first, then in arrival order).
        self._turns: dict[str, int] = {}
        self._turn = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mrc-agent-auth")
        self._worker: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        """Checks waiting or running."""
        return sum(self._held.values())

    def submit(self, peer: str, check: Callable[[], bool]
               ) -> asyncio.Future[tuple[bool, float]] | None:
        """Queue ``check`` for ``peer``: a future of (its answer, the monotonic time it began
        running), or None when the queue is full for this address or for all."""
        if self._held.get(peer, 0) >= self.per_peer or len(self) >= self.total:
            return None
        loop = asyncio.get_running_loop()
        job = _Job(check, loop.create_future())
        self._waiting.setdefault(peer, deque()).append(job)
        self._held[peer] = self._held.get(peer, 0) + 1
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._work())
        return job.future

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            peer = min(self._waiting, key=lambda p: self._turns.get(p, -1))
            self._turn += 1
            self._turns[peer] = self._turn
            jobs = self._waiting[peer]
            job = jobs.popleft()
            if not jobs:
                del self._waiting[peer]
            try:
                if job.future.done():  # its connection went (server stopping)
                    continue
                started = time.monotonic()
                try:
                    ok = await loop.run_in_executor(self._pool, job.check)
                except Exception as exc:  # the server logs it where it awaits the answer
                    if not job.future.done():
                        job.future.set_exception(exc)
                    continue
                if not job.future.done():
                    job.future.set_result((ok, started))
            finally:
                self._held[peer] -= 1
                if not self._held[peer]:
                    del self._held[peer]
                    del self._turns[peer]

    async def close(self) -> None:
        """Stop taking checks; the one running is left to finish in its thread."""
        for jobs in self._waiting.values():
            for job in jobs:
                job.future.cancel()
        self._waiting.clear()
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._pool.shutdown(wait=False, cancel_futures=True)
