"""PCIe traffic: NVML's cumulative byte counters where the driver has them, else the
throughput call, read by a background thread off the sampling path.

The byte-count fields (``NVML_FI_DEV_PCIE_COUNT_TX_BYTES``/``_RX_BYTES``, :class:`PcieCounters`)
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

from mrc_agent.agent.core.hw.base import HardwareError
from mrc_agent.agent.core.hw.nvml.session import (
    Gpu,
    Memo,
    NvmlSession,
    union_value,
    unsupported_codes,
)
from mrc_agent.agent.core.hw.nvml.units import pcie_kb_per_s_to_bytes_per_s

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
        #: The running thread and the event that stops it; each thread gets its own event.
        #: Guarded by the session lock (start() is called holding it).
        self._worker: tuple[threading.Thread, threading.Event] | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The running thread, if any."""
        worker = self._worker
        return worker[0] if worker is not None else None

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
        if not self._thread_enabled or self._worker is not None:
            return
        stop = threading.Event()
        thread = threading.Thread(
            target=self._loop, args=(stop,), name=PCIE_THREAD_NAME, daemon=True
        )
        self._worker = (thread, stop)
        thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (at most :data:`PCIE_JOIN_TIMEOUT_S`)."""
        with self._session.lock:
            worker, self._worker = self._worker, None
        if worker is None:
            return
        thread, stop = worker
        stop.set()  # wakes its pause at once; a round in progress ends after its current GPU
        # Joined without the session lock: the thread takes it for its snapshot of the GPUs.
        if thread is not threading.current_thread():
            thread.join(PCIE_JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning(
                    "PCIe throughput thread still in an NVML call after %.1f s; "
                    "shutting NVML down anyway",
                    PCIE_JOIN_TIMEOUT_S,
                )

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

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_round(stop)
            except Exception as err:  # a bug must not end the thread silently, nor spam
                self._memo.log_once(
                    log,
                    f"pcie_thread:{type(err).__name__}",
                    logging.WARNING,
                    "PCIe throughput round failed: %r",
                    err,
                )
            stop.wait(self._period)


#: Fastest plausible PCIe payload rate per direction, bytes per second: a Gen6 x16 link moves
#: about 121 GB/s, so twice that bounds any real increase; a larger "wrap" is a reset instead.
_MAX_PLAUSIBLE_BYTES_PER_S = 256e9
#: Value types the byte-count fields may come back in, and the width each wraps at.
_WRAP_BITS = {
    "NVML_VALUE_TYPE_UNSIGNED_INT": 32,
    "NVML_VALUE_TYPE_UNSIGNED_LONG": 64,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 64,
}


@dataclass
class _Count:
    """One direction's counter: the last raw reading and the running, wrap-free total."""

    raw: float
    total: float
    taken_at: float


def unwrap(previous: float, raw: float, bits: int | None, elapsed: float) -> float:
    """The increase from ``previous`` to ``raw`` of a counter that may wrap or reset.

    A decrease is a wrap at ``bits`` when the wrapped increase is one the link could have
    carried in ``elapsed`` seconds; otherwise the counter restarted (driver reload, GPU reset)
    and counts ``raw`` from zero.
    """
    if raw >= previous:
        return raw - previous
    if bits is not None:
        wrapped = raw + float(1 << bits) - previous
        if wrapped <= _MAX_PLAUSIBLE_BYTES_PER_S * max(elapsed, 0.01):
            return wrapped
    return raw


class PcieCounters:
    """Cumulative PCIe TX/RX bytes from NVML's byte-count fields, where the driver has them.

    ``NVML_FI_DEV_PCIE_COUNT_TX_BYTES`` / ``_RX_BYTES`` are read in one
    ``nvmlDeviceGetFieldValues`` call (no 20 ms block, unlike the throughput call). Totals
    are kept per GPU UUID across NVML sessions, with wraps and resets undone, so they never
    go down; the rate over the last two readings is what the throughput gauge then reports.
    A GPU (or an nvidia-ml-py) without the fields is remembered, and the throughput thread
    serves it instead.
    """

    def __init__(self, memo: Memo) -> None:
        self._memo = memo
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], _Count] = {}
        self._absent: set[str] = set()

    def live(self, uuid: str) -> bool:
        """Whether this GPU's byte counters answered (the thread then skips it)."""
        with self._lock:
            return (uuid, "tx") in self._counts

    def absent(self, uuid: str) -> bool:
        """Whether this GPU is known to lack the byte counters."""
        with self._lock:
            return uuid in self._absent

    def read(
        self, lib: Any, gpu: Gpu, now: float
    ) -> tuple[float, float, float | None, float | None] | None:
        """``(tx_total, rx_total, tx_rate, rx_rate)`` in bytes and bytes per second, or None.

        The rates are None on a GPU's first reading. None when the GPU has no byte counters.
        """
        if self.absent(gpu.identity.uuid):
            return None
        uuid = gpu.identity.uuid
        tx_id = getattr(lib, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", None)
        rx_id = getattr(lib, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", None)
        if tx_id is None or rx_id is None:
            self._mark_absent(gpu, "this nvidia-ml-py has no PCIe byte-count fields")
            return None
        values = self._memo.optional(
            lib, gpu, "pcie_byte_counters",
            lambda: lib.nvmlDeviceGetFieldValues(gpu.handle, [tx_id, rx_id]),
        )
        if values is None:
            self._mark_absent(gpu, "")
            return None
        got: dict[int, tuple[float, int | None]] = {}
        for value in list(values)[:2]:
            if value.nvmlReturn != lib.NVML_SUCCESS:
                if value.nvmlReturn in unsupported_codes(lib):
                    self._mark_absent(gpu, f"the driver lacks field {value.fieldId}")
                    return None
                raise lib.NVMLError(value.nvmlReturn)
            got[int(value.fieldId)] = (
                union_value(lib, value.valueType, value.value),
                _bits(lib, value.valueType),
            )
        if tx_id not in got or rx_id not in got:
            raise HardwareError(f"GPU {gpu.index}: NVML answered other fields than asked")
        with self._lock:
            tx = self._advance(uuid, "tx", *got[tx_id], now)
            rx = self._advance(uuid, "rx", *got[rx_id], now)
        return tx[0], rx[0], tx[1], rx[1]

    def _advance(
        self, uuid: str, direction: str, raw: float, bits: int | None, now: float
    ) -> tuple[float, float | None]:
        key = (uuid, direction)
        count = self._counts.get(key)
        if count is None:
            self._counts[key] = _Count(raw=raw, total=0.0, taken_at=now)
            return 0.0, None
        elapsed = now - count.taken_at
        increase = unwrap(count.raw, raw, bits, elapsed)
        self._counts[key] = _Count(raw=raw, total=count.total + increase, taken_at=now)
        rate = increase / elapsed if elapsed > 0 else None
        return count.total + increase, rate

    def _mark_absent(self, gpu: Gpu, why: str) -> None:
        uuid = gpu.identity.uuid
        with self._lock:
            if uuid in self._absent:
                return
            self._absent.add(uuid)
        self._memo.log_once(
            log, f"pcie_counters:{uuid}", logging.INFO,
            "GPU %d (%s): no PCIe byte counters%s; PCIe rates come from the 20 ms throughput "
            "call", gpu.index, uuid, f" ({why})" if why else "",
        )


def _bits(lib: Any, value_type: int) -> int | None:
    for const, bits in _WRAP_BITS.items():
        if value_type == getattr(lib, const, None):
            return bits
    return None
