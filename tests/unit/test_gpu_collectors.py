"""Tests of the gpu and gpm collectors (agent/core/collectors/gpu.py, gpm.py) on hand-built
samples: which series each field becomes, with which labels and in which order, and what they
publish for the derived collector."""

from __future__ import annotations

import pytest

from mrc_agent.agent.core.collectors import gpm as gpm_collector
from mrc_agent.agent.core.collectors import gpu as gpu_collector
from mrc_agent.agent.core.collectors.base import BuildContext, PassView, TargetState, Update
from mrc_agent.agent.core.collectors.gpm import GpmCollector
from mrc_agent.agent.core.collectors.gpu import GpuCollector, GpuReadings
from mrc_agent.agent.core.hw.base import DeviceSample, GpmSample, GPUIdentity, SourceUnavailable
from mrc_agent.agent.core.hw.sources import Sources
from tests.support import pass_view, published

GPU0 = GPUIdentity(index=0, uuid="GPU-0", name="NVIDIA H200")
GPU1 = GPUIdentity(index=1, uuid="GPU-1", name="NVIDIA H200")
L0 = ("0", "GPU-0", "NVIDIA H200")
L1 = ("1", "GPU-1", "NVIDIA H200")
NOW = 1234.5


class Devices:
    """A DeviceSource answering the samples it was given."""

    def __init__(self, *samples: DeviceSample) -> None:
        self.samples = list(samples)

    def sample_devices(self) -> list[DeviceSample]:
        return self.samples


class Gpms:
    """A GpmSource answering the samples it was given."""

    def __init__(self, *samples: GpmSample) -> None:
        self.samples = list(samples)

    def sample_gpm(self) -> list[GpmSample]:
        return self.samples


def context(targets: tuple[int, ...] = (), names: dict[int, str] | None = None) -> PassView:
    return pass_view(NOW, targets, wall=1.7e9,
                     processes={pid: TargetState(pid=pid, process=name)
                                for pid, name in (names or {}).items()})


def readings(update: Update) -> GpuReadings:
    out = published(update, GpuReadings)
    assert out is not None
    return out


# --- gpu collector ------------------------------------------------------------------------


def test_every_device_field_becomes_its_series_in_table_order() -> None:
    s = DeviceSample(
        gpu=GPU0, gpu_util=0.5, mem_util=0.25, mem_used_bytes=10.0, mem_total_bytes=80.0,
        pcie_tx_bytes_per_second=1.0, pcie_rx_bytes_per_second=2.0, pcie_replays_total=3.0,
        nvlink_tx_bytes_total=40.0, nvlink_rx_bytes_total=60.0, power_watts=300.0,
        sm_clock_hertz=1.98e9, temperature_celsius=41.0, xid_errors_total=2.0, last_xid=79.0,
        ecc_corrected_total=5.0, ecc_uncorrected_total=6.0,
    )
    out = GpuCollector(Devices(s)).update(context()).samples
    assert out == [
        ("mrc_gpu_utilization_ratio", L0, 0.5),
        ("mrc_gpu_memory_utilization_ratio", L0, 0.25),
        ("mrc_gpu_memory_used_bytes", L0, 10.0),
        ("mrc_gpu_memory_total_bytes", L0, 80.0),
        ("mrc_gpu_pcie_tx_bytes_per_second", L0, 1.0),
        ("mrc_gpu_pcie_rx_bytes_per_second", L0, 2.0),
        ("mrc_gpu_pcie_replays_total", L0, 3.0),
        ("mrc_gpu_nvlink_tx_bytes_total", L0, 40.0),
        ("mrc_gpu_nvlink_rx_bytes_total", L0, 60.0),
        ("mrc_gpu_power_watts", L0, 300.0),
        ("mrc_gpu_sm_clock_hertz", L0, 1.98e9),
        ("mrc_gpu_temperature_celsius", L0, 41.0),
        ("mrc_gpu_xid_errors_total", L0, 2.0),
        ("mrc_gpu_last_xid", L0, 79.0),
        ("mrc_gpu_ecc_errors_total", L0 + ("corrected",), 5.0),
        ("mrc_gpu_ecc_errors_total", L0 + ("uncorrected",), 6.0),
    ]


