"""When CUPTI PM sampling gives a GPU's collector (and primary context) back: a GPU whose metrics
never configure is released, in a cycle that leaves the other GPUs sampling whether or not CUPTI
counts profiler initialisations; and the CUPTI answers that never change are bounded reasons,
not failures retried forever."""

from __future__ import annotations

import pytest

from mrc_agent.agent.core.hw import cupti_reasons
from mrc_agent.agent.core.hw.base import GPUIdentity, HardwareError, SourceUnavailable
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from mrc_agent.agent.core.hw.cupti_pm import BACKOFF_MAX_S, PROFILING_METRICS, CuptiPmSampler
from mrc_agent.agent.tools.simgpu.cupti import FakeCupti, FakeDevice, Result, error, fake_uuid
from tests.support import Clock

SM, DRAM = PROFILING_METRICS


def never_configures(needs_primary_context: bool = False) -> FakeDevice:
    """A GPU that enables but whose chip accepts none of the metrics."""
    return FakeDevice(supported_metrics=frozenset(), needs_primary_context=needs_primary_context)


def rig(*devices: FakeDevice, counted: bool = True, clock: Clock | None = None
        ) -> tuple[CuptiPmSampler, FakeCupti]:
    lib = FakeCupti(dict(enumerate(devices)), counted=counted)
    gpus = [GPUIdentity(i, fake_uuid(i), "NVIDIA H200") for i in range(len(devices))]
    return CuptiPmSampler(gpus, lib=lib, cuda=CudaDriver(lib.driver),
                          clock=clock or Clock()), lib


def reason(sampler: CuptiPmSampler) -> str:
    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling()
    return caught.value.reason


# -- N9: a GPU whose metrics never configure ----------------------------------------------------


def test_a_lone_gpu_whose_metrics_never_configure_gives_back_its_collector_and_context() -> None:
    sampler, lib = rig(never_configures(needs_primary_context=True))

    assert reason(sampler) == "unsupported_device"

    # Released at once, not at close: the collector is disabled, the profiler deinitialised
    # and the primary context (device memory) given back.
    assert lib.enabled() == [] and lib.profiler_refs == 0
    assert lib.driver.retained == {}
    assert reason(sampler) == "unsupported_device"  # and not tried again
    assert lib.total("enable") == 2  # the first try and its primary-context retry


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "uncounted"])
def test_releasing_one_gpu_leaves_the_other_sampling_however_cupti_counts(counted: bool) -> None:
    good = FakeDevice(decodes=[[{SM: 1.0, DRAM: 10.0}], [{SM: 2.0, DRAM: 20.0}],
                               [{SM: 4.0, DRAM: 40.0}]])
    sampler, lib = rig(good, never_configures(), counted=counted)

    first = sampler.sample_profiling()
    second = sampler.sample_profiling()

    assert lib.enabled() == [0]  # GPU 1's collector is gone, GPU 0's was enabled again
    assert lib.collectors[-1].device_index == 0 and lib.collectors[-1].started
    # Nothing GPU 0 counted is lost: the decode before the release kept the first interval.
    assert first[0].sm_instructions_executed_total == 3.0
    assert second[0].sm_instructions_executed_total == 7.0
    assert second[0].dram_read_bytes_total == 70.0
    assert [s.sm_instructions_executed_total for s in second[1:]] == [None]
    assert sampler.status()[0] == "unsupported_device"


def test_a_release_stops_every_gpu_before_any_disable_and_disables_all_before_enabling() -> None:
    sampler, lib = rig(FakeDevice(decodes=[[{SM: 1.0, DRAM: 1.0}]] * 3), never_configures())

    sampler.sample_profiling()

    steps = [(i, m) for i, m in lib.calls if m in ("stop", "disable", "enable")]
    # The first pass enables both; the release then stops GPU 0, disables both, enables 0.
    assert steps == [(0, "enable"), (1, "enable"), (0, "stop"), (0, "disable"),
                     (1, "disable"), (0, "enable")]


