"""Tests for the CUPTI PM sampling source against the hand-written fake library and driver."""

from __future__ import annotations

import contextlib
import logging
import math
import subprocess
import sys
from collections.abc import Callable

import pytest

from mrc_agent.agent.core.hw import cupti_pm, cupti_reasons
from mrc_agent.agent.core.hw.base import (
    GPUIdentity,
    HardwareError,
    SourceUnavailable,
    ratio_of_percent,
)
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from mrc_agent.agent.core.hw.cupti_pm import (
    BACKOFF_MAX_S,
    BUSY_RETRY_S,
    DRAM_READ_METRICS,
    HARDWARE_BUFFER_BYTES,
    PROFILING_METRICS,
    SM_INSTRUCTION_METRICS,
    CuptiPmSampler,
)
from tests.fakes.fake_cupti import (
    CUresult,
    FakeCupti,
    FakeDevice,
    NotSupportedError,
    TriggerMode,
    cuptiError,
    error,
    fake_uuid,
)

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


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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


# -- counting ---------------------------------------------------------------------------------


def test_counters_accumulate_monotonically_over_decoded_records() -> None:
    device = FakeDevice(
        decodes=[
            [rec(100, 4096), rec(250, 8192)],
            [rec(50, 0)],
            [],  # an idle interval: nothing completed
            [rec(1e12, 2.5e9), rec(3, 64), rec(7, 128)],
        ]
    )
    sampler, lib = sampler_for(device)

    seen = [totals(sampler)[0] for _ in range(4)]

    assert seen == [
        (350.0, 12288.0),
        (400.0, 12288.0),
        (400.0, 12288.0),
        (400.0 + 1e12 + 10, 12288.0 + 2.5e9 + 192),
    ]
    collector = lib.collectors[0]
    assert collector.metrics == list(PROFILING_METRICS)
    assert collector.config == {
        "hardware_buffer_size": HARDWARE_BUFFER_BYTES,
        "sampling_interval": 100_000_000,  # 0.1 s in nanoseconds
        "trigger_mode": TriggerMode.GPU_TIME_INTERVAL,
    }
    assert sampler.status() == ("ok", "")
    # cuInit once, enabled and started once, not per sample; no primary context needed.
    assert lib.driver.calls == MAPPED
    assert lib.count(0, "enable") == 1 and lib.count(0, "start") == 1


def test_negative_or_non_finite_interval_values_never_lower_the_totals() -> None:
    device = FakeDevice(decodes=[[rec(10, 10)], [rec(-5, math.nan), rec(math.inf, 1)]])
    sampler, _ = sampler_for(device)

    assert totals(sampler) == [(10.0, 10.0)]
    assert totals(sampler) == [(10.0, 11.0)]


def test_a_full_decode_is_followed_by_another_so_the_buffer_empties() -> None:
    # 64 is the smallest decode size; 128 records fill two decodes, and a third finds the
    # buffer empty.
    device = FakeDevice(decodes=[[rec(1, 2)] * 128])
    sampler, lib = sampler_for(device, interval_s=10.0)

    assert totals(sampler) == [(128.0, 256.0)]
    assert lib.count(0, "decode") == 3
    assert lib.collectors[0].config["sampling_interval"] == 10_000_000_000


def test_without_sets_falls_back_to_the_names_the_chip_accepts() -> None:
    device = FakeDevice(
        supported_metrics=frozenset({"sm__inst_executed.sum"}),
        decodes=[[{"sm__inst_executed.sum": 42.0}]],
    )
    sampler, lib = sampler_for(device)

    [sample] = sampler.sample_profiling()

    assert lib.collectors[0].metrics == ["sm__inst_executed.sum"]
    assert sample.sm_instructions_executed_total == 42.0
    assert sample.dram_read_bytes_total is None  # absent series, never a zero
    assert (sample.sm_metric, sample.dram_metric, sample.metric_set) == (
        "sm__inst_executed.sum", None, None)


def test_a_later_dram_name_is_used_when_the_first_is_not_offered() -> None:
    device = FakeDevice(
        supported_metrics=frozenset({SM_INSTRUCTION_METRICS[0], DRAM_READ_METRICS[1]}),
        decodes=[[{SM_INSTRUCTION_METRICS[0]: 5.0, DRAM_READ_METRICS[1]: 640.0}]],
    )
    sampler, lib = sampler_for(device)

    assert totals(sampler) == [(5.0, 640.0)]
    assert lib.collectors[0].metrics == [SM_INSTRUCTION_METRICS[0], DRAM_READ_METRICS[1]]


def test_gpus_without_time_interval_trigger_use_sysclk_interval() -> None:
    # Turing and GA100 do not support GPU_TIME_INTERVAL (cupti_pmsampling.h).
    device = FakeDevice(supports_time_interval=False, decodes=[[rec(9, 90)]])
    sampler, lib = sampler_for(device)

    assert totals(sampler) == [(9.0, 90.0)]
    assert lib.collectors[0].config["trigger_mode"] == TriggerMode.GPU_SYSCLK_INTERVAL


# -- single-pass metric sets ------------------------------------------------------------------


