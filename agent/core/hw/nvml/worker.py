"""A daemon thread that reads NVML off the sampling path: one round, a pause, again.

Both PCIe threads are one of these: the throughput call's (20 ms blocking reads) and the narrow
byte counters' (a 32-bit counter read often enough that it cannot wrap twice unseen). Each runs
from a snapshot of the session's GPUs (:meth:`NvmlSession.snapshot`, which never waits for
the session lock the sampler holds through its passes), never holding that lock itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mrc_agent.agent.core.hw.nvml.session import Memo, NvmlSession

log = logging.getLogger(__name__)

class PeriodicThread:
    """Runs ``round(stop)`` then waits ``period()`` seconds, until stopped.

    ``name`` is the thread's name (py-spy dumps and thread listings show it), ``what`` what it
    reads, for its log lines. An exception from a round is logged once per type on ``memo`` and
    the thread goes on.
    """

    def __init__(
        self,
        session: NvmlSession,
        memo: Memo,
        name: str,
        what: str,
        round: Callable[[threading.Event], None],
        period: Callable[[], float],
    ) -> None:
        self._session = session
        self._memo = memo
        self._name = name
        self._what = what
        self._round = round
        self._period = period
        #: The running thread and the event that stops it; each thread gets its own event.
        #: Guarded by the session lock (start() is called holding it).
        self._worker: tuple[threading.Thread, threading.Event] | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The running thread, if any."""
        worker = self._worker
        return worker[0] if worker is not None else None

    def start(self) -> None:
        """Start the thread unless it runs. Called holding the session lock."""
        if self._worker is not None:
            return
        stop = threading.Event()
        thread = threading.Thread(target=self._loop, args=(stop,), name=self._name, daemon=True)
        self._worker = (thread, stop)
        thread.start()

    def stop(self, join_timeout: float) -> None:
        """Stop the thread and wait for it, at most ``join_timeout`` seconds: only a hung NVML
        call takes longer, and the thread is a daemon, so even then it does not keep the
        process alive."""
        with self._session.lock:
            worker, self._worker = self._worker, None
        if worker is None:
            return
        thread, stop = worker
        stop.set()  # wakes its pause at once; a round in progress ends after its current GPU
        # Joined without the session lock: a round may be in an NVML call that has to end.
        if thread is not threading.current_thread():
            thread.join(join_timeout)
            if thread.is_alive():
                log.warning(
                    "%s thread still in an NVML call after %.1f s; shutting NVML down anyway",
                    self._what, join_timeout,
                )

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self._round(stop)
            except Exception as err:  # a bug must not end the thread silently, nor spam
                self._memo.log_once(
                    log, f"{self._name}:{type(err).__name__}", logging.WARNING,
                    "%s round failed: %r", self._what, err,
                )
            stop.wait(self._period())
