"""Tests of the NVML adapter (agent/core/hw/nvml/) through the hand-written fake pynvml: unit
conversions, device sampling, failures and recovery, doctor's view, what each part logs, NVLink.
The PCIe throughput thread is in test_nvml_pcie_thread, GPM in test_nvml_gpm."""
from __future__ import annotations

import ctypes.util
import logging
import sys
from typing import Any

import pynvml
import pytest

from mrc_agent.agent.core.hw import nvml as nvml_mod
from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.tools.simgpu.nvml import gpu, nvlink
from tests.nvml_support import (
    MONO_NOW,
    NVML_LOGGER,
    UUID0,
    UUID1,
    WALL_NOW,
    EventNvml,
    backend,
    gpm_values,
    messages,
)


def test_unit_conversions_match_nvml_documented_units() -> None:
    assert nvml_mod.percent_to_ratio(37) == pytest.approx(0.37)
    assert nvml_mod.pcie_kb_per_s_to_bytes_per_s(3) == 3 * 1024
    assert nvml_mod.nvlink_kib_to_bytes(5) == 5 * 1024
    assert nvml_mod.gpm_mib_per_s_to_bytes_per_s(2) == 2 * 1024 * 1024
    assert nvml_mod.milliwatts_to_watts(312_500) == pytest.approx(312.5)
    assert nvml_mod.megahertz_to_hertz(1980) == 1_980_000_000


def test_nvml_timestamp_maps_sample_age_onto_monotonic_clock() -> None:
    stamp_us = int((WALL_NOW - 0.25) * 1_000_000)
    mapped = nvml_mod.nvml_timestamp_to_monotonic(stamp_us, mono_now=MONO_NOW, wall_now=WALL_NOW)
    assert mapped == pytest.approx(MONO_NOW - 0.25)
    # A sample stamped slightly "in the future" by clock disagreement is pinned to now.
    future_us = int((WALL_NOW + 1.0) * 1_000_000)
    assert (
        nvml_mod.nvml_timestamp_to_monotonic(future_us, mono_now=MONO_NOW, wall_now=WALL_NOW)
        == MONO_NOW
    )


def test_device_sample_converts_every_field_to_base_units() -> None:
    fake = EventNvml(
        [
            gpu(
                util={"gpu": 73, "memory": 12},
                memory={"total": 80 * 2**30, "used": 6 * 2**30, "reserved": 2**29},
                pcie={"tx_kb_per_s": 1500, "rx_kb_per_s": 250, "replays": 7},
                power_mw=412_345,
                sm_clock_mhz=1755,
                temperature_c=61,
                ecc={"corrected": 3, "uncorrected": 1},
            )
        ]
    )
    b = backend(fake)
    b.sample_devices()
    b._pcie.run_round()  # PCIe throughput comes from the background reader's latest values
    [s] = b.sample_devices()
    assert s.gpu.index == 0 and s.gpu.uuid == "GPU-00000000-fake-uuid"
    assert s.gpu.name == "NVIDIA H100 80GB HBM3"
    assert s.gpu_util == pytest.approx(0.73)
    assert s.mem_util == pytest.approx(0.12)
    # memory info v2: ``used`` excludes the driver's reservation
    assert s.mem_used_bytes == 6 * 2**30
    assert s.mem_total_bytes == 80 * 2**30
    assert s.pcie_tx_bytes_per_second == 1500 * 1024
    assert s.pcie_rx_bytes_per_second == 250 * 1024
    assert s.pcie_replays_total == 7
    assert s.power_watts == pytest.approx(412.345)
    assert s.sm_clock_hertz == 1_755_000_000
    assert s.temperature_celsius == 61
    assert (s.ecc_corrected_total, s.ecc_uncorrected_total) == (3, 1)
    assert s.xid_errors_total == 0 and s.last_xid is None


def test_memory_falls_back_to_v1_on_drivers_without_v2() -> None:
    fake = EventNvml(
        [
            gpu(
                memory={"total": 100, "used": 30, "reserved": 5},
                not_supported={"nvmlDeviceGetMemoryInfo_v2"},
            )
        ]
    )
    b = backend(fake)
    [s] = b.sample_devices()
    assert (s.mem_used_bytes, s.mem_total_bytes) == (35, 100)  # v1: used includes reserved
    b.sample_devices()
    # v2 was tried once, then only v1: two samples, three calls.
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 3