def test_sm_and_dram_metrics_come_from_one_single_pass_set(
    caplog: pytest.LogCaptureFixture,
) -> None:
    device = FakeDevice(
        supported_metrics=frozenset(),  # nothing is accepted without naming the set
        single_pass_sets={
            "Set0": ["sm__inst_executed_realtime", "gr__cycles_elapsed"],  # base names
            "Set1": ["sm__inst_executed.sum", "dram__bytes_read.sum.per_second"],
        },
        decodes=[[{"sm__inst_executed.sum": 7.0, "dram__bytes_read.sum": 70.0}]],
    )
    sampler, lib = sampler_for(device)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        [sample] = sampler.sample_profiling()

    collector = lib.collectors[0]
    # The pair in one set beats the more preferred SM name alone in another.
    assert collector.config["single_pass_metric_set_name"] == "Set1"
    assert collector.metrics == ["sm__inst_executed.sum", "dram__bytes_read.sum"]
    assert (sample.sm_instructions_executed_total, sample.dram_read_bytes_total) == (7.0, 70.0)
    assert sample.metric_set == "Set1"
    configured = [r.getMessage() for r in caplog.records if "configured" in r.getMessage()]
    assert len(configured) == 1 and "Set1" in configured[0] and "dram__bytes_read.sum" in (
        configured[0])


def test_a_throughput_only_set_yields_a_ratio_and_no_byte_counter() -> None:
    device = FakeDevice(
        supported_metrics=frozenset(),
        single_pass_sets={"PmSampling": ["sm__inst_executed_realtime.sum", PCT]},
        decodes=[
            [{SM: 10.0, PCT: 50.0}, {SM: 5.0, PCT: 70.0}],
            [{SM: 1.0, PCT: 250.0}, {SM: 1.0, PCT: math.nan}, {SM: 1.0, PCT: -3.0}],
            [],
        ],
    )
    sampler, lib = sampler_for(device)

    first, second, third = (sampler.sample_profiling()[0] for _ in range(3))

    assert lib.collectors[0].metrics == [SM, PCT]
    assert first.dram_read_throughput_ratio == pytest.approx(0.6)  # mean of 50 % and 70 %
    # Clamped to 0-1 where it enters; the NaN interval is dropped, not averaged in.
    assert second.dram_read_throughput_ratio == pytest.approx(0.5)
    assert third.dram_read_throughput_ratio is None  # no interval decoded by that call
    for sample in (first, second, third):
        assert sample.dram_read_bytes_total is None  # a percentage is never a byte count
        assert sample.dram_metric == PCT
    assert third.sm_instructions_executed_total == 18.0


def test_without_the_set_api_names_are_tried_in_order() -> None:
    lib = FakeCupti({0: FakeDevice(decodes=[[rec(1, 2)]])}, set_api=False)
    sampler, _ = sampler_for(FakeDevice(), lib=lib)

    assert totals(sampler) == [(1.0, 2.0)]
    assert "single_pass_metric_set_name" not in lib.collectors[0].config


def test_a_failing_set_api_falls_back_to_names_in_order() -> None:
    device = FakeDevice(single_pass_sets={"Set0": [SM, DRAM]}, decodes=[[rec(3, 4)]])
    sampler, lib = sampler_for(device)

    def broken(chip_name: str) -> list[str]:
        raise error("ERROR_UNKNOWN")

    lib.profiler_host.get_single_pass_sets = broken

    assert totals(sampler) == [(3.0, 4.0)]
    assert "single_pass_metric_set_name" not in lib.collectors[0].config


def test_a_set_choice_configure_refuses_falls_back_to_names_in_order() -> None:
    refused = ValueError("Requested PM sampling configuration is not supported.")
    device = FakeDevice(
        single_pass_sets={"Set0": [SM, DRAM]},
        errors={"configure": [refused, refused]},  # the set choice, in both trigger modes
        decodes=[[rec(1, 1)]],
    )
    sampler, lib = sampler_for(device)

    assert totals(sampler) == [(1.0, 1.0)]
    assert lib.count(0, "configure") == 3
    assert "single_pass_metric_set_name" not in lib.collectors[0].config


# -- CUDA driver initialisation ----------------------------------------------------------------


def test_the_fake_refuses_enable_before_cuinit_as_cupti_does() -> None:
    lib = FakeCupti({0: FakeDevice()})
    collector = lib.pm_sampling.Collector(device_index=0)

    with pytest.raises(cuptiError) as caught:
        collector.enable()

    assert caught.value.status == error("ERROR_NOT_INITIALIZED").status
    # enable()'s rollback ran: profiler_initialize undone by profiler_deinitialize.
    assert lib.total("profiler_initialize") == lib.total("profiler_deinitialize") == 1
    assert lib.profiler_refs == 0 and not collector.enabled


def test_a_stand_in_library_without_a_driver_gets_no_cuinit_and_is_refused() -> None:
    lib = FakeCupti({0: FakeDevice()})
    sampler = CuptiPmSampler([GPU0], lib=lib)  # what the agent did before cuInit was added

    assert unavailable(sampler).reason == "cupti_not_initialized"
    assert lib.driver.calls == []


def test_cuinit_runs_before_the_first_enable() -> None:
    sampler, lib = sampler_for(FakeDevice(decodes=[[rec(1, 1)]]), FakeDevice())

    sampler.sample_profiling()

    # cuInit and the UUIDs once per process, not per GPU.
    assert lib.driver.calls == [*MAPPED, "cuDeviceGet", "cuDeviceGetUuid"]
    assert sampler.status() == ("ok", "")


