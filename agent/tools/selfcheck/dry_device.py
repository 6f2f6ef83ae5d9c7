"""The dry run's GPU: the one simulated ``pynvml`` and ``cupti`` (:mod:`...simgpu`), their data
written from a :class:`~.dry.DryModel` at the moment each call answers.

:class:`DryNvml` is a ``FakeNvml`` whose GPUs are the model's: an H200 on PCIe Gen5 x16,
linked to the others by :data:`LINKS` NVLink links when there are two or more. Its ``refresh``
integrates the model for the call being answered (utilisation over the last 0.2 s and on
NVML's sample grid, PCIe throughput over NVML's 20 ms window, PCIe byte counters of the
model's width, NVLink counters in KiB, the aggregate scope the links' sum) and
``gpm_between`` gives GPM's ratios and rates over the window between two samples. What the
self-check does not verify (power, clocks, temperature, ECC, processes, MIG, events) answers
NOT_SUPPORTED, as on a GPU without it.

:class:`DryCupti` is a ``ClockedCupti`` (``simgpu.cupti``) on the model's clock, counters and
kernel-busy seconds (its GPU-activity metric), with one ``gh100`` device per GPU offering the
shipped ``Compute_Triage`` set; it refuses ``enable`` when the model's faults say so, and
stamps its samples early when they say that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mrc_agent.agent.tools.selfcheck.dry import DryModel
from mrc_agent.agent.tools.simgpu.cupti import ClockedCupti, FakeCollector
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu, nvlink, pynvml

#: nvmlDeviceGetPcieThroughput's window (NVML: "a byte counter over a 20ms interval").
PCIE_WINDOW_S = 0.02
_KB = 1024.0
_MIB = 1024.0 * 1024.0
#: GPM metric id name -> (model key, factor from the project's unit to NVML's).
GPM_METRICS = {
    "NVML_GPM_METRIC_SM_UTIL": ("sm_util", 100.0),
    "NVML_GPM_METRIC_SM_OCCUPANCY": ("sm_occupancy", 100.0),
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": ("tensor_util", 100.0),
    "NVML_GPM_METRIC_DRAM_BW_UTIL": ("dram_bw_util", 100.0),
    "NVML_GPM_METRIC_PCIE_TX_PER_SEC": ("pcie_tx_bytes_per_second", 1 / _MIB),
    "NVML_GPM_METRIC_PCIE_RX_PER_SEC": ("pcie_rx_bytes_per_second", 1 / _MIB),
    "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC": ("nvlink_tx_bytes_per_second", 1 / _MIB),
    "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC": ("nvlink_rx_bytes_per_second", 1 / _MIB),
}
#: NVLink links per simulated GPU when there are two or more (NVML counts per link).
LINKS = 2
#: The simulated H200's memory as NVML reports it, in bytes.
MEMORY = {"total": 141 * 2**30, "used": 2 * 2**30, "reserved": 512 * 2**20}
#: What the dry GPU answers NOT_SUPPORTED: the self-check does not verify these.
NOT_SUPPORTED = frozenset({
    "nvmlDeviceGetPowerUsage", "nvmlDeviceGetClockInfo", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetMigMode",
})
_ARCHITECTURES = {8: "AMPERE", 9: "HOPPER", 10: "BLACKWELL"}


class DryNvml(FakeNvml):
    """The simulated ``pynvml`` answering for one :class:`DryModel`."""

    def __init__(self, model: DryModel) -> None:
        linked = model.gpus >= 2
        bits = model.pcie_counter_bits
        super().__init__(
            [gpu(uuid=model.uuid(i), name=model.name, memory=dict(MEMORY),
                 compute_capability=model.compute_capability,
                 architecture=_ARCHITECTURES.get(model.compute_capability[0], "UNKNOWN"),
                 pcie_count={"tx_bytes": None, "rx_bytes": None,
                             "value_type": "NVML_VALUE_TYPE_UNSIGNED_INT" if bits <= 32
                             else "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG"},
                 nvlink={link: nvlink() for link in range(LINKS)} if linked else {},
                 gpm={})
             for i in range(model.gpus)],
            driver_version="dry-run", nvml_version="dry-run", cuda_driver_version=12080)
        self.model = model
        self.not_supported = set(NOT_SUPPORTED)
        self.clock = model.clock
        self._gpm_ids = {int(getattr(pynvml, name)): spec for name, spec in GPM_METRICS.items()}
        self._lock = threading.Lock()
        self.refresh = self._refresh
        self.gpm_between = self._gpm_between

    def _refresh(self, name: str, index: int) -> None:
        m, now, data = self.model, self.model.clock(), self.gpus[index]
        with self._lock:
            if name == "nvmlDeviceGetUtilizationRates":
                busy = m.busy(index, ("d2d", "gemm"), now - 0.2, now)
                dram = m.busy(index, ("d2d",), now - 0.2, now)
                data["util"] = {"gpu": round(100 * busy), "memory": round(100 * dram)}
            elif name == "nvmlDeviceGetSamples":
                seen = data["util_samples"]
                data["util_samples"] = seen + m.util_grid(index, seen[-1][0] if seen else -1, now)
            elif name == "nvmlDeviceGetPcieThroughput":
                tx, rx = m.pcie_rates(index, now - PCIE_WINDOW_S, now)
                data["pcie"].update(tx_kb_per_s=int(tx / _KB), rx_kb_per_s=int(rx / _KB))
            elif name == "nvmlDeviceGetFieldValues":
                self._counters(data, index, now)

    def _counters(self, data: dict[str, Any], index: int, now: float) -> None:
        """PCIe byte counters of the model's width ("can be wrapped", nvml.h; an unsigned int
        does wrap at 2^32) and NVLink's in KiB, each link an equal share."""
        m = self.model
        if not m.faults.pcie_counters_absent:
            tx, rx = m.pcie_counters(index, now)
            wrap = 1 << m.pcie_counter_bits
            data["pcie_count"].update(tx_bytes=int(tx) % wrap, rx_bytes=int(rx) % wrap)
        if data["nvlink"]:
            tx, rx = m.nvlink_bytes(index, now)
            for link in data["nvlink"].values():
                link.update(tx_kib=int(tx / LINKS / _KB), rx_kib=int(rx / LINKS / _KB))

    def _gpm_between(self, index: int, t0: float, t1: float) -> dict[int, float]:
        values = self.model.gpm(index, t0, t1)
        return {metric: values[key] * factor
                for metric, (key, factor) in self._gpm_ids.items()}