def test_a_device_sample_without_values_emits_nothing_and_leaves_no_utilisation() -> None:
    update = GpuCollector(Devices(DeviceSample(gpu=GPU0))).update(context(targets=(7,)))
    assert update.samples == []
    got = readings(update)
    assert got.util == {} and got.util_points == {} and got.gpus_of_pid == {}


def test_per_link_nvlink_counters_are_sorted_by_link_and_labelled_with_it() -> None:
    s = DeviceSample(gpu=GPU0, nvlink_links={2: (20.0, 21.0), 0: (1.0, 2.0)})
    out = GpuCollector(Devices(s)).update(context()).samples
    assert out == [
        ("mrc_gpu_nvlink_link_tx_bytes_total", L0 + ("0",), 1.0),
        ("mrc_gpu_nvlink_link_rx_bytes_total", L0 + ("0",), 2.0),
        ("mrc_gpu_nvlink_link_tx_bytes_total", L0 + ("2",), 20.0),
        ("mrc_gpu_nvlink_link_rx_bytes_total", L0 + ("2",), 21.0),
    ]


@pytest.mark.parametrize(
    ("corrected", "uncorrected", "expected"),
    [
        (4.0, None, [("corrected", 4.0)]),
        (None, 9.0, [("uncorrected", 9.0)]),
        (0.0, 0.0, [("corrected", 0.0), ("uncorrected", 0.0)]),  # zero is a value, not absent
    ],
)
def test_ecc_kinds_are_emitted_independently(
    corrected: float | None, uncorrected: float | None, expected: list[tuple[str, float]]
) -> None:
    s = DeviceSample(gpu=GPU0, ecc_corrected_total=corrected, ecc_uncorrected_total=uncorrected)
    out = GpuCollector(Devices(s)).update(context()).samples
    assert out == [("mrc_gpu_ecc_errors_total", L0 + (kind,), v) for kind, v in expected]


def test_process_memory_only_for_targets_sorted_by_pid_with_their_names() -> None:
    s0 = DeviceSample(gpu=GPU0, process_memory_bytes={300: 3.0, 100: 1.0, 200: 2.0})
    s1 = DeviceSample(gpu=GPU1, process_memory_bytes={100: 5.0})
    # 200 is another tenant's process; 300 is a target the process collector has no name for.
    update = GpuCollector(Devices(s0, s1)).update(
        context(targets=(300, 100), names={100: "python3", 200: "other"}))
    assert update.samples == [
        ("mrc_gpu_process_memory_used_bytes", L0 + ("100", "python3"), 1.0),
        ("mrc_gpu_process_memory_used_bytes", L0 + ("300", ""), 3.0),
        ("mrc_gpu_process_memory_used_bytes", L1 + ("100", "python3"), 5.0),
    ]
    assert readings(update).gpus_of_pid == {100: {GPU0, GPU1}, 300: {GPU0}}


def test_utilisation_and_its_points_are_published() -> None:
    points = [(NOW - 0.5, 0.25), (NOW - 0.25, 0.75)]
    fine = DeviceSample(gpu=GPU0, gpu_util=0.5, util_samples=points)
    coarse = DeviceSample(gpu=GPU1, gpu_util=0.0)  # no sample buffer; 0 is a real value
    got = readings(GpuCollector(Devices(fine, coarse)).update(context()))
    assert got.util == {GPU0: 0.5, GPU1: 0.0}
    # Without fine-grained points the rate itself stands for the pass, stamped now.
    assert got.util_points == {GPU0: points, GPU1: [(NOW, 0.0)]}