def test_nvlink_counters_per_link_and_summed_in_bytes() -> None:
    links = {0: nvlink(10, 20), 1: nvlink(30, 40), 2: nvlink(999, 999, active=False)}
    fake = EventNvml([gpu(nvlink=links)])
    b = backend(fake)
    [s] = b.sample_devices()
    assert s.nvlink_links == {0: (10 * 1024, 20 * 1024), 1: (30 * 1024, 40 * 1024)}
    assert s.nvlink_tx_bytes_total == 40 * 1024
    assert s.nvlink_rx_bytes_total == 60 * 1024

    fake.gpus[0]["nvlink"][1]["tx_kib"] += 1000  # traffic on link 1
    [s] = b.sample_devices()
    assert s.nvlink_links[1] == (1030 * 1024, 40 * 1024)
    assert s.nvlink_tx_bytes_total == 1040 * 1024
    # Links are discovered once per NVML session, not on every sample.
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 3


def test_gpu_without_nvlink_leaves_nvlink_fields_absent() -> None:
    fake = EventNvml([gpu(nvlink={})])
    b = backend(fake)
    [s] = b.sample_devices()
    assert s.nvlink_tx_bytes_total is None and s.nvlink_rx_bytes_total is None
    assert s.nvlink_links == {}
    b.sample_devices()
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 1  # probed once, found none, stopped


def test_not_supported_leaves_field_none_and_is_not_retried_or_relogged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = EventNvml([gpu(not_supported={"nvmlDeviceGetPowerUsage",
                                         "nvmlDeviceGetTotalEccErrors"})])
    b = backend(fake)
    with caplog.at_level(logging.INFO, logger="mrc_agent.agent.core.hw.nvml"):
        samples = [b.sample_devices()[0] for _ in range(3)]
    assert all(s.power_watts is None for s in samples)
    assert all(s.ecc_corrected_total is None and s.ecc_uncorrected_total is None for s in samples)
    assert all(s.temperature_celsius == 40 for s in samples)  # the rest still sampled
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1
    assert fake.calls["nvmlDeviceGetTotalEccErrors"] == 1
    power_logs = [r for r in caplog.records if "power_usage" in r.getMessage()]
    assert len(power_logs) == 1


def test_util_samples_only_new_ones_mapped_to_monotonic_clock() -> None:
    us = 1_000_000
    t1, t2 = int((WALL_NOW - 2.0) * us), int((WALL_NOW - 1.5) * us)
    fake = EventNvml([gpu(util_samples=[(t2, 60), (t1, 40)])])
    b = backend(fake)
    [s] = b.sample_devices()
    assert s.util_samples == [
        (pytest.approx(MONO_NOW - 2.0), pytest.approx(0.40)),
        (pytest.approx(MONO_NOW - 1.5), pytest.approx(0.60)),
    ]
    # Nothing newer: NVML answers NOT_FOUND, which is "no samples", not an error or unsupported.
    [s] = b.sample_devices()
    assert s.util_samples == []
    t3 = int((WALL_NOW - 0.5) * us)
    fake.gpus[0]["util_samples"].append((t3, 100))
    [s] = b.sample_devices()
    assert s.util_samples == [(pytest.approx(MONO_NOW - 0.5), pytest.approx(1.0))]
    assert fake.calls["nvmlDeviceGetSamples"] == 3


def test_util_samples_not_supported_falls_back_silently() -> None:
    fake = EventNvml([gpu(not_supported={"nvmlDeviceGetSamples"}, util={"gpu": 10, "memory": 0})])
    b = backend(fake)
    [s] = b.sample_devices()
    b.sample_devices()
    assert s.util_samples == [] and s.gpu_util == pytest.approx(0.10)
    assert fake.calls["nvmlDeviceGetSamples"] == 1


def test_xid_events_counted_cumulatively_with_last_xid() -> None:
    fake = EventNvml([gpu(index=0), gpu(index=1, xid_events=[13])])
    b = backend(fake)
    s0, s1 = b.sample_devices()
    assert (s0.xid_errors_total, s0.last_xid) == (0, None)
    assert (s1.xid_errors_total, s1.last_xid) == (1, 13)

    fake.gpus[0]["xid_events"] += [79, 48]
    s0, s1 = b.sample_devices()
    assert (s0.xid_errors_total, s0.last_xid) == (2, 48)
    assert (s1.xid_errors_total, s1.last_xid) == (1, 13)  # attributed to the right GPU
    assert set(fake.wait_timeouts) == {0}  # polled, never blocking the sampler


