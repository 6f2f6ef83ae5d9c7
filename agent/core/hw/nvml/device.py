"""One :class:`~agent.core.hw.base.DeviceSample` per GPU: the per-device NVML fields.

Utilisation (the rates and GetSamples' fine-grained buffer), memory, PCIe replays, power,
SM clock, temperature, ECC counts and per-process memory are read here, each through the
memo so a field the GPU does not support stays ``None`` and is not asked again. PCIe
throughput, NVLink counters and XID events have parts of their own; :class:`DeviceReader`
fills them in at the same point of the sample as always, so NVML sees the same calls in the
same order.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from mrc_agent.agent.core.hw.base import DeviceSample
from mrc_agent.agent.core.hw.nvml.events import XidEvents
from mrc_agent.agent.core.hw.nvml.nvlink import NvlinkCounters
from mrc_agent.agent.core.hw.nvml.pcie import PcieReader
from mrc_agent.agent.core.hw.nvml.session import Gpu, Memo, union_value
from mrc_agent.agent.core.hw.nvml.units import (
    megahertz_to_hertz,
    milliwatts_to_watts,
    nvml_timestamp_to_monotonic,
    percent_to_ratio,
)


class DeviceReader:
    """Builds device samples. ``clock`` is the monotonic clock samples are stamped with;
    ``wall_clock`` the one NVML's sample timestamps are taken on (the Unix epoch)."""

    def __init__(
        self,
        memo: Memo,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        *,
        pcie: PcieReader,
        nvlink: NvlinkCounters,
        xid: XidEvents,
    ) -> None:
        self._memo = memo
        self._clock = clock
        self._wall_clock = wall_clock
        self._pcie = pcie
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
            s.gpu_util = percent_to_ratio(util.gpu)
            s.mem_util = percent_to_ratio(util.memory)
        s.util_samples = self._util_samples(lib, gpu)

        s.mem_used_bytes, s.mem_total_bytes = self._memory(lib, gpu)

        # Not read here: each call blocks 20 ms. The PCIe thread's latest values, if fresh.
        pcie = self._pcie.latest(gpu.identity.uuid)
        if pcie is not None:
            s.pcie_tx_bytes_per_second = pcie.tx_bytes_per_second
            s.pcie_rx_bytes_per_second = pcie.rx_bytes_per_second
        replays = optional(
            lib, gpu, "pcie_replay_counter", lambda: lib.nvmlDeviceGetPcieReplayCounter(h)
        )
        if replays is not None:
            s.pcie_replays_total = float(replays)

        self._nvlink.read(lib, gpu, s)

        power = optional(lib, gpu, "power_usage", lambda: lib.nvmlDeviceGetPowerUsage(h))
        if power is not None:
            s.power_watts = milliwatts_to_watts(power)
        clock = optional(
            lib, gpu, "sm_clock", lambda: lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_SM)
        )
        if clock is not None:
            s.sm_clock_hertz = megahertz_to_hertz(clock)
        temp = optional(
            lib,
            gpu,
            "temperature",
            lambda: lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU),
        )
        if temp is not None:
            s.temperature_celsius = float(temp)

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

    def _util_samples(self, lib: Any, gpu: Gpu) -> list[tuple[float, float]]:
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
        mono_now, wall_now = self._clock(), self._wall_clock()
        out: list[tuple[float, float]] = []
        newest = last
        for sample in sorted(samples, key=lambda smp: int(smp.timeStamp)):
            stamp = int(sample.timeStamp)
            if stamp <= last:
                continue  # the buffer may repeat the boundary sample
            value = union_value(lib, value_type, sample.sampleValue)
            when = nvml_timestamp_to_monotonic(stamp, mono_now=mono_now, wall_now=wall_now)
            out.append((when, percent_to_ratio(value)))
            newest = max(newest, stamp)
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
        return float(mem.used), float(mem.total)

    def _process_memory(self, lib: Any, gpu: Gpu) -> dict[int, float]:
        h = gpu.handle
        out: dict[int, float] = {}
        for feature, query in (
            ("compute_processes", lib.nvmlDeviceGetComputeRunningProcesses),
            ("graphics_processes", lib.nvmlDeviceGetGraphicsRunningProcesses),
        ):
            procs = self._memo.optional(lib, gpu, feature, partial(query, h))
            for proc in procs or ():
                used = proc.usedGpuMemory
                if used is None:
                    continue  # pynvml's spelling of NVML_VALUE_NOT_AVAILABLE (e.g. WDDM)
                pid = int(proc.pid)
                # A process with both a compute and a graphics context is listed twice with
                # the same total; summing would double-count it.
                out[pid] = max(out.get(pid, 0.0), float(used))
        return out