def test_primary_context_is_taken_only_where_enable_refuses_without_it() -> None:
    needs = FakeDevice(needs_primary_context=True, decodes=[[rec(2, 4)]])
    sampler, lib = sampler_for(FakeDevice(decodes=[[rec(1, 1)]]), needs)

    assert totals(sampler) == [(1.0, 1.0), (2.0, 4.0)]
    assert lib.driver.retained == {1: 1}  # GPU 0 did not need one
    assert [lib.count(i, "enable") for i in (0, 1)] == [1, 2]  # one retry, not more

    sampler.close()
    assert lib.driver.retained == {}


def test_primary_context_is_released_when_the_retry_does_not_help() -> None:
    still = error("ERROR_NOT_INITIALIZED")
    device = FakeDevice(errors={"enable": [still, still]})
    sampler, lib = sampler_for(device)

    exc = unavailable(sampler)

    assert exc.reason == "cupti_not_initialized" and "NOT_INITIALIZED" in exc.detail
    assert lib.count(0, "enable") == 2
    assert "cuDevicePrimaryCtxRelease" in lib.driver.calls and lib.driver.retained == {}


def test_missing_libcuda_is_cuda_missing_and_names_the_container_setting() -> None:
    sampler, lib = sampler_for(FakeDevice())
    lib.driver.library_missing = True

    exc = unavailable(sampler)

    assert exc.reason == "cuda_missing" and "cuda_missing" in cupti_pm._REASON_CODES
    assert "libcuda.so.1 not found" in exc.detail
    assert "NVIDIA_DRIVER_CAPABILITIES to include compute" in exc.detail
    assert lib.total("enable") == 0
    assert unavailable(sampler).reason == "cuda_missing"
    assert lib.driver.calls == ["cuInit"]  # for good: not asked again


def test_cupti_finding_no_cuda_driver_is_cuda_missing() -> None:
    exc = NotSupportedError("CUDA driver is not found (libcuda.so.1: cannot open shared object)")
    sampler, _ = sampler_for(FakeDevice(errors={"enable": [exc]}))

    caught = unavailable(sampler)
    assert caught.reason == "cuda_missing"
    assert "NVIDIA_DRIVER_CAPABILITIES" in caught.detail


def test_cuinit_with_no_visible_device_is_no_gpu() -> None:
    sampler, lib = sampler_for(FakeDevice())
    lib.driver.init_results = [CUresult.CUDA_ERROR_NO_DEVICE]

    exc = unavailable(sampler)
    assert exc.reason == "no_gpu" and "CUDA_ERROR_NO_DEVICE" in exc.detail


def test_a_transient_cuinit_failure_is_retried_after_the_backoff() -> None:
    clock = Clock()
    sampler, lib = sampler_for(FakeDevice(decodes=[[rec(5, 5)]]), clock=clock)
    lib.driver.init_results = [CUresult.CUDA_ERROR_SYSTEM_NOT_READY]  # fabric manager starting

    with pytest.raises(HardwareError) as caught:
        sampler.sample_profiling()
    assert not isinstance(caught.value, SourceUnavailable)
    clock.now += cupti_pm.BACKOFF_INITIAL_S
    assert totals(sampler) == [(5.0, 5.0)]
    assert lib.driver.calls == ["cuInit", *MAPPED]


# -- reasons ----------------------------------------------------------------------------------


def test_missing_cupti_module_is_cupti_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupti", None)  # makes `import cupti` fail
    sampler = CuptiPmSampler([GPU0])

    exc = unavailable(sampler)

    assert exc.reason == "cupti_missing"
    assert "cupti-python" in exc.detail
    assert sampler.status()[0] == "cupti_missing"


def test_cupti_without_pm_sampling_is_cupti_missing() -> None:
    class OldCupti:  # cupti-python < 13.3 has only the bindings
        cupti = FakeCupti().cupti

    exc = unavailable(CuptiPmSampler([GPU0], lib=OldCupti()))
    assert exc.reason == "cupti_missing"
    assert "13.3" in exc.detail


@pytest.mark.parametrize(
    ("method", "exc"),
    [
        # What Collector.enable() raises for CUPTI_ERROR_INSUFFICIENT_PRIVILEGES.
        ("enable", PermissionError("Insufficient privileges for PM sampling")),
        ("start", error("ERROR_INSUFFICIENT_PRIVILEGES")),
        ("enable", error("ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES")),
    ],
)
def test_insufficient_privileges_is_no_permission(method: str, exc: BaseException) -> None:
    clock = Clock()
    sampler, lib = sampler_for(FakeDevice(errors={method: [exc]}), clock=clock)

    assert unavailable(sampler).reason == "no_permission"
    assert sampler.status()[0] == "no_permission"
    # Permission does not change while the agent runs: no second attempt, same answer.
    clock.now += BACKOFF_MAX_S * 10
    with pytest.raises(SourceUnavailable, match="no_permission"):
        sampler.sample_profiling()
    assert lib.count(0, "enable") == 1 and lib.count(0, "start") <= 1


