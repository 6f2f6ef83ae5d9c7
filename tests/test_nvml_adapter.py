"""Tests of the NVML adapter (agent/core/hw/nvml/) through the hand-written fake pynvml."""

from __future__ import annotations

import ctypes.util
import logging
import sys
import threading
import time
from typing import Any

import pynvml
import pytest

from mrc_agent.agent.core.hw import nvml as nvml_mod
from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.core.hw.nvml import pcie as pcie_mod
from mrc_agent.agent.core.hw.nvml.pcie import PcieReader
from tests.fakes.fake_pynvml import FakeNvml, gpu, nvlink

WALL_NOW = 1_700_000_000.0  # the fake wall clock, seconds since the epoch
MONO_NOW = 5_000.0  # the fake monotonic clock


class Ticker:
    """A clock that moves ``step`` seconds on every reading (one GPM window per call)."""

    def __init__(self, step: float = 1.0, now: float = MONO_NOW) -> None:
        self.step, self.now = step, now

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def backend(fake: FakeNvml, **kwargs: Any) -> NvmlBackend:
    """A backend on fixed clocks and without the PCIe thread: tests call ``_pcie.run_round()``.

    Its GPM clock moves one window per call, so every ``sample_gpm`` takes a new sample.
    """
    kwargs.setdefault("clock", lambda: MONO_NOW)
    kwargs.setdefault("pcie_thread", False)
    kwargs.setdefault("gpm_clock", Ticker())
    return NvmlBackend(lib=fake, wall_clock=lambda: WALL_NOW, **kwargs)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = MONO_NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def gpm_values(**overrides: float) -> dict[int, float]:
    values = {
        pynvml.NVML_GPM_METRIC_SM_UTIL: 80.0,
        pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 40.0,
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 25.0,
        pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 50.0,
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 100.0,
        pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 200.0,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 3.0,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 4.0,
    }
    for name, value in overrides.items():
        values[getattr(pynvml, f"NVML_GPM_METRIC_{name}")] = value
    return values


# --- pure conversions ---------------------------------------------------------------------


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


# --- device sampling ----------------------------------------------------------------------