def test_a_gpu_waiting_out_a_backoff_keeps_waiting_through_a_release() -> None:
    clock = Clock()
    flaky = FakeDevice(errors={"start": [error("ERROR_UNKNOWN")]})
    sampler, lib = rig(flaky, never_configures(), clock=clock)

    with pytest.raises(HardwareError):
        sampler.sample_profiling()  # GPU 0's start failed: retried after 1 s

    assert lib.enabled() == []  # released with GPU 1; re-enabled when its backoff ends
    assert lib.count(0, "start") == 1
    clock.now += 1.0
    sampler.sample_profiling()
    assert lib.enabled() == [0] and lib.count(0, "start") == 2


# -- F10: answers that do not change ------------------------------------------------------------


@pytest.mark.parametrize(("result", "expected"), [
    ("ERROR_NOT_COMPATIBLE", "cupti_incompatible"),  # CUPTI newer than the driver
    ("ERROR_NOT_INITIALIZED", "cupti_not_initialized"),  # even after cuInit and a context
])
def test_cupti_answers_that_never_change_are_reasons_not_retried(
    result: str, expected: str,
) -> None:
    clock = Clock()
    sampler, lib = rig(FakeDevice(errors={"enable": [error(result)] * 9}), clock=clock)

    assert reason(sampler) == expected
    tries = lib.total("enable")
    clock.now += 10 * BACKOFF_MAX_S
    assert reason(sampler) == expected
    assert lib.total("enable") == tries  # never asked again
    assert sampler.status()[0] == expected and result in sampler.status()[1]


@pytest.mark.parametrize("method", ["enable", "start"])
@pytest.mark.parametrize("exc", [
    TypeError("Collector.enable() takes 1 positional argument but 2 were given"),
    AttributeError("module 'cupti.pm_sampling' has no attribute 'TriggerMode'"),
])
def test_a_binding_signature_mismatch_is_said_once_and_not_retried(
    method: str, exc: BaseException, caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    sampler, lib = rig(FakeDevice(errors={method: [exc] * 9}), clock=clock)

    with caplog.at_level("WARNING"):
        for _ in range(4):
            assert reason(sampler) == "binding_mismatch"
            clock.now += 10 * BACKOFF_MAX_S
    assert lib.count(0, method) == 1  # not every pass, not after a backoff either
    assert lib.enabled() == []  # a collector it will never use is given back
    assert sampler.status() == ("binding_mismatch", f"{type(exc).__name__}: {exc}")
    said = [r for r in caplog.records if "binding_mismatch" in r.getMessage()]
    assert len(said) == 1


def test_a_decode_signature_mismatch_after_a_good_start_stops_for_good() -> None:
    clock = Clock()
    rows = [[{SM: 10.0, DRAM: 64.0}]] * 3
    bad = TypeError("decode() got an unexpected keyword argument 'max_samples'")
    sampler, lib = rig(FakeDevice(decodes=list(rows), errors={"decode": [None, bad, bad]}),
                       clock=clock)

    assert sampler.sample_profiling()[0].sm_instructions_executed_total == 10.0
    with pytest.raises(HardwareError):
        sampler.sample_profiling()  # the pass it failed in
    for _ in range(3):
        clock.now += 10 * BACKOFF_MAX_S
        assert reason(sampler) == "binding_mismatch"
    assert lib.count(0, "decode") == 2 and lib.count(0, "start") == 1
    assert lib.enabled() == []


def test_every_reason_is_bounded_and_every_result_name_is_cuptis() -> None:
    assert set(cupti_reasons.REASON_BY_RESULT.values()) <= cupti_reasons.REASON_CODES
    assert cupti_reasons.REASON_BY_RESULT["ERROR_NOT_INITIALIZED"] != "no_gpu"
    assert {m.name for m in Result} >= {"ERROR_NOT_COMPATIBLE", "ERROR_NOT_INITIALIZED"}
    cupti = pytest.importorskip("cupti")
    assert set(cupti_reasons.REASON_BY_RESULT) <= set(cupti.cupti.Result.__members__)
