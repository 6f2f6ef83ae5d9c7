"""``mrc-agent selfcheck``'s PCIe rows at the agent's own cadence: byte counters that cannot
silently under-read, and the throughput call on its own.

NVML says of ``NVML_FI_DEV_PCIE_COUNT_{TX,RX}_BYTES`` only that the value "can be wrapped".
An unsigned-int counter wraps every ~80 ms of host->device copies, so a reader that undoes at
most one wrap per read under-reads by far at the agent's cadence while a 0.1 s poll may look
fine. So during one window of pinned host->device copies, fresh ``NvmlBackend`` instances
(each with its own counter state, as the sidecar has) read the GPU:

- every :data:`CADENCES_S` seconds: the default ``--interval`` (1 s) and the deployed 0.5 s;
- once before and once after a gap of at least ``gap_s`` (5 s on a GPU) without a read;

and each one's ``pcie_rx_bytes_total`` growth is held against the bytes copied. Beside them a
thread calls ``nvmlDeviceGetPcieThroughput`` directly (the 20 ms window the agent falls back
to) and its rate, in the agent's unit conversion, is held against the copy's bandwidth.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.nvml.pcie_counters import WRAP_BITS
from mrc_agent.agent.core.hw.nvml.units import pcie_kb_per_s_to_bytes_per_s
from mrc_agent.agent.tools.selfcheck import compare as cmp
from mrc_agent.agent.tools.selfcheck.compare import TruthCheck
from mrc_agent.agent.tools.selfcheck.workload import WorkDone, Workload

#: The agent's default --interval and the deployment's 0.5 s.
CADENCES_S = (1.0, 0.5)
#: The throughput call's own pace while the copies run (each call blocks ~20 ms).
THROUGHPUT_EVERY_S = 0.1


@dataclass
class CounterReader:
    """One agent backend reading the GPU under test every ``period`` seconds (``None``:
    only when told, before and after the window)."""

    name: str
    backend: Any
    uuid: str
    period: float | None
    clock: Callable[[], float] = time.monotonic
    reads: list[tuple[float, float | None]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def read(self) -> None:
        try:
            samples = self.backend.sample_devices()
        except (SourceUnavailable, HardwareError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        mine = next((s for s in samples if s.gpu.uuid == self.uuid), None)
        self.reads.append((self.clock(), mine.pcie_rx_bytes_total if mine else None))

    def loop(self, stop: threading.Event) -> None:
        assert self.period is not None
        while not stop.wait(self.period):
            self.read()


def counter_check(name: str, reads: list[tuple[float, float | None]], copied: float,
                  width: int | None, rate: float, why: str) -> TruthCheck:
    """The growth of the agent's total from the first read to the last against the bytes
    copied between them; the note says how often such a counter wraps at ``rate``."""
    values = [v for _, v in reads]
    measured = None
    if len(values) >= 2 and values[0] is not None and values[-1] is not None:
        measured = values[-1] - values[0]
    gaps = [b - a for (a, _), (b, _) in zip(reads, reads[1:], strict=False)]
    note = f"{why}; {len(reads)} reads, longest gap {max(gaps, default=0.0):.2f} s"
    if width is not None and rate > 0:
        note += f"; {width}-bit counter wraps every {(1 << width) / rate:.3g} s at this rate"
    check = cmp.ratio_check(name, measured, copied, cmp.PCIE_COUNTER_BAND, "B", note)
    check.extra = {"reads": len(reads), "longest_gap_s": max(gaps, default=0.0),
                   "counter_bits": width, "first_read": reads[0][0] if reads else None,
                   "last_read": reads[-1][0] if reads else None}
    return check


def field_width(lib: Any, handle: Any) -> tuple[str | None, int | None]:
    """The RX byte counter's NVML value type and the width it wraps at."""
    try:
        value = lib.nvmlDeviceGetFieldValues(handle, [lib.NVML_FI_DEV_PCIE_COUNT_RX_BYTES])[0]
    except (lib.NVMLError, AttributeError):
        return None, None
    if value.nvmlReturn != lib.NVML_SUCCESS:
        return None, None
    names = [n for n in WRAP_BITS if getattr(lib, n, None) == value.valueType]
    return (names[0], WRAP_BITS[names[0]]) if names else (str(value.valueType), None)


def throughput_loop(lib: Any, handle: Any, stop: threading.Event,
                    out: list[tuple[float, float]], clock: Callable[[], float]) -> None:
    """``nvmlDeviceGetPcieThroughput`` RX, converted as the agent converts it."""
    while not stop.is_set():
        try:
            kb = lib.nvmlDeviceGetPcieThroughput(handle, lib.NVML_PCIE_UTIL_RX_BYTES)
        except lib.NVMLError:
            return  # not supported: the row says the call gave nothing
        out.append((clock(), pcie_kb_per_s_to_bytes_per_s(kb)))
        stop.wait(THROUGHPUT_EVERY_S)


def pcie_cadence_checks(work: Workload, new_backend: Callable[[], Any],
                        nvml_lib: Callable[[], Any], uuid: str, window_s: float,
                        gap_s: float, settle_s: float, rate_settle_s: float,
                        say: Callable[[str], None]) -> tuple[list[TruthCheck], WorkDone]:
    """Host->device copies for ``max(window_s, gap_s)`` read at each cadence, over one long
    gap, and through the throughput call."""
    seconds = max(window_s, gap_s)
    readers = [CounterReader(f"every_{c:g}s", new_backend(), uuid, c) for c in CADENCES_S]
    readers.append(CounterReader(f"gap_{seconds:g}s", new_backend(), uuid, None))
    lib = nvml_lib()
    lib.nvmlInit()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    rates: list[tuple[float, float]] = []
    try:
        handle = lib.nvmlDeviceGetHandleByUUID(uuid)
        type_name, width = field_width(lib, handle)
        for r in readers:
            r.read()  # primes the counters; the first total is the baseline
        say(f"pinned host->device copies for {seconds:g} s, PCIe read every "
            f"{', '.join(f'{c:g}' for c in CADENCES_S)} s and once over the whole window "
            f"(pcie_cadence)")
        threads = [threading.Thread(target=r.loop, args=(stop,), daemon=True,
                                    name=f"selfcheck-pcie-{r.name}")
                   for r in readers if r.period is not None]
        threads.append(threading.Thread(target=throughput_loop, daemon=True,
                                        args=(lib, handle, stop, rates, time.monotonic),
                                        name="selfcheck-pcie-throughput"))
        for t in threads:
            t.start()
        done = work.copy("h2d", seconds)
        time.sleep(settle_s)
    finally:
        stop.set()
        for t in threads:
            t.join()
        lib.nvmlShutdown()
    checks = []
    for r in readers:
        r.read()
        how = f"every {r.period:g} s" if r.period else "only before and after"
        why = f"pcie_rx_bytes_total read {how} / bytes copied; value type {type_name}"
        if r.errors:
            why += f"; device source: {r.errors[0]}"
        checks.append(counter_check(f"pcie.h2d_{r.name}.rx_counter", r.reads, float(done.bytes),
                                    width, done.bandwidth, why))
        r.backend.close()
    steady = [v for t, v in rates if done.start + rate_settle_s <= t <= done.end]
    measured = statistics.median(steady) if steady else None
    checks.append(cmp.ratio_check(
        "pcie.throughput_call.rx_rate", measured, done.bandwidth, cmp.PCIE_RATE_BAND, "B/s",
        f"nvmlDeviceGetPcieThroughput RX ({len(steady)} calls, the agent's KB) / copy bandwidth"))
    return checks, done