def test_xid_unsupported_leaves_xid_fields_absent() -> None:
    fake = EventNvml([gpu(not_supported={"nvmlDeviceRegisterEvents"}, xid_events=[79])])
    [s] = backend(fake).sample_devices()
    assert s.xid_errors_total is None and s.last_xid is None
    assert all(e.freed for e in fake.event_sets)  # the unused set was given back


def test_process_memory_from_compute_and_graphics_lists() -> None:
    fake = EventNvml(
        [
            gpu(
                compute_processes=[(100, 2 * 2**30), (200, 512 * 2**20), (300, None)],
                graphics_processes=[(100, 2 * 2**30), (400, 1024)],
            )
        ]
    )
    [s] = backend(fake).sample_devices()
    # pid 100 has both contexts and is counted once; pid 300's memory is not available.
    assert s.process_memory_bytes == {100: 2 * 2**30, 200: 512 * 2**20, 400: 1024}


def test_library_missing_is_nvml_missing_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    b = backend(EventNvml([gpu()], library_missing=True))
    with caplog.at_level(logging.WARNING, logger="mrc_agent.agent.core.hw.nvml"):
        for _ in range(3):
            with pytest.raises(SourceUnavailable) as info:
                b.sample_devices()
            assert info.value.reason == "nvml_missing"
    assert len([r for r in caplog.records if "nvml_missing" in r.getMessage()]) == 1


def test_pynvml_not_importable_is_nvml_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes ``import pynvml`` fail
    with pytest.raises(SourceUnavailable) as info:
        NvmlBackend().sample_devices()
    assert info.value.reason == "nvml_missing"


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="this host has an NVML library"
)
def test_real_pynvml_without_driver_library_is_nvml_missing() -> None:
    with pytest.raises(SourceUnavailable) as info:
        NvmlBackend().sample_devices()
    assert info.value.reason == "nvml_missing"


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver_not_loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no_permission"),
    ],
)
def test_init_errors_map_to_reasons(code: int, reason: str) -> None:
    fake = EventNvml([gpu()])
    fake.init_error = code
    with pytest.raises(SourceUnavailable) as info:
        backend(fake).sample_devices()
    assert info.value.reason == reason


def test_no_gpu_is_source_unavailable() -> None:
    fake = EventNvml([])
    with pytest.raises(SourceUnavailable) as info:
        backend(fake).sample_devices()
    assert info.value.reason == "no_gpu"
    assert not fake.initialized  # the session was shut down again


def test_unknown_init_error_is_hardware_error_not_unavailable() -> None:
    fake = EventNvml([gpu()])
    fake.init_error = pynvml.NVML_ERROR_UNKNOWN
    with pytest.raises(HardwareError) as info:
        backend(fake).sample_devices()
    assert not isinstance(info.value, SourceUnavailable)


def test_gpu_lost_is_hardware_error_then_recovers_with_fresh_handles() -> None:
    fake = EventNvml([gpu(index=0, xid_events=[31]), gpu(index=1)])
    b = backend(fake)
    assert len(b.sample_devices()) == 2
    fake.lose_gpu(1)
    with pytest.raises(HardwareError) as info:
        b.sample_devices()
    assert not isinstance(info.value, SourceUnavailable)
    assert "lost" in str(info.value).lower()

    fake.restore_gpu(1)  # NVML answers again, but only through new handles
    s0, s1 = b.sample_devices()
    assert (s0.gpu.index, s1.gpu.index) == (0, 1)
    assert fake.calls["nvmlInit"] == 2 and fake.calls["nvmlShutdown"] == 1
    assert s0.xid_errors_total == 1  # the counter survived the re-initialisation
    assert all(e.freed for e in fake.event_sets[:2])  # old session's sets were freed


def test_timeout_mid_sample_is_hardware_error_and_next_call_retries() -> None:
    fake = EventNvml([gpu()])
    b = backend(fake)
    fake.fail_next["nvmlDeviceGetPowerUsage"] = [pynvml.NVML_ERROR_TIMEOUT]
    with pytest.raises(HardwareError):
        b.sample_devices()
    [s] = b.sample_devices()
    assert s.power_watts == pytest.approx(300.0)  # a timeout is not remembered as unsupported


