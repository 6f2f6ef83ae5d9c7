"""Admission control, and bounded concurrency for the chain's slow steps.

:class:`Admission` takes a request into the chain or refuses it at once with 429 and
``Retry-After``: at most ``max_concurrency + max_queue`` requests are in the chain together, so
overload costs a small, bounded amount of memory instead of a growing backlog of decoded images.
Inside the chain a request decodes its image and reads its text on pools of their own, and
holds one of ``max_concurrency`` model slots only for the model's own work: a step that an input
can make slow (OCR of a page of dense text spends its whole 10 s timeout) never holds a slot
that a quick request needs.

:class:`BoundedStep` runs such a step on a fixed number of threads, and a request waits a
bounded time for one to come free — taking over the thread of a call that has already run
long — and past that goes on without the step (:class:`StepBusy`), so a few slow inputs delay
the others by that much at most.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mrc_agent.reference_service.errors import ServiceError

T = TypeVar("T")

log = logging.getLogger(__name__)

#: How often a request waiting for a step's thread looks for a call it may take over.
_PREEMPT_POLL_S = 0.05


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


@dataclass
class _Running:
    started: float
    cancel: threading.Event = field(default_factory=threading.Event)


class BoundedStep:
    """A chain step on ``executor``'s threads, ``workers`` at a time (the executor's size).

    The step's callable is called with a ``cancel`` keyword (a :class:`threading.Event`) and
    must give up soon after it is set. :meth:`run` waits at most ``wait_s`` for a thread, then
    raises :class:`StepBusy`; while it waits, it takes the thread of the call that has run
    longest, once that call has run ``preempt_after_s``: a few inputs that keep the step busy
    for its whole timeout (OCR of a page of dense text) then cost the other requests that long
    at most, not the full timeout each. A thread counts as taken until its call really
    returns, even when the request that started it has gone, so the executor never queues work
    behind a busy thread.
    """

    def __init__(self, executor: concurrent.futures.Executor, workers: int,
                 wait_s: float, preempt_after_s: float | None = None) -> None:
        self._executor = executor
        self._free = asyncio.Semaphore(workers)
        self.wait_s = wait_s
        self.preempt_after_s = preempt_after_s
        self._running: list[_Running] = []

    def _preempt(self) -> None:
        """Cancel the longest-running call, if it has run long enough and is not cancelled."""
        if self.preempt_after_s is None:
            return
        now = time.monotonic()
        live = [r for r in self._running if not r.cancel.is_set()]
        if live:
            oldest = min(live, key=lambda r: r.started)
            if now - oldest.started >= self.preempt_after_s:
                oldest.cancel.set()

    async def _acquire(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StepBusy(f"no thread came free within {self.wait_s:g}s")
            try:
                # Short waits: between them a call may have run long enough to be taken over.
                await asyncio.wait_for(self._free.acquire(), min(left, _PREEMPT_POLL_S))
                return
            except asyncio.TimeoutError:
                self._preempt()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._free.locked():
            self._preempt()
        await self._acquire()
        loop = asyncio.get_running_loop()
        running = _Running(time.monotonic())
        self._running.append(running)
        try:
            job = self._executor.submit(functools.partial(fn, *args, cancel=running.cancel))
        except BaseException:
            self._running.remove(running)
            self._free.release()
            raise

        def release() -> None:
            self._running.remove(running)
            self._free.release()

        def done(_: concurrent.futures.Future[T]) -> None:
            try:
                loop.call_soon_threadsafe(release)
            except RuntimeError:  # the loop is closed: nobody waits for a thread any more
                log.debug("step finished after its event loop closed")

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)
