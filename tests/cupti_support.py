"""What the CUPTI PM sampling tests share: the metric names, two H200-like GPUs, a clock moved
by hand, and a sampler over the fake library and driver."""

from __future__ import annotations

import pytest

from mrc_agent.agent.core.hw.base import (
    GPUIdentity,
    SourceUnavailable,
)
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from mrc_agent.agent.core.hw.cupti_pm import (
    PROFILING_METRICS,
    CuptiPmSampler,
)
from tests.fakes.fake_cupti import (
    FakeCupti,
    FakeDevice,
    fake_uuid,
)
from tests.support import Clock

SM, DRAM = PROFILING_METRICS
PCT = "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"
GPU0 = GPUIdentity(0, fake_uuid(0), "NVIDIA H200")
GPU1 = GPUIdentity(1, fake_uuid(1), "NVIDIA H200")
LOGGER = "mrc_agent.agent.core.hw.cupti_pm"
#: What the driver is asked first: cuInit, then each CUDA device's UUID (one device here).
MAPPED = ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetUuid"]


def rec(sm: float, dram: float) -> dict[str, float]:
    """One PM sampling interval's values under the preferred metric names."""
    return {SM: sm, DRAM: dram}


def sampler_for(
    *devices: FakeDevice, interval_s: float = 0.1, clock: Clock | None = None,
    lib: FakeCupti | None = None,
) -> tuple[CuptiPmSampler, FakeCupti]:
    lib = lib or FakeCupti({i: d for i, d in enumerate(devices)})
    gpus = [GPUIdentity(i, fake_uuid(i), "NVIDIA H200") for i in range(len(devices))]
    sampler = CuptiPmSampler(gpus, lib=lib, interval_s=interval_s, clock=clock or Clock(),
                             cuda=CudaDriver(lib.driver))
    return sampler, lib


def totals(sampler: CuptiPmSampler) -> list[tuple[float | None, float | None]]:
    return [
        (s.sm_instructions_executed_total, s.dram_read_bytes_total)
        for s in sampler.sample_profiling()
    ]


def unavailable(sampler: CuptiPmSampler) -> SourceUnavailable:
    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling()
    return caught.value
