"""GPU collectors over the hardware boundary: NVML device state (``gpu``), GPM activity
(``gpm``) and true profiling counters (``profiling``).

They only translate :mod:`agent.core.hw.base` samples into metric samples; which library answered
(NVML, CUPTI or a replayed trace) is the source's business. A field the source left ``None`` is
an absent series, never a zero.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from agent.core.collectors.base import SampleContext
from agent.core.hw.base import DeviceSource, GpmSource, ProfilingSource, SourceUnavailable
from exporters.exposition.snapshot import Sample

log = logging.getLogger(__name__)

#: DeviceSample attribute -> metric name, for the plain one-value-per-GPU fields.
_DEVICE_FIELDS = {
    "gpu_util": "mrc_gpu_utilization_ratio",
    "mem_util": "mrc_gpu_memory_utilization_ratio",
    "mem_used_bytes": "mrc_gpu_memory_used_bytes",
    "mem_total_bytes": "mrc_gpu_memory_total_bytes",
    "pcie_tx_bytes_per_second": "mrc_gpu_pcie_tx_bytes_per_second",
    "pcie_rx_bytes_per_second": "mrc_gpu_pcie_rx_bytes_per_second",
    "pcie_replays_total": "mrc_gpu_pcie_replays_total",
    "nvlink_tx_bytes_total": "mrc_gpu_nvlink_tx_bytes_total",
    "nvlink_rx_bytes_total": "mrc_gpu_nvlink_rx_bytes_total",
    "power_watts": "mrc_gpu_power_watts",
    "sm_clock_hertz": "mrc_gpu_sm_clock_hertz",
    "temperature_celsius": "mrc_gpu_temperature_celsius",
    "xid_errors_total": "mrc_gpu_xid_errors_total",
    "last_xid": "mrc_gpu_last_xid",
}

_GPM_FIELDS = {
    "sm_util": "mrc_gpu_sm_active_ratio",
    "sm_occupancy": "mrc_gpu_sm_occupancy_ratio",
    "tensor_util": "mrc_gpu_tensor_pipe_active_ratio",
    "dram_bw_util": "mrc_gpu_dram_bandwidth_utilization_ratio",
    "pcie_tx_bytes_per_second": "mrc_gpu_gpm_pcie_tx_bytes_per_second",
    "pcie_rx_bytes_per_second": "mrc_gpu_gpm_pcie_rx_bytes_per_second",
    "nvlink_tx_bytes_per_second": "mrc_gpu_gpm_nvlink_tx_bytes_per_second",
    "nvlink_rx_bytes_per_second": "mrc_gpu_gpm_nvlink_rx_bytes_per_second",
}

_PROFILING_FIELDS = {
    "sm_instructions_executed_total": "mrc_gpu_sm_instructions_executed_total",
    "dram_read_bytes_total": "mrc_gpu_dram_read_bytes_total",
}

S = TypeVar("S")


def _require(source: S | None) -> S:
    """The source, or "not available here" when the GPU backend is 'none'."""
    if source is None:
        raise SourceUnavailable("gpu_backend_none", "the GPU backend is 'none'")
    return source


#: Below this DRAM utilisation the SM/DRAM activity quotient is noise, so it is not exported.
MIN_DRAM_UTIL_FOR_PROXY = 0.01


def _fields(obj: object, table: dict[str, str], labels: tuple[str, ...]) -> list[Sample]:
    out: list[Sample] = []
    for attr, metric in table.items():
        value = getattr(obj, attr)
        if value is not None:
            out.append((metric, labels, float(value)))
    return out


class GpuCollector:
    name = "gpu"

    def __init__(self, source: DeviceSource | None) -> None:
        self._source = source

    def update(self, ctx: SampleContext) -> list[Sample]:
        out: list[Sample] = []
        names = {pid: st.process for pid, st in ctx.processes.items()}
        target_pids = {t.pid for t in ctx.targets}
        for s in _require(self._source).sample_devices():
            labels = s.gpu.labels
            out.extend(_fields(s, _DEVICE_FIELDS, labels))
            for link, (tx, rx) in sorted(s.nvlink_links.items()):
                out.append(("mrc_gpu_nvlink_link_tx_bytes_total", labels + (str(link),), tx))
                out.append(("mrc_gpu_nvlink_link_rx_bytes_total", labels + (str(link),), rx))
            if s.ecc_corrected_total is not None:
                out.append(("mrc_gpu_ecc_errors_total", labels + ("corrected",),
                            s.ecc_corrected_total))
            if s.ecc_uncorrected_total is not None:
                out.append(("mrc_gpu_ecc_errors_total", labels + ("uncorrected",),
                            s.ecc_uncorrected_total))
            for pid, used in sorted(s.process_memory_bytes.items()):
                # Only targets: other tenants' processes would be unbounded and not ours.
                if pid in target_pids:
                    name = names.get(pid, "")
                    out.append(("mrc_gpu_process_memory_used_bytes",
                                labels + (str(pid), name), used))
                    ctx.gpus_of_pid.setdefault(pid, set()).add(s.gpu)
            if s.gpu_util is not None:
                ctx.gpu_util[s.gpu] = s.gpu_util
                ctx.gpu_util_points[s.gpu] = s.util_samples or [(ctx.now, s.gpu_util)]
        return out


class GpmCollector:
    name = "gpm"

    def __init__(self, source: GpmSource | None) -> None:
        self._source = source

    def update(self, ctx: SampleContext) -> list[Sample]:
        out: list[Sample] = []
        for s in _require(self._source).sample_gpm():
            labels = s.gpu.labels
            out.extend(_fields(s, _GPM_FIELDS, labels))
            if (s.sm_util is not None and s.dram_bw_util is not None
                    and s.dram_bw_util >= MIN_DRAM_UTIL_FOR_PROXY):
                out.append(("mrc_gpu_gpm_sm_to_dram_activity", labels,
                            s.sm_util / s.dram_bw_util))
        return out


class ProfilingCollector:
    """True instruction and DRAM-read counters; ``status`` reports which signal feeds the
    compute-to-memory panel and why."""

    name = "profiling"

    def __init__(self, source: ProfilingSource | None) -> None:
        self._source = source
        self.status: tuple[str, str] = ("not_requested", "")

    def update(self, ctx: SampleContext) -> list[Sample]:
        try:
            samples = _require(self._source).sample_profiling()
        except SourceUnavailable as exc:
            self.status = (exc.reason, exc.detail)
            raise
        self.status = ("ok", "")
        out: list[Sample] = []
        for s in samples:
            out.extend(_fields(s, _PROFILING_FIELDS, s.gpu.labels))
        return out
