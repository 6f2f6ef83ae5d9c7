"""The decode pool: a bounded set of daemon threads that runs decodes under a timeout.

A Python thread cannot be killed, so :class:`DecodePool` bounds the damage instead of pretending
to cancel. Decodes run on a small dedicated pool of daemon threads; a decode that overruns
``decode_timeout_s`` gets the caller a 504 at once, its thread is written off as *stuck* and a
replacement thread is started, so the pool keeps its capacity. Stuck threads are capped
(``max_stuck``); past the cap new decodes get 503 until they drain. Why not a process pool,
which could kill a hung decoder? Every request would pay to ship up to 20 MiB in and megabytes
of pixels out through a pipe, plus a process per worker with its own memory; and the decoders
here work on a finite, size-checked buffer with pixel counts bounded before decoding, so a
"hang" is in practice a pathologically slow decode that ends, returning its thread.

The pool runs any callable; it knows nothing of images.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mrc_agent.reference_service.errors import ServiceError

log = logging.getLogger(__name__)

T = TypeVar("T")


class _State(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    state: _State = _State.PENDING
    abandoned: bool = False


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the waiter timed out or was cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class DecodePool:
    """A fixed number of decode threads where a stuck decode only ever costs its own thread.

    :meth:`run` awaits a job with a timeout. On timeout the caller gets 504
    ``decode_timeout`` at once; a job still queued is dropped, a running one is *abandoned*: its
    thread is counted as stuck and a replacement thread starts, so ``workers`` threads stay
    available. When the abandoned job finally returns, its thread exits. At most ``max_stuck``
    threads may be stuck; beyond that :meth:`run` refuses with 503 ``decode_unavailable`` rather
    than growing without bound. Threads are daemons so a stuck one never blocks shutdown.
    ``on_abandoned(delta)`` hears of each change to the stuck count (+1 when a thread is
    written off, -1 when it retires): the service exports it as a gauge.
    """

    def __init__(self, workers: int, max_stuck: int | None = None,
                 name: str = "mrc-decode",
                 on_abandoned: Callable[[int], None] | None = None) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers = workers
        self.max_stuck = 2 * workers if max_stuck is None else max_stuck
        self._name = name
        self._on_abandoned = on_abandoned
        self._ids = itertools.count()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stuck = 0
        self._live = 0
        self._closed = False
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        # Called with self._lock held or before the pool is shared.
        self._live += 1
        t = threading.Thread(target=self._worker, name=f"{self._name}-{next(self._ids)}",
                             daemon=True)
        t.start()

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                with self._lock:
                    self._live -= 1
                return
            with self._lock:
                if job.state is _State.CANCELLED:
                    continue
                job.state = _State.RUNNING
            result: Any = None
            exc: BaseException | None = None
            try:
                result = job.fn(*job.args)
            except Exception as e:  # handed to the awaiting request, which decides
                exc = e
            with self._lock:
                job.state = _State.DONE
                abandoned = job.abandoned
                if abandoned:
                    self._stuck -= 1
                    self._live -= 1
                    self._abandoned(-1)  # under the lock: never reported before its +1
            if abandoned:
                log.warning("abandoned decode finished after its timeout; thread %s retires",
                            threading.current_thread().name)
                return  # its replacement has been running since the timeout
            try:
                job.loop.call_soon_threadsafe(_settle, job.future, result, exc)
            except RuntimeError:  # the awaiting event loop is closed: nobody is listening
                log.debug("decode result dropped: event loop closed")

    async def run(self, fn: Callable[..., T], *args: Any, timeout: float | None,
                  on_timeout: Callable[[bool], ServiceError] | None = None) -> T:
        """Run ``fn(*args)`` on the pool; 504 ``decode_timeout`` after ``timeout`` seconds.

        ``on_timeout(running)`` replaces that error: ``running`` says whether the job had
        started (False: it was still waiting for a thread)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("DecodePool is shut down")
            if self._stuck >= self.max_stuck:
                raise ServiceError.of(
                    "decode_unavailable",
                    f"{self._stuck} image decodes are stuck past their timeout; try again later")
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future())
        self._jobs.put(job)
        try:
            result: T = await asyncio.wait_for(job.future, timeout)
            return result
        except asyncio.TimeoutError:
            with self._lock:
                if job.state is _State.PENDING:
                    job.state = _State.CANCELLED
                    where = "waiting for a decode thread"
                elif job.state is _State.RUNNING:
                    job.abandoned = True
                    self._stuck += 1
                    self._abandoned(+1)
                    self._spawn()
                    where = "decoding"
                else:  # finished in the same instant; its result is already discarded
                    where = "finishing"
                stuck = self._stuck
            log.warning("%s timed out after %.3gs while %s (stuck: %d)",
                        self._name, timeout, where, stuck)
            if on_timeout is not None:
                raise on_timeout(where != "waiting for a decode thread") from None
            raise ServiceError.of(
                "decode_timeout", f"image decoding took longer than {timeout:g}s") from None
        except asyncio.CancelledError:
            # The request went away: drop the job if it has not started; a running one
            # finishes normally and frees its thread.
            with self._lock:
                if job.state is _State.PENDING:
                    job.state = _State.CANCELLED
            raise

    def _abandoned(self, delta: int) -> None:
        # Called with self._lock held; the callback must not call back into the pool.
        if self._on_abandoned is not None:
            self._on_abandoned(delta)

    def stats(self) -> dict[str, int]:
        """Threads alive, stuck (abandoned after a timeout) and jobs queued."""
        with self._lock:
            return {"threads": self._live, "stuck": self._stuck, "queued": self._jobs.qsize()}

    def shutdown(self) -> None:
        """Stop idle threads; stuck ones are daemons and end with the process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            n = self._live - self._stuck
        for _ in range(n):
            self._jobs.put(None)
