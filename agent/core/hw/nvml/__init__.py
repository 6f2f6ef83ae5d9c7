"""The NVML adapter: device state and GPM activity from NVIDIA's management library.

This is the only package in the project that talks to ``pynvml`` (package nvidia-ml-py). It is
imported lazily, when :class:`NvmlBackend` first needs it, so a host without the package or the
driver can still import the agent; tests pass a hand-written fake as ``lib``.

Its rooms, each one concern:

* :mod:`.units`: NVML's units to the project's base units (ratios 0-1, bytes, bytes per
  second, watts, hertz, seconds); pure functions and named factors, each with where the unit
  comes from.
* :mod:`.session`: loading the library, NVML init and teardown, the per-GPU handle record,
  and NVML errors translated into :class:`~mrc_agent.agent.core.hw.base.SourceUnavailable` (the
  source does not apply here) or :class:`~mrc_agent.agent.core.hw.base.HardwareError` (it failed
  now); after a failure the next call starts a fresh session, so the collector recovers on its own.
  Also the memo of which queries a GPU answered NOT_SUPPORTED (neither retried nor logged again; the
  field stays ``None``, an absent series, never a zero) and of what was logged once.
* :mod:`.device`: one device sample per GPU, the per-device fields.
* :mod:`.pcie`: PCIe throughput, off the sampling path: ``nvmlDeviceGetPcieThroughput``
  blocks ~20 ms per call, so a background thread reads it and samples take its latest values.
* :mod:`.nvlink`: active-link discovery and the NVLink byte counters.
* :mod:`.gpm`: GPM support and GPM samples.
* :mod:`.events`: XID event registration and polling.
* :mod:`.backend`: :class:`NvmlBackend`, which composes them behind the ``DeviceSource`` /
  ``GpmSource`` API.

The names below are the package's API; everything else is internal to it.
"""

from __future__ import annotations

from mrc_agent.agent.core.hw.nvml.backend import NvmlBackend
from mrc_agent.agent.core.hw.nvml.events import MAX_EVENTS_PER_POLL
from mrc_agent.agent.core.hw.nvml.pcie import (
    DEFAULT_PCIE_PERIOD_S,
    DEFAULT_PCIE_STALE_AFTER_S,
    PCIE_JOIN_TIMEOUT_S,
    PCIE_THREAD_NAME,
)
from mrc_agent.agent.core.hw.nvml.units import (
    GPM_MIB_PER_S_TO_BYTES_PER_S,
    HERTZ_PER_MEGAHERTZ,
    MICROSECONDS_PER_SECOND,
    MILLIWATTS_PER_WATT,
    NVLINK_KIB_TO_BYTES,
    PCIE_KB_PER_S_TO_BYTES_PER_S,
    PERCENT,
    gpm_mib_per_s_to_bytes_per_s,
    megahertz_to_hertz,
    milliwatts_to_watts,
    nvlink_kib_to_bytes,
    nvml_timestamp_to_monotonic,
    pcie_kb_per_s_to_bytes_per_s,
    percent_to_ratio,
)

__all__ = [
    "DEFAULT_PCIE_PERIOD_S",
    "DEFAULT_PCIE_STALE_AFTER_S",
    "GPM_MIB_PER_S_TO_BYTES_PER_S",
    "HERTZ_PER_MEGAHERTZ",
    "MAX_EVENTS_PER_POLL",
    "MICROSECONDS_PER_SECOND",
    "MILLIWATTS_PER_WATT",
    "NVLINK_KIB_TO_BYTES",
    "PCIE_JOIN_TIMEOUT_S",
    "PCIE_KB_PER_S_TO_BYTES_PER_S",
    "PCIE_THREAD_NAME",
    "PERCENT",
    "NvmlBackend",
    "gpm_mib_per_s_to_bytes_per_s",
    "megahertz_to_hertz",
    "milliwatts_to_watts",
    "nvlink_kib_to_bytes",
    "nvml_timestamp_to_monotonic",
    "pcie_kb_per_s_to_bytes_per_s",
    "percent_to_ratio",
]
