"""The CUPTI PM sampling source against the hand-written fake library and driver: counting,
the choice of metrics, CUDA and CUPTI start-up, and what each refusal means. Retries, several
GPUs, logging and close are in test_cupti_pm_recovery."""


from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable

import pytest

from mrc_agent.agent.core.hw import cupti_pm
from mrc_agent.agent.core.hw.base import (
    HardwareError,
    SourceUnavailable,
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
from mrc_agent.agent.tools.simgpu.cupti import (
    CUresult,
    FakeCupti,
    FakeDevice,
    NotSupportedError,
    TriggerMode,
    cuptiError,
    error,
)
from tests.cupti_support import (
    DRAM,
    GPU0,
    LOGGER,
    MAPPED,
    PCT,
    SM,
    Clock,
    rec,
    sampler_for,
    totals,
    unavailable,
)


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


def test_nvperf_form_of_not_initialised_is_cupti_not_initialized() -> None:
    # cupti-python's text for ERROR_NOT_INITIALIZED from profiler_initialize (pm_sampling.py):
    # the same code as the raw answer, so the same reason; the text stays in the detail.
    exc = RuntimeError("CUPTI could not load the nvperf* libraries required for profiling. "
                       "Ensure libnvperf_host.so and libnvperf_target.so, shipped alongside "
                       "the libcupti.so in use, are discoverable by the dynamic linker")
    sampler, lib = sampler_for(FakeDevice(errors={"enable": [exc, exc]}))

    caught = unavailable(sampler)
    assert caught.reason == "cupti_not_initialized" and "nvperf" in caught.detail
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
