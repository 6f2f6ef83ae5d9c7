"""``mrc-agent selfcheck --dry``: a simulated GPU and the workload that drives it, so the whole
self-check runs on a machine without a GPU.

:class:`DryModel` is the simulated hardware: a log of activities (a copy or GEMM run of known
size over a monotonic time window, work spread evenly over it) from which every reading is
integrated at the moment it is asked for: PCIe and NVLink byte counters, 20 ms throughputs, GPM
ratios over any two sample times, utilisation samples on NVML's grid, CUPTI intervals (their
GPU-activity share from the seconds kernels ran, :meth:`DryModel.busy_seconds`). So the
agent's real readers (``NvmlBackend`` and ``CuptiPmSampler``, fed through the project's one
simulated pynvml and cupti-python, ``agent/tools/simgpu``, whose data :mod:`.dry_device`
writes from this model) see numbers that agree with what :class:`DryWorkload` says it did, in
real time. :class:`DryFaults` makes the device lie in one way (half the PCIe bytes, TX and RX
swapped, ...) so a test can prove the checks catch it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from mrc_agent.agent.tools.selfcheck.workload import (
    COPY_BYTES,
    D2D_BYTES,
    GEMM_N,
    GapsDone,
    WorkDone,
    busy_with_gaps,
)

#: The simulated hardware's speeds: an H200 on PCIe Gen5 x16 with NVLink 4, roughly.
DRY_RATES = {"h2d": 52e9, "d2h": 54e9, "d2d": 2.0e12, "peer": 120e9}  # bytes per second
DRY_GEMM_S = 1.6e-3  # one 8192^3 bf16 GEMM
#: Simulated counts per unit of work.
INSTRUCTIONS_PER_GEMM = 3.1e8
INSTRUCTIONS_PER_COPIED_BYTE = 1 / 16  # one 16-byte load and store per thread and step
GEMM_DRAM_READ_BYTES = 3 * GEMM_N * GEMM_N * 2  # A, B and C once (the rest hits L2)
#: PCIe overhead the simulated counters add to payload (TLP headers), and the share of the
#: opposite direction (read requests, ACKs) a one-way copy causes.
PCIE_OVERHEAD = 1.06
PCIE_REVERSE_SHARE = 0.03
#: NVML's utilisation sample period on Hopper (about 1/6 s) and the buffer's history.
UTIL_PERIOD_S = 1 / 6
UTIL_HISTORY_S = 5.0
#: Kinds whose work runs as kernels on the SMs (what gpu_util and sm_util see).
KERNEL_KINDS = ("d2d", "gemm")


@dataclass(frozen=True)
class DryFaults:
    """Ways the simulated device can lie; the defaults are an honest device."""

    pcie_counter_scale: float = 1.0  # the PCIe byte counters report this share of the bytes
    pcie_rate_scale: float = 1.0  # NVML PCIe throughput and GPM PCIe rates likewise
    swap_pcie: bool = False  # TX and RX swapped everywhere
    dram_read_scale: float = 1.0  # CUPTI DRAM read bytes
    gemm_instruction_offset: float = 0.0  # instructions added once per GEMM run, any length
    util_timestamp_offset_s: float = 0.0  # utilisation samples stamped this much too early
    gpm_scale: float = 1.0  # every GPM activity ratio
    pcie_counters_absent: bool = False  # the PCIe byte-count fields answer NOT_SUPPORTED
    cupti_refused: bool = False  # PM sampling cannot be enabled (no profiling permission)
    activity_stamp_offset_s: float = 0.0  # CUPTI PM samples stamped this much too early
    activity_busy_throughout: bool = False  # CUPTI's GPU-activity metric never reads idle


@dataclass(frozen=True)
class Activity:
    gpu: int
    kind: str  # h2d, d2h, d2d, gemm, nvlink_tx, nvlink_rx
    start: float
    end: float
    amount: float  # bytes, or GEMMs for "gemm"

    def done_by(self, t: float) -> float:
        """The amount done by monotonic time ``t``, spread evenly over the window."""
        if t >= self.end:
            return self.amount
        if t <= self.start:
            return 0.0
        return self.amount * (t - self.start) / (self.end - self.start)

    def overlap(self, t0: float, t1: float) -> float:
        return max(0.0, min(t1, self.end) - max(t0, self.start))


@dataclass
class DryModel:
    """The simulated GPUs (index 0 is the one under test; with 2+, all linked by NVLink)."""

    gpus: int = 2
    faults: DryFaults = field(default_factory=DryFaults)
    name: str = "NVIDIA H200 (selfcheck dry run)"
    #: Width of the PCIe byte counters NVML hands out (an unsigned int wraps at 2^32, about
    #: every 80 ms of host->device copies); 64 for a driver with 64-bit counters.
    pcie_counter_bits: int = 32
    #: What the part reports as its compute capability: 9.0 is Hopper.
    compute_capability: tuple[int, int] = (9, 0)
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._log: list[Activity] = []
        self.created = self.clock()
        self.wall_offset = self.wall_clock() - self.created

    def uuid(self, index: int) -> str:
        return f"GPU-d0000000-0000-4000-8000-{index:012d}"

    def add(self, gpu: int, kind: str, start: float, end: float, amount: float) -> None:
        with self._lock:
            self._log.append(Activity(gpu, kind, start, end, amount))

    def _activities(self, gpu: int, kinds: Iterable[str]) -> list[Activity]:
        wanted = set(kinds)
        with self._lock:
            return [a for a in self._log if a.gpu == gpu and a.kind in wanted]

    def amount(self, gpu: int, kind: str, t: float) -> float:
        """Cumulative amount of ``kind`` done by time ``t``."""
        return sum(a.done_by(t) for a in self._activities(gpu, (kind,)))

    def busy_seconds(self, gpu: int, t: float) -> float:
        """Cumulative seconds up to ``t`` during which a kernel ran (:data:`KERNEL_KINDS`,
        overlapping runs counted once): what CUPTI's GPU-activity metric integrates."""
        if self.faults.activity_busy_throughout:
            return t - self.created
        spans = sorted((a.start, min(a.end, t)) for a in self._activities(gpu, KERNEL_KINDS)
                       if a.start < t)
        total, reach = 0.0, float("-inf")
        for start, end in spans:
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total

    def busy(self, gpu: int, kinds: Iterable[str], t0: float, t1: float) -> float:
        """Fraction of ``[t0, t1]`` covered by activities of ``kinds`` (at most 1)."""
        if t1 <= t0:
            return 0.0
        covered = sum(a.overlap(t0, t1) for a in self._activities(gpu, kinds))
        return min(1.0, covered / (t1 - t0))

    # --- readings, in base units ----------------------------------------------------------

    def pcie_bytes(self, gpu: int, t: float) -> tuple[float, float]:
        """Cumulative PCIe ``(tx, rx)`` bytes on the wire: host->device is the GPU's RX."""
        h2d, d2h = self.amount(gpu, "h2d", t), self.amount(gpu, "d2h", t)
        tx = PCIE_OVERHEAD * d2h + PCIE_REVERSE_SHARE * h2d
        rx = PCIE_OVERHEAD * h2d + PCIE_REVERSE_SHARE * d2h
        return (rx, tx) if self.faults.swap_pcie else (tx, rx)

    def pcie_counters(self, gpu: int, t: float) -> tuple[float, float]:
        tx, rx = self.pcie_bytes(gpu, t)
        scale = self.faults.pcie_counter_scale
        return tx * scale, rx * scale

    def pcie_rates(self, gpu: int, t0: float, t1: float) -> tuple[float, float]:
        """Mean PCIe ``(tx, rx)`` bytes per second over ``[t0, t1]``."""
        (tx0, rx0), (tx1, rx1) = self.pcie_bytes(gpu, t0), self.pcie_bytes(gpu, t1)
        dt = max(t1 - t0, 1e-9)
        scale = self.faults.pcie_rate_scale
        return (tx1 - tx0) / dt * scale, (rx1 - rx0) / dt * scale

    def nvlink_bytes(self, gpu: int, t: float) -> tuple[float, float]:
        return self.amount(gpu, "nvlink_tx", t), self.amount(gpu, "nvlink_rx", t)

    def instructions(self, gpu: int, t: float) -> float:
        gemm = self.amount(gpu, "gemm", t) * INSTRUCTIONS_PER_GEMM
        offset = self.faults.gemm_instruction_offset
        if offset:
            gemm += offset * sum(1 for a in self._activities(gpu, ("gemm",)) if a.start <= t)
        return gemm + self.amount(gpu, "d2d", t) * INSTRUCTIONS_PER_COPIED_BYTE

    def dram_read_bytes(self, gpu: int, t: float) -> float:
        read = (self.amount(gpu, "d2d", t) + self.amount(gpu, "d2h", t)
                + self.amount(gpu, "gemm", t) * GEMM_DRAM_READ_BYTES)
        return read * self.faults.dram_read_scale

    def gpm(self, gpu: int, t0: float, t1: float) -> dict[str, float]:
        """GPM metrics between two sample times, in the project's units (ratios, B/s)."""
        kernel = self.busy(gpu, KERNEL_KINDS, t0, t1)
        gemm = self.busy(gpu, ("gemm",), t0, t1)
        d2d = self.busy(gpu, ("d2d",), t0, t1)
        tx, rx = self.pcie_rates(gpu, t0, t1)
        (ntx0, nrx0), (ntx1, nrx1) = self.nvlink_bytes(gpu, t0), self.nvlink_bytes(gpu, t1)
        dt = max(t1 - t0, 1e-9)
        s = self.faults.gpm_scale
        return {
            "sm_util": min(1.0, kernel * 0.97 * s),
            "sm_occupancy": min(1.0, kernel * 0.5 * s),
            "tensor_util": min(1.0, gemm * 0.8 * s),
            "dram_bw_util": min(1.0, (d2d * 0.9 + gemm * 0.1) * s),
            "pcie_tx_bytes_per_second": tx,
            "pcie_rx_bytes_per_second": rx,
            "nvlink_tx_bytes_per_second": (ntx1 - ntx0) / dt,
            "nvlink_rx_bytes_per_second": (nrx1 - nrx0) / dt,
        }

    def util_grid(self, gpu: int, after_wall_us: int, now: float) -> list[tuple[int, int]]:
        """NVML's utilisation samples ``(wall-clock microseconds, percent)`` stamped after
        ``after_wall_us``, up to ``now``: one per :data:`UTIL_PERIOD_S` since the history
        began."""
        first = self.created - UTIL_HISTORY_S
        shift = self.faults.util_timestamp_offset_s
        out = []
        k = 1
        while True:
            g = first + k * UTIL_PERIOD_S
            if g > now:
                break
            stamp = int(round((g + self.wall_offset - shift) * 1e6))
            if stamp > after_wall_us:
                busy = self.busy(gpu, KERNEL_KINDS, g - UTIL_PERIOD_S, g)
                out.append((stamp, int(round(100 * busy))))
            k += 1
        return out