def test_gpm_recovers_after_gpu_lost_and_primes_again() -> None:
    fake = EventNvml([gpu(gpm=gpm_values())])
    b = backend(fake)
    b.sample_gpm()
    assert len(b.sample_gpm()) == 1
    fake.lose_gpu(0)
    with pytest.raises(HardwareError):
        b.sample_gpm()
    fake.restore_gpu(0)
    assert b.sample_gpm() == []  # a new session: primes again
    [g] = b.sample_gpm()
    assert g.sm_util == pytest.approx(0.80)


def test_info_reports_versions_and_per_gpu_capabilities() -> None:
    fake = EventNvml(
        [
            gpu(
                index=0,
                gpm=gpm_values(),
                nvlink={0: nvlink(), 1: nvlink(), 2: nvlink(active=False)},
            ),
            gpu(index=1, name="NVIDIA A10", not_supported={"nvmlDeviceGetPowerUsage"}),
        ],
        driver_version="550.54.15",
        cuda_driver_version=12040,
    )
    b = backend(fake)
    b.sample_devices()
    info: dict[str, Any] = b.info()
    assert info["available"] is True and info["error"] is None
    assert info["driver_version"] == "550.54.15"
    assert info["nvml_version"] == "12.550.54.15"
    assert info["cuda_driver_version"] == "12.4"
    g0, g1 = info["gpus"]
    assert (g0["index"], g0["uuid"], g0["gpm_supported"], g0["nvlink_active_links"]) == (
        0,
        "GPU-00000000-fake-uuid",
        True,
        2,
    )
    assert (g1["name"], g1["gpm_supported"], g1["nvlink_active_links"]) == ("NVIDIA A10", False, 0)
    assert "power_usage" in g1["unsupported"]


def test_info_without_nvml_reports_reason_instead_of_raising() -> None:
    info = backend(EventNvml([gpu()], library_missing=True)).info()
    assert info["available"] is False
    assert info["reason"] == "nvml_missing"
    assert info["gpus"] == []


def test_close_frees_everything_and_shuts_down() -> None:
    fake = EventNvml([gpu(gpm=gpm_values())])
    b = backend(fake)
    b.sample_devices()
    b.sample_gpm()
    b.close()
    b.close()  # idempotent
    assert not fake.initialized
    assert fake.calls["nvmlShutdown"] == 1
    assert fake.calls["nvmlGpmSampleFree"] == 2
    assert all(e.freed for e in fake.event_sets)


#: Every query the device, PCIe, NVLink and GPM parts make, by the name the memo keeps it under.
EVERY_FEATURE = [
    "compute_processes",
    "ecc_errors",
    "gpm",
    "graphics_processes",
    "memory_info",
    "memory_info_v2",
    "nvlink_link_count",
    "nvlink_throughput",
    "pcie_byte_counters",
    "pcie_replay_counter",
    "pcie_throughput",
    "power_usage",
    "sm_clock",
    "temperature",
    "temperature_v",
    "utilization",
    "utilization_samples",
]


def test_a_gpu_supporting_nothing_names_every_feature_once_and_is_not_asked_again() -> None:
    refused = {
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetSamples",
        "nvmlDeviceGetMemoryInfo",  # v2 and v1 alike
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetPcieReplayCounter",
        "nvmlDeviceGetFieldValues",  # the link count and the link counters
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlGpmQueryDeviceSupport",
    }
    # One link answers its state: found by probing, then its counters are refused.
    fake = EventNvml([gpu(not_supported=refused, nvlink={0: nvlink(5, 6)}, gpm=gpm_values())])
    b = backend(fake)
    for _ in range(2):
        [s] = b.sample_devices()
        b._pcie.run_round()
        with pytest.raises(SourceUnavailable):
            b.sample_gpm()
    assert (s.gpu_util, s.mem_util, s.mem_used_bytes, s.mem_total_bytes) == (None,) * 4
    assert (s.pcie_tx_bytes_per_second, s.pcie_replays_total, s.nvlink_tx_bytes_total) == (
        (None,) * 3
    )
    assert (s.power_watts, s.sm_clock_hertz, s.temperature_celsius) == (None,) * 3
    assert (s.ecc_corrected_total, s.util_samples, s.process_memory_bytes) == (None, [], {})
    [g] = b.info()["gpus"]
    assert g["unsupported"] == EVERY_FEATURE
    assert g["gpm_supported"] is False and g["nvlink_active_links"] == 1
    # Each refused once: v1 and v2 memory are two queries, field values the PCIe byte
    # counters, the link count, then the links.
    assert {name: fake.calls[name] for name in refused} == {
        **{name: 1 for name in refused},
        "nvmlDeviceGetMemoryInfo": 2,
        "nvmlDeviceGetFieldValues": 3,  # the PCIe byte counters too
    }


