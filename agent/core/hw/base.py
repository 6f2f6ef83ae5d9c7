"""The hardware boundary: what a GPU source returns, the protocols it implements, and the
project's own error types.

Everything above this module (collectors, runner, recorder) speaks only these types; the NVML,
CUPTI and replay adapters translate their library's answers and errors into them. All fields of
the samples are optional: ``None`` means "this source does not measure it on this GPU", which
the collectors turn into an absent series, never into a zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


def finite(value: float | None) -> float | None:
    """``value`` as a float, or None when it is absent, NaN or infinite.

    Every number a hardware library hands over passes through here or :func:`ratio`: NVML can
    answer SUCCESS with NaN, and a NaN exported is a series no rule can reason about.
    """
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def ratio(value: float | None) -> float | None:
    """A finite value clamped to 0-1 (None when absent or not finite)."""
    number = finite(value)
    return None if number is None else min(1.0, max(0.0, number))


def ratio_of_percent(value: float | None) -> float | None:
    """A percentage (0-100, as NVML and CUPTI give them) as a ratio clamped to 0-1; None when
    absent or not finite."""
    number = finite(value)
    return None if number is None else ratio(number / 100.0)


class HardwareError(Exception):
    """A hardware source failed at run time (GPU lost, timeout, driver error)."""


class SourceUnavailable(HardwareError):
    """The source does not apply here: no GPU, no NVML library, no GPM, no profiling permission.

    ``reason`` is a short, bounded code (it becomes a label value); ``detail`` is for people.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class GPUIdentity:
    """Labels every per-GPU series carries."""

    index: int
    uuid: str
    name: str

    @property
    def labels(self) -> tuple[str, str, str]:
        return (str(self.index), self.uuid, self.name)

    @property
    def is_mig(self) -> bool:
        """A MIG device, not a whole GPU: NVML reports one per slice, with its ``MIG-…`` UUID
        (in any case) and the index of its physical GPU. CUPTI refuses those."""
        return self.uuid[:4].lower() == "mig-"


@dataclass
class DeviceSample:
    """NVML-level device state. Rates are bytes per second, counters are cumulative."""

    gpu: GPUIdentity
    gpu_util: float | None = None  # 0-1, fraction of the sample period a kernel ran
    mem_util: float | None = None  # 0-1, memory-controller busy fraction
    #: Fine-grained utilisation samples ``(monotonic seconds, 0-1)`` since the last call,
    #: oldest first, when the source keeps a sample buffer (NVML GetSamples, replay).
    util_samples: list[tuple[float, float]] = field(default_factory=list)
    mem_used_bytes: float | None = None
    mem_total_bytes: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    #: Cumulative PCIe bytes (NVML_FI_DEV_PCIE_COUNT_TX_BYTES / _RX_BYTES), wraps undone.
    pcie_tx_bytes_total: float | None = None
    pcie_rx_bytes_total: float | None = None
    pcie_replays_total: float | None = None
    #: Intervals dropped from the PCIe byte totals, cumulative, per ``(direction, reason)``
    #: (``tx``/``rx``; ``gap``/``impossible``); every pair, at 0 too, where the counters answer.
    pcie_dropped_intervals: dict[tuple[str, str], float] = field(default_factory=dict)
    nvlink_tx_bytes_total: float | None = None  # summed over links
    nvlink_rx_bytes_total: float | None = None
    #: Per-link cumulative ``(tx_bytes, rx_bytes)``, keyed by link index.
    nvlink_links: dict[int, tuple[float, float]] = field(default_factory=dict)
    power_watts: float | None = None
    sm_clock_hertz: float | None = None
    temperature_celsius: float | None = None
    ecc_corrected_total: float | None = None
    ecc_uncorrected_total: float | None = None
    xid_errors_total: float | None = None
    last_xid: float | None = None
    #: GPU memory held by each process, keyed by the PID NVML reports.
    process_memory_bytes: dict[int, float] = field(default_factory=dict)
    #: Which reading is live where the source had a choice, e.g. ``{"pcie": "byte_counters",
    #: "nvlink": "aggregate", "util_clock": "realtime"}``; bounded values (they become labels).
    sources: dict[str, str] = field(default_factory=dict)


