"""PCIe traffic: NVML's cumulative byte counters where the driver has them, else the
throughput call, read by a background thread off the sampling path.

The byte-count fields (``NVML_FI_DEV_PCIE_COUNT_TX_BYTES``/``_RX_BYTES``, :mod:`.pcie_counters`)
say bytes in so many words and cost one field read; the throughput call's "KB/s" never says
which kilo (taken as 1024 here, see ``units.py``), so where both exist the counters win and
``doctor`` prints the two side by side for the unit to be checked on the hardware.

nvmlDeviceGetPcieThroughput "is querying a byte counter over a 20ms interval" (NVML API
reference) and blocks for that window: TX+RX cost ~40 ms per GPU, ~320 ms per pass on 8 GPUs,
which the sampler's 0.1 s pace cannot afford. A dedicated daemon thread reads it instead (for
the GPUs without byte counters), one
round over the GPUs then a pause, and publishes its latest values; device samples take them,
reporting ``None`` once they are older than ``stale_after``.

The thread reads NVML without the session lock (NVML API reference, introduction,
https://docs.nvidia.com/deploy/nvml-api/nvml-api-reference.html: "NVML is thread-safe so it is
safe to make simultaneous NVML calls from multiple threads"; and pynvml calls through
ctypes.CDLL, which releases the GIL during the call), so the sampler never waits behind its
20 ms reads. It works from a snapshot of the session's GPUs, whose handles a re-init may kill
meanwhile: such a read fails, is logged once at debug, and that GPU waits a round.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, NvmlSession
from mrc_agent.agent.core.hw.nvml.units import pcie_kb_per_s_to_bytes_per_s
from mrc_agent.agent.core.hw.nvml.worker import PeriodicThread

log = logging.getLogger(__name__)

#: Name of the background thread (shows up in py-spy dumps and thread listings).
PCIE_THREAD_NAME = "mrc-agent-nvml-pcie"
#: Pause between two rounds over all GPUs, in seconds.
DEFAULT_PCIE_PERIOD_S = 0.25
#: A value older than this (seconds, monotonic) is reported as absent, never as a stale number.
DEFAULT_PCIE_STALE_AFTER_S = 5.0
#: stop() waits this long for the thread; only a hung NVML call can take longer (the thread is
#: a daemon, so even then it does not keep the process alive).
PCIE_JOIN_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PcieReading:
    """The PCIe thread's latest TX/RX rates for one GPU, in bytes per second."""

    #: When the reads finished, on the backend's monotonic clock.
    taken_at: float
    tx_bytes_per_second: float
    rx_bytes_per_second: float


def _pcie_throughput(lib: Any, handle: Any) -> tuple[int, int]:
    """TX and RX PCIe throughput in KB/s; blocks ~20 ms per direction."""
    return (
        lib.nvmlDeviceGetPcieThroughput(handle, lib.NVML_PCIE_UTIL_TX_BYTES),
        lib.nvmlDeviceGetPcieThroughput(handle, lib.NVML_PCIE_UTIL_RX_BYTES),
    )


