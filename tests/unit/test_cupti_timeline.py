"""The hardware GPU-activity timeline: PM sampling's activity metric, chosen from the chip's set,
decoded every 20 ms with its stamps mapped onto the agent's monotonic clock, and used by the
derived collector for idle windows, busy time and starvation in place of NVML's samples."""

from __future__ import annotations

import logging

import pytest

from mrc_agent.agent.core.collectors.base import DerivedThresholds, TargetState, Update
from mrc_agent.agent.core.collectors.derived import IDLE_WINDOW, DerivedCollector, Starvation
from mrc_agent.agent.core.collectors.profiling import HardwareActivity, ProfilingCollector
from mrc_agent.agent.core.collectors.stacks import FUNCTION_SECONDS, StacksCollector
from mrc_agent.agent.core.hw.base import GPUIdentity, ProfilingSample
from mrc_agent.agent.core.hw.cuda_driver import CudaDriver
from mrc_agent.agent.core.hw.cupti_metrics import GPU_ACTIVE_METRICS
from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler
from mrc_agent.agent.core.hw.cupti_timeline import (
    MAX_PENDING_POINTS,
    ActivityTimeline,
    decode_rows,
)
from mrc_agent.agent.core.sample import HistogramValue
from mrc_agent.agent.core.stacks import StackSample
from mrc_agent.agent.tools.simgpu.cupti import ClockedCupti, CounterData, Sample, fake_uuid
from tests.support import GPU0, GPU1, Clock, FakeSampler, pass_view

ACTIVE = GPU_ACTIVE_METRICS[0]
LOGGER = "mrc_agent.agent.core.hw.cupti_timeline"
#: The agent's monotonic clock and a wall clock 1.7e9 s ahead of it.
WALL_OFFSET = 1.7e9


def _timeline(mono: Clock) -> ActivityTimeline:
    return ActivityTimeline("GPU 0", mono, {"realtime": lambda: mono() + WALL_OFFSET,
                                             "monotonic": mono})


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


# -- the stamps ---------------------------------------------------------------------------------


def test_stamps_on_the_wall_clock_are_dated_on_the_monotonic_clock() -> None:
    mono = Clock(500.0)
    timeline = _timeline(mono)
    timeline.add([(_ns(WALL_OFFSET + 499.96), 100.0), (_ns(WALL_OFFSET + 499.98), 25.0)])
    assert timeline.stamp_clock == "realtime"
    points = timeline.take()
    assert [t for t, _ in points] == pytest.approx([499.96, 499.98], abs=2e-6)
    assert [u for _, u in points] == [1.0, 0.25]
    assert timeline.take() == ()  # taken once


def test_stamps_on_the_monotonic_clock_keep_their_time() -> None:
    mono = Clock(80.0)
    timeline = _timeline(mono)
    timeline.add([(_ns(79.5), 0.0)])
    assert timeline.stamp_clock == "monotonic"
    assert timeline.take() == (pytest.approx((79.5, 0.0), abs=2e-6),)


def test_stamps_on_no_known_clock_give_no_points_and_say_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    mono = Clock(80.0)
    timeline = _timeline(mono)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        timeline.add([(_ns(1e5), 50.0)])  # ahead of the monotonic clock, far behind the wall
        timeline.add([(_ns(1e5 + 0.02), 50.0)])
    assert timeline.stamp_clock == "unknown"
    assert timeline.take() == ()
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 0: PM-sampling stamps fit no known clock; its hardware activity timeline is "
        "not used"]


def test_a_stamp_seen_before_or_missing_is_not_a_new_point() -> None:
    mono = Clock(10.0)
    timeline = _timeline(mono)
    timeline.add([(_ns(9.90), 10.0), (_ns(9.92), 20.0)])
    timeline.add([(_ns(9.92), 20.0), (None, 30.0), (_ns(9.94), 40.0)])
    assert [u for _, u in timeline.take()] == [0.1, 0.2, 0.4]


