"""Tests for the CUPTI PM sampling source against the hand-written fake library."""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pytest

from mrc_agent.agent.core.hw import cupti_pm
from mrc_agent.agent.core.hw.base import GPUIdentity, HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.cupti_pm import (
    DRAM_READ_METRICS,
    HARDWARE_BUFFER_BYTES,
    PROFILING_METRICS,
    SM_INSTRUCTION_METRICS,
    CuptiPmSampler,
)
from tests.fakes.fake_cupti import FakeCupti, FakeDevice, NotSupportedError, TriggerMode, error

SM, DRAM = PROFILING_METRICS
GPU0 = GPUIdentity(0, "GPU-00000000-0000-0000-0000-000000000000", "NVIDIA H200")
GPU1 = GPUIdentity(1, "GPU-11111111-1111-1111-1111-111111111111", "NVIDIA H200")


def rec(sm: float, dram: float) -> dict[str, float]:
    """One PM sampling interval's values under the preferred metric names."""
    return {SM: sm, DRAM: dram}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sampler_for(
    *devices: FakeDevice, interval_s: float = 0.1, clock: Clock | None = None
) -> tuple[CuptiPmSampler, FakeCupti]:
    lib = FakeCupti({i: d for i, d in enumerate(devices)})
    gpus = [GPUIdentity(i, f"GPU-{i}", "NVIDIA H200") for i in range(len(devices))]
    sampler = CuptiPmSampler(gpus, lib=lib, interval_s=interval_s, clock=clock or Clock())
    return sampler, lib


def totals(sampler: CuptiPmSampler) -> list[tuple[float | None, float | None]]:
    return [
        (s.sm_instructions_executed_total, s.dram_read_bytes_total)
        for s in sampler.sample_profiling()
    ]


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
    for earlier, later in zip(seen, seen[1:], strict=False):
        for a, b in zip(earlier, later, strict=True):
            assert a is not None and b is not None and b >= a
    collector = lib.collectors[0]
    assert collector.metrics == list(PROFILING_METRICS)
    assert collector.config == {
        "hardware_buffer_size": HARDWARE_BUFFER_BYTES,
        "sampling_interval": 100_000_000,  # 0.1 s in nanoseconds
        "trigger_mode": TriggerMode.GPU_TIME_INTERVAL,
    }
    assert sampler.status() == ("ok", "")
    # Enabled and started once, not per sample.
    assert lib.count(0, "enable") == 1 and lib.count(0, "start") == 1


def test_negative_or_nan_interval_values_never_lower_the_totals() -> None:
    device = FakeDevice(decodes=[[rec(10, 10)], [rec(-5, math.nan), rec(math.inf, 1)]])
    sampler, _ = sampler_for(device)

    assert totals(sampler) == [(10.0, 10.0)]
    assert totals(sampler) == [(10.0, 11.0)]


def test_a_full_decode_is_followed_by_another_so_the_buffer_empties() -> None:
    # 64 is the smallest decode size; 150 records need three decodes in one call.
    device = FakeDevice(decodes=[[rec(1, 2)] * 150])
    sampler, lib = sampler_for(device, interval_s=10.0)

    assert totals(sampler) == [(150.0, 300.0)]
    assert lib.count(0, "decode") == 3


def test_falls_back_to_the_names_the_chip_accepts_and_leaves_the_rest_absent() -> None:
    device = FakeDevice(
        supported_metrics=frozenset({"sm__inst_executed.sum"}),
        decodes=[[{"sm__inst_executed.sum": 42.0}]],
    )
    sampler, lib = sampler_for(device)

    [sample] = sampler.sample_profiling()

    assert lib.collectors[0].metrics == ["sm__inst_executed.sum"]
    assert sample.sm_instructions_executed_total == 42.0
    assert sample.dram_read_bytes_total is None  # absent series, never a zero


def test_second_dram_name_is_used_when_the_first_is_not_offered() -> None:
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


# -- reasons ----------------------------------------------------------------------------------


def test_missing_cupti_module_is_cupti_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupti", None)  # makes `import cupti` fail
    sampler = CuptiPmSampler([GPU0])

    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling()

    assert caught.value.reason == "cupti_missing"
    assert "cupti-python" in caught.value.detail
    assert sampler.status()[0] == "cupti_missing"