@pytest.mark.parametrize(
    ("method", "exc"),
    [
        ("enable", error("ERROR_HARDWARE_BUSY")),
        ("start", error("ERROR_HARDWARE_BUSY")),
        ("enable", error("ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")),
        ("enable", error("ERROR_DISABLED")),
        ("enable", RuntimeError("PM sampling is already enabled on this device.")),
    ],
)
def test_counters_held_by_another_profiler_is_profiler_busy(
    method: str, exc: BaseException
) -> None:
    clock = Clock()
    sampler, lib = sampler_for(FakeDevice(errors={method: [exc]}, decodes=[[rec(1, 1)]]),
                               clock=clock)

    assert unavailable(sampler).reason == "profiler_busy"
    # A busy start keeps its enabled collector (no disable: it would deinitialise the profiler).
    assert lib.collectors[0].enabled is (method == "start")
    assert lib.total("disable") == 0

    # Not retried straight away...
    clock.now += BUSY_RETRY_S / 2
    with pytest.raises(SourceUnavailable, match="profiler_busy"):
        sampler.sample_profiling()
    assert lib.total("enable") == 1 and lib.total("start") == int(method == "start")
    # ...but once the other profiler had time to finish, sampling starts.
    clock.now += BUSY_RETRY_S
    assert totals(sampler) == [(1.0, 1.0)]
    assert sampler.status() == ("ok", "")
    assert lib.total("enable") == (1 if method == "start" else 2)


@pytest.mark.parametrize(
    "make_device",
    [
        # Made per test: a device's queued errors are used up, and the same test may run twice
        # in one process (mutmut runs the suite in-process more than once).
        lambda: FakeDevice(errors={"enable": [error("ERROR_NOT_SUPPORTED")]}),
        lambda: FakeDevice(errors={"enable": [error("ERROR_MIG_DEVICE_NOT_SUPPORTED")]}),
        # The chip's PM sampling offers none of the metrics (configure raises ValueError).
        lambda: FakeDevice(supported_metrics=frozenset({"gr__cycles_elapsed.max"})),
    ],
    ids=["not_supported", "mig_device", "no_metric"],
)
def test_pm_sampling_not_supported_is_unsupported_device(
    make_device: Callable[[], FakeDevice],
) -> None:
    sampler, lib = sampler_for(make_device())

    assert unavailable(sampler).reason == "unsupported_device"
    assert lib.count(0, "start") == 0
    sampler.close()
    assert all(not c.enabled for c in lib.collectors)


@pytest.mark.parametrize(("exc", "reason"), [(error("ERROR_INVALID_DEVICE"), "no_gpu"),
                                             (None, "no_cuda_device")])
def test_no_such_device_is_no_gpu(exc: BaseException | None, reason: str) -> None:
    # None: CUDA knows no device at all, so none has the GPU's UUID.
    lib = FakeCupti({0: FakeDevice(errors={"enable": [exc]})} if exc is not None else {})
    sampler = CuptiPmSampler([GPU0], lib=lib, cuda=CudaDriver(lib.driver))

    assert unavailable(sampler).reason == reason


def test_nvperf_libraries_missing_is_cupti_missing() -> None:
    exc = RuntimeError("CUPTI could not load the nvperf* libraries required for profiling.")
    sampler, lib = sampler_for(FakeDevice(errors={"enable": [exc, exc]}))

    assert unavailable(sampler).reason == "cupti_missing"
    # cupti-python turns ERROR_NOT_INITIALIZED into this text, so one retry with the primary
    # context was made, and the context given back when it did not help.
    assert lib.count(0, "enable") == 2 and lib.driver.retained == {}


def test_reason_is_logged_once_not_per_sample(caplog: pytest.LogCaptureFixture) -> None:
    sampler, _ = sampler_for(FakeDevice(errors={"enable": [PermissionError("ERR_NVGPUCTRPERM")]}))

    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(5):
            with pytest.raises(SourceUnavailable):
                sampler.sample_profiling()

    messages = [r.getMessage() for r in caplog.records if "no_permission" in r.getMessage()]
    assert len(messages) == 1


# -- backoff ----------------------------------------------------------------------------------


def _attempt_times(sampler: CuptiPmSampler, lib: FakeCupti, clock: Clock, method: str,
                   until: float, step: float = 0.5) -> list[float]:
    """Seconds (from the start) at which ``method`` ran on GPU 0, calling every ``step``."""
    start, times = clock.now, []
    while clock.now - start <= until:
        before = lib.count(0, method)
        with contextlib.suppress(HardwareError):  # failing starts are what is being timed
            sampler.sample_profiling()
        if lib.count(0, method) > before:
            times.append(clock.now - start)
        clock.now += step
    return times


def test_transient_start_failures_back_off_exponentially_then_recover() -> None:
    clock = Clock()
    device = FakeDevice(errors={"start": [error("ERROR_UNKNOWN")] * 5}, decodes=[[rec(1, 1)]])
    sampler, lib = sampler_for(device, clock=clock)

    times = _attempt_times(sampler, lib, clock, "start", until=60.0)

    assert times == [0.0, 1.0, 3.0, 7.0, 15.0, 31.0]  # 1 s doubling; the sixth one works
    assert lib.count(0, "enable") == 1  # the enabled collector is reused for every retry
    assert sampler.status() == ("ok", "")


