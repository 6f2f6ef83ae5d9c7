"""Which GPUs CUPTI PM sampling holds: only the pod's (the attribution decision, followed as it
changes), none of several while that is undecided unless opted in, and each by the CUDA device
whose UUID is its own, never by assuming CUDA's ordinal is NVML's index."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import pytest

from mrc_agent.agent.core.attribution import NVIDIA_VISIBLE_DEVICES, TargetView
from mrc_agent.agent.core.collectors.base import PassView, TargetState
from mrc_agent.agent.core.collectors.profiling import (
    ProfilingCollector,
    ProfilingStatus,
    compute_memory_source,
)
from mrc_agent.agent.core.hw.base import (
    DeviceSample,
    GPUIdentity,
    ProfilingScope,
    ScopedProfilingSource,
    ScopeOf,
    SourceUnavailable,
)
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from mrc_agent.agent.core.hw.cupti_pm import PROFILING_METRICS, CuptiPmSampler
from mrc_agent.agent.core.hw.profiling import LazyProfiling
from mrc_agent.agent.tools.simgpu.cupti import FakeCupti, FakeDevice, fake_uuid
from tests.support import pass_view, run_pass

SM, DRAM = PROFILING_METRICS
LOGGER = "mrc_agent.agent.core.hw.cupti_pm"


def gpus(count: int) -> list[GPUIdentity]:
    """NVML's view of ``count`` GPUs, each the fake CUDA device of the same number."""
    return [GPUIdentity(i, fake_uuid(i), "NVIDIA H200") for i in range(count)]


def busy(count: int = 4) -> list[list[dict[str, float]]]:
    return [[{SM: 1.0, DRAM: 2.0}] for _ in range(count)]


def rig(count: int, profile_undecided: bool = False) -> tuple[CuptiPmSampler, FakeCupti]:
    lib = FakeCupti({i: FakeDevice(decodes=busy()) for i in range(count)})
    return CuptiPmSampler(gpus(count), lib=lib, cuda=CudaDriver(lib.driver),
                          profile_undecided=profile_undecided), lib


def scope(*watched: GPUIdentity, undecided: bool = False) -> ScopeOf:
    def scope_of(_gpus: Sequence[GPUIdentity]) -> ProfilingScope:
        return ProfilingScope(frozenset(watched), undecided)
    return scope_of


def pod_pass(collector: ProfilingCollector, environ: dict[str, str] | None
             ) -> tuple[PassView, list[str]]:
    """One pass of the collector for a target with ``environ`` (None: no target at all); the
    view after it and the GPU labels of the series."""
    view = pass_view() if environ is None else pass_view(
        targets=(10,),
        processes={10: TargetState(10, "python3", view=TargetView(10, environ=environ))})
    view, samples = run_pass(view, [collector])
    return view, sorted({labels[0] for _, labels, _ in samples})


# -- only the pod's GPUs ------------------------------------------------------------------------


def test_the_profiling_collector_enables_only_the_targets_gpu() -> None:
    sampler, lib = rig(3)
    collector = ProfilingCollector(sampler)

    view, shown = pod_pass(collector, {NVIDIA_VISIBLE_DEVICES: fake_uuid(1)})

    assert shown == ["1"] and view.get(ProfilingStatus) == ProfilingStatus("ok", "")
    # The neighbours' performance monitors are never touched.
    assert [lib.count(i, "enable") for i in range(3)] == [0, 1, 0]
    assert sampler.status() == ("ok", "")


def test_a_gpu_that_leaves_is_released_and_one_that_joins_is_started() -> None:
    devices = gpus(2)
    lib = FakeCupti({0: FakeDevice(needs_primary_context=True, decodes=busy()),
                     1: FakeDevice(decodes=busy())})
    sampler = CuptiPmSampler(devices, lib=lib, cuda=CudaDriver(lib.driver))

    [first] = sampler.sample_profiling_for(scope(devices[0]))
    assert first.gpu == devices[0] and first.sm_instructions_executed_total == 1.0
    assert lib.enabled() == [0] and lib.driver.retained == {0: 1}

    [second] = sampler.sample_profiling_for(scope(devices[1]))

    assert second.gpu == devices[1] and second.sm_instructions_executed_total == 1.0
    assert lib.enabled() == [1]  # GPU 0 disabled, GPU 1 enabled and started
    assert lib.driver.retained == {}  # GPU 0's primary context given back
    assert lib.profiler_refs == 1
    [back] = sampler.sample_profiling_for(scope(devices[0], devices[1]))[:1]
    # A GPU that comes back carries on from its old total, which kept the intervals decoded
    # as it was released: one per pass, three in all.
    assert back.gpu == devices[0] and back.sm_instructions_executed_total == 3.0