def test_device_sample_converts_every_field_to_base_units() -> None:
    fake = FakeNvml(
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
    fake = FakeNvml(
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
    fake = FakeNvml([gpu(nvlink=links)])
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
    fake = FakeNvml([gpu(nvlink={})])
    b = backend(fake)
    [s] = b.sample_devices()
    assert s.nvlink_tx_bytes_total is None and s.nvlink_rx_bytes_total is None
    assert s.nvlink_links == {}
    b.sample_devices()
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 1  # probed once, found none, stopped


def test_not_supported_leaves_field_none_and_is_not_retried_or_relogged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu(not_supported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors"})])
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


# --- PCIe throughput (background reader) ----------------------------------------------------


def test_pcie_throughput_comes_from_the_cache_never_from_the_sampling_path() -> None:
    fake = FakeNvml(
        [
            gpu(index=0, pcie={"tx_kb_per_s": 10, "rx_kb_per_s": 20, "replays": 0}),
            gpu(index=1, pcie={"tx_kb_per_s": 30, "rx_kb_per_s": 40, "replays": 0}),
        ]
    )
    b = backend(fake)
    s0, s1 = b.sample_devices()
    # Nothing read yet: absent, not zero.
    assert s0.pcie_tx_bytes_per_second is None and s0.pcie_rx_bytes_per_second is None
    assert s1.pcie_tx_bytes_per_second is None
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0  # the 20 ms call is never made here

    b._pcie.run_round()
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 4  # TX and RX per GPU
    s0, s1 = b.sample_devices()
    assert (s0.pcie_tx_bytes_per_second, s0.pcie_rx_bytes_per_second) == (10 * 1024, 20 * 1024)
    assert (s1.pcie_tx_bytes_per_second, s1.pcie_rx_bytes_per_second) == (30 * 1024, 40 * 1024)

    fake.gpus[0]["pcie"]["tx_kb_per_s"] = 99
    [s0, _] = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second == 10 * 1024  # still the last published value
    b._pcie.run_round()
    [s0, _] = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second == 99 * 1024
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 8  # only the two rounds read it


def test_stale_pcie_values_are_reported_absent_not_repeated() -> None:
    clock = FakeClock()
    fake = FakeNvml([gpu()])
    b = backend(fake, clock=clock, pcie_stale_after=2.0)
    b.sample_devices()
    b._pcie.run_round()
    clock.now += 2.0  # exactly at the limit: still fresh
    [s] = b.sample_devices()
    assert s.pcie_tx_bytes_per_second == 1000 * 1024
    clock.now += 0.001  # the reader stopped publishing (e.g. stuck in NVML)
    [s] = b.sample_devices()
    assert s.pcie_tx_bytes_per_second is None and s.pcie_rx_bytes_per_second is None
    b._pcie.run_round()  # it publishes again
    [s] = b.sample_devices()
    assert s.pcie_rx_bytes_per_second == 2000 * 1024


def test_pcie_not_supported_is_remembered_and_not_read_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu(index=0, not_supported={"nvmlDeviceGetPcieThroughput"}), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    with caplog.at_level(logging.INFO, logger="mrc_agent.agent.core.hw.nvml"):
        for _ in range(3):
            b._pcie.run_round()
    s0, s1 = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second is None and s0.pcie_rx_bytes_per_second is None
    assert s1.pcie_tx_bytes_per_second == 1000 * 1024  # the other GPU is unaffected
    # GPU 0: its first TX call only, then never again; GPU 1: TX and RX in each of 3 rounds.
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 1 + 3 * 2
    assert len([r for r in caplog.records if "pcie_throughput" in r.getMessage()]) == 1
    # The same memory of unsupported queries as every other field (doctor shows it).
    g0, g1 = b.info()["gpus"]
    assert "pcie_throughput" in g0["unsupported"] and "pcie_throughput" not in g1["unsupported"]


def test_failing_pcie_read_skips_the_gpu_and_does_not_break_sampling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    with caplog.at_level(logging.DEBUG, logger="mrc_agent.agent.core.hw.nvml"):
        for _ in range(2):
            fake.fail_next["nvmlDeviceGetPcieThroughput"] = [pynvml.NVML_ERROR_UNKNOWN]
            b._pcie.run_round()  # GPU 0's first call fails; no exception escapes
    s0, s1 = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second is None  # skipped, never a made-up value
    assert s1.pcie_tx_bytes_per_second == 1000 * 1024
    failures = [r for r in caplog.records if "reading PCIe throughput failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.DEBUG  # logged once, at debug
    # Neither remembered as unsupported nor a reason to re-initialise NVML.
    assert fake.calls["nvmlInit"] == 1
    b._pcie.run_round()
    s0, _ = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second == 1000 * 1024


def test_pcie_round_tolerates_handles_invalidated_by_a_reinit() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    snapshot = b._session.snapshot()  # what the thread holds while the sampler re-initialises
    assert snapshot is not None
    fake.lose_gpu(1)
    with pytest.raises(HardwareError):
        b.sample_devices()
    fake.restore_gpu(1)
    b.sample_devices()  # a new session: the snapshot's handles are dead
    assert fake.calls["nvmlInit"] == 2
    lib, old_gpus = snapshot
    b._pcie.read(lib, old_gpus)  # NVMLErrors from dead handles: skipped, not raised
    b._pcie.run_round()  # the next round takes the new session's handles
    s0, s1 = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second == s1.pcie_tx_bytes_per_second == 1000 * 1024


def test_pcie_round_without_an_nvml_session_does_nothing() -> None:
    fake = FakeNvml([gpu()])
    b = backend(fake)
    b._pcie.run_round()  # not initialised yet
    b.sample_devices()
    b.close()
    b._pcie.run_round()  # shut down
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0


def pcie_thread_of(b: NvmlBackend) -> threading.Thread | None:
    return b._pcie.thread


def test_pcie_thread_starts_on_first_successful_sample_and_close_stops_it() -> None:
    fake = FakeNvml([gpu()])
    b = NvmlBackend(lib=fake, pcie_period=0.01)
    assert pcie_thread_of(b) is None  # lazily: nothing before the first sample
    [s] = b.sample_devices()
    thread = pcie_thread_of(b)
    assert thread is not None and thread.is_alive() and thread.daemon
    assert thread.name == "mrc-agent-nvml-pcie"
    b.sample_devices()
    assert pcie_thread_of(b) is thread  # one thread, not one per sample

    deadline = time.monotonic() + 5.0
    while s.pcie_tx_bytes_per_second is None and time.monotonic() < deadline:
        time.sleep(0.01)
        [s] = b.sample_devices()
    assert (s.pcie_tx_bytes_per_second, s.pcie_rx_bytes_per_second) == (1000 * 1024, 2000 * 1024)

    b.close()
    assert not thread.is_alive()
    assert pcie_thread_of(b) is None
    b.close()  # still idempotent


def test_pcie_thread_not_started_when_sampling_fails() -> None:
    b = NvmlBackend(lib=FakeNvml([gpu()], library_missing=True))
    with pytest.raises(SourceUnavailable):
        b.sample_devices()
    assert pcie_thread_of(b) is None


def test_close_interrupts_the_pause_at_once() -> None:
    fake = FakeNvml([gpu()])
    b = NvmlBackend(lib=fake, pcie_period=60.0)
    b.sample_devices()
    thread = pcie_thread_of(b)
    assert thread is not None
    deadline = time.monotonic() + 5.0
    while fake.calls["nvmlDeviceGetPcieThroughput"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # let the first round finish, so the thread is in its 60 s pause
    started = time.monotonic()
    b.close()
    assert time.monotonic() - started < 1.0
    assert not thread.is_alive()


def test_blocking_pcie_reads_do_not_slow_sampling() -> None:
    fake = FakeNvml([gpu(index=i) for i in range(8)])
    fake.pcie_throughput_delay_s = 0.2  # far slower than NVML's 20 ms, to make it obvious
    b = NvmlBackend(lib=fake, pcie_period=0.0)
    b.sample_devices()  # starts the thread, which is now blocked in its reads
    deadline = time.monotonic() + 5.0
    while fake.calls["nvmlDeviceGetPcieThroughput"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    started = time.monotonic()
    for _ in range(5):
        b.sample_devices()
    # Had sampling read PCIe itself: 5 samples x 8 GPUs x 2 x 0.2 s = 16 s.
    assert time.monotonic() - started < 1.0
    b.close()


def test_pcie_parameters_are_checked() -> None:
    with pytest.raises(ValueError):
        NvmlBackend(lib=FakeNvml([gpu()]), pcie_period=-1.0)
    with pytest.raises(ValueError):
        NvmlBackend(lib=FakeNvml([gpu()]), pcie_stale_after=0.0)


def test_util_samples_only_new_ones_mapped_to_monotonic_clock() -> None:
    us = 1_000_000
    t1, t2 = int((WALL_NOW - 2.0) * us), int((WALL_NOW - 1.5) * us)
    fake = FakeNvml([gpu(util_samples=[(t2, 60), (t1, 40)])])
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
    fake = FakeNvml([gpu(not_supported={"nvmlDeviceGetSamples"}, util={"gpu": 10, "memory": 0})])
    b = backend(fake)
    [s] = b.sample_devices()
    b.sample_devices()
    assert s.util_samples == [] and s.gpu_util == pytest.approx(0.10)
    assert fake.calls["nvmlDeviceGetSamples"] == 1


def test_xid_events_counted_cumulatively_with_last_xid() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1, xid_events=[13])])
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
    fake = FakeNvml([gpu(not_supported={"nvmlDeviceRegisterEvents"}, xid_events=[79])])
    [s] = backend(fake).sample_devices()
    assert s.xid_errors_total is None and s.last_xid is None
    assert all(e.freed for e in fake.event_sets)  # the unused set was given back


def test_process_memory_from_compute_and_graphics_lists() -> None:
    fake = FakeNvml(
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


# --- GPM ----------------------------------------------------------------------------------


def test_gpm_first_call_primes_then_reports_converted_values() -> None:
    fake = FakeNvml([gpu(gpm=gpm_values())])
    b = backend(fake)
    assert b.sample_gpm() == []
    [g] = b.sample_gpm()
    assert g.gpu.uuid == "GPU-00000000-fake-uuid"
    assert g.sm_util == pytest.approx(0.80)
    assert g.sm_occupancy == pytest.approx(0.40)
    assert g.tensor_util == pytest.approx(0.25)
    assert g.dram_bw_util == pytest.approx(0.50)
    assert g.pcie_tx_bytes_per_second == 100 * 2**20
    assert g.pcie_rx_bytes_per_second == 200 * 2**20
    assert g.nvlink_tx_bytes_per_second == 3 * 2**20
    assert g.nvlink_rx_bytes_per_second == 4 * 2**20

    fake.gpus[0]["gpm"] = gpm_values(SM_UTIL=10.0)
    [g] = b.sample_gpm()
    assert g.sm_util == pytest.approx(0.10)
    assert fake.calls["nvmlGpmSampleAlloc"] == 2  # two buffers, reused alternately


def test_gpm_metric_not_supported_is_absent_not_zero() -> None:
    values = gpm_values()
    del values[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC]
    del values[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC]
    fake = FakeNvml([gpu(gpm=values)])
    b = backend(fake)
    b.sample_gpm()
    [g] = b.sample_gpm()
    assert g.nvlink_tx_bytes_per_second is None and g.nvlink_rx_bytes_per_second is None
    assert g.sm_util == pytest.approx(0.80)


def test_gpm_only_for_capable_gpus() -> None:
    fake = FakeNvml([gpu(index=0, gpm=None), gpu(index=1, gpm=gpm_values())])
    b = backend(fake)
    b.sample_gpm()
    samples = b.sample_gpm()
    assert [g.gpu.index for g in samples] == [1]


def test_gpm_unsupported_everywhere_is_source_unavailable() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])  # gpm=None: pre-Hopper
    b = backend(fake)
    with pytest.raises(SourceUnavailable) as info:
        b.sample_gpm()
    assert info.value.reason == "gpm_unsupported"
    with pytest.raises(SourceUnavailable):
        b.sample_gpm()
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 2  # once per GPU, then remembered


# --- unavailability and failures ------------------------------------------------------------


def test_library_missing_is_nvml_missing_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    b = backend(FakeNvml([gpu()], library_missing=True))
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
    fake = FakeNvml([gpu()])
    fake.init_error = code
    with pytest.raises(SourceUnavailable) as info:
        backend(fake).sample_devices()
    assert info.value.reason == reason


def test_no_gpu_is_source_unavailable() -> None:
    fake = FakeNvml([])
    with pytest.raises(SourceUnavailable) as info:
        backend(fake).sample_devices()
    assert info.value.reason == "no_gpu"
    assert not fake.initialized  # the session was shut down again


def test_unknown_init_error_is_hardware_error_not_unavailable() -> None:
    fake = FakeNvml([gpu()])
    fake.init_error = pynvml.NVML_ERROR_UNKNOWN
    with pytest.raises(HardwareError) as info:
        backend(fake).sample_devices()
    assert not isinstance(info.value, SourceUnavailable)


def test_gpu_lost_is_hardware_error_then_recovers_with_fresh_handles() -> None:
    fake = FakeNvml([gpu(index=0, xid_events=[31]), gpu(index=1)])
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
    fake = FakeNvml([gpu()])
    b = backend(fake)
    fake.fail_next["nvmlDeviceGetPowerUsage"] = [pynvml.NVML_ERROR_TIMEOUT]
    with pytest.raises(HardwareError):
        b.sample_devices()
    [s] = b.sample_devices()
    assert s.power_watts == pytest.approx(300.0)  # a timeout is not remembered as unsupported


def test_gpm_recovers_after_gpu_lost_and_primes_again() -> None:
    fake = FakeNvml([gpu(gpm=gpm_values())])
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


# --- doctor and close -----------------------------------------------------------------------


def test_info_reports_versions_and_per_gpu_capabilities() -> None:
    fake = FakeNvml(
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
    info = backend(FakeNvml([gpu()], library_missing=True)).info()
    assert info["available"] is False
    assert info["reason"] == "nvml_missing"
    assert info["gpus"] == []


def test_close_frees_everything_and_shuts_down() -> None:
    fake = FakeNvml([gpu(gpm=gpm_values())])
    b = backend(fake)
    b.sample_devices()
    b.sample_gpm()
    b.close()
    b.close()  # idempotent
    assert not fake.initialized
    assert fake.calls["nvmlShutdown"] == 1
    assert fake.calls["nvmlGpmSampleFree"] == 2
    assert all(e.freed for e in fake.event_sets)


# --- what each part names, logs and refuses ----------------------------------------------------

NVML_LOGGER = "mrc_agent.agent.core.hw.nvml"
UUID0, UUID1 = "GPU-00000000-fake-uuid", "GPU-00000001-fake-uuid"


def messages(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if part in r.getMessage()]


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
    fake = FakeNvml([gpu(not_supported=refused, nvlink={0: nvlink(5, 6)}, gpm=gpm_values())])
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
    fake = FakeNvml(
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
    fake = FakeNvml([gpu(util_samples=[(t1, 10), (t2, 20)], util_samples_repeat_boundary=True)])
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
    fake = FakeNvml([gpu(index=0, util_samples=[(recent, 70)]), gpu(index=1, util_samples=[])])
    b = backend(fake)
    b.sample_devices()
    # GPU 1's first samples are older than GPU 0's newest: still new for GPU 1.
    fake.gpus[1]["util_samples"].append((older, 20))
    s0, s1 = b.sample_devices()
    assert s0.util_samples == []
    assert s1.util_samples == [(pytest.approx(MONO_NOW - 3.0), pytest.approx(0.20))]


# --- NVLink ---------------------------------------------------------------------------------


def test_nvlink_without_a_link_count_probes_until_the_first_unknown_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml(
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
    fake = FakeNvml([gpu(nvlink={0: nvlink(1, 2)}, not_supported={"nvmlDeviceGetFieldValues"})])
    b = backend(fake)
    [s] = b.sample_devices()
    assert s.nvlink_links == {} and s.nvlink_tx_bytes_total is None
    assert b.info()["gpus"][0]["nvlink_active_links"] == 1
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 2  # link 0, then 1 is unknown


def test_nvlink_link_refused_within_the_count_is_skipped_not_the_end() -> None:
    fake = FakeNvml([gpu(nvlink={0: nvlink(1, 2), 1: nvlink(3, 4)}, nvlink_aggregate_scope=False)])
    fake.fail_next["nvmlDeviceGetNvLinkState"] = [pynvml.NVML_ERROR_NOT_SUPPORTED]  # link 0
    [s] = backend(fake).sample_devices()
    assert s.nvlink_links == {1: (3072, 4096)}
    assert s.nvlink_tx_bytes_total == 3072


def test_nvlink_counter_not_supported_on_one_link_leaves_only_complete_links(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    rx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    fake = FakeNvml(
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
    fake = FakeNvml(
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
    fake = FakeNvml(
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


# --- GPM ------------------------------------------------------------------------------------


def test_gpm_metrics_are_computed_between_consecutive_samples() -> None:
    fake = FakeNvml([gpu(gpm=gpm_values())])
    b = backend(fake)
    for _ in range(4):
        b.sample_gpm()
    # Sample n+1 is taken into the buffer that held sample n-1: each window is the last period.
    assert fake.gpm_windows == [(1, 2), (2, 3), (3, 4)]


def test_gpus_without_gpm_are_each_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml(
        [
            gpu(index=0),
            gpu(index=1, not_supported={"nvmlGpmQueryDeviceSupport"}),
            gpu(index=2, gpm=gpm_values()),
        ]
    )
    b = backend(fake)
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        for _ in range(3):
            b.sample_gpm()
    assert messages(caplog, "GPM support") == [
        f"GPU 0 ({UUID0}): no GPM support",
        f"GPU 1 ({UUID1}): no GPM support",
    ]
    g0, g1, g2 = b.info()["gpus"]
    assert (g0["gpm_supported"], g1["gpm_supported"], g2["gpm_supported"]) == (False, False, True)
    assert g1["unsupported"] == ["gpm"] and g0["unsupported"] == []


def test_gpm_supported_device_that_will_not_sample_is_unsupported_at_once() -> None:
    # E.g. MIG mode at device level: the support query says yes, sampling says NOT_SUPPORTED.
    fake = FakeNvml([gpu(gpm=gpm_values(), not_supported={"nvmlGpmSampleGet"})])
    b = backend(fake)
    with pytest.raises(SourceUnavailable) as info:
        b.sample_gpm()
    assert info.value.reason == "gpm_unsupported"
    with pytest.raises(SourceUnavailable):
        b.sample_gpm()
    assert fake.calls["nvmlGpmSampleGet"] == 1
    [g] = b.info()["gpus"]
    assert g["gpm_supported"] is False and g["unsupported"] == ["gpm"]


def test_gpm_metrics_not_supported_are_each_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    values = gpm_values()
    del values[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC]
    del values[pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC]
    b = backend(FakeNvml([gpu(gpm=values)]))
    with caplog.at_level(logging.INFO, logger=NVML_LOGGER):
        for _ in range(3):
            b.sample_gpm()
    assert messages(caplog, "GPM metric") == [
        f"GPU 0 ({UUID0}): GPM metric nvlink_tx_bytes_per_second not supported; leaving it absent",
        f"GPU 0 ({UUID0}): GPM metric nvlink_rx_bytes_per_second not supported; leaving it absent",
    ]


def test_gpm_metric_error_is_absent_for_that_window_not_a_session_reset(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unknown = pynvml.NVML_ERROR_UNKNOWN
    fake = FakeNvml(
        [gpu(gpm=gpm_values(), gpm_metric_errors={pynvml.NVML_GPM_METRIC_SM_UTIL: unknown})]
    )
    b = backend(fake)
    b.sample_gpm()
    with caplog.at_level(logging.WARNING, logger=NVML_LOGGER):
        [g] = b.sample_gpm()
        [g] = b.sample_gpm()
    assert g.sm_util is None  # the failing metric is absent...
    assert g.dram_bw_util == pytest.approx(0.50)  # ...the others are there
    assert fake.calls["nvmlInit"] == 1 and fake.calls["nvmlShutdown"] == 0  # no re-init
    assert len(messages(caplog, "absent for that window")) == 1  # logged once, not per window
    fake.gpus[0]["gpm_metric_errors"] = {}
    [g] = b.sample_gpm()
    assert g.sm_util == pytest.approx(0.80)  # back in the next window


def test_gpm_nan_and_infinite_values_are_dropped_and_ratios_clamped() -> None:
    fake = FakeNvml([gpu(gpm=gpm_values(SM_UTIL=float("nan"), SM_OCCUPANCY=100.4,
                                        ANY_TENSOR_UTIL=-0.2, PCIE_TX_PER_SEC=float("inf"),
                                        PCIE_RX_PER_SEC=-1.0))])
    b = backend(fake)
    b.sample_gpm()
    [g] = b.sample_gpm()
    assert g.sm_util is None  # NaN with SUCCESS: absent, never exported
    assert g.sm_occupancy == 1.0 and g.tensor_util == 0.0  # clamped to 0-1
    assert g.pcie_tx_bytes_per_second is None  # infinite: absent
    assert g.pcie_rx_bytes_per_second == 0.0  # a rate is never negative
    assert g.dram_bw_util == pytest.approx(0.50)


def test_gpm_samples_once_per_window_and_repeats_the_last_window_between() -> None:
    clock = FakeClock()
    fake = FakeNvml([gpu(gpm=gpm_values())])
    b = backend(fake, gpm_clock=clock, gpm_interval=1.0)
    assert b.sample_gpm() == []  # primes at t=0
    clock.now += 0.5
    assert b.sample_gpm() == []  # inside the first window: nothing yet, no new sample
    assert fake.calls["nvmlGpmSampleGet"] == 1
    clock.now += 0.5
    [g] = b.sample_gpm()  # the window closed at t=1.0
    assert g.sm_util == pytest.approx(0.80)
    fake.gpus[0]["gpm"] = gpm_values(SM_UTIL=10.0)
    for _ in range(5):  # a 10 Hz sampler inside the second window
        clock.now += 0.1
        [g] = b.sample_gpm()
        assert g.sm_util == pytest.approx(0.80)  # the last window's value, again
    assert fake.calls["nvmlGpmSampleGet"] == 2 and fake.calls["nvmlGpmMetricsGet"] == 1
    clock.now += 0.5
    [g] = b.sample_gpm()
    assert g.sm_util == pytest.approx(0.10)
    assert fake.gpm_windows == [(1, 2), (2, 3)]


@pytest.mark.parametrize("seconds", [0.0, 0.1, 0.19, float("nan"), float("inf") * -1])
def test_gpm_interval_under_the_floor_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match="at least 0.2 s"):
        backend(FakeNvml([gpu()]), gpm_interval=seconds)


def test_gpm_buffer_that_cannot_be_freed_does_not_stop_teardown(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvml([gpu(gpm=gpm_values())])
    b = backend(fake)
    b.sample_devices()
    b.sample_gpm()

    def refuse(sample: Any) -> None:
        fake.calls["nvmlGpmSampleFree"] += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(fake, "nvmlGpmSampleFree", refuse)
    with caplog.at_level(logging.DEBUG, logger=NVML_LOGGER):
        b.close()
    assert fake.calls["nvmlGpmSampleFree"] == 2  # both buffers tried
    assert all(e.freed for e in fake.event_sets) and not fake.initialized
    assert messages(caplog, "freeing") == [
        "ignored NVML error while freeing a GPM sample: Unknown Error"
    ] * 2


# --- PCIe reader ----------------------------------------------------------------------------


def test_pcie_parameters_are_checked_with_their_names() -> None:
    with pytest.raises(ValueError, match=r"^pcie_period must be >= 0, not -1.0$"):
        NvmlBackend(lib=FakeNvml([gpu()]), pcie_period=-1.0)
    with pytest.raises(ValueError, match=r"^pcie_stale_after must be > 0, not 0.0$"):
        NvmlBackend(lib=FakeNvml([gpu()]), pcie_stale_after=0.0)
    NvmlBackend(lib=FakeNvml([gpu()]), pcie_period=0.0, pcie_stale_after=0.5)  # both allowed


def test_pcie_reader_defaults_start_a_thread_and_keep_values_five_seconds() -> None:
    clock = FakeClock()
    b = backend(FakeNvml([gpu()]))
    b.sample_devices()
    reader = PcieReader(b._session, b._memo, clock)
    reader.run_round()
    clock.now += 5.0
    assert reader.latest(UUID0) is not None
    clock.now += 0.001
    assert reader.latest(UUID0) is None
    reader.start()
    thread = reader.thread
    assert thread is not None and thread.is_alive()
    reader.stop()
    assert not thread.is_alive()


def test_pcie_round_told_to_stop_reads_nothing() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    stop = threading.Event()
    stop.set()
    b._pcie.run_round(stop)
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    b._pcie.run_round(threading.Event())
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 4


def test_pcie_value_dropped_as_soon_as_the_gpu_stops_supporting_it() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    b._pcie.run_round()
    fake.gpus[0]["not_supported"].add("nvmlDeviceGetPcieThroughput")
    b._pcie.run_round()
    s0, s1 = b.sample_devices()
    assert s0.pcie_tx_bytes_per_second is None  # not the last value until it goes stale
    assert s1.pcie_tx_bytes_per_second == 1000 * 1024


def test_failing_pcie_reads_are_logged_once_per_gpu_with_the_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    b = backend(fake)
    b.sample_devices()
    with caplog.at_level(logging.DEBUG, logger=NVML_LOGGER):
        for _ in range(2):
            fake.fail_next["nvmlDeviceGetPcieThroughput"] = [pynvml.NVML_ERROR_UNKNOWN] * 2
            b._pcie.run_round()
    assert messages(caplog, "reading PCIe throughput failed") == [
        f"GPU 0 ({UUID0}): reading PCIe throughput failed (Unknown Error); skipped this round",
        f"GPU 1 ({UUID1}): reading PCIe throughput failed (Unknown Error); skipped this round",
    ]


def test_pcie_thread_survives_failing_rounds_and_logs_each_kind_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeNvml([gpu()])
    failures: list[Exception] = [RuntimeError("boom"), RuntimeError("again"), ValueError("bad")]
    read = fake.nvmlDeviceGetPcieThroughput

    def flaky(handle: Any, counter: int) -> int:
        if failures:
            raise failures.pop(0)  # a bug, not an NVMLError: the round fails as a whole
        return read(handle, counter)

    fake.nvmlDeviceGetPcieThroughput = flaky  # type: ignore[method-assign]
    b = NvmlBackend(lib=fake, pcie_period=0.01)
    with caplog.at_level(logging.WARNING, logger=NVML_LOGGER):
        [s] = b.sample_devices()
        deadline = time.monotonic() + 5.0
        while s.pcie_tx_bytes_per_second is None and time.monotonic() < deadline:
            time.sleep(0.01)
            [s] = b.sample_devices()
        b.close()
    assert s.pcie_tx_bytes_per_second == 1000 * 1024  # the fourth round, after a pause each
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "PCIe throughput round failed: RuntimeError('boom')"),
        (logging.WARNING, "PCIe throughput round failed: ValueError('bad')"),
    ]


class GatedPcieRead:
    """Replaces the fake's PCIe read: the first call blocks until ``gate`` is set, as a 20 ms
    NVML window (or a hung call) would, and tells the test through ``entered``."""

    def __init__(self, fake: FakeNvml) -> None:
        self._read = fake.nvmlDeviceGetPcieThroughput
        self.entered = threading.Event()
        self.gate = threading.Event()
        fake.nvmlDeviceGetPcieThroughput = self  # type: ignore[method-assign]

    def __call__(self, handle: Any, counter: int) -> int:
        if not self.entered.is_set():
            self.entered.set()
            self.gate.wait(5.0)
        return self._read(handle, counter)


def test_stopping_ends_a_round_after_the_gpu_being_read() -> None:
    fake = FakeNvml([gpu(index=0), gpu(index=1)])
    read = GatedPcieRead(fake)
    b = NvmlBackend(lib=fake, pcie_period=60.0)
    b.sample_devices()
    assert read.entered.wait(5.0)  # the thread is in GPU 0's TX read
    opener = threading.Timer(0.01, read.gate.set)  # the read returns while close() waits
    opener.start()
    b.close()
    opener.join()
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2  # GPU 0's TX and RX, not GPU 1


def test_close_gives_up_on_a_hung_pcie_read_with_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeout = 0.05
    monkeypatch.setattr(pcie_mod, "PCIE_JOIN_TIMEOUT_S", timeout)
    fake = FakeNvml([gpu()])
    read = GatedPcieRead(fake)
    b = NvmlBackend(lib=fake, pcie_period=60.0)
    b.sample_devices()
    thread = pcie_thread_of(b)
    assert thread is not None
    assert read.entered.wait(5.0)  # hung in an NVML call
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=NVML_LOGGER):
        b.close()
    assert time.monotonic() - started < 1.0  # waited the join timeout, not for the call
    assert thread.is_alive() and not fake.initialized  # shut down anyway
    assert messages(caplog, "still in an NVML call") == [
        f"PCIe throughput thread still in an NVML call after {timeout:.1f} s; "
        "shutting NVML down anyway"
    ]
    read.gate.set()  # its call returns, it sees the stop and ends
    thread.join(5.0)
    assert not thread.is_alive()


def test_pcie_thread_starts_again_after_close() -> None:
    fake = FakeNvml([gpu()])
    b = NvmlBackend(lib=fake, pcie_period=0.01)
    b.sample_devices()
    first = pcie_thread_of(b)
    b.close()
    b.sample_devices()
    second = pcie_thread_of(b)
    assert second is not None and second is not first and second.is_alive()
    b.close()
    assert first is not None and not first.is_alive() and not second.is_alive()
