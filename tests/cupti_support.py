"""What the CUPTI PM sampling tests share: the metric names, two H200-like GPUs, a clock moved
by hand, a sampler over the fake library and driver, and devices offering the sets real CUPTI
releases ship (``tests/data/cupti_sets``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
from mrc_agent.agent.tools.simgpu.chips import COUNTER_ROLLUP, THROUGHPUT_ROLLUP
from mrc_agent.agent.tools.simgpu.cupti import (
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


#: The sets ``libcupti.so.13`` ships, read out of the wheels.
CUPTI_SETS_DIR = Path(__file__).resolve().parent / "data" / "cupti_sets"


def real_sets(version: str, chip: str) -> list[dict[str, Any]]:
    """The set entries (``{"chips", "set", "metrics", "user_metrics"}``) CUPTI ``version``
    ships for ``chip`` (lower case, as the library's documents name chips)."""
    data = json.loads((CUPTI_SETS_DIR / f"cupti-{version}.json").read_text(encoding="utf-8"))
    return [entry for entry in data["sets"] if chip in entry["chips"]]


def real_device(version: str, chip: str, **overrides: Any) -> FakeDevice:
    """A device offering exactly the single-pass sets CUPTI ``version`` has for ``chip``.

    Without a set name ``configure`` accepts a listed metric by its full name with ``.sum``
    (a throughput user metric with ``.avg.pct_of_peak_sustained_elapsed``); with one, by the
    name less its rollup. The metric units ``ProfilerHost.get_metric_properties`` gives follow
    the names (``sectors``, ``bytes``, ``%``), what Nsight Compute's tables state.
    """
    entries = real_sets(version, chip)
    if not entries:
        raise ValueError(f"CUPTI {version} has no set for {chip}")
    supported: set[str] = set()
    for entry in entries:
        supported.update(m + COUNTER_ROLLUP for m in entry["metrics"])
        supported.update(name + THROUGHPUT_ROLLUP for name, body in entry["user_metrics"].items()
                         if body["kind"] == "throughput")
    fields: dict[str, Any] = {
        "chip_name": chip, "supported_metrics": frozenset(supported),
        "single_pass_sets": {entry["set"]: list(entry["metrics"]) for entry in entries},
    }
    fields.update(overrides)
    return FakeDevice(**fields)