def test_a_value_that_is_no_percentage_is_left_out_and_others_are_clamped() -> None:
    mono = Clock(10.0)
    timeline = _timeline(mono)
    timeline.add([(_ns(9.90), float("nan")), (_ns(9.92), 130.0), (_ns(9.94), -5.0),
                  (_ns(9.96), None)])
    assert [u for _, u in timeline.take()] == [1.0, 0.0]


def test_points_never_taken_are_bounded_newest_kept() -> None:
    mono = Clock(1000.0)
    timeline = _timeline(mono)
    step = 0.001
    timeline.add([(_ns(900.0 + k * step), 50.0) for k in range(MAX_PENDING_POINTS + 5)])
    points = timeline.take()
    assert len(points) == MAX_PENDING_POINTS
    assert points[0][0] == pytest.approx(900.0 + 5 * step, abs=2e-6)


def test_decoded_rows_follow_the_configured_order_and_carry_the_end_stamp() -> None:
    data = CounterData(["b", "a"], [Sample(5, 9, [2.0, 1.0]), Sample(9, 0, [4.0, 3.0])])
    assert decode_rows(data, ["a", "b", "c"]) == [([1.0, 2.0, None], 9), ([3.0, 4.0, None], None)]
    assert decode_rows(data, [None, "b"]) == [([None, 2.0], 9), ([None, 4.0], None)]


# -- the sampler ----------------------------------------------------------------------------


def _busy_gpu0(index: int, t: float) -> float:
    """Cumulative busy seconds: GPU 0 busy except over [100.30, 100.36) and [101.0, 101.2);
    GPU 1 always busy."""
    idle = 0.0
    if index == 0:
        for start, end in ((100.30, 100.36), (101.0, 101.2)):
            idle += min(max(t - start, 0.0), end - start)
    return t - idle


def _sampler(clock: Clock) -> tuple[CuptiPmSampler, ClockedCupti]:
    gpus = [GPUIdentity(i, fake_uuid(i), "NVIDIA H200") for i in range(2)]
    lib = ClockedCupti([g.uuid for g in gpus], clock, lambda i, t: 1e9 * t,
                       lambda i, t: 1e8 * t, busy_seconds=_busy_gpu0)
    sampler = CuptiPmSampler(gpus, lib=lib, interval_s=0.02, clock=clock,
                             cuda=CudaDriver(lib.driver), sample_clocks={"monotonic": clock})
    return sampler, lib


def test_the_sampler_configures_the_activity_metric_and_hands_out_its_timeline() -> None:
    clock = Clock(100.0)
    sampler, lib = _sampler(clock)
    first = sampler.sample_profiling()  # starts sampling
    assert [s.activity_metric for s in first] == [ACTIVE, ACTIVE]
    assert [s.activity_clock for s in first] == [None, None]  # no stamp yet
    assert ACTIVE in (lib.collectors[0].metrics or [])
    clock.t = 100.5
    gpu0, gpu1 = sampler.sample_profiling()
    assert len(gpu0.activity_points) == 25  # 0.5 s of 20 ms intervals
    idle = [t for t, u in gpu0.activity_points if u < 0.5]
    assert idle == pytest.approx([100.32, 100.34, 100.36], abs=1e-6)  # each interval's end
    partial = {round(t, 2): u for t, u in gpu0.activity_points if 1e-6 < u < 1.0 - 1e-6}
    assert partial == {}  # the window starts and ends on interval bounds
    assert all(u == pytest.approx(1.0) for _, u in gpu1.activity_points)
    assert gpu0.sm_instructions_executed_total == pytest.approx(0.5e9)  # counters unchanged
    assert gpu0.activity_clock == gpu1.activity_clock == "monotonic"