def test_backoff_is_capped_at_five_minutes() -> None:
    clock = Clock()
    device = FakeDevice(errors={"configure": [error("ERROR_UNKNOWN")] * 1000})
    sampler, lib = sampler_for(device, clock=clock)

    times = _attempt_times(sampler, lib, clock, "configure", until=2000.0, step=1.0)

    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps[:9] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
    assert gaps[9:] and set(gaps[9:]) == {BACKOFF_MAX_S}
    assert sampler.status()[0] == "hardware_error"


def test_failing_enables_back_off_too() -> None:
    clock = Clock()
    sampler, lib = sampler_for(FakeDevice(errors={"enable": [error("ERROR_UNKNOWN")] * 3}),
                               clock=clock)

    times = _attempt_times(sampler, lib, clock, "enable", until=20.0)

    assert times == [0.0, 1.0, 3.0, 7.0]


def test_a_good_decode_resets_the_backoff() -> None:
    clock = Clock()
    device = FakeDevice(
        errors={"start": [error("ERROR_UNKNOWN")] * 3, "decode": [None, error("ERROR_UNKNOWN")]},
        decodes=[[rec(1, 1)], [rec(1, 1)], [rec(1, 1)]],
    )
    sampler, lib = sampler_for(device, clock=clock)
    _attempt_times(sampler, lib, clock, "start", until=7.0)  # fails at 0, 1, 3; works at 7
    assert sampler.status() == ("ok", "")

    clock.now += 0.5
    with pytest.raises(HardwareError, match="decode failed"):
        sampler.sample_profiling()
    clock.now += cupti_pm.BACKOFF_INITIAL_S  # 1 s again, not the 8 s the start had reached
    assert totals(sampler) == [(2.0, 2.0)]


def test_while_every_gpu_waits_for_its_retry_the_call_is_a_hardware_error() -> None:
    clock = Clock()
    sampler, lib = sampler_for(FakeDevice(errors={"start": [error("ERROR_UNKNOWN")]}),
                               clock=clock)
    with pytest.raises(HardwareError):
        sampler.sample_profiling()

    with pytest.raises(HardwareError, match="waits to retry") as caught:
        sampler.sample_profiling()  # within the backoff: nothing is tried
    assert not isinstance(caught.value, SourceUnavailable)
    assert lib.count(0, "start") == 1


# -- profiler lifetime: per process, not per collector ------------------------------------------


