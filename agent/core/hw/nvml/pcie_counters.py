"""PCIe byte totals from NVML's byte-count fields, that cannot silently under-read.

``NVML_FI_DEV_PCIE_COUNT_TX_BYTES``/``_RX_BYTES`` say bytes in so many words and cost one
field read, but NVML says of them only that the value "can be wrapped". The width is the
value's own ``NVML_VALUE_TYPE_*``: an unsigned int wraps at 2^32 bytes, every ~67 ms of a Gen5
x16 link (an H200's) at its line rate. A reader every 0.5-1 s that undoes one wrap per read
would under-read by up to ~90 % and look fine. So:

* each GPU's link bounds what any increase may be: generation and width from NVML
  (:func:`link_bytes_per_s`), Gen6 x16 where NVML does not say;
* a narrow counter (under 64 bits) is read by a thread of its own, :data:`READS_PER_WRAP`
  times per the shortest time it can wrap in (every 22 ms on an H200), so a wrap is never
  missed while the thread keeps up;
* every read is timed from before the call to after it, and an increase is kept only when
  exactly one explanation fits the link over the longest time the two reads can be apart
  (:func:`unwrap`). A narrow counter that could have wrapped more than once since its last
  read, or any increase larger than the link carries, is dropped, not exported: the total
  skips it, the rate over that window is absent, and it is said once per GPU.
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
from mrc_agent.agent.core.hw.nvml.worker import PeriodicThread

log = logging.getLogger(__name__)

#: Name of the thread that reads narrow byte counters often enough.
NARROW_THREAD_NAME = "mrc-agent-nvml-pcie-counters"
#: stop() waits this long for the narrow-counter thread (its reads do not block).
NARROW_JOIN_TIMEOUT_S = 2.0
#: PCIe transfer rate per lane by generation, GT/s. One bit per transfer, so GT/s x lanes / 8
#: bounds the bytes per second one direction carries; line encoding and packet headers only
#: lower what a counter can see.
_GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0, 7: 128.0}
#: The bound where NVML does not say the link's generation and width: Gen6 x16.
FALLBACK_LINK_BYTES_PER_S = 64.0 * 16 / 8 * 1e9
#: Bytes any increase may carry beyond the bound (reads stamped at nearly the same instant).
_SLACK_BYTES = float(1 << 20)
#: Reads of a narrow counter per the shortest time it can wrap in: a read may then come up to
#: two periods late and still see every wrap.
READS_PER_WRAP = 3
#: The narrow-counter thread's period stays within these bounds, seconds.
_NARROW_PERIOD_MIN_S = 0.005
_NARROW_PERIOD_MAX_S = 0.25
#: Value types the byte-count fields may come back in, and the width each wraps at.
WRAP_BITS = {
    "NVML_VALUE_TYPE_UNSIGNED_INT": 32,
    "NVML_VALUE_TYPE_UNSIGNED_LONG": 64,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 64,
}


def link_bytes_per_s(generation: int | None, width: int | None) -> float:
    """What one direction of a PCIe link of ``generation`` and ``width`` lanes cannot exceed,
    bytes per second; :data:`FALLBACK_LINK_BYTES_PER_S` where either is unknown."""
    if generation not in _GT_PER_S or width is None or not 1 <= width <= 32:
        return FALLBACK_LINK_BYTES_PER_S
    return _GT_PER_S[generation] * width / 8 * 1e9


def narrow_period(bits: int, bound: float) -> float:
    """How often to read a counter of ``bits`` on a link of ``bound`` bytes per second."""
    wrap_s = float(1 << bits) / bound
    return min(_NARROW_PERIOD_MAX_S, max(_NARROW_PERIOD_MIN_S, wrap_s / READS_PER_WRAP))


def unwrap(
    previous: float, raw: float, bits: int | None, longest: float,
    bound: float = FALLBACK_LINK_BYTES_PER_S,
) -> float | None:
    """The increase from ``previous`` to ``raw`` of a counter that may wrap or restart, or
    None where the link cannot tell which.

    ``longest`` is the longest time the two reads can be apart, ``bound`` the link's bytes per
    second. None: a counter of ``bits`` that could have carried a whole wrap in that time
    (how many wraps it made cannot be known), or a reading no increase the link could carry
    explains (an impossible delta). Otherwise a decrease is one wrap when the wrapped increase
    fits the link, else a restart (driver reload, GPU reset) that counts ``raw`` from zero.
    """
    most = bound * max(longest, 0.0) + _SLACK_BYTES
    if bits is not None and bits < 64 and most >= float(1 << bits):
        return None
    if raw >= previous:
        increase: float | None = raw - previous
    elif bits is not None:
        increase = raw + float(1 << bits) - previous
    else:
        increase = None
    if increase is not None and increase <= most:
        return increase
    return raw if raw <= most else None


@dataclass
class _Count:
    """One direction's counter: the last raw reading, when it was taken (the monotonic times
    before and after the call) and the running total with every increase kept."""

    raw: float
    total: float
    before: float
    after: float


@dataclass
class _Report:
    """What the sampler last reported for one GPU, for the rate over its own interval."""

    tx: float
    rx: float
    at: float
    #: An increase was dropped since: the rate over this window is unknown.
    dropped: bool = False


class PcieCounters:
    """Cumulative PCIe TX/RX bytes from NVML's byte-count fields, where the driver has them.

    TX and RX are read in one ``nvmlDeviceGetFieldValues`` call (no 20 ms block, unlike the
    throughput call). Totals are kept per GPU UUID across NVML sessions, never go down, and
    keep only increases the link can explain. The sampler's :meth:`read` gives the rate over
    its own interval; the narrow-counter thread's :meth:`poll` only advances the totals. A GPU
    (or an nvidia-ml-py) without the fields is remembered, and the throughput thread serves
    it instead. ``clock`` is monotonic.
    """

    def __init__(self, memo: Memo, clock: Callable[[], float]) -> None:
        self._memo = memo
        self._clock = clock
        #: Guards the tables below; never held across an NVML call.
        self._lock = threading.Lock()
        #: Held from a field read to its totals, so two readers' answers apply in the order
        #: they were read (swapped, a later raw value before an earlier one looks like a wrap).
        #: Taken after the session lock where both are held, never before it.
        self._reading = threading.Lock()
        self._counts: dict[tuple[str, str], _Count] = {}
        self._reports: dict[str, _Report] = {}
        self._absent: set[str] = set()
        #: Per GPU UUID: the bytes per second its link cannot exceed.
        self._bounds: dict[str, float] = {}
        #: Per GPU UUID with a counter under 64 bits: how often the thread must read it.
        self._narrow: dict[str, float] = {}

    def live(self, uuid: str) -> bool:
        """Whether this GPU's byte counters answered (the throughput thread then skips it)."""
        with self._lock:
            return (uuid, "tx") in self._counts

    def absent(self, uuid: str) -> bool:
        """Whether this GPU is known to lack the byte counters."""
        with self._lock:
            return uuid in self._absent

    def narrow(self, uuid: str) -> bool:
        """Whether this GPU's byte counters are under 64 bits wide (the thread reads them)."""
        with self._lock:
            return uuid in self._narrow

    def narrow_period(self) -> float | None:
        """How often the thread must read the narrow counters; None when there are none."""
        with self._lock:
            return min(self._narrow.values(), default=None)

    def read(
        self, lib: Any, gpu: Gpu
    ) -> tuple[float, float, float | None, float | None] | None:
        """``(tx_total, rx_total, tx_rate, rx_rate)`` in bytes and bytes per second, or None.

        The rates are over the time since this method's previous answer for the GPU; None on
        the first, and over a window in which an increase was dropped. None when the GPU has
        no byte counters.
        """
        uuid = gpu.identity.uuid
        with self._reading:
            if not self._advance(lib, gpu):
                return None
            with self._lock:
                tx, rx = self._counts[(uuid, "tx")], self._counts[(uuid, "rx")]
                at = (tx.before + tx.after) / 2
                last = self._reports.get(uuid)
                self._reports[uuid] = _Report(tx.total, rx.total, at)
        rates: tuple[float | None, float | None] = (None, None)
        if last is not None and not last.dropped and at > last.at:
            rates = ((tx.total - last.tx) / (at - last.at), (rx.total - last.rx) / (at - last.at))
        return tx.total, rx.total, rates[0], rates[1]

    def poll(self, lib: Any, gpu: Gpu) -> None:
        """Read the counters and advance the totals (the narrow-counter thread)."""
        with self._reading:
            self._advance(lib, gpu)

    def _advance(self, lib: Any, gpu: Gpu) -> bool:
        """One field read applied to the totals; False when the GPU has no byte counters."""
        uuid = gpu.identity.uuid
        if self.absent(uuid):
            return False
        tx_id = getattr(lib, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", None)
        rx_id = getattr(lib, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", None)
        if tx_id is None or rx_id is None:
            self._mark_absent(gpu, "this nvidia-ml-py has no PCIe byte-count fields")
            return False
        before = self._clock()
        values = self._memo.optional(
            lib, gpu, "pcie_byte_counters",
            lambda: lib.nvmlDeviceGetFieldValues(gpu.handle, [tx_id, rx_id]),
        )
        after = self._clock()
        if values is None:
            self._mark_absent(gpu, "")
            return False
        got: dict[int, tuple[float, int | None]] = {}
        for value in list(values)[:2]:
            if value.nvmlReturn != lib.NVML_SUCCESS:
                if value.nvmlReturn in unsupported_codes(lib):
                    self._mark_absent(gpu, f"the driver lacks field {value.fieldId}")
                    return False
                raise lib.NVMLError(value.nvmlReturn)
            got[int(value.fieldId)] = (
                union_value(lib, value.valueType, value.value),
                counter_bits(lib, value.valueType),
            )
        if tx_id not in got or rx_id not in got:
            raise HardwareError(f"GPU {gpu.index}: NVML answered other fields than asked")
        bound = self._bound(lib, gpu)
        for direction, field_id in (("tx", tx_id), ("rx", rx_id)):
            raw, bits = got[field_id]
            self._step(gpu, direction, raw, bits, bound, before, after)
        return True

    def _step(self, gpu: Gpu, direction: str, raw: float, bits: int | None, bound: float,
              before: float, after: float) -> None:
        uuid = gpu.identity.uuid
        if bits is not None and bits < 64:
            self._note_narrow(gpu, bits, bound)
        key = (uuid, direction)
        with self._lock:
            count = self._counts.get(key)
            if count is None:
                self._counts[key] = _Count(raw=raw, total=0.0, before=before, after=after)
                return
            longest = after - count.before
            increase = unwrap(count.raw, raw, bits, longest, bound)
            total = count.total + (increase or 0.0)
            self._counts[key] = _Count(raw=raw, total=total, before=before, after=after)
            report = self._reports.get(uuid)
            if increase is None and report is not None:
                report.dropped = True
        if increase is None:
            self._memo.log_once(
                log, f"pcie_dropped:{uuid}", logging.WARNING,
                "GPU %d (%s): PCIe %s byte counter went from %.0f to %.0f in up to %.3f s, "
                "which a %s-bit counter on a %.0f GB/s link cannot be read from unambiguously; "
                "that interval is dropped from the totals and its rate left absent (said "
                "once per GPU)", gpu.index, uuid, direction.upper(), count.raw, raw, longest,
                bits if bits is not None else "?", bound / 1e9,
            )

    def _bound(self, lib: Any, gpu: Gpu) -> float:
        """The bytes per second this GPU's link cannot exceed, asked of NVML once per GPU."""
        uuid = gpu.identity.uuid
        with self._lock:
            if uuid in self._bounds:
                return self._bounds[uuid]
        found: list[int | None] = []
        for feature, name in (("pcie_max_link_generation", "nvmlDeviceGetMaxPcieLinkGeneration"),
                              ("pcie_max_link_width", "nvmlDeviceGetMaxPcieLinkWidth")):
            call = getattr(lib, name, None)
            got = None if call is None else self._memo.optional(
                lib, gpu, feature, partial(call, gpu.handle))
            found.append(int(got) if got is not None else None)
        bound = link_bytes_per_s(found[0], found[1])
        with self._lock:
            self._bounds[uuid] = bound
        return bound

    def _note_narrow(self, gpu: Gpu, bits: int, bound: float) -> None:
        uuid = gpu.identity.uuid
        period = narrow_period(bits, bound)
        with self._lock:
            if self._narrow.get(uuid) == period:
                return
            self._narrow[uuid] = period
        self._memo.log_once(
            log, f"pcie_narrow:{uuid}", logging.INFO,
            "GPU %d (%s): PCIe byte counters are %d-bit and wrap every %.0f ms at the link's "
            "%.0f GB/s; read every %.0f ms by their own thread", gpu.index, uuid, bits,
            float(1 << bits) / bound * 1e3, bound / 1e9, period * 1e3,
        )

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


class NarrowCounterReader:
    """The thread that reads narrow byte counters often enough that none wraps unseen.

    Started by the backend once a GPU's counters are found narrow; reads only those GPUs, from
    a snapshot of the session's, at :meth:`PcieCounters.narrow_period`. ``thread=False`` never
    starts it; the reads then only come from :meth:`run_round` (what the tests do).
    """

    def __init__(self, session: NvmlSession, memo: Memo, counters: PcieCounters, *,
                 thread: bool = True) -> None:
        self._session = session
        self._memo = memo
        self._counters = counters
        self._thread_enabled = thread
        self._thread = PeriodicThread(
            session, memo, NARROW_THREAD_NAME, "PCIe byte counter", self.run_round,
            lambda: counters.narrow_period() or _NARROW_PERIOD_MAX_S,
        )

    @property
    def thread(self) -> threading.Thread | None:
        """The running thread, if any."""
        return self._thread.thread

    def start(self) -> None:
        """Start the thread if a GPU has narrow counters. Called holding the session lock."""
        if self._thread_enabled and self._counters.narrow_period() is not None:
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (at most :data:`NARROW_JOIN_TIMEOUT_S`)."""
        self._thread.stop(NARROW_JOIN_TIMEOUT_S)

    def run_round(self, stop: threading.Event | None = None) -> None:
        """Read each narrow GPU's counters once. Never raises for NVML errors."""
        snapshot = self._session.snapshot()
        if snapshot is None:
            return
        lib, gpus = snapshot
        for gpu in gpus:
            if stop is not None and stop.is_set():
                return
            uuid = gpu.identity.uuid
            if not self._counters.narrow(uuid):
                continue
            try:
                self._counters.poll(lib, gpu)
            except (lib.NVMLError, HardwareError) as err:
                # A handle the sampler has since re-initialised, or a lost GPU: the sampler
                # notices and recovers. The next read's longer gap shows in its own check.
                self._memo.log_once(
                    log, f"pcie_narrow_error:{uuid}", logging.DEBUG,
                    "GPU %d (%s): reading PCIe byte counters failed (%s); skipped this round",
                    gpu.index, uuid, err,
                )


def counter_bits(lib: Any, value_type: int) -> int | None:
    """The width a counter of this ``NVML_VALUE_TYPE_*`` wraps at; None for another type."""
    for const, bits in WRAP_BITS.items():
        if value_type == getattr(lib, const, None):
            return bits
    return None
