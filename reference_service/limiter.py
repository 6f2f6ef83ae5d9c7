"""Admission control: a concurrency limit with a bounded queue in front of it.

A request either gets a model slot, waits in the queue (at most ``max_queue`` waiters), or is
refused at once with 429 and ``Retry-After`` — so overload costs a small, bounded amount of
memory instead of a growing backlog of decoded images.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext

from mrc_agent.reference_service.errors import ServiceError


class Overloaded(ServiceError):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(429, "overloaded",
                         "the service is at capacity; retry after the given delay")
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int, retry_after_s: int) -> None:
        self._slots = asyncio.Semaphore(max_concurrency)
        self._max_queue = max_queue
        self._retry_after_s = retry_after_s
        self.waiting = 0
        self.running = 0

    @asynccontextmanager
    async def slot(self, waiting: AbstractContextManager[object] | None = None
                   ) -> AsyncIterator[None]:
        """Hold a model slot for the duration of the block, or raise Overloaded at once.

        ``waiting`` is entered while the request waits for its slot (the queued gauge).
        """
        if self._slots.locked() and self.waiting >= self._max_queue:
            raise Overloaded(self._retry_after_s)
        self.waiting += 1
        try:
            with waiting if waiting is not None else nullcontext():
                await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