def test_a_run_time_failure_of_one_gpu_leaves_the_other_sampling_and_never_deinitialises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    gpu0 = FakeDevice(decodes=[[rec(1, 10)], [rec(2, 20)], [rec(3, 30)]])
    gpu1 = FakeDevice(
        decodes=[[rec(100, 1000)], [rec(5, 50)]],  # the failed decode consumes nothing
        errors={"decode": [None, MemoryError("Record overflow in the hardware buffer.")]},
    )
    sampler, lib = sampler_for(gpu0, gpu1, clock=clock)
    assert totals(sampler) == [(1.0, 10.0), (100.0, 1000.0)]

    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(
        HardwareError, match="GPU 1: decode failed.*Record overflow"
    ):
        sampler.sample_profiling()
    assert sampler.status()[0] == "hardware_error"

    clock.now += cupti_pm.BACKOFF_INITIAL_S
    # GPU 0 decoded through GPU 1's failure; GPU 1 carries on from its totals.
    assert totals(sampler) == [(6.0, 60.0), (105.0, 1050.0)]
    assert sampler.status() == ("ok", "")
    # GPU 1 was stopped and restarted on its enabled collector: no disable, no new enable,
    # and nothing deinitialised the process-wide profiler under GPU 0.
    assert len(lib.collectors) == 2
    assert [lib.count(1, m) for m in ("enable", "stop", "configure", "start")] == [1, 1, 2, 2]
    assert lib.total("disable") == 0 and lib.total("profiler_deinitialize") == 0
    assert lib.count(0, "stop") == 0 and lib.collectors[0].started
    assert sum("hardware_error" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_enable_on_one_gpu_does_not_disturb_the_one_already_sampling() -> None:
    clock = Clock()
    gpu0 = FakeDevice(decodes=[[rec(1, 1)], [rec(1, 1)], [rec(1, 1)]])
    gpu1 = FakeDevice(errors={"enable": [error("ERROR_HARDWARE_BUSY")] * 2},
                      decodes=[[rec(9, 9)]])
    sampler, lib = sampler_for(gpu0, gpu1, clock=clock)

    assert totals(sampler) == [(1.0, 1.0), (None, None)]
    clock.now += BUSY_RETRY_S  # GPU 1's enable is retried beside GPU 0 sampling, and fails
    assert totals(sampler) == [(2.0, 2.0), (None, None)]
    clock.now += BUSY_RETRY_S
    assert totals(sampler) == [(3.0, 3.0), (9.0, 9.0)]

    # Each failed enable rolled itself back (as the real one does); GPU 0's own profiler
    # reference held throughout, and GPU 0 was never stopped.
    assert lib.total("profiler_deinitialize") == 2
    assert lib.profiler_refs == 2
    assert lib.count(0, "stop") == 0 and lib.count(0, "enable") == 1


def test_a_restart_reuses_the_working_configuration_and_logs_the_choice_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    device = FakeDevice(
        supported_metrics=frozenset(),
        single_pass_sets={"Set0": [SM, DRAM]},
        errors={"decode": [None, error("ERROR_UNKNOWN")]},
        decodes=[[rec(1, 1)], [rec(2, 2)]],
    )
    sampler, lib = sampler_for(device, clock=clock)
    asked: list[str] = []
    real_sets = lib.profiler_host.get_single_pass_sets

    def counted(chip_name: str) -> list[str]:
        asked.append(chip_name)
        return real_sets(chip_name)

    lib.profiler_host.get_single_pass_sets = counted

    with caplog.at_level(logging.INFO, logger=LOGGER):
        sampler.sample_profiling()
        with pytest.raises(HardwareError):
            sampler.sample_profiling()
        clock.now += cupti_pm.BACKOFF_INITIAL_S
        assert totals(sampler) == [(3.0, 3.0)]

    assert asked == ["GH100"]  # the sets were read for the first configure only
    assert lib.count(0, "configure") == 2
    assert lib.collectors[0].config["single_pass_metric_set_name"] == "Set0"
    assert sum("configured" in r.getMessage() for r in caplog.records) == 1


def test_every_enable_of_a_pass_comes_before_any_start() -> None:
    sampler, lib = sampler_for(FakeDevice(), FakeDevice(), FakeDevice())

    sampler.sample_profiling()

    methods = [m for _, m in lib.calls if m in ("enable", "start")]
    assert methods == ["enable"] * 3 + ["start"] * 3


def test_close_stops_every_gpu_before_disabling_any_then_releases_contexts() -> None:
    needs = FakeDevice(needs_primary_context=True)
    sampler, lib = sampler_for(FakeDevice(decodes=[[rec(1, 1)]]), needs)
    sampler.sample_profiling()
    assert all(c.started for c in lib.collectors if c.enabled)

    sampler.close()
    sampler.close()  # idempotent

    methods = [m for _, m in lib.calls if m in ("stop", "disable")]
    assert methods == ["stop", "stop", "disable", "disable"]
    assert all(not c.started and not c.enabled for c in lib.collectors)
    assert lib.profiler_refs == 0 and lib.driver.retained == {}
    with pytest.raises(HardwareError, match="closed"):
        sampler.sample_profiling()


def test_one_unsupported_gpu_leaves_the_other_sampling() -> None:
    ok = FakeDevice(decodes=[[rec(8, 16)]])
    mig = FakeDevice(errors={"enable": [error("ERROR_MIG_DEVICE_NOT_SUPPORTED")]})
    sampler, _ = sampler_for(ok, mig)

    assert totals(sampler) == [(8.0, 16.0), (None, None)]
    assert sampler.status()[0] == "unsupported_device"


# -- boundaries --------------------------------------------------------------------------------


def test_nothing_touches_cuda_or_cupti_before_the_first_sample() -> None:
    lib = FakeCupti({0: FakeDevice()})
    sampler = CuptiPmSampler([GPU0, GPU1], lib=lib, cuda=CudaDriver(lib.driver))

    assert lib.calls == [] and lib.driver.calls == []
    assert sampler.status()[0] == "not_started"


def test_importing_and_building_the_source_loads_neither_cupti_nor_cuda() -> None:
    code = (
        "import sys\n"
        "from mrc_agent.agent.core.hw import cupti_pm, cuda_driver\n"
        "from mrc_agent.agent.core.hw.profiling import LazyProfiling\n"
        "class Devices:\n"
        "    def sample_devices(self):\n"
        "        raise AssertionError('asked for devices before the first sample')\n"
        "LazyProfiling(Devices())\n"
        "cupti_pm.CuptiPmSampler([])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupti', 'cuda')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        CuptiPmSampler([GPU0], lib=FakeCupti(), interval_s=0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(50.0, 0.5), (0.0, 0.0), (100.0, 1.0), (130.0, 1.0), (-2.0, 0.0), (math.nan, None),
     (math.inf, None), (-math.inf, None), (None, None)],
)
def test_percentages_become_clamped_ratios_and_non_numbers_are_dropped(
    value: float | None, expected: float | None
) -> None:
    assert ratio_of_percent(value) == expected


def test_fake_matches_the_real_library_where_installed() -> None:
    """Guards the fakes against drift on hosts that have cupti-python (skipped elsewhere)."""
    cupti = pytest.importorskip("cupti")
    driver = pytest.importorskip("cuda.bindings.driver")
    import inspect

    from tests.fakes import fake_cupti

    real = cupti.cupti.Result
    assert {m.name: m.value for m in fake_cupti.Result} == {
        m.name: getattr(real, m.name).value for m in fake_cupti.Result
    }
    assert set(cupti_reasons.REASON_BY_RESULT) <= set(real.__members__)
    for mode in fake_cupti.TriggerMode:
        assert getattr(cupti.pm_sampling.TriggerMode, mode.name).value == mode.value
    configure = inspect.signature(cupti.pm_sampling.Collector.configure).parameters
    assert {"metrics", "hardware_buffer_size", "sampling_interval", "trigger_mode",
            "single_pass_metric_set_name"} <= set(configure)
    assert "max_samples" in inspect.signature(cupti.pm_sampling.Collector.decode).parameters
    assert str(cupti.cupti.cuptiError(26)) == str(fake_cupti.error("ERROR_HARDWARE_BUSY"))
    for name in ("get_single_pass_sets", "get_metrics_in_single_pass_set"):
        assert list(inspect.signature(getattr(cupti.profiler_host, name)).parameters) == list(
            inspect.signature(getattr(FakeCupti().profiler_host, name)).parameters)
    for m in fake_cupti.CUresult:
        assert int(getattr(driver.CUresult, m.name)) == m.value