def test_a_scope_with_no_gpu_releases_everything_and_says_no_gpu() -> None:
    sampler, lib = rig(2)
    sampler.sample_profiling_for(scope(*gpus(2)))

    with pytest.raises(SourceUnavailable) as caught:
        sampler.sample_profiling_for(scope())

    assert caught.value.reason == "no_gpu" and sampler.status()[0] == "no_gpu"
    assert lib.enabled() == [] and lib.profiler_refs == 0


# -- undecided attribution ----------------------------------------------------------------------


def test_undecided_attribution_over_several_gpus_profiles_none_and_says_why() -> None:
    sampler, lib = rig(2)
    collector = ProfilingCollector(sampler)

    with pytest.raises(SourceUnavailable) as caught:
        pod_pass(collector, None)  # no target: nobody says which GPUs are the pod's

    assert caught.value.reason == "attribution_unknown"
    assert "profile_unattributed" in caught.value.detail
    assert lib.total("enable") == 0 and lib.driver.calls == []
    assert sampler.status()[0] == "attribution_unknown"
    # The pass says so where the compute-to-memory signal is explained.
    update = collector.update(pass_view())
    assert isinstance(update.error, SourceUnavailable)
    [(_, labels, _)] = compute_memory_source(pass_view().with_outputs(update.outputs))
    assert labels[1] == "attribution_unknown"


def test_undecided_attribution_over_one_gpu_profiles_it() -> None:
    sampler, lib = rig(1)

    _, shown = pod_pass(ProfilingCollector(sampler), None)

    assert shown == ["0"] and lib.enabled() == [0]


def test_the_opt_in_profiles_every_gpu_while_undecided() -> None:
    sampler, lib = rig(2, profile_undecided=True)

    _, shown = pod_pass(ProfilingCollector(sampler), None)

    assert shown == ["0", "1"] and lib.enabled() == [0, 1]


def test_profiling_starts_on_the_pods_gpu_once_the_attribution_is_decided() -> None:
    sampler, lib = rig(2)
    collector = ProfilingCollector(sampler)
    with pytest.raises(SourceUnavailable):
        pod_pass(collector, {})  # a target whose environment names no GPU: undecided

    _, shown = pod_pass(collector, {NVIDIA_VISIBLE_DEVICES: fake_uuid(0)})

    assert shown == ["0"] and lib.enabled() == [0]
    assert collector.status == ("ok", "")


class _Nvml:
    def __init__(self, devices: list[GPUIdentity]) -> None:
        self.devices = devices

    def sample_devices(self) -> list[DeviceSample]:
        return [DeviceSample(gpu=g) for g in self.devices]


@pytest.mark.parametrize("opt_in", [False, True])
def test_the_lazy_source_is_scoped_and_carries_the_opt_in(
    monkeypatch: pytest.MonkeyPatch, opt_in: bool,
) -> None:
    lib = FakeCupti({i: FakeDevice(decodes=busy()) for i in range(2)})
    monkeypatch.setitem(sys.modules, "cupti", lib)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", lib.driver)
    lazy = LazyProfiling(_Nvml(gpus(2)), profile_undecided=opt_in)
    assert isinstance(lazy, ScopedProfilingSource)

    try:
        got = [s.gpu.index for s in lazy.sample_profiling_for(scope(*gpus(2), undecided=True))]
    except SourceUnavailable as exc:
        got = [exc.reason]  # type: ignore[list-item]
    finally:
        lazy.close()

    assert got == ([0, 1] if opt_in else ["attribution_unknown"])