class DryWorkload:
    """The :class:`~.workload.Workload` of the dry run: each call logs its work on
    the model and sleeps for as long as the simulated hardware would take."""

    def __init__(self, model: DryModel, sleep: Callable[[float], None] = time.sleep) -> None:
        self.model = model
        self._sleep = sleep

    def uuids(self) -> list[str]:
        return [self.model.uuid(i) for i in range(self.model.gpus)]

    def peers(self) -> list[tuple[int, int]]:
        n = self.model.gpus
        return [(a, b) for a in range(n) for b in range(n) if a != b]

    def _run(self, kind: str, duration: float, count: int, bytes_per_op: int,
             log: Iterable[tuple[int, str, float]]) -> WorkDone:
        start = self.model.clock()
        end = start + duration
        for gpu, what, amount in log:
            self.model.add(gpu, what, start, end, amount)
        self._sleep(max(0.0, end - self.model.clock()))
        return WorkDone(kind, count, bytes_per_op, duration, start, end)

    def copy(self, kind: str, seconds: float) -> WorkDone:
        size = D2D_BYTES if kind == "d2d" else COPY_BYTES
        count = max(1, round(seconds * DRY_RATES[kind] / size))
        return self._run(kind, count * size / DRY_RATES[kind], count, size,
                         [(0, kind, count * size)])

    def gemm(self, seconds: float | None = None, count: int | None = None) -> WorkDone:
        n = count if count is not None else max(1, round((seconds or 0.0) / DRY_GEMM_S))
        return self._run("gemm", n * DRY_GEMM_S, n, GEMM_DRAM_READ_BYTES, [(0, "gemm", n)])

    def peer_copy(self, src: int, dst: int, seconds: float) -> WorkDone:
        count = max(1, round(seconds * DRY_RATES["peer"] / COPY_BYTES))
        total = count * COPY_BYTES
        return self._run("peer", total / DRY_RATES["peer"], count, COPY_BYTES,
                         [(src, "nvlink_tx", total), (dst, "nvlink_rx", total)])

    def idle(self, seconds: float) -> None:
        self._sleep(seconds)

    def idle_gaps(self, busy_s: float, gaps: Sequence[float]) -> GapsDone:
        return busy_with_gaps(lambda s: self.gemm(seconds=s), self._sleep, busy_s, gaps)

    def close(self) -> None:
        pass
