"""The simulated ``pynvml``: a hand-written, data-driven stand-in for the parts of ``pynvml``
that ``agent/core/hw/nvml/`` (and the self-check) call, so the NVML adapter runs on machines
without a GPU. The tests and ``mrc-agent selfcheck --dry`` both use it.

Build it from plain dicts (:func:`~.nvml_data.gpu` lists every key and its default), hand it
to ``NvmlBackend(lib=fake)``, then change the dicts between samples to advance counters, queue
XID events, lose a GPU and so on; or set ``refresh`` to write a moment's readings into the
dicts just before each call answers (the dry run integrates its model that way) and
``gpm_between`` where GPM values depend on the window between two samples.

It cannot drift from the real library's vocabulary: every constant (``NVML_*``,
``nvmlEventType*``, ``nvmlMemory_v2``), exception class (``NVMLError*``) and ctypes structure
(``c_nvml*``) is the real one from ``pynvml``, and the functions answer with the real ctypes
structures, so a misspelt field name in the adapter fails here as it would on a GPU. Functions
the adapter does not use are deliberately absent (``AttributeError``). ``pynvml`` is imported
on first use: importing the agent's modules must not load it (tests/unit/test_footprint.py).

Like NVML, it checks what it is given: calls before ``nvmlInit`` or with a handle from an older
session raise, wrong enum arguments raise ``NVMLError_InvalidArgument``, and ``calls`` counts
every call by function name so tests can prove a query was not retried. Like NVML, it may be
called from several threads (the adapter's PCIe throughput thread): counting is locked, and
``pcie_throughput_delay_s`` makes ``nvmlDeviceGetPcieThroughput`` block as NVML's does.
"""

from __future__ import annotations

import copy
import ctypes
import importlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mrc_agent.agent.tools.simgpu.nvml_data import gpu as gpu
from mrc_agent.agent.tools.simgpu.nvml_data import mig_device as mig_device
from mrc_agent.agent.tools.simgpu.nvml_data import nvlink as nvlink


class _OnFirstUse:
    """``pynvml``, imported when first used (see the module docstring), then kept: every
    constant and structure the fake names goes through here, hundreds of thousands of times
    in a long ``tracegen`` trace."""

    _module: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module("pynvml")
        return getattr(self._module, name)


pynvml: Any = _OnFirstUse()

def not_supported() -> int:
    """NVML_ERROR_NOT_SUPPORTED, what NVML answers for a feature the GPU lacks."""
    return int(pynvml.NVML_ERROR_NOT_SUPPORTED)


#: Names resolved from the real pynvml module rather than faked.
_PASSTHROUGH_PREFIXES = ("NVML_", "NVMLError", "NVMLLibraryMismatchError", "c_nvml",
                         "nvmlEventType", "nvmlMemory_v")


def _active_sum(links: dict[int, dict[str, Any]], key: str) -> int:
    """The links' ``key`` (``tx_kib``/``rx_kib``) summed over the active ones: what the
    aggregate scope answers. Summed only for the reads that answer it, not per field."""
    return sum(link[key] for link in links.values() if link["active"])


@dataclass(frozen=True)
class FakeHandle:
    """An nvmlDevice_t: valid only in the NVML session (generation) that handed it out.

    ``mig`` is the MIG device's position on its parent GPU ``index``; None for a whole GPU.
    """

    index: int
    generation: int
    mig: int | None = None


#: What NVML answers for a MIG device handle (the rest is device-wide: NOT_SUPPORTED).
_MIG_HANDLE_CALLS = frozenset({
    "nvmlDeviceGetUUID", "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
})
#: What the whole GPU no longer answers once MIG mode is on.
_NOT_IN_MIG_MODE = frozenset({
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetSamples", "nvmlGpmSampleGet",
})