@dataclass
class GpmSample:
    """NVML GPM (Hopper+) activity ratios (0-1) and rates (bytes per second)."""

    gpu: GPUIdentity
    sm_util: float | None = None
    sm_occupancy: float | None = None
    tensor_util: float | None = None
    dram_bw_util: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_rx_bytes_per_second: float | None = None
    #: For a MIG device: the GPU instance these numbers were measured over. GPM samples a
    #: whole GPU instance (``nvmlGpmMigSampleGet``), so every MIG device (compute instance) of
    #: it gets the same values (the GPM collector exports them once per GPU instance); ``None``
    #: for a whole GPU.
    gpu_instance: int | None = None


@dataclass
class ProfilingSample:
    """True hardware counters (CUPTI PM sampling), cumulative since the source started."""

    gpu: GPUIdentity
    sm_instructions_executed_total: float | None = None
    dram_read_bytes_total: float | None = None
    #: Where the chip's PM-sampling set has no DRAM byte counter, only a read-throughput
    #: percentage: its mean over the intervals decoded by this call, as a 0-1 ratio of peak.
    #: Never a byte count.
    dram_read_throughput_ratio: float | None = None
    #: The CUPTI metric names and single-pass set configured on this GPU (``None``: not
    #: measured, or configured without a set). Bounded: they come from CUPTI's metric tables.
    sm_metric: str | None = None
    dram_metric: str | None = None
    metric_set: str | None = None
    #: What the DRAM metric counts (``bytes``, ``sectors`` of 32 bytes, ``percent_of_peak``) and
    #: where that was read (``cupti_metric_properties`` or ``metric_name``): the basis of the
    #: conversion behind ``dram_read_bytes_total``.
    dram_unit: str | None = None
    dram_unit_basis: str | None = None
    #: The hardware GPU-activity timeline decoded since the last sample: ``(monotonic seconds,
    #: 0-1 share of the interval the GPU was active)`` per PM-sampling interval, oldest first,
    #: and the metric it is read from (``None``: not sampled on this GPU).
    activity_points: tuple[tuple[float, float], ...] = ()
    activity_metric: str | None = None
    #: The clock the activity points' stamps were found on (``realtime``, ``boottime``,
    #: ``monotonic``; ``unknown``: none fits, so the timeline is not used); ``None`` before the
    #: first stamp, or where nothing stamps them (a replayed trace).
    activity_clock: str | None = None


class DeviceSource(Protocol):
    """NVML-level device sampling."""

    def sample_devices(self) -> list[DeviceSample]:
        """One sample per GPU. Raises SourceUnavailable or HardwareError."""
        ...


class GpmSource(Protocol):
    """GPM activity sampling."""

    def sample_gpm(self) -> list[GpmSample]:
        """One sample per GPM-capable GPU. Raises SourceUnavailable or HardwareError."""
        ...


class ProfilingSource(Protocol):
    """Profiling-counter sampling."""

    def sample_profiling(self) -> list[ProfilingSample]:
        """One sample per GPU. Raises SourceUnavailable (with the driver's reason) or
        HardwareError."""
        ...


@dataclass(frozen=True)
class ProfilingScope:
    """The GPUs a profiling source may hold this pass: the pod's (the attribution decision).
    ``undecided``: no target said which GPUs are its own, so ``gpus`` is every GPU."""

    gpus: frozenset[GPUIdentity]
    undecided: bool = False


#: Given the GPUs a profiling source could profile, the scope it is to profile this pass.
ScopeOf = Callable[[Sequence[GPUIdentity]], ProfilingScope]


@runtime_checkable
class ScopedProfilingSource(ProfilingSource, Protocol):
    """A profiling source that holds hardware per GPU (CUPTI PM sampling holds the GPU's
    performance monitors): it profiles only the GPUs of the scope, so a pod's agent never takes
    its neighbours' counters. A recorded trace holds nothing and is only a ProfilingSource."""

    def sample_profiling_for(self, scope_of: ScopeOf) -> list[ProfilingSample]:
        """One sample per GPU of ``scope_of``'s answer; GPUs that left it are released.
        Raises SourceUnavailable or HardwareError as :meth:`sample_profiling` does."""
        ...