# -- what the messages say ----------------------------------------------------------------------


def test_without_gpus_the_source_says_so_in_the_error_and_the_status() -> None:
    sampler = CuptiPmSampler([], lib=FakeCupti(), cuda=None)

    exc = unavailable(sampler)

    assert (exc.reason, exc.detail) == sampler.status() == (
        "no_gpu", "no GPUs were given to the profiling source")


def test_a_closed_sampler_says_it_is_closed_and_each_gpu_is_not_started() -> None:
    sampler, _ = sampler_for(FakeDevice())
    sampler.sample_profiling()

    sampler.close()

    assert sampler.status() == ("not_started", "closed")
    with pytest.raises(HardwareError, match="^CUPTI PM sampling is closed$"):
        sampler.sample_profiling()


def test_failures_of_several_gpus_are_listed_in_one_error_then_while_they_wait() -> None:
    busy = error("ERROR_UNKNOWN")
    sampler, _ = sampler_for(FakeDevice(errors={"start": [busy]}),
                             FakeDevice(errors={"start": [busy]}))
    why = "start failed: cuptiError: ERROR_UNKNOWN (999) (retry in 1 s)"

    with pytest.raises(HardwareError) as first:
        sampler.sample_profiling()
    with pytest.raises(HardwareError) as waiting:
        sampler.sample_profiling()

    assert str(first.value) == f"CUPTI PM sampling failed: GPU 0: {why}; GPU 1: {why}"
    assert str(waiting.value) == f"CUPTI PM sampling waits to retry: GPU 0: {why}; GPU 1: {why}"


def test_starting_and_failing_are_logged_with_the_gpu_and_what_it_measures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    device = FakeDevice(decodes=[[rec(1, 1)]], errors={"decode": [None, MemoryError("overflow")]})
    sampler, _ = sampler_for(device)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        sampler.sample_profiling()
        with pytest.raises(HardwareError, match="GPU 0: decode failed: MemoryError: overflow"):
            sampler.sample_profiling()

    messages = [r.getMessage() for r in caplog.records]
    what = f"metrics {SM}, {DRAM} (no single-pass set)"
    assert f"CUPTI PM sampling on GPU 0 configured: {what}" in messages
    assert f"CUPTI PM sampling started on GPU 0: {what}" in messages
    assert ("CUPTI PM sampling on GPU 0: hardware_error (GPU 0: decode failed: MemoryError: "
            "overflow (retry in 1 s))") in messages


def test_the_primary_context_retry_is_logged_with_its_memory_cost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sampler, _ = sampler_for(FakeDevice(), FakeDevice(needs_primary_context=True))

    with caplog.at_level(logging.INFO, logger=LOGGER):
        sampler.sample_profiling()

    [message] = [r.getMessage() for r in caplog.records if "primary context" in r.getMessage()]
    assert message.startswith(
        "CUPTI PM sampling on CUDA device 1: enable() answered cuptiError: "
        "ERROR_NOT_INITIALIZED (15) "
        "after cuInit; retrying")
    assert message.endswith("with the device's primary context (it holds device memory)")


def test_a_missing_libcuda_is_decided_once_and_told_for_every_gpu(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sampler, lib = sampler_for(FakeDevice(), FakeDevice())
    lib.driver.library_missing = True

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        exc = unavailable(sampler)

    assert exc.reason == "cuda_missing" and lib.driver.calls == ["cuInit"]
    for gpu in (0, 1):
        [told] = [r.getMessage() for r in caplog.records if f"on GPU {gpu}:" in r.getMessage()]
        assert told == f"CUPTI PM sampling on GPU {gpu}: cuda_missing ({exc.detail})"


def test_a_missing_cupti_is_logged_once_and_answered_the_same_every_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "cupti", None)
    sampler = CuptiPmSampler([GPU0])

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first, second = unavailable(sampler), unavailable(sampler)

    assert (second.reason, second.detail) == (first.reason, first.detail)
    assert first.detail.endswith("; install mrc-agent[profiling] (cupti-python>=13.3)")
    [message] = [r.getMessage() for r in caplog.records]
    assert message == f"CUPTI PM sampling unavailable: cupti_missing: {first.detail}"


def test_cupti_without_pm_sampling_says_which_version_it_needs() -> None:
    class OldCupti:
        cupti = FakeCupti().cupti

    exc = unavailable(CuptiPmSampler([GPU0], lib=OldCupti()))
    assert exc.detail == "cupti-python has no pm_sampling module; it needs >= 13.3"


def test_without_arguments_the_sampler_imports_cupti_and_the_cuda_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lib = FakeCupti({0: FakeDevice(decodes=[[rec(4, 8)]])})
    monkeypatch.setitem(sys.modules, "cupti", lib)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", lib.driver)
    sampler = CuptiPmSampler([GPU0])

    assert totals(sampler) == [(4.0, 8.0)]
    assert lib.driver.calls == MAPPED
    # The default interval is 0.1 s.
    assert lib.collectors[0].config["sampling_interval"] == 100_000_000


