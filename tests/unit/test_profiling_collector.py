"""The profiling collector over the real CUPTI sampler with the fake library beneath it: which
series a throughput-only chip and a byte-counter chip export, as Prometheus sees them."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from mrc_agent.agent.core.attribution import Attribution
from mrc_agent.agent.core.catalog import CATALOG
from mrc_agent.agent.core.collectors.profiling import (
    DRAM_READ_BYTES,
    DRAM_READ_THROUGHPUT,
    PROFILING_METRICS_INFO,
    ProfilingCollector,
    ProfilingStatus,
)
from mrc_agent.agent.core.hw.base import GPUIdentity, SourceUnavailable
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler
from mrc_agent.agent.core.sample import Snapshot
from mrc_agent.agent.tools.simgpu.cupti import FakeCupti, FakeDevice, fake_uuid
from mrc_agent.exporters.exposition.snapshot import SnapshotCollector
from tests.support import pass_view, published

SM = "sm__inst_executed_realtime.sum"
PCT = "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"
BYTES = "dram__bytes_read.sum"


def _exposition(*devices: FakeDevice) -> dict[str, list[tuple[dict[str, str], float]]]:
    lib = FakeCupti(dict(enumerate(devices)))
    gpus = [GPUIdentity(i, fake_uuid(i), "NVIDIA H200") for i in range(len(devices))]
    # No targets: the attribution is undecided, so several GPUs need the opt-in.
    collector = ProfilingCollector(CuptiPmSampler(gpus, lib=lib, cuda=CudaDriver(lib.driver),
                                                  profile_undecided=True))
    samples = collector.update(pass_view()).samples
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(CATALOG, lambda: Snapshot(1, 1.0, tuple(samples))))
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_a_throughput_only_chip_exports_a_ratio_and_names_its_metrics_never_bytes() -> None:
    hopper = FakeDevice(
        supported_metrics=frozenset(),
        single_pass_sets={"PmSampling": ["sm__inst_executed_realtime", "dramc__read_throughput"]},
        decodes=[[{SM: 10.0, PCT: 40.0}, {SM: 10.0, PCT: 80.0}]],
    )

    series = _exposition(hopper)

    [(labels, value)] = series[DRAM_READ_THROUGHPUT.name]
    assert labels["gpu"] == "0" and value == pytest.approx(0.6)  # mean of 40 % and 80 %
    assert DRAM_READ_BYTES.name not in series
    [(info, one)] = series[PROFILING_METRICS_INFO.name]
    assert one == 1.0
    assert (info["sm_metric"], info["dram_metric"], info["metric_set"]) == (SM, PCT, "PmSampling")
    assert info["uuid"] == fake_uuid(0) and info["gpu_model"] == "NVIDIA H200"


def test_a_byte_counter_chip_exports_bytes_no_ratio_and_says_no_set_was_used() -> None:
    device = FakeDevice(decodes=[[{SM: 5.0, BYTES: 4096.0}]])  # no sets: names tried in order

    series = _exposition(device, FakeDevice(errors={"enable": [PermissionError("admin only")]}))

    assert [v for _, v in series[DRAM_READ_BYTES.name]] == [4096.0]
    assert DRAM_READ_THROUGHPUT.name not in series
    # Only the sampling GPU says which names are live.
    [(info, _)] = series[PROFILING_METRICS_INFO.name]
    assert (info["gpu"], info["dram_metric"], info["metric_set"]) == ("0", BYTES, "none")


def _collector(*devices: FakeDevice) -> ProfilingCollector:
    lib = FakeCupti(dict(enumerate(devices)))
    gpus = [GPUIdentity(i, fake_uuid(i), "NVIDIA H200") for i in range(len(devices))]
    return ProfilingCollector(CuptiPmSampler(gpus, lib=lib, cuda=CudaDriver(lib.driver)))


def test_status_says_not_requested_then_why_not_and_leaves_it_in_the_pass() -> None:
    collector = _collector(FakeDevice(errors={"enable": [PermissionError("admin only")]}))
    assert collector.status == ("not_requested", "")

    update = collector.update(pass_view())

    assert isinstance(update.error, SourceUnavailable) and update.samples == []
    assert collector.status == ("no_permission", "PermissionError: admin only")
    assert published(update, ProfilingStatus) == ProfilingStatus(*collector.status)


def test_a_working_source_is_ok_with_no_detail_in_the_pass() -> None:
    collector = _collector(FakeDevice(decodes=[[{SM: 1.0, BYTES: 2.0}]]))

    update = collector.update(pass_view())

    assert update.error is None
    assert collector.status == ("ok", "")
    assert published(update, ProfilingStatus) == ProfilingStatus("ok", "")


def test_only_watched_gpus_are_exported() -> None:
    collector = _collector(FakeDevice(decodes=[[{SM: 1.0, BYTES: 2.0}]]),
                           FakeDevice(decodes=[[{SM: 3.0, BYTES: 4.0}]]))
    watched = GPUIdentity(1, fake_uuid(1), "NVIDIA H200")
    view = pass_view(outputs=[Attribution(mode="test", gpus={watched: frozenset()})])

    samples = collector.update(view).samples

    assert samples and {labels[0] for _, labels, _ in samples} == {"1"}


def test_a_gpu_measuring_sm_instructions_only_still_names_its_metrics() -> None:
    series = _exposition(FakeDevice(supported_metrics=frozenset({SM}), decodes=[[{SM: 5.0}]]))

    [(info, _)] = series[PROFILING_METRICS_INFO.name]
    assert (info["sm_metric"], info["dram_metric"]) == (SM, "none")