def test_make_sources_gives_the_lazy_source_the_setting() -> None:
    from mrc_agent.agent.core.config import AgentConfig
    from mrc_agent.agent.core.wiring import make_sources
    from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu

    for opt_in in (False, True):
        cfg = AgentConfig(gpu_backend="nvml", profile_unattributed=opt_in)
        sources = make_sources(cfg, nvml_lib=FakeNvml([gpu(index=0)]))
        try:
            assert isinstance(sources.profiling, LazyProfiling)
            assert sources.profiling._profile_undecided is opt_in
        finally:
            sources.close()


# -- CUDA ordinals by UUID ----------------------------------------------------------------------


def test_a_gpu_renumbered_by_cuda_visible_devices_is_profiled_as_its_cuda_device() -> None:
    # CUDA_VISIBLE_DEVICES=3: the node's GPU 3 is this process's CUDA device 0.
    third = GPUIdentity(3, fake_uuid(3), "NVIDIA H200")
    lib = FakeCupti({0: FakeDevice(uuid=third.uuid, decodes=busy())})
    sampler = CuptiPmSampler([third], lib=lib, cuda=CudaDriver(lib.driver))

    [sample] = sampler.sample_profiling()

    assert sample.gpu == third and sample.sm_instructions_executed_total == 1.0
    assert [c.device_index for c in lib.collectors] == [0]


def test_counters_carry_the_uuid_of_the_gpu_that_counted_them_whatever_cuda_order() -> None:
    # CUDA numbers the two GPUs the other way round from NVML (fastest first, say).
    first, second = gpus(2)
    lib = FakeCupti({0: FakeDevice(uuid=second.uuid, decodes=[[{SM: 200.0, DRAM: 2.0}]]),
                     1: FakeDevice(uuid=first.uuid, decodes=[[{SM: 100.0, DRAM: 1.0}]])})
    sampler = CuptiPmSampler([first, second], lib=lib, cuda=CudaDriver(lib.driver))

    by_uuid = {s.gpu.uuid: s.sm_instructions_executed_total for s in sampler.sample_profiling()}

    assert by_uuid == {first.uuid: 100.0, second.uuid: 200.0}


@pytest.mark.parametrize("cuda_uuid", [fake_uuid(7), "MIG-8c7d1f2e-3a4b-5c6d-7e8f-90a1b2c3d4e5"],
                         ids=["hidden", "mig_instance"])
def test_a_gpu_cuda_does_not_see_is_not_profiled_and_said_once(
    caplog: pytest.LogCaptureFixture, cuda_uuid: str,
) -> None:
    seen, unseen = gpus(2)
    lib = FakeCupti({0: FakeDevice(uuid=seen.uuid, decodes=busy()),
                     1: FakeDevice(uuid=cuda_uuid, decodes=busy())})
    sampler = CuptiPmSampler([seen, unseen], lib=lib, cuda=CudaDriver(lib.driver))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            samples = sampler.sample_profiling()

    assert [s.sm_instructions_executed_total for s in samples] == [3.0, None]
    assert [c.device_index for c in lib.collectors] == [0]  # the other CUDA device untouched
    said = [r.getMessage() for r in caplog.records if "no_cuda_device" in r.getMessage()]
    assert len(said) == 1 and unseen.uuid in said[0]
    assert sampler.status()[0] == "no_cuda_device"


def test_the_uuids_are_read_once_per_process() -> None:
    sampler, lib = rig(2)

    for _ in range(3):
        sampler.sample_profiling()

    assert lib.driver.calls.count("cuDeviceGetCount") == 1
    assert lib.driver.calls.count("cuDeviceGetUuid") == 2


def test_the_opt_in_setting_reads_yes_and_no_and_refuses_anything_else() -> None:
    from mrc_agent.agent.core.config import ConfigError, load

    assert load({}, env={"MRC_AGENT_PROFILE_UNATTRIBUTED": "yes"}).profile_unattributed is True
    assert load({"profile_unattributed": "false"}, env={}).profile_unattributed is False
    assert load({}, env={}).profile_unattributed is False
    with pytest.raises(ConfigError, match="'profile_unattributed': 'maybe' is not true or false"):
        load({}, env={"MRC_AGENT_PROFILE_UNATTRIBUTED": "maybe"})