def test_process_memory_skips_unavailable_entries_and_keeps_the_larger_of_two_contexts() -> None:
    fake = EventNvml(
        [
            gpu(
                compute_processes=[(300, None), (100, 0), (200, 2 * 2**30)],
                graphics_processes=[(200, 2**30), (400, 5)],
            )
        ]
    )
    [s] = backend(fake).sample_devices()
    # pid 300 comes first and is unavailable: the rest of the list still counts; pid 100 holds
    # a context but no memory yet (0, not absent); pid 200's graphics context is the smaller.
    assert s.process_memory_bytes == {100: 0.0, 200: 2 * 2**30, 400: 5.0}


def test_util_samples_boundary_sample_repeated_by_the_driver_is_not_read_twice() -> None:
    us = 1_000_000
    t1, t2, t3 = (int((WALL_NOW - age) * us) for age in (2.0, 1.0, 0.5))
    fake = EventNvml([gpu(util_samples=[(t1, 10), (t2, 20)], util_samples_repeat_boundary=True)])
    b = backend(fake)
    [s] = b.sample_devices()
    assert [v for _, v in s.util_samples] == [pytest.approx(0.10), pytest.approx(0.20)]
    [s] = b.sample_devices()  # the driver answers t2 again
    assert s.util_samples == []
    fake.gpus[0]["util_samples"].append((t3, 30))
    [s] = b.sample_devices()  # t2 again, then t3
    assert s.util_samples == [(pytest.approx(MONO_NOW - 0.5), pytest.approx(0.30))]


def test_util_samples_are_tracked_per_gpu() -> None:
    us = 1_000_000
    recent, older = int((WALL_NOW - 0.5) * us), int((WALL_NOW - 3.0) * us)
    fake = EventNvml([gpu(index=0, util_samples=[(recent, 70)]), gpu(index=1, util_samples=[])])
    b = backend(fake)
    b.sample_devices()
    # GPU 1's first samples are older than GPU 0's newest: still new for GPU 1.
    fake.gpus[1]["util_samples"].append((older, 20))
    s0, s1 = b.sample_devices()
    assert s0.util_samples == []
    assert s1.util_samples == [(pytest.approx(MONO_NOW - 3.0), pytest.approx(0.20))]


def test_nvlink_without_a_link_count_probes_until_the_first_unknown_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = EventNvml(
        [
            gpu(
                nvlink={0: nvlink(1, 2), 1: nvlink(3, 4)},
                fields_not_supported={pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT},
            )
        ]
    )
    b = backend(fake)
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        [s] = b.sample_devices()
        b.sample_devices()
    assert s.nvlink_links == {0: (1024, 2048), 1: (3072, 4096)}
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 3  # links 0 and 1, then 2 is unknown
    assert messages(caplog, "not supported") == [
        f"GPU 0 ({UUID0}): field nvlink_link_count not supported; leaving it absent"
    ]


def test_nvlink_without_field_values_probes_up_to_the_library_maximum() -> None:
    fake = EventNvml([gpu(nvlink={0: nvlink(1, 2)}, not_supported={"nvmlDeviceGetFieldValues"})])
    b = backend(fake)
    [s] = b.sample_devices()
    assert s.nvlink_links == {} and s.nvlink_tx_bytes_total is None
    assert b.info()["gpus"][0]["nvlink_active_links"] == 1
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 2  # link 0, then 1 is unknown


def test_nvlink_link_refused_within_the_count_is_skipped_not_the_end() -> None:
    fake = EventNvml([gpu(nvlink={0: nvlink(1, 2), 1: nvlink(3, 4)}, nvlink_aggregate_scope=False)])
    fake.fail_next["nvmlDeviceGetNvLinkState"] = [pynvml.NVML_ERROR_NOT_SUPPORTED]  # link 0
    [s] = backend(fake).sample_devices()
    assert s.nvlink_links == {1: (3072, 4096)}
    assert s.nvlink_tx_bytes_total == 3072


