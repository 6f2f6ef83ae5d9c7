"""Admission control, and bounded concurrency for the chain's slow steps.

:class:`Admission` takes a request into the chain or refuses it at once with 429 and
``Retry-After``: at most ``max_concurrency + max_queue`` requests are in the chain together, so
overload costs a small, bounded amount of memory instead of a growing backlog of decoded images.
Inside the chain a request decodes its image and reads its text on pools of their own, and
holds one of ``max_concurrency`` model slots only for the model's own work: a step that an input
can make slow (OCR of a page of dense text spends its whole 10 s timeout) never holds a slot
that a quick request needs.

:class:`BoundedStep` runs such a step on a fixed number of threads, and a request waits a
bounded time for one to come free; past that it goes on without the step (:class:`StepBusy`),
so a few slow inputs delay the others by that wait at most.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from typing import Any, TypeVar

from mrc_agent.reference_service.errors import ServiceError

T = TypeVar("T")

log = logging.getLogger(__name__)


class Overloaded(ServiceError):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(429, "overloaded",
                         "the service is at capacity; retry after the given delay")
        self.retry_after_s = retry_after_s


class Admission:
    """``max_concurrency`` model slots, and at most ``max_queue`` more requests in the chain
    (decoding, reading text, or waiting for a slot)."""

    def __init__(self, max_concurrency: int, max_queue: int, retry_after_s: int) -> None:
        self._slots = asyncio.Semaphore(max_concurrency)
        self._capacity = max_concurrency + max_queue
        self._retry_after_s = retry_after_s
        self.admitted = 0
        self.waiting = 0
        self.running = 0

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold a place in the chain for the block, or raise Overloaded at once."""
        if self.admitted >= self._capacity:
            raise Overloaded(self._retry_after_s)
        self.admitted += 1
        try:
            yield
        finally:
            self.admitted -= 1

    @asynccontextmanager
    async def slot(self, waiting: AbstractContextManager[object] | None = None
                   ) -> AsyncIterator[None]:
        """Hold a model slot for the block (inside :meth:`admit`, which bounds the waiters).

        ``waiting`` is entered while the request waits for its slot (the queued gauge).
        """
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


class StepBusy(Exception):
    """No thread of a :class:`BoundedStep` came free within its wait."""


class BoundedStep:
    """A chain step on ``executor``'s threads, ``workers`` at a time (the executor's size).

    :meth:`run` waits at most ``wait_s`` for a thread, then raises :class:`StepBusy`. A thread
    counts as taken until its call really returns, even when the request that started it has
    gone, so the executor never queues work behind a busy thread.
    """

    def __init__(self, executor: concurrent.futures.Executor, workers: int,
                 wait_s: float) -> None:
        self._executor = executor
        self._free = asyncio.Semaphore(workers)
        self.wait_s = wait_s

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            await asyncio.wait_for(self._free.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            raise StepBusy(f"no thread came free within {self.wait_s:g}s") from None
        loop = asyncio.get_running_loop()
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            self._free.release()
            raise

        def done(_: concurrent.futures.Future[T]) -> None:
            try:
                loop.call_soon_threadsafe(self._free.release)
            except RuntimeError:  # the loop is closed: nobody waits for a thread any more
                log.debug("step finished after its event loop closed")

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)