class FakeNvml:
    """The fake module. ``gpus`` is a list of :func:`gpu` dicts, kept (copied) as ``self.gpus``."""

    def __init__(
        self,
        gpus: Iterable[dict[str, Any]],
        *,
        library_missing: bool = False,
        driver_version: str = "550.54.15",
        nvml_version: str = "12.550.54.15",
        cuda_driver_version: int = 12040,
    ) -> None:
        self.gpus: list[dict[str, Any]] = [copy.deepcopy(g) for g in gpus]
        self.library_missing = library_missing
        #: NVML error code nvmlInit answers with (None: succeeds), e.g. DRIVER_NOT_LOADED.
        self.init_error: int | None = None
        #: function name -> error codes to raise on its next calls, one per call.
        self.fail_next: dict[str, list[int]] = {}
        self.driver_version = driver_version
        self.nvml_version = nvml_version
        self.cuda_driver_version = cuda_driver_version
        self.calls: Counter[str] = Counter()
        self._calls_lock = threading.Lock()
        #: Seconds each nvmlDeviceGetPcieThroughput call blocks (NVML: a 20 ms window).
        self.pcie_throughput_delay_s = 0.0
        #: Function names that answer NOT_SUPPORTED whatever the handle, implemented here or
        #: not (per GPU: its dict's ``not_supported``).
        self.not_supported: set[str] = set()
        #: Called with (function name, GPU index) just before a call on that GPU answers from
        #: its dict: a scenario writes that moment's readings there (None: the dicts as set).
        self.refresh: Callable[[str, int], None] | None = None
        #: GPM values by metric id for (gpu index, time of sample1, time of sample2), where a
        #: scenario's values depend on the window (None: the dict's ``gpm`` at sample2).
        self.gpm_between: Callable[[int, float, float], dict[int, float]] | None = None
        #: The clock GPM samples are stamped with (for ``gpm_between``).
        self.clock: Callable[[], float] = time.monotonic
        self.initialized = False
        self.generation = 0
        #: Per GPU index: handles from generations below this are dead (GPU was lost).
        self.min_generation: dict[int, int] = {}
        #: Per nvmlGpmMetricsGet call: the (sample1, sample2) sequence numbers it computed
        #: between, numbered 1, 2, ... in the order nvmlGpmSampleGet took them.
        self.gpm_windows: list[tuple[int, int]] = []
        self._gpm_taken = 0
        # GPM sample buffers: address of the opaque struct -> (gpu index or None, metric values,
        # sequence number of the sample it holds, 0 while unfilled, time it was taken).
        self._gpm_buffers: dict[int, tuple[Any, dict[int, float] | None, int, float]] = {}
        self._gpm_structs: list[Any] = []  # keeps the structs (and so their addresses) alive

    # --- the real library's vocabulary ----------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith(_PASSTHROUGH_PREFIXES):
            return getattr(pynvml, name)
        if name in self.__dict__.get("not_supported", ()):
            return lambda *_args, **_kwargs: self._enter(name)  # answers NOT_SUPPORTED
        raise AttributeError(f"fake pynvml does not implement {name!r}")

    def __getattribute__(self, name: str) -> Any:
        # A function the bound pynvml module lacks is absent here too, so a fake built on an
        # older nvidia-ml-py (tests/nvml_support.load_fake_for) offers exactly that version's
        # functions.
        if name.startswith("nvml") and name[4:5].isupper() and not hasattr(pynvml, name):
            raise AttributeError(f"this nvidia-ml-py has no {name!r}")
        return object.__getattribute__(self, name)

    # --- test controls --------------------------------------------------------------------

    def lose_gpu(self, index: int) -> None:
        """The GPU falls off the bus: its handles answer GPU_IS_LOST until it is restored."""
        self.gpus[index]["lost"] = True

    def restore_gpu(self, index: int) -> None:
        """NVML answers again, but only through handles fetched in a new session."""
        self.gpus[index]["lost"] = False
        self.min_generation[index] = self.generation + 1

    # --- plumbing -------------------------------------------------------------------------

    @staticmethod
    def _error(code: int) -> Exception:
        """The bound pynvml's ``NVMLError`` for ``code`` (its subclass for that code)."""
        error: Exception = pynvml.NVMLError(code)
        return error

    def _count(self, name: str) -> None:
        with self._calls_lock:  # ``+=`` on a Counter is not atomic across threads
            self.calls[name] += 1

    def _enter(self, name: str, handle: FakeHandle | None = None) -> dict[str, Any] | None:
        """Count the call and raise what NVML would; return the GPU dict for ``handle``."""
        self._count(name)
        if not self.initialized:
            raise self._error(pynvml.NVML_ERROR_UNINITIALIZED)
        queued = self.fail_next.get(name)
        if queued:
            raise self._error(queued.pop(0))
        if name in self.not_supported:
            raise self._error(not_supported())
        if handle is None:
            return None
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(self.gpus):
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.refresh is not None:
            self.refresh(name, handle.index)
        data = self.gpus[handle.index]
        if data["lost"] or handle.generation < self.min_generation.get(handle.index, 0):
            raise self._error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if handle.generation != self.generation:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.mig is not None:
            if name not in _MIG_HANDLE_CALLS:
                raise self._error(not_supported())  # device-wide queries need the whole GPU
            data = data["mig"][handle.mig]
        elif data["mig"] and name in _NOT_IN_MIG_MODE:
            raise self._error(not_supported())
        if name in data["not_supported"]:
            raise self._error(not_supported())
        return data

    def _gpu(self, name: str, handle: FakeHandle) -> dict[str, Any]:
        data = self._enter(name, handle)
        assert data is not None
        return data

    # --- init / system --------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.library_missing:
            raise self._error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if self.init_error is not None:
            raise self._error(self.init_error)
        self.initialized = True
        self.generation += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._enter("nvmlSystemGetNVMLVersion")
        return self.nvml_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index]["lost"]:
            raise self._error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return FakeHandle(index, self.generation)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return str(self._gpu("nvmlDeviceGetUUID", handle)["uuid"])

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return str(self._gpu("nvmlDeviceGetName", handle)["name"])

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for index, data in enumerate(self.gpus):
            if data["uuid"] == text:
                if data["lost"]:
                    raise self._error(pynvml.NVML_ERROR_GPU_IS_LOST)
                return FakeHandle(index, self.generation)
        raise self._error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeHandle) -> tuple[int, int]:
        capability = self._gpu("nvmlDeviceGetCudaComputeCapability", handle)["compute_capability"]
        if capability is None:
            raise self._error(not_supported())
        return int(capability[0]), int(capability[1])

    def nvmlDeviceGetArchitecture(self, device: FakeHandle) -> int:
        name = self._gpu("nvmlDeviceGetArchitecture", device)["architecture"]
        if name is None:
            raise self._error(not_supported())
        return int(getattr(pynvml, f"NVML_DEVICE_ARCH_{name}"))

    # --- device queries -------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        util = self._gpu("nvmlDeviceGetUtilizationRates", handle)["util"]
        return pynvml.c_nvmlUtilization_t(gpu=util["gpu"], memory=util["memory"])

    def nvmlDeviceGetSamples(
        self, handle: FakeHandle, sampling_type: int, timeStamp: int
    ) -> tuple[int, list[Any]]:
        data = self._gpu("nvmlDeviceGetSamples", handle)
        if sampling_type != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        repeat = data["util_samples_repeat_boundary"]
        newer = [
            (ts, v)
            for ts, v in data["util_samples"]
            if ts > timeStamp or (repeat and ts == timeStamp)
        ]
        if not newer:
            # What NVML answers when no sample is newer than lastSeenTimeStamp.
            raise self._error(pynvml.NVML_ERROR_NOT_FOUND)
        samples = []
        for ts, value in newer:
            sample = pynvml.c_nvmlSample_t()
            sample.timeStamp = ts
            sample.sampleValue.uiVal = value
            samples.append(sample)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> Any:
        data = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        mem = data["memory"]
        if version is None:
            return pynvml.c_nvmlMemory_t(
                total=mem["total"],
                used=mem["used"] + mem["reserved"],
                free=mem["total"] - mem["used"] - mem["reserved"],
            )
        if "nvmlDeviceGetMemoryInfo_v2" in data["not_supported"]:
            raise self._error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if version != pynvml.nvmlMemory_v2:
            raise self._error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return pynvml.c_nvmlMemory_v2_t(
            version=version,
            total=mem["total"],
            reserved=mem["reserved"],
            used=mem["used"],
            free=mem["total"] - mem["used"] - mem["reserved"],
        )

    def nvmlDeviceGetPcieThroughput(self, handle: FakeHandle, counter: int) -> int:
        pcie = self._gpu("nvmlDeviceGetPcieThroughput", handle)["pcie"]
        if self.pcie_throughput_delay_s:
            time.sleep(self.pcie_throughput_delay_s)
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return int(pcie["tx_kb_per_s"])
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return int(pcie["rx_kb_per_s"])
        raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._pcie_link("nvmlDeviceGetMaxPcieLinkGeneration", handle, "generation")

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._pcie_link("nvmlDeviceGetGpuMaxPcieLinkGeneration", handle, "generation",
                               "gpu_max_link")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeHandle) -> int:
        return self._pcie_link("nvmlDeviceGetMaxPcieLinkWidth", handle, "width")

    def _pcie_link(self, name: str, handle: FakeHandle, what: str,
                   key: str = "max_link") -> int:
        value = self._gpu(name, handle)["pcie"].get(f"{key}_{what}")
        if value is None:
            raise self._error(not_supported())
        return int(value)

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        return int(self._gpu("nvmlDeviceGetPcieReplayCounter", handle)["pcie"]["replays"])

    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        links = self._gpu("nvmlDeviceGetNvLinkState", handle)["nvlink"]
        if not links:
            raise self._error(not_supported())
        if link not in links:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if links[link]["active"] else 0

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, fieldIds: list[Any]) -> Any:
        data = self._gpu("nvmlDeviceGetFieldValues", handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        links = data["nvlink"]
        pcie_fields = {
            getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", -1): "tx_bytes",
            getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", -1): "rx_bytes",
        }
        nvlink_fields = (
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        )
        for i, requested in enumerate(fieldIds):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            out = values[i]
            out.fieldId, out.scopeId = field_id, scope
            out.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            out.nvmlReturn = pynvml.NVML_SUCCESS
            if field_id in data["field_errors"]:
                out.nvmlReturn = data["field_errors"][field_id]
            elif (
                field_id in data["fields_not_supported"]
                or (field_id, scope) in data["fields_not_supported"]
            ):
                out.nvmlReturn = not_supported()
            elif field_id in pcie_fields:
                raw = data["pcie_count"][pcie_fields[field_id]]
                if raw is None:
                    out.nvmlReturn = not_supported()
                    continue
                out.valueType = getattr(pynvml, data["pcie_count"]["value_type"])
                if out.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
                    out.value.uiVal = int(raw) % 2**32
                else:
                    out.value.ullVal = int(raw) % 2**64
            elif not links:
                out.nvmlReturn = not_supported()
            elif field_id == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
                out.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                out.value.uiVal = len(links)
            elif field_id in nvlink_fields:
                key = "tx_kib" if field_id == nvlink_fields[0] else "rx_kib"
                if scope == 0xFFFFFFFF:
                    aggregate = data["nvlink_aggregate_scope"]
                    if aggregate is not True:
                        out.nvmlReturn = not_supported() if aggregate is False else aggregate
                        continue
                    out.value.ullVal = _active_sum(links, key) + data["nvlink_aggregate_extra_kib"]
                elif scope not in links:
                    out.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
                elif data["nvlink_per_link_is_aggregate"]:
                    out.value.ullVal = _active_sum(links, key)
                else:
                    out.value.ullVal = links[scope][key]
            else:
                out.nvmlReturn = not_supported()
        return values

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return int(self._gpu("nvmlDeviceGetPowerUsage", handle)["power_mw"])

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, type: int) -> int:
        data = self._gpu("nvmlDeviceGetClockInfo", handle)
        if type != pynvml.NVML_CLOCK_SM:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(data["sm_clock_mhz"])

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        data = self._gpu("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(data["temperature_c"])

    def nvmlDeviceGetTemperatureV(
        self, handle: FakeHandle, sensor: int, version: int | None = None
    ) -> int:
        data = self._gpu("nvmlDeviceGetTemperatureV", handle)
        if version is not None and version != pynvml.nvmlTemperature_v1:
            raise self._error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(data["temperature_c"])

    def nvmlDeviceGetTotalEccErrors(
        self, handle: FakeHandle, errorType: int, counterType: int
    ) -> int:
        ecc = self._gpu("nvmlDeviceGetTotalEccErrors", handle)["ecc"]
        if counterType != pynvml.NVML_VOLATILE_ECC:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return int(ecc["corrected"])
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return int(ecc["uncorrected"])
        raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _processes(self, name: str, handle: FakeHandle, key: str) -> list[Any]:
        procs = self._gpu(name, handle)[key]
        out = []
        for pid, used in procs:
            info = pynvml.c_nvmlProcessInfo_t(pid=pid, usedGpuMemory=used or 0)
            obj = pynvml.nvmlStructToFriendlyObject(info)
            if used is None:
                obj.usedGpuMemory = None  # pynvml's translation of NVML_VALUE_NOT_AVAILABLE
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses", handle, "compute_processes")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        return self._processes(
            "nvmlDeviceGetGraphicsRunningProcesses", handle, "graphics_processes"
        )

    # --- events ---------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        """The simulated GPU delivers no events (neither the dry run nor tracegen needs them):
        NOT_SUPPORTED, as on a GPU without them. The tests' ``EventNvml``
        (``tests/nvml_support.py``) delivers the GPU dicts' ``xid_events``."""
        self._enter("nvmlEventSetCreate")
        raise self._error(not_supported())

    # --- MIG ------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, device: FakeHandle) -> list[int]:
        data = self._gpu("nvmlDeviceGetMigMode", device)
        if data["mig_mode"] is not None:
            return list(data["mig_mode"])
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if data["mig"] else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]  # current, pending

    def nvmlDeviceGetMaxMigDeviceCount(self, device: FakeHandle) -> int:
        self._gpu("nvmlDeviceGetMaxMigDeviceCount", device)
        return 7  # an H100/H200's most GPU instances

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeHandle, index: int) -> FakeHandle:
        data = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if not 0 <= index < 7:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # A MIG device sits in its "slot" (default: its place in the list); others are empty.
        slots = {m.get("slot", i): i for i, m in enumerate(data["mig"])}
        if index not in slots:
            raise self._error(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeHandle(device.index, device.generation, mig=slots[index])

    def nvmlDeviceGetGpuInstanceId(self, device: FakeHandle) -> int:
        if device.mig is None:
            self._enter("nvmlDeviceGetGpuInstanceId")
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # not a MIG device
        return int(self._gpu("nvmlDeviceGetGpuInstanceId", device)["gpu_instance"])

    def nvmlGpmMigSampleGet(self, device: FakeHandle, gpuInstanceId: int, gpmSample: Any) -> Any:
        data = self._gpu("nvmlGpmMigSampleGet", device)
        address = ctypes.addressof(gpmSample.contents)
        if address not in self._gpm_buffers or device.mig is not None:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        found = [m for m in data["mig"] if m["gpu_instance"] == gpuInstanceId]
        if not found:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_taken += 1
        # Keyed like a GPU of its own, so sample1 and sample2 must be the same instance.
        owner = (device.index, gpuInstanceId)
        self._gpm_buffers[address] = (owner, dict(found[0]["gpm"]), self._gpm_taken,
                                      self.clock())
        return gpmSample

    # --- GPM ------------------------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, device: FakeHandle) -> Any:
        data = self._gpu("nvmlGpmQueryDeviceSupport", device)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 0 if data["gpm"] is None else 1
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._enter("nvmlGpmSampleAlloc")
        struct = pynvml.struct_c_nvmlGpmSample_t()
        self._gpm_structs.append(struct)
        self._gpm_buffers[ctypes.addressof(struct)] = (None, None, 0, 0.0)
        return pynvml.c_nvmlGpmSample_t(struct)

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._count("nvmlGpmSampleFree")
        self._gpm_buffers.pop(ctypes.addressof(gpmSample.contents), None)

    def nvmlGpmSampleGet(self, device: FakeHandle, gpmSample: Any) -> Any:
        data = self._gpu("nvmlGpmSampleGet", device)
        address = ctypes.addressof(gpmSample.contents)
        if address not in self._gpm_buffers:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if data["gpm"] is None:
            raise self._error(not_supported())
        self._gpm_taken += 1
        self._gpm_buffers[address] = (device.index, dict(data["gpm"]), self._gpm_taken,
                                      self.clock())
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        """Each metric's value is the one the GPU dict held when sample2 was taken."""
        self._enter("nvmlGpmMetricsGet")
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise self._error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if not 0 < metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        address1 = ctypes.addressof(metricsGet.sample1.contents)
        address2 = ctypes.addressof(metricsGet.sample2.contents)
        first = self._gpm_buffers.get(address1)
        second = self._gpm_buffers.get(address2)
        if first is None or second is None or first[1] is None or second[1] is None:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # an unfilled buffer
        if address1 == address2 or first[0] != second[0]:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # same buffer, or two GPUs
        if first[2] > second[2]:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # sample1 must be the older
        self.gpm_windows.append((first[2], second[2]))
        values = second[1]
        owner = second[0]
        if self.gpm_between is not None and isinstance(owner, int):
            values = self.gpm_between(owner, first[3], second[3])
        errors = self.gpus[owner]["gpm_metric_errors"] if isinstance(owner, int) else {}
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            if metric.metricId in errors:
                metric.nvmlReturn = errors[metric.metricId]
            elif metric.metricId in values:
                metric.nvmlReturn = pynvml.NVML_SUCCESS
                metric.value = values[metric.metricId]
            else:
                metric.nvmlReturn = not_supported()
        return metricsGet
