"""The CUPTI PM sampling source against the fake library and driver: backoff and recovery, GPUs
that fail apart from each other, what is logged and raised, and close."""


from __future__ import annotations

import contextlib
import logging
import math
import subprocess
import sys

import pytest

from mrc_agent.agent.core.hw import cupti_pm, cupti_reasons
from mrc_agent.agent.core.hw.base import (
    HardwareError,
    SourceUnavailable,
    ratio_of_percent,
)
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from mrc_agent.agent.core.hw.cupti_pm import (
    BACKOFF_MAX_S,
    BUSY_RETRY_S,
    CuptiPmSampler,
)
from mrc_agent.agent.tools.simgpu.cupti import (
    CUresult,
    FakeCupti,
    FakeDevice,
    NotSupportedError,
    error,
)
from tests.cupti_support import (
    DRAM,
    GPU0,
    GPU1,
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

    from mrc_agent.agent.tools.simgpu import cupti as fake_cupti

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
