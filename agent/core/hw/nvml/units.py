"""NVML's units to the project's base units: pure functions, no NVML.

The project measures in ratios 0-1, bytes, bytes per second, watts, hertz and seconds; NVML
answers in percent, KB/s, KiB, MiB/s, milliwatts, megahertz and wall-clock microseconds. Each
factor below names the NVML unit it undoes and where that unit is stated.
"""

from __future__ import annotations

#: Utilisation rates, GetSamples utilisation values and GPM ``*_UTIL`` metrics are percentages
#: (0-100) in NVML's docs (nvmlUtilization_t, nvmlGpmMetricId_t "0.0 - 100.0").
PERCENT = 100.0
#: nvmlDeviceGetPcieThroughput: "Reference in which to return throughput in KB/s" (NVML API
#: reference). NVML does not say which KB; we take 1024 bytes, the same kilo NVML spells out as
#: KiB for the NVLink throughput fields, so PCIe and NVLink bytes share one convention.
PCIE_KB_PER_S_TO_BYTES_PER_S = 1024.0
#: NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX: "NVLink TX/RX Data throughput in KiB" (pynvml /
#: nvml.h comment on the field ids); a cumulative counter, so bytes = KiB * 1024.
NVLINK_KIB_TO_BYTES = 1024.0
#: NVML_GPM_METRIC_PCIE_*_PER_SEC and NVML_GPM_METRIC_NVLINK_TOTAL_*_PER_SEC: "in MiB/sec"
#: (nvmlGpmMetricId_t docs and pynvml comments).
GPM_MIB_PER_S_TO_BYTES_PER_S = 1024.0 * 1024.0
#: nvmlDeviceGetPowerUsage returns milliwatts.
MILLIWATTS_PER_WATT = 1000.0
#: nvmlDeviceGetClockInfo returns MHz.
HERTZ_PER_MEGAHERTZ = 1_000_000.0
#: nvmlSample_t.timeStamp: "CPU Timestamp in microseconds". NVML does not name the clock; the
#: wall clock (Unix epoch) is the common reading, one report found the boot clock, so the
#: clock is identified at run time (:func:`identify_clock`).
MICROSECONDS_PER_SECOND = 1_000_000.0
#: A sample buffer holds seconds of history, so the newest timestamp lies within this many
#: seconds of "now" on the clock it was taken on; the clocks differ by far more (the wall clock
#: from the others by decades, the boot clock from the monotonic one by time spent suspended).
CLOCK_MATCH_S = 120.0


def percent_to_ratio(percent: float) -> float:
    """NVML percent (0-100) to a 0-1 ratio."""
    return float(percent) / PERCENT


def pcie_kb_per_s_to_bytes_per_s(kb_per_s: float) -> float:
    """nvmlDeviceGetPcieThroughput's KB/s to bytes per second."""
    return float(kb_per_s) * PCIE_KB_PER_S_TO_BYTES_PER_S


def nvlink_kib_to_bytes(kib: float) -> float:
    """NVLink throughput field value (KiB, cumulative) to bytes."""
    return float(kib) * NVLINK_KIB_TO_BYTES


def gpm_mib_per_s_to_bytes_per_s(mib_per_s: float) -> float:
    """GPM PCIe/NVLink MiB/s to bytes per second."""
    return float(mib_per_s) * GPM_MIB_PER_S_TO_BYTES_PER_S


def milliwatts_to_watts(milliwatts: float) -> float:
    return float(milliwatts) / MILLIWATTS_PER_WATT


def megahertz_to_hertz(megahertz: float) -> float:
    return float(megahertz) * HERTZ_PER_MEGAHERTZ


def identify_clock(timestamp_us: int, nows: dict[str, float]) -> str | None:
    """Which clock of ``nows`` (name -> that clock's "now", seconds) ``timestamp_us`` is on.

    The nearest clock within :data:`CLOCK_MATCH_S` that the timestamp is not ahead of (by more
    than a second); None when none fits, so the samples are not used at all rather than dated
    decades off.
    """
    stamp = timestamp_us / MICROSECONDS_PER_SECOND
    fits = [
        (now - stamp, name) for name, now in nows.items() if -1.0 <= now - stamp <= CLOCK_MATCH_S
    ]
    return min(fits)[1] if fits else None


def nvml_timestamp_to_monotonic(timestamp_us: int, *, mono_now: float, wall_now: float) -> float:
    """Map an NVML sample timestamp (microseconds on the clock read as ``wall_now``) onto the
    monotonic clock.

    The sample's age is measured on its own clock and subtracted from "now" on the monotonic
    clock, so a wall-clock step between samples moves at most the current batch. Clamped to
    ``mono_now``: small disagreements between the two clocks must not date a sample in the
    future.
    """
    age = wall_now - timestamp_us / MICROSECONDS_PER_SECOND
    return min(mono_now, mono_now - age)
