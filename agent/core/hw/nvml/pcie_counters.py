"""PCIe byte totals from NVML's byte-count fields, that cannot silently under-read.

``NVML_FI_DEV_PCIE_COUNT_TX_BYTES``/``_RX_BYTES`` say bytes in so many words and cost one
field read, but NVML says of them only that the value "can be wrapped". NVIDIA's open
driver keeps them as 32-bit values (``ctrl2080bus.h``) whatever ``NVML_VALUE_TYPE_*`` NVML
hands them back as, so a counter is taken as 32 bits wide until a value of 2^32 or more has
been seen on it (then it is known to be 64); a signed type's negative value is the unsigned
one it was cast from. 32 bits
wrap at 2^32 bytes, every ~67 ms of a Gen5 x16 link (an H200's) at its line rate. A reader
every 0.5-1 s that undoes one wrap per read would under-read by up to ~90 % and look fine. So:

* each GPU's link bounds what any increase may be (:func:`link_bytes_per_s`): the larger of
  NVML's device-only and reported max generation (the reported one is capped by the upstream
  port, which a VM or riser may under-report), at a width of at least 16; Gen6 x16 where NVML
  says neither generation;
* a narrow counter (not yet seen at 2^32 or more) is read by a thread of its own,
  :data:`READS_PER_WRAP` times per the shortest time it can wrap in (every 22 ms on an H200),
  so a wrap is never missed while the thread keeps up;
* every read is timed from before the call to after it, and an increase is kept only when
  exactly one explanation fits the link over the longest time the two reads can be apart
  (:func:`unwrap`). A narrow counter that could have wrapped more than once since its last
  read, or any increase larger than the link carries, is dropped, not exported: the total
  skips it, the rate over that window is absent, it is said once per GPU, and it is counted
  per direction and :data:`DROP_REASONS` reason (:meth:`PcieCounters.dropped`).

The thread's reads are the agent's most frequent work (8 GPUs x 45 rounds a second on
H200s), so a read looks nothing up that cannot change: NVML's field ids, codes and value
types are taken from the library once (:class:`Vocabulary`), a counter's state is updated in
place, and a round asks which GPUs are narrow once, not per GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from mrc_agent.agent.core.hw.base import HardwareError
from mrc_agent.agent.core.hw.nvml.session import (
    VALUE_MEMBERS,
    Gpu,
    Memo,
    NvmlSession,
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
#: Value types the byte-count fields may come back in, and the width each type names. The
#: counter's own width may be less (see the module docstring): :meth:`PcieCounters` takes 32
#: until it has seen a value of 2^32 or more.
WRAP_BITS = {
    "NVML_VALUE_TYPE_UNSIGNED_INT": 32,
    "NVML_VALUE_TYPE_SIGNED_INT": 32,
    "NVML_VALUE_TYPE_UNSIGNED_LONG": 64,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 64,
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 64,
}
_SIGNED_BITS = {"NVML_VALUE_TYPE_SIGNED_INT": 32, "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 64}
#: The width a counter is taken to have until a value at or past 2^32 shows it is wider.
NARROW_BITS = 32
#: The least link width the bound assumes: a riser or VM may report fewer lanes than it has.
_MIN_LINK_WIDTH = 16
#: Why an interval was dropped: ``gap``, a narrow counter's two reads so far apart it could
#: have wrapped more than once; ``impossible``, an increase no wrap nor restart the link could
#: carry explains.
DROP_REASONS = ("gap", "impossible")
DIRECTIONS = ("tx", "rx")


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
    None where the link cannot tell which (:func:`judge` says why)."""
    return judge(previous, raw, bits, longest, bound)[0]


def judge(
    previous: float, raw: float, bits: int | None, longest: float,
    bound: float = FALLBACK_LINK_BYTES_PER_S,
) -> tuple[float | None, str | None]:
    """``(increase, None)``, or ``(None, reason)`` with a :data:`DROP_REASONS` reason.

    ``longest`` is the longest time the two reads can be apart, ``bound`` the link's bytes per
    second. None: a counter of ``bits`` that could have carried a whole wrap in that time
    (how many wraps it made cannot be known), or a reading no increase the link could carry
    explains (an impossible delta). Otherwise a decrease is one wrap when the wrapped increase
    fits the link, else a restart (driver reload, GPU reset) that counts ``raw`` from zero.
    """
    most = bound * max(longest, 0.0) + _SLACK_BYTES
    if bits is not None and bits < 64 and most >= float(1 << bits):
        return None, "gap"
    if raw >= previous:
        increase: float | None = raw - previous
    elif bits is not None:
        increase = raw + float(1 << bits) - previous
    else:
        increase = None
    if increase is not None and increase <= most:
        return increase, None
    return (raw, None) if raw <= most else (None, "impossible")


