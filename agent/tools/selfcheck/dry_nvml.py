"""The dry run's ``pynvml`` stand-in: answers the NVML adapter from a :class:`DryModel`.

It implements what the adapter reads for the self-check (device enumeration, utilisation rates
and samples, memory, PCIe throughput and byte counters, NVLink state and counters, GPM) in
NVML's own units and structures: constants, ``NVMLError`` and the ``c_nvml*`` ctypes
structures are the real ones from ``pynvml`` (a dependency of the agent), so the adapter's
conversions run exactly as on a GPU. Every other ``nvml*`` function answers NOT_SUPPORTED,
which the adapter turns into an absent field, as on a GPU without that feature.
"""

from __future__ import annotations

import ctypes
import importlib
from dataclasses import dataclass
from typing import Any

from mrc_agent.agent.tools.selfcheck.dry import DryModel


class _OnFirstUse:
    """``pynvml``, imported when first used: importing the agent's modules must not load it
    (tests/unit/test_footprint.py), and only a dry run uses this module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("pynvml"), name)


pynvml: Any = _OnFirstUse()

_PASSTHROUGH_PREFIXES = ("NVML_", "NVMLError", "c_nvml", "nvmlEventType", "nvmlMemory_v")
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
#: nvmlFieldValue_t.scopeId for all links together (NVML: UINT_MAX).
AGGREGATE_SCOPE = 0xFFFFFFFF


@dataclass(frozen=True)
class _Handle:
    index: int


def _not_supported(*_args: Any, **_kwargs: Any) -> Any:
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


class DryNvml:
    """The stand-in module for one :class:`DryModel`."""

    def __init__(self, model: DryModel) -> None:
        self.model = model
        self.initialized = False
        self._gpm_ids = {int(getattr(pynvml, name)): spec for name, spec in GPM_METRICS.items()}
        # GPM sample buffers: struct address -> (gpu index, monotonic time taken) or None.
        self._gpm_buffers: dict[int, tuple[int, float] | None] = {}
        self._gpm_structs: list[Any] = []  # keeps the structs (and their addresses) alive

    def __getattr__(self, name: str) -> Any:
        if name.startswith(_PASSTHROUGH_PREFIXES):
            return getattr(pynvml, name)
        if name.startswith("nvml"):
            return _not_supported
        raise AttributeError(name)

    def _gpu(self, handle: _Handle) -> int:
        if not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return handle.index

    # --- session -------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return "dry-run"

    def nvmlSystemGetNVMLVersion(self) -> str:
        return "dry-run"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12080

    def nvmlDeviceGetCount(self) -> int:
        return self.model.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < self.model.gpus:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self.model.uuid(self._gpu(handle))

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._gpu(handle)
        return self.model.name

    # --- device --------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        gpu, now = self._gpu(handle), self.model.clock()
        busy = self.model.busy(gpu, ("d2d", "gemm"), now - 0.2, now)
        dram = self.model.busy(gpu, ("d2d",), now - 0.2, now)
        return pynvml.c_nvmlUtilization_t(gpu=round(100 * busy), memory=round(100 * dram))

    def nvmlDeviceGetSamples(self, handle: _Handle, sampling_type: int,
                             timeStamp: int) -> tuple[int, list[Any]]:
        gpu = self._gpu(handle)
        if sampling_type != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        grid = self.model.util_grid(gpu, int(timeStamp), self.model.clock())
        if not grid:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        out = []
        for stamp, percent in grid:
            sample = pynvml.c_nvmlSample_t()
            sample.timeStamp = stamp
            sample.sampleValue.uiVal = percent
            out.append(sample)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, out

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        self._gpu(handle)
        total, used, reserved = 141 * 2**30, 2 * 2**30, 512 * 2**20
        return pynvml.c_nvmlMemory_v2_t(version=version or 0, total=total, reserved=reserved,
                                        used=used, free=total - used - reserved)

    def nvmlDeviceGetPcieThroughput(self, handle: _Handle, counter: int) -> int:
        gpu, now = self._gpu(handle), self.model.clock()
        tx, rx = self.model.pcie_rates(gpu, now - PCIE_WINDOW_S, now)
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return int(tx / _KB)
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return int(rx / _KB)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: _Handle) -> int:
        self._gpu(handle)
        return 5  # an H200's link: PCIe Gen5 x16

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: _Handle) -> int:
        self._gpu(handle)
        return 16

    def nvmlDeviceGetPcieReplayCounter(self, handle: _Handle) -> int:
        self._gpu(handle)
        return 0

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        self._gpu(handle)
        if self.model.gpus < 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < LINKS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(pynvml.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetFieldValues(self, handle: _Handle, fieldIds: list[Any]) -> Any:
        gpu, now = self._gpu(handle), self.model.clock()
        pcie_tx, pcie_rx = self.model.pcie_counters(gpu, now)
        nv_tx, nv_rx = self.model.nvlink_bytes(gpu, now)
        linked = self.model.gpus >= 2
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for i, requested in enumerate(fieldIds):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            out = values[i]
            out.fieldId, out.scopeId = field_id, scope
            out.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            out.nvmlReturn = pynvml.NVML_SUCCESS
            pcie_fields = (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
                           pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES)
            if field_id in pcie_fields and self.model.faults.pcie_counters_absent:
                out.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif field_id in pcie_fields:
                total = pcie_tx if field_id == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES else pcie_rx
                self._pcie_counter(out, total)
            elif linked and field_id == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
                out.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                out.value.uiVal = LINKS
            elif linked and field_id in (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                                         pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX):
                total = nv_tx if field_id == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else nv_rx
                # KiB; scope UINT_MAX is all links together, a link index that link's share.
                share = 1 if scope == AGGREGATE_SCOPE else LINKS
                if scope != AGGREGATE_SCOPE and not 0 <= scope < LINKS:
                    out.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
                out.value.ullVal = int(total / share / _KB)
            else:
                out.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def _pcie_counter(self, out: Any, total: float) -> None:
        """A PCIe byte counter of the model's width: NVML "can be wrapped" (nvml.h), and an
        unsigned int does wrap at 2^32."""
        bits = self.model.pcie_counter_bits
        raw = int(total) % (1 << bits)
        if bits <= 32:
            out.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            out.value.uiVal = raw
        else:
            out.value.ullVal = raw

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        self._gpu(handle)
        return self.model.compute_capability

    def nvmlDeviceGetArchitecture(self, handle: _Handle) -> int:
        self._gpu(handle)
        major = self.model.compute_capability[0]
        name = {9: "HOPPER", 10: "BLACKWELL", 8: "AMPERE"}.get(major, "UNKNOWN")
        return int(getattr(pynvml, f"NVML_DEVICE_ARCH_{name}"))

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for index in range(self.model.gpus):
            if self.model.uuid(index) == text:
                return _Handle(index)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    # --- GPM -----------------------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, device: _Handle) -> Any:
        self._gpu(device)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 1
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        struct = pynvml.struct_c_nvmlGpmSample_t()
        self._gpm_structs.append(struct)
        self._gpm_buffers[ctypes.addressof(struct)] = None
        return pynvml.c_nvmlGpmSample_t(struct)

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._gpm_buffers.pop(ctypes.addressof(gpmSample.contents), None)

    def nvmlGpmSampleGet(self, device: _Handle, gpmSample: Any) -> Any:
        gpu = self._gpu(device)
        address = ctypes.addressof(gpmSample.contents)
        if address not in self._gpm_buffers:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_buffers[address] = (gpu, self.model.clock())
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        first = self._gpm_buffers.get(ctypes.addressof(metricsGet.sample1.contents))
        second = self._gpm_buffers.get(ctypes.addressof(metricsGet.sample2.contents))
        if first is None or second is None or first[0] != second[0] or first[1] > second[1]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        values = self.model.gpm(second[0], first[1], second[1])
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            spec = self._gpm_ids.get(int(metric.metricId))
            if spec is None:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            key, factor = spec
            metric.nvmlReturn = pynvml.NVML_SUCCESS
            metric.value = values[key] * factor
        return metricsGet