def test_utilisation_points_without_a_rate_are_not_published() -> None:
    s = DeviceSample(gpu=GPU0, util_samples=[(NOW, 0.5)])
    got = readings(GpuCollector(Devices(s)).update(context()))
    assert got.util == {} and got.util_points == {}


def test_collectors_without_a_source_are_unavailable() -> None:
    with pytest.raises(SourceUnavailable) as info:
        GpuCollector(None).update(context())
    assert info.value.reason == "gpu_backend_none"
    with pytest.raises(SourceUnavailable) as info:
        GpmCollector(None).update(context())
    assert info.value.reason == "gpu_backend_none"


def test_factories_take_their_own_source() -> None:
    devices, gpms = Devices(DeviceSample(gpu=GPU0, power_watts=1.0)), Gpms()
    ctx = BuildContext(sources=Sources(device=devices, gpm=gpms))
    gpu_c = gpu_collector.DEFINITION.factory(ctx)
    gpm_c = gpm_collector.DEFINITION.factory(ctx)
    assert gpu_c.update(context()).samples == [("mrc_gpu_power_watts", L0, 1.0)]
    assert gpm_c.update(context()).samples == []
    gpms.samples.append(GpmSample(gpu=GPU1, sm_occupancy=0.5))
    assert gpm_c.update(context()).samples == [("mrc_gpu_sm_occupancy_ratio", L1, 0.5)]


# --- gpm collector ------------------------------------------------------------------------


def test_every_gpm_field_becomes_its_series_then_the_activity_quotient() -> None:
    s = GpmSample(
        gpu=GPU0, sm_util=0.8, sm_occupancy=0.4, tensor_util=0.25, dram_bw_util=0.5,
        pcie_tx_bytes_per_second=1.0, pcie_rx_bytes_per_second=2.0,
        nvlink_tx_bytes_per_second=3.0, nvlink_rx_bytes_per_second=4.0,
    )
    out = GpmCollector(Gpms(s, GpmSample(gpu=GPU1))).update(context()).samples
    assert out == [
        ("mrc_gpu_sm_active_ratio", L0, 0.8),
        ("mrc_gpu_sm_occupancy_ratio", L0, 0.4),
        ("mrc_gpu_tensor_pipe_active_ratio", L0, 0.25),
        ("mrc_gpu_dram_bandwidth_utilization_ratio", L0, 0.5),
        ("mrc_gpu_gpm_pcie_tx_bytes_per_second", L0, 1.0),
        ("mrc_gpu_gpm_pcie_rx_bytes_per_second", L0, 2.0),
        ("mrc_gpu_gpm_nvlink_tx_bytes_per_second", L0, 3.0),
        ("mrc_gpu_gpm_nvlink_rx_bytes_per_second", L0, 4.0),
        # an activity ratio over an activity ratio: 0.8 / 0.5, not an instruction count
        ("mrc_gpu_gpm_sm_to_dram_activity", L0, pytest.approx(1.6)),
    ]


def _quotient(sm: float | None, dram: float | None) -> list[object]:
    gpms = Gpms(GpmSample(gpu=GPU0, sm_util=sm, dram_bw_util=dram))
    out = GpmCollector(gpms).update(context()).samples
    return [v for name, _, v in out if name == "mrc_gpu_gpm_sm_to_dram_activity"]


def test_activity_quotient_from_the_dram_threshold_up() -> None:
    threshold = gpm_collector.MIN_DRAM_UTIL_FOR_PROXY
    assert threshold == 0.01
    assert _quotient(0.02, threshold) == [pytest.approx(2.0)]  # at the threshold: exported
    assert _quotient(0.3, 0.6) == [pytest.approx(0.5)]
    assert _quotient(0.0, 0.5) == [0.0]  # idle SMs, busy DRAM: a real zero
    assert _quotient(0.5, 0.0099) == []  # below it: noise, not exported
    assert _quotient(0.5, 0.0) == []  # no division by zero


def test_activity_quotient_needs_both_ratios() -> None:
    assert _quotient(None, 0.5) == []
    assert _quotient(0.5, None) == []
