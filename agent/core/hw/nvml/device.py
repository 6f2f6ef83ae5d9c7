"""One :class:`~mrc_agent.agent.core.hw.base.DeviceSample` per GPU: the per-device NVML fields.

Utilisation (the rates and GetSamples' fine-grained buffer), memory, PCIe replays, power,
SM clock, temperature, ECC counts and per-process memory are read here, each through the
memo so a field the GPU does not support stays ``None`` and is not asked again. PCIe
throughput, NVLink counters and XID events have parts of their own; :class:`DeviceReader`
fills them in at the same point of the sample as always, so NVML sees the same calls in the
same order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from mrc_agent.agent.core.hw.base import DeviceSample, finite, ratio_of_percent
from mrc_agent.agent.core.hw.nvml.events import XidEvents
from mrc_agent.agent.core.hw.nvml.nvlink import NvlinkCounters
from mrc_agent.agent.core.hw.nvml.pcie import PcieReader
from mrc_agent.agent.core.hw.nvml.pcie_counters import PcieCounters
from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, union_value
from mrc_agent.agent.core.hw.nvml.units import (
    identify_clock,
    megahertz_to_hertz,
    milliwatts_to_watts,
    nvml_timestamp_to_monotonic,
)

log = logging.getLogger(__name__)

#: Per-process queries, newest first: a driver without the ``_v3`` entry points (which the
#: plain names call in nvidia-ml-py 12.535 and later) still answers ``_v2``.
_PROCESS_QUERIES = (
    ("compute_processes", ("nvmlDeviceGetComputeRunningProcesses",
                           "nvmlDeviceGetComputeRunningProcesses_v2")),
    ("graphics_processes", ("nvmlDeviceGetGraphicsRunningProcesses",
                            "nvmlDeviceGetGraphicsRunningProcesses_v2")),
)


def default_sample_clocks(wall_clock: Callable[[], float]) -> dict[str, Callable[[], float]]:
    """The clocks an NVML sample timestamp may be on, by the name the info metric shows."""
    return {
        "realtime": wall_clock,
        "boottime": lambda: time.clock_gettime(time.CLOCK_BOOTTIME),
        "monotonic": lambda: time.clock_gettime(time.CLOCK_MONOTONIC),
    }


class DeviceReader:
    """Builds device samples. ``clock`` is the monotonic clock samples are stamped with;
    ``sample_clocks`` the clocks NVML's sample timestamps may be taken on, by name: which one
    a GPU's timestamps are on is identified from its first batch (``sources["util_clock"]``)."""

    def __init__(
        self,
        memo: Memo,
        clock: Callable[[], float],
        sample_clocks: dict[str, Callable[[], float]],
        *,
        pcie: PcieReader,
        pcie_counters: PcieCounters,
        nvlink: NvlinkCounters,
        xid: XidEvents,
    ) -> None:
        self._memo = memo
        self._clock = clock
        self._sample_clocks = sample_clocks
        #: The clock each GPU's sample timestamps were found on (None: none fits, unused).
        self._util_clock: dict[str, str | None] = {}
        self._pcie = pcie
        self._pcie_counters = pcie_counters
        self._nvlink = nvlink
        self._xid = xid
        # The newest GetSamples timestamp seen per GPU UUID, kept across NVML sessions so a
        # re-init does not re-read old utilisation samples.
        self._last_util_timestamp: dict[str, int] = {}

    def sample(self, lib: Any, gpu: Gpu) -> DeviceSample:
        """Every field of one GPU; an NVMLError other than "not supported" propagates."""
        h = gpu.handle
        optional = self._memo.optional
        s = DeviceSample(gpu=gpu.identity)

        util = optional(lib, gpu, "utilization", lambda: lib.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            s.gpu_util = ratio_of_percent(util.gpu)
            s.mem_util = ratio_of_percent(util.memory)
        s.util_samples = self._util_samples(lib, gpu, s)

        s.mem_used_bytes, s.mem_total_bytes = self._memory(lib, gpu)

        self._pcie_traffic(lib, gpu, s)
        replays = optional(
            lib, gpu, "pcie_replay_counter", lambda: lib.nvmlDeviceGetPcieReplayCounter(h)
        )
        if replays is not None:
            s.pcie_replays_total = float(replays)

        self._nvlink.read(lib, gpu, s)

        power = optional(lib, gpu, "power_usage", lambda: lib.nvmlDeviceGetPowerUsage(h))
        if power is not None:
            s.power_watts = finite(milliwatts_to_watts(power))
        clock = optional(
            lib, gpu, "sm_clock", lambda: lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_SM)
        )
        if clock is not None:
            s.sm_clock_hertz = finite(megahertz_to_hertz(clock))
        s.temperature_celsius = finite(self._temperature(lib, gpu))

        ecc = optional(
            lib,
            gpu,
            "ecc_errors",
            lambda: (
                lib.nvmlDeviceGetTotalEccErrors(
                    h, lib.NVML_MEMORY_ERROR_TYPE_CORRECTED, lib.NVML_VOLATILE_ECC
                ),
                lib.nvmlDeviceGetTotalEccErrors(
                    h, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
                ),
            ),
        )
        if ecc is not None:
            s.ecc_corrected_total, s.ecc_uncorrected_total = float(ecc[0]), float(ecc[1])

        self._xid.poll(lib, gpu, s)
        s.process_memory_bytes = self._process_memory(lib, gpu)
        return s

    def sample_mig(self, lib: Any, mig: Gpu) -> DeviceSample:
        """What NVML answers per MIG device: its memory and the processes on it."""
        s = DeviceSample(gpu=mig.identity)
        s.mem_used_bytes, s.mem_total_bytes = self._memory(lib, mig)
        s.process_memory_bytes = self._process_memory(lib, mig)
        return s

    def pcie_counters(self, lib: Any, gpus: list[Gpu]) -> dict[str, tuple[float, float]]:
        """Each GPU's PCIe byte totals (TX, RX) now, for GPUs that have the counters."""
        out: dict[str, tuple[float, float]] = {}
        for gpu in gpus:
            counted = self._pcie_counters.read(lib, gpu)
            if counted is not None:
                out[gpu.identity.uuid] = (counted[0], counted[1])
        return out

    def _pcie_traffic(self, lib: Any, gpu: Gpu, s: DeviceSample) -> None:
        """Byte counters where the driver has them; else the PCIe thread's latest rates."""
        counted = self._pcie_counters.read(lib, gpu)
        if counted is not None:
            s.pcie_tx_bytes_total, s.pcie_rx_bytes_total = counted[0], counted[1]
            s.pcie_tx_bytes_per_second, s.pcie_rx_bytes_per_second = counted[2], counted[3]
            s.pcie_dropped_intervals = self._pcie_counters.dropped(gpu.identity.uuid)
            s.sources["pcie"] = "byte_counters"
            return
        s.sources["pcie"] = "throughput_call"
        # Not read here: each call blocks 20 ms. The PCIe thread's latest values, if fresh.
        pcie = self._pcie.latest(gpu.identity.uuid)
        if pcie is not None:
            s.pcie_tx_bytes_per_second = pcie.tx_bytes_per_second
            s.pcie_rx_bytes_per_second = pcie.rx_bytes_per_second

    def _temperature(self, lib: Any, gpu: Gpu) -> float | None:
        """nvmlDeviceGetTemperatureV where the library and driver have it; the deprecated
        nvmlDeviceGetTemperature otherwise (nvidia-ml-py 12.535 has only that one)."""
        h = gpu.handle
        if hasattr(lib, "nvmlDeviceGetTemperatureV"):
            temp = self._memo.optional(
                lib, gpu, "temperature_v",
                lambda: lib.nvmlDeviceGetTemperatureV(h, lib.NVML_TEMPERATURE_GPU),
            )
            if temp is not None:
                return float(temp)
        temp = self._memo.optional(
            lib, gpu, "temperature",
            lambda: lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU),
        )
        return None if temp is None else float(temp)

    def _util_samples(self, lib: Any, gpu: Gpu, s: DeviceSample) -> list[tuple[float, float]]:
        uuid = gpu.identity.uuid
        last = self._last_util_timestamp.get(uuid, 0)
        # NOT_FOUND is NVML's answer when no sample is newer than ``last``.
        got = self._memo.optional(
            lib,
            gpu,
            "utilization_samples",
            lambda: lib.nvmlDeviceGetSamples(gpu.handle, lib.NVML_GPU_UTILIZATION_SAMPLES, last),
            empty=(lib.NVML_ERROR_NOT_FOUND,),
        )
        if not got:
            return []
        value_type, samples = got
        ordered = sorted(samples, key=lambda smp: int(smp.timeStamp))
        if not ordered:
            return []
        mono_now = self._clock()
        nows = {name: read() for name, read in self._sample_clocks.items()}
        if uuid not in self._util_clock:
            found = identify_clock(int(ordered[-1].timeStamp), nows)
            self._util_clock[uuid] = found
            self._memo.log_once(
                log, f"util_clock:{uuid}", logging.INFO if found else logging.WARNING,
                "GPU %d (%s): utilisation sample timestamps %s", gpu.index, uuid,
                f"are on the {found} clock" if found else
                "fit no known clock; fine-grained utilisation samples are not used",
            )
        clock_name = self._util_clock[uuid]
        s.sources["util_clock"] = clock_name or "unknown"
        out: list[tuple[float, float]] = []
        newest = last
        for sample in ordered:
            stamp = int(sample.timeStamp)
            if stamp <= last:
                continue  # the buffer may repeat the boundary sample
            newest = max(newest, stamp)
            value = ratio_of_percent(union_value(lib, value_type, sample.sampleValue))
            if clock_name is None or value is None:
                continue
            when = nvml_timestamp_to_monotonic(stamp, mono_now=mono_now, wall_now=nows[clock_name])
            out.append((when, value))
        self._last_util_timestamp[uuid] = newest
        return out

    def _memory(self, lib: Any, gpu: Gpu) -> tuple[float | None, float | None]:
        h = gpu.handle
        # v2 reports driver-reserved memory separately, so ``used`` is what processes hold;
        # v1's ``used`` includes the reservation. Older drivers only have v1.
        mem = self._memo.optional(
            lib,
            gpu,
            "memory_info_v2",
            lambda: lib.nvmlDeviceGetMemoryInfo(h, version=lib.nvmlMemory_v2),
        )
        if mem is None:
            mem = self._memo.optional(
                lib, gpu, "memory_info", lambda: lib.nvmlDeviceGetMemoryInfo(h)
            )
        if mem is None:
            return None, None
        return finite(mem.used), finite(mem.total)

    def _process_memory(self, lib: Any, gpu: Gpu) -> dict[int, float]:
        h = gpu.handle
        out: dict[int, float] = {}
        for feature, names in _PROCESS_QUERIES:
            procs = None
            for i, name in enumerate(names):
                query = getattr(lib, name, None)
                if query is None:
                    continue
                procs = self._memo.optional(
                    lib, gpu, feature if i == 0 else f"{feature}_v{i + 1}", partial(query, h)
                )
                if procs is not None:
                    break
            for proc in procs or ():
                used = finite(proc.usedGpuMemory)
                if used is None:
                    continue  # pynvml's spelling of NVML_VALUE_NOT_AVAILABLE (e.g. WDDM)
                pid = int(proc.pid)
                # A process with both a compute and a graphics context is listed twice with
                # the same total; summing would double-count it.
                out[pid] = max(out.get(pid, 0.0), float(used))
        return out