def test_a_chip_without_an_activity_metric_has_no_timeline() -> None:
    clock = Clock(100.0)
    sets = {"cupti": "x", "chip": "gh100", "set": "Compute_Triage",
            "metrics": ["sm__inst_executed_realtime", "dramc__sectors_op_read"],
            "user_metrics": []}
    lib = ClockedCupti([fake_uuid(0)], clock, lambda i, t: t, lambda i, t: t, sets=sets,
                       busy_seconds=_busy_gpu0)
    sampler = CuptiPmSampler([GPUIdentity(0, fake_uuid(0), "NVIDIA H200")], lib=lib,
                             interval_s=0.02, clock=clock,
                             cuda=CudaDriver(lib.driver), sample_clocks={"monotonic": clock})
    sampler.sample_profiling()
    clock.t = 100.2
    (sample,) = sampler.sample_profiling()
    assert (sample.activity_metric, sample.activity_points, sample.activity_clock) == (
        None, (), None)
    assert sample.sm_instructions_executed_total is not None


def test_the_profiling_collector_publishes_the_timeline_of_the_gpus_it_watches() -> None:
    clock = Clock(100.0)
    sampler, _ = _sampler(clock)
    collector = ProfilingCollector(sampler, gpus="all")
    collector.update(pass_view(100.0))
    clock.t = 100.1
    update = collector.update(pass_view(100.1))
    activity = next(o for o in update.outputs if isinstance(o, HardwareActivity))
    assert set(activity.points) == {GPUIdentity(0, fake_uuid(0), "NVIDIA H200"),
                                    GPUIdentity(1, fake_uuid(1), "NVIDIA H200")}
    assert all(len(p) == 5 for p in activity.points.values())
    info = [labels for name, labels, _ in update.samples
            if name == "mrc_gpu_profiling_metrics_info"]
    # The activity metric, then the clock its stamps were found on.
    assert info and all(labels[-2:] == (ACTIVE, "monotonic") for labels in info)


# -- the derived collector ------------------------------------------------------------------


def _hw(points: dict[GPUIdentity, list[tuple[float, float]]]) -> HardwareActivity:
    return HardwareActivity({g: tuple(p) for g, p in points.items()})


def _histogram(update: Update, gpu: GPUIdentity) -> HistogramValue:
    (h,) = [v for name, labels, v in update.samples
            if name == IDLE_WINDOW.name and labels == gpu.labels]
    assert isinstance(h, HistogramValue)
    return h


def _every_20ms(start: float, end: float, idle: tuple[float, float]) -> list[tuple[float, float]]:
    n = round((end - start) / 0.02)
    out = []
    for k in range(1, n + 1):
        t = start + k * 0.02
        out.append((t, 0.0 if idle[0] < t <= idle[1] + 1e-9 else 1.0))
    return out


def test_a_50_ms_idle_window_on_the_hardware_timeline_is_measured() -> None:
    collector = DerivedCollector(DerivedThresholds(idle_util=0.05))
    points = _every_20ms(10.0, 11.0, (10.40, 10.46))  # idle points at 10.42, 10.44, 10.46
    # NVML's 1/6 s samples saw no idle moment; they are not used for this GPU.
    nvml = [(10.0 + k / 6, 0.9) for k in range(1, 7)]
    update = collector.update(pass_view(11.0, util={GPU0: 0.9}, points={GPU0: nvml},
                                        outputs=(_hw({GPU0: points}),)))
    h = _histogram(update, GPU0)
    assert h.total == 1
    assert h.sum == pytest.approx(0.06)  # first idle point to first busy point after it
    busy = next(v for name, labels, v in update.samples
                if name == "mrc_gpu_busy_seconds_total" and labels == GPU0.labels)
    assert busy == pytest.approx(0.98 - 0.06)  # 49 spans of 20 ms after the first point, 3 idle


def test_a_gpu_without_a_hardware_timeline_keeps_nvmls_points() -> None:
    collector = DerivedCollector(DerivedThresholds(idle_util=0.05))
    nvml = [(10.0, 0.9), (10.2, 0.0), (10.6, 0.0), (10.8, 0.9)]
    update = collector.update(pass_view(11.0, util={GPU0: 0.9, GPU1: 0.9},
                                        points={GPU0: nvml, GPU1: nvml},
                                        outputs=(_hw({GPU0: _every_20ms(10.0, 11.0,
                                                                        (10.5, 10.5))}),)))
    assert _histogram(update, GPU1).sum == pytest.approx(0.6)  # NVML's window
    assert _histogram(update, GPU0).total == 0  # the hardware saw no idle point