def test_a_failing_cuinit_and_a_failing_enable_say_which_step_failed() -> None:
    clock = Clock()
    sampler, lib = sampler_for(FakeDevice(errors={"enable": [error("ERROR_UNKNOWN")]}),
                               clock=clock)
    lib.driver.init_results = [CUresult.CUDA_ERROR_SYSTEM_NOT_READY]

    cuinit = r"cuInit failed: CUDA_ERROR_SYSTEM_NOT_READY \(802\) \(retry in 1 s\)"
    with pytest.raises(HardwareError, match=f"GPU 0: CUDA initialisation failed: {cuinit}"):
        sampler.sample_profiling()
    clock.now += 1.0
    with pytest.raises(HardwareError, match=r"GPU 0: enable failed: cuptiError: ERROR_UNKNOWN "
                                            r"\(999\) \(retry in 2 s\)"):
        sampler.sample_profiling()


@pytest.mark.parametrize("method", ["enable", "start"])
def test_a_busy_gpu_says_what_cupti_answered(method: str) -> None:
    sampler, _ = sampler_for(FakeDevice(errors={method: [error("ERROR_HARDWARE_BUSY")]}))

    assert unavailable(sampler).detail == "cuptiError: ERROR_HARDWARE_BUSY (26)"


def test_a_chip_offering_no_metric_names_what_was_wanted_and_the_last_refusal() -> None:
    sampler, _ = sampler_for(FakeDevice(supported_metrics=frozenset({"gr__cycles_elapsed.max"})))

    exc = unavailable(sampler)

    wanted = (cupti_pm.SM_INSTRUCTION_METRICS + cupti_pm.DRAM_COUNT_METRICS
              + cupti_pm.DRAM_THROUGHPUT_METRICS)
    last = cupti_pm.DRAM_THROUGHPUT_METRICS[-1]
    assert exc.detail == f"PM sampling accepts none of {wanted}: Invalid metrics [{last!r}]"


@pytest.mark.parametrize(
    ("text", "reason"),
    [("CUDA driver is not found (libcuda.so.1)", "cuda_missing"),
     ("CUDA driver is too old for this CUPTI", "unsupported_device")],
)
def test_cupti_python_not_supported_errors_are_told_apart(text: str, reason: str) -> None:
    sampler, _ = sampler_for(FakeDevice(errors={"enable": [NotSupportedError(text)]}))

    assert unavailable(sampler).reason == reason


# -- more counting -----------------------------------------------------------------------------


def test_a_gpu_measuring_dram_bytes_only_counts_them() -> None:
    device = FakeDevice(supported_metrics=frozenset({DRAM}), decodes=[[rec(1, 64)]])
    sampler, lib = sampler_for(device)

    assert totals(sampler) == [(None, 64.0)]
    assert lib.collectors[0].metrics == [DRAM]


def test_a_gpu_waiting_for_its_restart_has_no_series_while_another_samples() -> None:
    clock = Clock()
    gpu0 = FakeDevice(decodes=[[rec(1, 1)], [rec(1, 1)], [rec(1, 1)]])
    gpu1 = FakeDevice(decodes=[[rec(5, 5)]], errors={"decode": [None, error("ERROR_UNKNOWN")]})
    sampler, _ = sampler_for(gpu0, gpu1, clock=clock)
    assert totals(sampler) == [(1.0, 1.0), (5.0, 5.0)]
    with pytest.raises(HardwareError):
        sampler.sample_profiling()

    assert totals(sampler) == [(3.0, 3.0), (None, None)]  # within GPU 1's backoff


def test_a_restart_onto_a_throughput_metric_drops_the_old_byte_total() -> None:
    clock = Clock()
    refused = ValueError("Requested PM sampling configuration is not supported.")
    device = FakeDevice(
        supported_metrics=frozenset({SM, DRAM, PCT}),
        # The first configuration works; after the decode failure it and the other byte pair
        # the chip offers are refused, so the restart measures the throughput percentage.
        errors={"configure": [None, refused, refused], "decode": [None, error("ERROR_UNKNOWN")]},
        decodes=[[rec(1, 100)], [{SM: 1.0, PCT: 40.0}]],
    )
    sampler, lib = sampler_for(device, clock=clock)
    assert totals(sampler) == [(1.0, 100.0)]
    with pytest.raises(HardwareError):
        sampler.sample_profiling()
    clock.now += cupti_pm.BACKOFF_INITIAL_S

    [sample] = sampler.sample_profiling()

    assert lib.collectors[0].metrics == [SM, PCT]
    assert sample.dram_read_bytes_total is None
    assert sample.dram_read_throughput_ratio == pytest.approx(0.4)
    assert sample.sm_instructions_executed_total == 2.0


def test_the_sampling_interval_is_whole_nanoseconds_and_at_least_one() -> None:
    sampler, lib = sampler_for(FakeDevice(), interval_s=1e-10)
    sampler.sample_profiling()
    assert lib.collectors[0].config["sampling_interval"] == 1


def test_interval_error_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match=r"^interval_s must be > 0, got -1\.0$"):
        CuptiPmSampler([GPU0], lib=FakeCupti(), interval_s=-1.0)