def test_cupti_without_pm_sampling_is_cupti_missing() -> None:
    class OldCupti:  # cupti-python < 13.3 has only the bindings
        cupti = FakeCupti().cupti

    sampler = CuptiPmSampler([GPU0], lib=OldCupti())

    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling()
    assert caught.value.reason == "cupti_missing"
    assert "13.3" in caught.value.detail


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
    device = FakeDevice(errors={method: [exc]})
    sampler, lib = sampler_for(device)

    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling()

    assert caught.value.reason == "no_permission"
    assert sampler.status()[0] == "no_permission"
    # Permission does not change while the agent runs: no second attempt, same answer.
    with pytest.raises(SourceUnavailable, match="no_permission"):
        sampler.sample_profiling()
    assert lib.count(0, "enable") == 1


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
    device = FakeDevice(errors={method: [exc]}, decodes=[[rec(1, 1)]])
    sampler, lib = sampler_for(device, clock=clock)

    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling()
    assert caught.value.reason == "profiler_busy"
    assert lib.collectors[0].enabled is False  # a half-started collector is released

    # Not retried straight away...
    clock.now += cupti_pm.BUSY_RETRY_S / 2
    with pytest.raises(SourceUnavailable, match="profiler_busy"):
        sampler.sample_profiling()
    assert lib.count(0, "enable") == 1
    # ...but once the other profiler had time to finish, sampling starts.
    clock.now += cupti_pm.BUSY_RETRY_S
    assert totals(sampler) == [(1.0, 1.0)]
    assert sampler.status() == ("ok", "")


@pytest.mark.parametrize(
    "device",
    [
        FakeDevice(errors={"enable": [error("ERROR_NOT_SUPPORTED")]}),
        FakeDevice(errors={"enable": [error("ERROR_MIG_DEVICE_NOT_SUPPORTED")]}),
        # The chip's PM sampling offers none of the metrics (configure raises ValueError).
        FakeDevice(supported_metrics=frozenset({"gr__cycles_elapsed.max"})),
    ],
)
def test_pm_sampling_not_supported_is_unsupported_device(device: FakeDevice) -> None:
    sampler, lib = sampler_for(device)

    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling()

    assert caught.value.reason == "unsupported_device"
    assert all(not c.enabled for c in lib.collectors)
    assert lib.count(0, "start") == 0


@pytest.mark.parametrize(
    "exc",
    [
        NotSupportedError("CUDA driver is not found (libcuda.so.1: cannot open shared object)"),
        error("ERROR_INVALID_DEVICE"),
        None,  # the fake knows no device 0: enable() raises ValueError("Invalid device_index")
    ],
)
def test_no_driver_or_no_such_device_is_no_gpu(exc: BaseException | None) -> None:
    devices = {0: FakeDevice(errors={"enable": [exc]})} if exc is not None else {}
    sampler = CuptiPmSampler([GPU0], lib=FakeCupti(devices))

    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling()
    assert caught.value.reason == "no_gpu"


def test_nvperf_libraries_missing_is_cupti_missing() -> None:
    exc = RuntimeError("CUPTI could not load the nvperf* libraries required for profiling.")
    sampler, _ = sampler_for(FakeDevice(errors={"enable": [exc]}))

    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling()
    assert caught.value.reason == "cupti_missing"


def test_reason_is_logged_once_not_per_sample(caplog: pytest.LogCaptureFixture) -> None:
    device = FakeDevice(errors={"enable": [PermissionError("ERR_NVGPUCTRPERM")]})
    sampler, _ = sampler_for(device)

    with caplog.at_level(logging.INFO, logger="mrc_agent.agent.core.hw.cupti_pm"):
        for _ in range(5):
            with pytest.raises(SourceUnavailable):
                sampler.sample_profiling()

    messages = [r.getMessage() for r in caplog.records if "no_permission" in r.getMessage()]
    assert len(messages) == 1


# -- run time ---------------------------------------------------------------------------------