def test_starvation_reads_the_hardware_timelines_last_sixth_of_a_second() -> None:
    collector = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    # Busy through the pass until its last 180 ms, which are idle; NVML's gauge reads busy.
    points = _every_20ms(10.0, 11.0, (10.82, 11.0))
    update = collector.update(pass_view(
        11.0, (7,), processes={7: TargetState(7, "python", 0.5, 0.97)}, util={GPU0: 0.9},
        points={GPU0: []}, outputs=(_hw({GPU0: points}),)))
    starved = {name: v for name, labels, v in update.samples if labels == ("7", "python")}
    assert starved["mrc_gpu_starved"] == 1.0
    # One busy point of the nine inside the last 1/6 s: a mean of 1/9, at or below 0.2.
    points = _every_20ms(10.0, 11.0, (10.82, 10.98))
    update = collector.update(pass_view(
        12.0, (7,), processes={7: TargetState(7, "python", 0.5, 0.97)}, util={GPU0: 0.0},
        points={GPU0: []}, outputs=(_hw({GPU0: [(t + 1.0, u) for t, u in points]}),)))
    starved = {name: v for name, labels, v in update.samples if labels == ("7", "python")}
    assert starved["mrc_gpu_starved"] == 1.0
    # Two busy points of the nine: a mean of 2/9, above 0.2; NVML's idle gauge is not used.
    points = _every_20ms(10.0, 11.0, (10.82, 10.96))
    update = collector.update(pass_view(
        13.0, (7,), processes={7: TargetState(7, "python", 0.5, 0.97)}, util={GPU0: 0.0},
        points={GPU0: []}, outputs=(_hw({GPU0: [(t + 2.0, u) for t, u in points]}),)))
    starved = {name: v for name, labels, v in update.samples if labels == ("7", "python")}
    assert starved["mrc_gpu_starved"] == 0.0


def test_a_pass_without_hardware_points_falls_back_on_the_gauge_for_starvation() -> None:
    collector = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    update = collector.update(pass_view(
        11.0, (7,), processes={7: TargetState(7, "python", 0.5, 0.97)}, util={GPU0: 0.05},
        points={GPU0: []}, outputs=(_hw({GPU0: []}),)))
    starved = {name: v for name, labels, v in update.samples if labels == ("7", "python")}
    assert starved["mrc_gpu_starved"] == 1.0


def test_the_stacks_join_sees_a_60_ms_wait_on_the_hardware_timeline() -> None:
    """A 10 ms stack sample every 10 ms: the six inside the hardware's idle stretch
    (10.40, 10.46] land in "starved"; NVML's samples, busy throughout, are not used."""
    samples = [StackSample(10.0 + k / 100, 0.01, "T0:1", "app:resize") for k in range(1, 101)]
    c = StacksCollector(lambda pid: FakeSampler(samples), idle_util=0.05, clock=lambda: 0.0)
    view = pass_view(11.0, (7,), processes={7: TargetState(7, "python", 0.5, 0.98)},
                     points={GPU0: [(10.0 + k / 6, 0.9) for k in range(1, 7)]},
                     util={GPU0: 0.9},
                     outputs=[Starvation({7: True}),
                              _hw({GPU0: _every_20ms(10.0, 11.0, (10.40, 10.46))})])
    got = {labels[3]: v for name, labels, v in c.update(view).samples
           if name == FUNCTION_SECONDS.name}
    assert got == {"busy": pytest.approx(0.94), "starved": pytest.approx(0.06)}


def test_a_profiling_sample_without_the_metric_publishes_no_timeline() -> None:
    sample = ProfilingSample(gpu=GPU0, sm_instructions_executed_total=1.0)
    assert (sample.activity_metric, sample.activity_points) == (None, ())