class DryCupti(ClockedCupti):
    """The simulated ``cupti`` reading one :class:`DryModel`: a ``gh100`` per GPU, refusing
    ``enable`` when the model's faults say so.

    With ``activity_stamp_offset_s`` the library runs on a clock that far behind the model's,
    each cumulative reading taken that far ahead: every interval holds the model's values for
    its true span, stamped ``offset`` too early."""

    def __init__(self, model: DryModel, sets: dict[str, Any] | None = None) -> None:
        shift = model.faults.activity_stamp_offset_s

        def late(read: Callable[[int, float], float]) -> Callable[[int, float], float]:
            return read if not shift else (lambda i, t: read(i, t + shift))

        clock = model.clock if not shift else (lambda: model.clock() - shift)
        super().__init__([model.uuid(i) for i in range(model.gpus)], clock,
                         late(model.instructions), late(model.dram_read_bytes), sets,
                         busy_seconds=late(model.busy_seconds))
        self.model = model
        self.on_call = self._on_call

    def _on_call(self, collector: FakeCollector, method: str) -> None:
        if method == "enable" and self.model.faults.cupti_refused:
            # What cupti-python's enable() raises for CUPTI_ERROR_INSUFFICIENT_PRIVILEGES.
            raise PermissionError("Insufficient privileges to enable PM sampling")
        self.clocked_call(collector, method)