def test_failure_after_start_is_hardware_error_and_recovers_keeping_totals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    device = FakeDevice(
        decodes=[[rec(10, 100)], [rec(1, 1)], [rec(5, 50)]],
        errors={"decode": [None, error("ERROR_UNKNOWN"), MemoryError("Record overflow")]},
    )
    sampler, lib = sampler_for(device)

    assert totals(sampler) == [(10.0, 100.0)]
    with caplog.at_level(logging.WARNING, logger="mrc_agent.agent.core.hw.cupti_pm"):
        with pytest.raises(HardwareError) as first:
            sampler.sample_profiling()
        assert not isinstance(first.value, SourceUnavailable)
        assert "ERROR_UNKNOWN" in str(first.value)
        assert sampler.status()[0] == "hardware_error"
        # The broken collector was released; the next call starts a new one, which fails too.
        with pytest.raises(HardwareError, match="Record overflow"):
            sampler.sample_profiling()
    assert len(lib.collectors) == 2
    assert not lib.collectors[0].enabled

    # Third collector works; the totals carry on from before the failures.
    assert totals(sampler) == [(11.0, 101.0)]
    assert sampler.status() == ("ok", "")
    assert len(lib.collectors) == 3
    assert sum("hardware_error" in r.getMessage() for r in caplog.records) == 1


def test_unknown_error_while_starting_is_hardware_error_and_retried() -> None:
    device = FakeDevice(errors={"start": [error("ERROR_UNKNOWN")]}, decodes=[[rec(2, 3)]])
    sampler, lib = sampler_for(device)

    with pytest.raises(HardwareError) as caught:
        sampler.sample_profiling()
    assert not isinstance(caught.value, SourceUnavailable)
    assert totals(sampler) == [(2.0, 3.0)]
    assert lib.count(0, "enable") == 2


def test_one_unsupported_gpu_leaves_the_other_sampling() -> None:
    ok = FakeDevice(decodes=[[rec(8, 16)]])
    mig = FakeDevice(errors={"enable": [error("ERROR_MIG_DEVICE_NOT_SUPPORTED")]})
    sampler, _ = sampler_for(ok, mig)

    assert totals(sampler) == [(8.0, 16.0), (None, None)]
    assert sampler.status()[0] == "unsupported_device"


def test_close_stops_and_disables_sampling() -> None:
    sampler, lib = sampler_for(FakeDevice(decodes=[[rec(1, 1)]]), FakeDevice())
    sampler.sample_profiling()
    assert all(c.started for c in lib.collectors)

    sampler.close()
    sampler.close()  # idempotent

    assert all(not c.started and not c.enabled for c in lib.collectors)
    assert [lib.count(i, "stop") for i in (0, 1)] == [1, 1]
    assert [lib.count(i, "disable") for i in (0, 1)] == [1, 1]
    with pytest.raises(HardwareError, match="closed"):
        sampler.sample_profiling()


def test_nothing_touches_cupti_before_the_first_sample() -> None:
    lib = FakeCupti({0: FakeDevice()})
    sampler = CuptiPmSampler([GPU0, GPU1], lib=lib)

    assert lib.calls == []
    assert sampler.status()[0] == "not_started"


def test_module_import_does_not_import_cupti() -> None:
    code = "import sys, agent.core.hw.cupti_pm; print('cupti' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        CuptiPmSampler([GPU0], lib=FakeCupti(), interval_s=0)


def test_fake_matches_the_real_library_where_installed() -> None:
    """Guards the fake against drift on hosts that have cupti-python (skipped elsewhere)."""
    cupti = pytest.importorskip("cupti")
    import inspect

    from tests.fakes import fake_cupti

    real = cupti.cupti.Result
    assert {m.name: m.value for m in fake_cupti.Result} == {
        m.name: real[m.name].value for m in fake_cupti.Result
    }
    assert set(cupti_pm._REASON_BY_RESULT) <= set(real.__members__)
    for mode in fake_cupti.TriggerMode:
        assert cupti.pm_sampling.TriggerMode[mode.name].value == mode.value
    configure = inspect.signature(cupti.pm_sampling.Collector.configure).parameters
    assert {"metrics", "hardware_buffer_size", "sampling_interval", "trigger_mode"} <= set(
        configure
    )
    assert "max_samples" in inspect.signature(cupti.pm_sampling.Collector.decode).parameters
    assert str(cupti.cupti.cuptiError(26)) == str(fake_cupti.error("ERROR_HARDWARE_BUSY"))