@dataclass(frozen=True)
class Vocabulary:
    """What a read needs from one NVML library, looked up once per library object.

    An attribute of nvidia-ml-py is a module lookup per use, and a read would make a dozen;
    none of them can change while the library is loaded.
    """

    #: The TX and RX byte-count field ids; None where this nvidia-ml-py has no such fields.
    fields: tuple[int, int] | None
    success: int
    #: Value type -> (nvmlValue_t member, width of a signed type or 0), as
    #: :func:`~mrc_agent.agent.core.hw.nvml.session.union_value` and :func:`counter_raw`
    #: read them (the first constant of a value wins, as their loops do).
    decode: dict[int, tuple[str, int]]

    @classmethod
    def of(cls, lib: Any) -> Vocabulary:
        tx_id = getattr(lib, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", None)
        rx_id = getattr(lib, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", None)
        decode: dict[int, tuple[str, int]] = {}
        for const, member in VALUE_MEMBERS:
            code = getattr(lib, const, None)
            if code is not None and code not in decode:
                decode[code] = (member, 0)
        for const, bits in _SIGNED_BITS.items():
            code = getattr(lib, const, None)
            if code in decode and not decode[code][1]:
                decode[code] = (decode[code][0], bits)
        fields = None if tx_id is None or rx_id is None else (int(tx_id), int(rx_id))
        return cls(fields, lib.NVML_SUCCESS, decode)

    def raw(self, value_type: int, value: Any) -> float:
        """:func:`counter_raw`, from the table."""
        try:
            member, signed = self.decode[value_type]
        except KeyError:
            raise HardwareError(f"NVML returned an unknown value type {value_type}") from None
        raw = float(getattr(value, member))
        if raw >= 0 or not signed:
            return raw
        wrap = signed if raw < -float(1 << 31) else NARROW_BITS
        return raw + float(1 << wrap)


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
    its own interval; the narrow-counter thread's :meth:`poll_round` only advances the totals. A GPU
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
        #: Per GPU UUID with a counter taken as narrow: how often the thread must read it.
        self._narrow: dict[str, float] = {}
        #: Counters (UUID, direction) seen at 2^32 or more: 64 bits wide, whatever their type.
        self._wide: set[tuple[str, str]] = set()
        #: Intervals dropped per (UUID, direction, reason), since the agent started.
        self._dropped: dict[tuple[str, str, str], int] = {}
        #: The library last read and its :class:`Vocabulary`.
        self._vocabulary: tuple[Any, Vocabulary] | None = None

    def live(self, uuid: str) -> bool:
        """Whether this GPU's byte counters answered (the throughput thread then skips it)."""
        with self._lock:
            return (uuid, "tx") in self._counts

    def absent(self, uuid: str) -> bool:
        """Whether this GPU is known to lack the byte counters."""
        with self._lock:
            return uuid in self._absent

    def narrow(self, uuid: str) -> bool:
        """Whether a byte counter of this GPU is taken as narrow (the thread reads them)."""
        with self._lock:
            return uuid in self._narrow

    def narrow_set(self) -> frozenset[str]:
        """The UUIDs of the GPUs with a counter taken as narrow, at once."""
        with self._lock:
            return frozenset(self._narrow)

    def narrow_period(self) -> float | None:
        """How often the thread must read the narrow counters; None when there are none."""
        with self._lock:
            return min(self._narrow.values(), default=None)

    def dropped(self, uuid: str) -> dict[tuple[str, str], float]:
        """Intervals dropped from this GPU's totals per (direction, reason), every pair present
        (0 where none was); empty for a GPU whose byte counters have not answered."""
        with self._lock:
            if (uuid, "tx") not in self._counts:
                return {}
            return {(d, r): float(self._dropped.get((uuid, d, r), 0))
                    for d in DIRECTIONS for r in DROP_REASONS}

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
                # Copied here: the thread updates the counts in place once the lock is free.
                tx, rx = self._counts[(uuid, "tx")], self._counts[(uuid, "rx")]
                tx_total, rx_total, at = tx.total, rx.total, (tx.before + tx.after) / 2
                last = self._reports.get(uuid)
                self._reports[uuid] = _Report(tx_total, rx_total, at)
        rates: tuple[float | None, float | None] = (None, None)
        if last is not None and not last.dropped and at > last.at:
            rates = ((tx_total - last.tx) / (at - last.at), (rx_total - last.rx) / (at - last.at))
        return tx_total, rx_total, rates[0], rates[1]

    def _advance(self, lib: Any, gpu: Gpu) -> bool:
        """One field read applied to the totals; False when the GPU has no byte counters.

        The narrow-counter thread runs this for every narrow GPU some 45 times a second, so
        the tables are locked twice (before the read and after it), and the answer's fields
        are read past pynvml's per-read Python hook (``_PrintableStructure.__getattribute__``
        turns bytes into str; these fields are numbers)."""
        uuid = gpu.identity.uuid
        with self._lock:
            if uuid in self._absent:
                return False
            bound = self._bounds.get(uuid)
        vocabulary = self._vocabulary_of(lib)
        if vocabulary.fields is None:
            self._mark_absent(gpu, "this nvidia-ml-py has no PCIe byte-count fields")
            return False
        tx_id, rx_id = vocabulary.fields
        before = self._clock()
        values = self._memo.optional(
            lib, gpu, "pcie_byte_counters",
            lambda: lib.nvmlDeviceGetFieldValues(gpu.handle, [tx_id, rx_id]),
        )
        after = self._clock()
        if values is None:
            self._mark_absent(gpu, "")
            return False
        got: dict[int, float] = {}
        for value in list(values)[:2]:
            code = _field(value, "nvmlReturn")
            if code != vocabulary.success:
                if code in unsupported_codes(lib):
                    self._mark_absent(gpu, f"the driver lacks field {_field(value, 'fieldId')}")
                    return False
                raise lib.NVMLError(code)
            got[int(_field(value, "fieldId"))] = vocabulary.raw(
                _field(value, "valueType"), _field(value, "value"))
        if tx_id not in got or rx_id not in got:
            raise HardwareError(f"GPU {gpu.index}: NVML answered other fields than asked")
        if bound is None:
            bound = self._bound(lib, gpu)
        with self._lock:
            drops, period = self._apply(uuid, bound, (got[tx_id], got[rx_id]), before, after)
        self._say(gpu, bound, drops, period)
        return True

    def poll_round(self, lib: Any, gpus: Sequence[Gpu], stop: threading.Event | None = None
                   ) -> list[tuple[Gpu, Exception]]:
        """Read each of ``gpus``' counters once and advance the totals: the narrow-counter
        thread's round, some 45 times a second. What :meth:`_advance` does per GPU, with the
        tables locked twice a round rather than twice a GPU, and one clock read between two
        GPUs' reads (the end of one is the start of the next). A GPU whose answer is anything
        but two successful counts (an error, a field it lacks, an unknown value type) or whose
        link bound is not known yet is read again by :meth:`_advance`, which says what it
        means. Returns the GPUs whose read failed there (NVMLError or HardwareError)."""
        vocabulary = self._vocabulary_of(lib)
        answers: list[tuple[Gpu, float, tuple[float, float], float, float]] = []
        said: list[tuple[Gpu, float, list[tuple[Any, ...]], float | None]] = []
        with self._reading:
            if vocabulary.fields is None:
                return self._advance_each(lib, gpus)  # each marked absent, saying why
            tx_id, rx_id = vocabulary.fields
            fields, read = [tx_id, rx_id], lib.nvmlDeviceGetFieldValues
            failed: list[tuple[Gpu, Exception]] = []
            with self._lock:
                todo = [(g, self._bounds.get(g.identity.uuid)) for g in gpus
                        if g.identity.uuid not in self._absent]
            after = self._clock()
            for gpu, bound in todo:
                if stop is not None and stop.is_set():
                    break
                before = after
                try:
                    counts = _counts_of(read(gpu.handle, fields), vocabulary, tx_id, rx_id)
                except Exception:  # noqa: BLE001  (read again below, where it is said)
                    counts = None
                after = self._clock()
                if counts is None or bound is None:
                    failed += self._advance_each(lib, [gpu])
                    after = self._clock()
                    continue
                answers.append((gpu, bound, counts, before, after))
            with self._lock:
                for gpu, bound, counts, before, after in answers:
                    drops, period = self._apply(gpu.identity.uuid, bound, counts, before, after)
                    if drops or period is not None:
                        said.append((gpu, bound, drops, period))
        for gpu, bound, drops, period in said:
            self._say(gpu, bound, drops, period)
        return failed

    def _advance_each(self, lib: Any, gpus: Sequence[Gpu]) -> list[tuple[Gpu, Exception]]:
        """:meth:`_advance` each GPU, holding ``_reading``; the ones whose read failed."""
        failed: list[tuple[Gpu, Exception]] = []
        for gpu in gpus:
            try:
                self._advance(lib, gpu)
            except (lib.NVMLError, HardwareError) as err:
                failed.append((gpu, err))
        return failed

    def _apply(self, uuid: str, bound: float, counts: tuple[float, float], before: float,
               after: float) -> tuple[list[tuple[Any, ...]], float | None]:
        """Holding ``_lock``: one reading of the TX and RX counts applied. Returns the dropped
        intervals to log, each led by its direction, and the thread's period when the GPU has
        just become narrow (else None)."""
        drops: list[tuple[Any, ...]] = []
        narrow = False
        for direction, raw in zip(DIRECTIONS, counts, strict=True):
            still, drop = self._step(uuid, direction, raw, bound, before, after)
            narrow = still or narrow
            if drop is not None:
                drops.append((direction, *drop))
        return drops, self._note_narrow(uuid, narrow, bound)

    def _say(self, gpu: Gpu, bound: float, drops: list[tuple[Any, ...]],
             period: float | None) -> None:
        """Log, once per GPU, a dropped interval and the counters being taken as narrow."""
        uuid = gpu.identity.uuid
        for direction, previous, raw, longest, bits in drops:
            self._memo.log_once(
                log, f"pcie_dropped:{uuid}", logging.WARNING,
                "GPU %d (%s): PCIe %s byte counter went from %.0f to %.0f in up to %.3f s, "
                "which a %s-bit counter on a %.0f GB/s link cannot be read from unambiguously; "
                "that interval is dropped from the totals and its rate left absent (said "
                "once per GPU; mrc_gpu_pcie_dropped_intervals_total counts each)", gpu.index,
                uuid, direction.upper(), previous, raw, longest, bits, bound / 1e9,
            )
        if period is not None:
            self._memo.log_once(
                log, f"pcie_narrow:{uuid}", logging.INFO,
                "GPU %d (%s): PCIe byte counters are taken as %d-bit (none seen at 2^32 yet) "
                "and wrap every %.0f ms at the link's %.0f GB/s; read every %.0f ms by their "
                "own thread", gpu.index, uuid, NARROW_BITS,
                float(1 << NARROW_BITS) / bound * 1e3, bound / 1e9, period * 1e3,
            )

    def _vocabulary_of(self, lib: Any) -> Vocabulary:
        cached = self._vocabulary
        if cached is None or cached[0] is not lib:
            cached = self._vocabulary = (lib, Vocabulary.of(lib))
        return cached[1]

    def _step(self, uuid: str, direction: str, raw: float, bound: float,
              before: float, after: float
              ) -> tuple[bool, tuple[float, float, float, int] | None]:
        """Apply one reading, holding ``_lock``: whether the counter is still taken as narrow,
        and, where its interval was dropped, (previous raw, raw, longest gap, bits) to log."""
        key = (uuid, direction)
        if raw >= float(1 << NARROW_BITS):
            self._wide.add(key)  # judged wide from here on, this reading included
        bits = 64 if key in self._wide else NARROW_BITS
        count = self._counts.get(key)
        if count is None:
            self._counts[key] = _Count(raw=raw, total=0.0, before=before, after=after)
            return bits < 64, None
        longest = after - count.before
        previous = count.raw
        increase, reason = judge(previous, raw, bits, longest, bound)
        # In place, under the lock: read() copies what it reports while holding it.
        count.raw, count.before, count.after = raw, before, after
        if increase is not None:
            count.total += increase
        if reason is None:
            return bits < 64, None
        drop = (uuid, direction, reason)
        self._dropped[drop] = self._dropped.get(drop, 0) + 1
        report = self._reports.get(uuid)
        if report is not None:
            report.dropped = True
        return bits < 64, (previous, raw, longest, bits)

    def _bound(self, lib: Any, gpu: Gpu) -> float:
        """The bytes per second this GPU's link cannot exceed, asked of NVML once per GPU."""
        uuid = gpu.identity.uuid
        with self._lock:
            if uuid in self._bounds:
                return self._bounds[uuid]
        found: list[int | None] = []
        for feature, name in (
            ("pcie_gpu_max_link_generation", "nvmlDeviceGetGpuMaxPcieLinkGeneration"),
            ("pcie_max_link_generation", "nvmlDeviceGetMaxPcieLinkGeneration"),
            ("pcie_max_link_width", "nvmlDeviceGetMaxPcieLinkWidth"),
        ):
            call = getattr(lib, name, None)
            got = None if call is None else self._memo.optional(
                lib, gpu, feature, partial(call, gpu.handle))
            found.append(int(got) if got is not None else None)
        # The device's own max generation is not capped by the upstream port, which a VM or a
        # riser may under-report; a bound too low drops every real increase, one too high
        # only lets a wrap be missed later (the thread then reads less often than it could).
        generations = [g for g in found[:2] if g in _GT_PER_S]
        bound = link_bytes_per_s(
            max(generations, default=None), max(found[2] or 0, _MIN_LINK_WIDTH))
        with self._lock:
            self._bounds[uuid] = bound
        return bound

    def _note_narrow(self, uuid: str, narrow: bool, bound: float) -> float | None:
        """Holding ``_lock``: note whether the GPU's counters are narrow; the thread's period
        when the GPU has just become narrow (to log), else None."""
        if not narrow:  # both counters seen wide: the sampler's reads suffice
            self._narrow.pop(uuid, None)
            return None
        if uuid in self._narrow:  # its period follows from its bound, fixed per GPU
            return None
        period = self._narrow[uuid] = narrow_period(NARROW_BITS, bound)
        return period

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
        narrow = self._counters.narrow_set()
        failed = self._counters.poll_round(
            lib, [g for g in gpus if g.identity.uuid in narrow], stop)
        for gpu, err in failed:
            # A handle the sampler has since re-initialised, or a lost GPU: the sampler
            # notices and recovers. The next read's longer gap shows in its own check.
            self._memo.log_once(
                log, f"pcie_narrow_error:{gpu.identity.uuid}", logging.DEBUG,
                "GPU %d (%s): reading PCIe byte counters failed (%s); skipped this round",
                gpu.index, gpu.identity.uuid, err,
            )


#: A field of an answer's structure, read without pynvml's Python-level ``__getattribute__``.
_field = object.__getattribute__


def _counts_of(values: Any, vocabulary: Vocabulary, tx_id: int, rx_id: int
               ) -> tuple[float, float] | None:
    """The TX and RX counts of a field answer where both succeeded, else None."""
    got: dict[int, float] = {}
    for value in values[:2]:
        if _field(value, "nvmlReturn") != vocabulary.success:
            return None
        got[_field(value, "fieldId")] = vocabulary.raw(
            _field(value, "valueType"), _field(value, "value"))
    tx, rx = got.get(tx_id), got.get(rx_id)
    return None if tx is None or rx is None else (tx, rx)


def counter_raw(lib: Any, value_type: int, value: Any) -> float:
    """A byte count as the unsigned value the driver keeps, from an nvmlValue_t of any type.

    A signed type's negative value is an unsigned one cast: an int's is taken modulo 2^32,
    a long long's modulo 2^32 where it fits an int (a 32-bit count sign-extended), else 2^64.
    """
    return Vocabulary.of(lib).raw(value_type, value)