class PcieReader:
    """The PCIe throughput thread and its latest reading per GPU.

    ``period`` is the pause between two rounds, ``stale_after`` the age (on ``clock``) past
    which a reading is no longer reported. ``thread=False`` never starts the thread; readings
    then only come from calling :meth:`run_round` (what the tests do).
    """

    def __init__(
        self,
        session: NvmlSession,
        memo: Memo,
        clock: Callable[[], float],
        *,
        period: float = DEFAULT_PCIE_PERIOD_S,
        stale_after: float = DEFAULT_PCIE_STALE_AFTER_S,
        thread: bool = True,
        skip: Callable[[str], bool] = lambda uuid: False,
    ) -> None:
        if period < 0:
            raise ValueError(f"pcie_period must be >= 0, not {period}")
        if stale_after <= 0:
            raise ValueError(f"pcie_stale_after must be > 0, not {stale_after}")
        self._session = session
        self._memo = memo
        self._clock = clock
        self._period = period
        self._stale_after = stale_after
        self._thread_enabled = thread
        #: GPUs (by UUID) served by their byte counters: the thread does not read them.
        self._skip = skip
        # What the thread shares with the sampler. Guarded by its own lock, never held across
        # an NVML call nor while taking the session lock.
        self._lock = threading.Lock()
        self._latest: dict[str, PcieReading] = {}
        self._thread = PeriodicThread(
            session, memo, PCIE_THREAD_NAME, "PCIe throughput", self.run_round,
            lambda: self._period,
        )

    @property
    def thread(self) -> threading.Thread | None:
        """The running thread, if any."""
        return self._thread.thread

    def latest(self, uuid: str) -> PcieReading | None:
        """The thread's latest reading for this GPU; None if none or too old."""
        with self._lock:
            reading = self._latest.get(uuid)
        if reading is None or self._clock() - reading.taken_at > self._stale_after:
            return None
        return reading

    def clear(self) -> None:
        """Forget every reading (at close: a new session starts without old values)."""
        with self._lock:
            self._latest.clear()

    def start(self) -> None:
        """Start the thread unless it runs or is disabled. Called holding the session lock."""
        if self._thread_enabled:
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (at most :data:`PCIE_JOIN_TIMEOUT_S`)."""
        self._thread.stop(PCIE_JOIN_TIMEOUT_S)

    def run_round(self, stop: threading.Event | None = None) -> None:
        """One round over the current GPUs: read TX and RX throughput, publish the values.

        Does nothing while NVML is not initialised. Never raises for NVML errors.
        """
        snapshot = self._session.snapshot()
        if snapshot is not None:
            self.read(*snapshot, stop=stop)

    def read(self, lib: Any, gpus: list[Gpu], *, stop: threading.Event | None = None) -> None:
        """Read and publish each GPU's throughput; a GPU whose read fails is skipped."""
        for gpu in gpus:
            if stop is not None and stop.is_set():
                return
            uuid = gpu.identity.uuid
            if self._skip(uuid):
                continue
            try:
                kb = self._memo.optional(
                    lib, gpu, "pcie_throughput", partial(_pcie_throughput, lib, gpu.handle)
                )
            except lib.NVMLError as err:
                # E.g. a handle from a session the sampler has since re-initialised, or a GPU
                # that is lost: the sampler notices and recovers; this GPU waits a round.
                self._memo.log_once(
                    log,
                    f"pcie_error:{uuid}",
                    logging.DEBUG,
                    "GPU %d (%s): reading PCIe throughput failed (%s); skipped this round",
                    gpu.index,
                    uuid,
                    err,
                )
                continue
            if kb is None:  # not supported: remembered by the memo, never read again
                with self._lock:
                    self._latest.pop(uuid, None)
                continue
            reading = PcieReading(
                taken_at=self._clock(),
                tx_bytes_per_second=pcie_kb_per_s_to_bytes_per_s(kb[0]),
                rx_bytes_per_second=pcie_kb_per_s_to_bytes_per_s(kb[1]),
            )
            with self._lock:
                self._latest[uuid] = reading

    def read_once(self, lib: Any, gpus: list[Gpu]) -> dict[str, tuple[float, float]]:
        """One throughput reading per GPU now, even where byte counters serve it (``doctor``
        compares the two); bytes per second (TX, RX). GPUs whose read fails are left out."""
        out: dict[str, tuple[float, float]] = {}
        for gpu in gpus:
            try:
                kb = self._memo.optional(
                    lib, gpu, "pcie_throughput", partial(_pcie_throughput, lib, gpu.handle)
                )
            except lib.NVMLError:
                continue
            if kb is not None:
                out[gpu.identity.uuid] = (
                    pcie_kb_per_s_to_bytes_per_s(kb[0]),
                    pcie_kb_per_s_to_bytes_per_s(kb[1]),
                )
        return out