def test_nvlink_counter_not_supported_on_one_link_leaves_only_complete_links(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    rx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    fake = EventNvml(
        [
            gpu(
                nvlink={0: nvlink(1, 2), 1: nvlink(3, 4), 2: nvlink(5, 6)},
                fields_not_supported={(tx, 0), (rx, 2)},
                nvlink_aggregate_scope=False,  # the per-link sum is all there is
            )
        ]
    )
    b = backend(fake)
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        [s] = b.sample_devices()
        b.sample_devices()
    # Link 0 has no TX counter and link 2 no RX counter: only link 1 is reported, and summed.
    assert s.nvlink_links == {1: (3072, 4096)}
    assert (s.nvlink_tx_bytes_total, s.nvlink_rx_bytes_total) == (3072, 4096)
    assert messages(caplog, "not supported") == [
        f"GPU 0 ({UUID0}): field nvlink_field_{tx}_link_0 not supported; leaving it absent",
        f"GPU 0 ({UUID0}): field nvlink_field_{rx}_link_2 not supported; leaving it absent",
    ]


def test_nvlink_field_error_other_than_not_supported_fails_the_sample() -> None:
    lost = pynvml.NVML_ERROR_GPU_IS_LOST
    fake = EventNvml(
        [
            gpu(
                nvlink={0: nvlink(1, 2)},
                field_errors={pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: lost},
            )
        ]
    )
    with pytest.raises(HardwareError) as info:
        backend(fake).sample_devices()
    assert not isinstance(info.value, SourceUnavailable)
    assert f"(code {lost})" in str(info.value)


def test_gpus_without_active_nvlink_are_each_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = EventNvml(
        [
            gpu(index=0),
            gpu(index=1, nvlink={0: nvlink(active=False)}),
            gpu(index=2, nvlink={0: nvlink()}),
        ]
    )
    b = backend(fake)
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        b.sample_devices()
        b.close()
        b.sample_devices()  # a new session discovers again, but does not log again
    assert messages(caplog, "no active NVLink") == [
        f"GPU 0 ({UUID0}): no active NVLink; NVLink series stay absent",
        f"GPU 1 ({UUID1}): no active NVLink; NVLink series stay absent",
    ]


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_TIMEOUT])
def test_one_transient_aggregate_refusal_does_not_switch_to_per_link_for_good(code: int) -> None:
    fake = EventNvml([gpu(nvlink={0: nvlink(1, 2), 1: nvlink(3, 4)}, nvlink_aggregate_scope=code)])
    b = backend(fake)
    [s] = b.sample_devices()  # this pass: the per-link reads
    assert s.sources["nvlink"] == "per_link_sum" and s.nvlink_tx_bytes_total == 4 * 1024
    fake.gpus[0]["nvlink_aggregate_scope"] = True  # the blip passed
    [s] = b.sample_devices()
    assert s.sources["nvlink"] == "aggregate" and s.nvlink_tx_bytes_total == 4 * 1024


def test_aggregate_refusals_in_a_row_switch_but_not_supported_switches_at_once() -> None:
    from mrc_agent.agent.core.hw.nvml.nvlink import AGGREGATE_REFUSALS

    flaky = gpu(nvlink={0: nvlink(1, 2), 1: nvlink(3, 4)},
                nvlink_aggregate_scope=pynvml.NVML_ERROR_UNKNOWN)
    fake = EventNvml([flaky])
    b = backend(fake)
    for _ in range(AGGREGATE_REFUSALS):
        b.sample_devices()
    fake.gpus[0]["nvlink_aggregate_scope"] = True  # too late: given up after that many in a row
    assert b.sample_devices()[0].sources["nvlink"] == "per_link_sum"
    refused = gpu(nvlink={0: nvlink(1, 2), 1: nvlink(3, 4)}, nvlink_aggregate_scope=False)
    fake = EventNvml([refused])
    b = backend(fake)
    b.sample_devices()  # NOT_SUPPORTED: the driver has no such scope, no second ask
    fake.gpus[0]["nvlink_aggregate_scope"] = True
    assert b.sample_devices()[0].sources["nvlink"] == "per_link_sum"
