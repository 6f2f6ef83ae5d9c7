"""``mrc-agent selfcheck``'s hardware activity timeline row (``cupti.activity_idle_gaps``): the
idle windows the agent's ``IdleTracker`` finds in CUPTI's 20 ms GPU-activity points against
idle gaps the workload made on purpose.

The phase runs on the dry run's pieces (``DryModel``, ``DryWorkload``, ``DryCupti``, the agent's
``CuptiPmSampler`` behind the same JSON ``LocalSampler``) on a simulated clock: the workload's
sleeps move the clock and poll the readers as the real run's polling thread would, so five
rounds of gaps take no real time. A device that stamps its samples 100 ms off, or whose
activity never reads idle, must FAIL; one without the metric or without profiling SKIPs.
"""

from __future__ import annotations

from typing import Any

import pytest

from mrc_agent.agent.core.hw.base import DeviceSample, GPUIdentity
from mrc_agent.agent.core.hw.cupti_pm import CuptiPmSampler
from mrc_agent.agent.core.wiring import PROFILING_INTERVAL_S as AGENT_INTERVAL_S
from mrc_agent.agent.tools.selfcheck import command as selfcheck
from mrc_agent.agent.tools.selfcheck import compare as cmp
from mrc_agent.agent.tools.selfcheck import phases as ph
from mrc_agent.agent.tools.selfcheck import timeline
from mrc_agent.agent.tools.selfcheck.dry import DryFaults, DryModel, DryWorkload
from mrc_agent.agent.tools.selfcheck.dry_device import DryCupti
from mrc_agent.agent.tools.selfcheck.sampler import LocalSampler, SamplerServer
from mrc_agent.agent.tools.selfcheck.workload import GAP_PATTERN_S, gap_sequence
from tests.support import Clock

INTERVAL = 0.02
POLL_S = 0.1


class _NoDevices:
    def sample_devices(self) -> list[DeviceSample]:
        return []


def _gap_phase(faults: DryFaults | None = None, sets: dict[str, Any] | None = None,
               rounds: int = 5, busy_s: float = 0.3) -> tuple[ph.Phase, ph.AgentReaders, str]:
    """The selfcheck's idle-gap phase on the dry GPU, on a simulated clock, polled every
    0.1 s of it; the phase as :func:`phases.observe` would have recorded it."""
    clock = Clock(1000.0)
    model = DryModel(gpus=1, faults=faults or DryFaults(), clock=clock,
                     wall_clock=lambda: clock() + 1.7e9)
    gpu = GPUIdentity(0, model.uuid(0), model.name)
    lib = DryCupti(model, sets)
    sampler = CuptiPmSampler([gpu], lib=lib, interval_s=INTERVAL, clock=clock,
                             sample_clocks={"monotonic": clock,
                                            "realtime": lambda: clock() + 1.7e9})
    readers = ph.AgentReaders(_NoDevices(), None, LocalSampler(SamplerServer(sampler, gpu,
                                                                             lib=lib)),
                              0.2, POLL_S, clock=clock)
    polls: list[ph.Poll] = []

    def sleep(seconds: float) -> None:
        end = clock() + seconds
        while clock() < end - 1e-12:
            clock.t = min(end, clock() + POLL_S)
            polls.append(readers.poll())

    before = readers.poll()  # starts PM sampling
    sleep(0.5)
    polls.clear()
    work = DryWorkload(model, sleep=sleep).idle_gaps(busy_s, gap_sequence(rounds))
    sleep(0.3)  # settle: the last intervals complete
    after = readers.poll()
    return ph.Phase("idle_gaps", work, before, after, polls, work.start, work.end), readers, \
        gpu.uuid


def _check(**kwargs: Any) -> cmp.TruthCheck:
    phase, readers, uuid = _gap_phase(**kwargs)
    return ph.activity_gap_check(phase, uuid, readers, INTERVAL)


# --- on the dry GPU --------------------------------------------------------------------------


def test_the_dry_gpu_shows_every_gap_within_two_intervals_of_its_start() -> None:
    check = _check()
    assert check.verdict == cmp.PASS, check.note
    recall = check.extra["recall"]
    assert {k: (v["found"], v["gaps"]) for k, v in recall.items()} == {
        str(g): (5, 5) for g in GAP_PATTERN_S}
    assert check.extra["false_windows"] == []
    # Each point is dated by its interval's end and only a wholly idle interval reads idle:
    # the detected start trails the true one by one to two intervals.
    assert all(INTERVAL - 1e-6 <= o <= 2 * INTERVAL + 1e-6 for o in check.extra["offsets_s"])
    assert check.measured == pytest.approx(0.03, abs=0.011)
    assert "50 ms 5/5, 100 ms 5/5, 200 ms 5/5" in check.note


@pytest.mark.parametrize("shift", [0.1, -0.1])
def test_stamps_100_ms_off_fail_on_the_start_offset(shift: float) -> None:
    check = _check(faults=DryFaults(activity_stamp_offset_s=shift))
    assert check.verdict == cmp.FAIL, check.note
    assert "clock mapping is off" in check.note
    assert check.measured is not None and abs(check.measured) > 2 * INTERVAL


def test_activity_that_never_reads_idle_fails_on_recall() -> None:
    check = _check(faults=DryFaults(activity_busy_throughout=True))
    assert check.verdict == cmp.FAIL
    for gap in ("50 ms", "100 ms", "200 ms"):
        assert f"found 0/5 of the {gap} gaps" in check.note
    assert "no gap found" in check.note and check.measured is None


def test_a_chip_without_an_activity_metric_skips_and_says_why() -> None:
    sets = {"cupti": "x", "chip": "gh100", "set": "Compute_Triage",
            "metrics": ["sm__inst_executed_realtime", "dramc__sectors_op_read"],
            "user_metrics": []}
    check = _check(sets=sets, rounds=1)
    assert (check.verdict, check.missing) == (cmp.SKIP, False)
    assert "offers no GPU-activity metric" in check.note


def test_profiling_that_never_starts_skips_as_a_missing_value() -> None:
    check = _check(faults=DryFaults(cupti_refused=True), rounds=1)
    assert (check.verdict, check.missing) == (cmp.SKIP, True)
    assert "profiling unavailable" in check.note and "no_permission" in check.note
    # On Hopper+ the missing value is a FAIL, like every other CUPTI row.
    assert cmp.require([check], "this Hopper+ GPU")[0].verdict == cmp.FAIL


def test_the_dry_busy_seconds_count_overlapping_kernels_once() -> None:
    clock = Clock(10.0)
    model = DryModel(gpus=1, clock=clock)
    model.add(0, "gemm", 11.0, 12.0, 100)
    model.add(0, "d2d", 11.5, 12.5, 1e9)
    model.add(0, "h2d", 13.0, 14.0, 1e9)  # a copy engine, no kernel
    assert [model.busy_seconds(0, t) for t in (11.0, 11.5, 12.0, 13.0, 20.0)] == \
        pytest.approx([0.0, 0.5, 1.0, 1.5, 1.5])


# --- the pure comparison -----------------------------------------------------------------


def _points(start: float, end: float, idle: list[tuple[float, float]]
            ) -> list[tuple[float, float]]:
    """A point every 20 ms over ``[start, end]``: 0 where its interval lies in an idle span."""
    out = []
    for k in range(1, round((end - start) / INTERVAL) + 1):
        t = start + k * INTERVAL
        out.append((t, 0.0 if any(a <= t - INTERVAL and t <= b + 1e-9 for a, b in idle)
                    else 1.0))
    return out


def _gaps(first: float = 10.3) -> list[tuple[float, float, float]]:
    """Five 50 ms gaps, 0.35 s apart, starting at ``first``."""
    return [(0.05, first + 0.35 * k, first + 0.35 * k + 0.05) for k in range(5)]


def test_four_of_five_50_ms_gaps_is_enough_three_is_not() -> None:
    gaps = _gaps()
    seen = [(a, b) for _, a, b in gaps]
    for missed, verdict in ((1, cmp.PASS), (2, cmp.FAIL)):
        points = _points(10.0, 12.2, seen[missed:])
        check = timeline.idle_gaps_check(points, gaps, 10.0, 12.2, INTERVAL)
        assert check.verdict == verdict, check.note
    assert "found 3/5 of the 50 ms gaps (goal >= 80%)" in check.note


def test_an_idle_window_where_the_gpu_was_busy_fails_on_precision() -> None:
    gaps = _gaps()
    points = _points(10.0, 12.2, [(a, b) for _, a, b in gaps] + [(10.5, 10.56)])
    check = timeline.idle_gaps_check(points, gaps, 10.0, 12.2, INTERVAL)
    assert check.verdict == cmp.FAIL
    assert "1 idle window(s) overlap no gap, first +0.520..+0.580 s" in check.note


def test_idle_before_and_after_the_workload_window_is_not_judged() -> None:
    gaps = _gaps()
    # Idle until 10.0 and after 12.2: the GPU waits there on purpose.
    points = _points(9.0, 13.0, [(9.0, 10.0), *[(a, b) for _, a, b in gaps], (12.2, 13.0)])
    check = timeline.idle_gaps_check(points, gaps, 10.0, 12.2, INTERVAL)
    assert check.verdict == cmp.PASS, check.note
    assert check.extra["windows"] == 5


def test_no_points_inside_the_workload_window_is_a_missing_value() -> None:
    check = timeline.idle_gaps_check(_points(1.0, 2.0, []), _gaps(), 10.0, 12.2, INTERVAL)
    assert (check.verdict, check.missing) == (cmp.SKIP, True)


def test_the_windows_are_the_agents_idle_tracker_s_own() -> None:
    points = [(1.00, 1.0), (1.02, 0.0), (1.04, 0.04), (1.06, 0.5), (1.08, 0.0)]
    assert timeline.detect_windows(points) == [(1.02, 1.06), (1.08, 1.08)]
    assert timeline.IDLE_THRESHOLD == 0.05


def test_the_selfcheck_samples_at_the_agents_profiling_interval() -> None:
    assert selfcheck.PROFILING_INTERVAL_S == AGENT_INTERVAL_S == 0.02
    dry = selfcheck.Plan.for_mode(True, 1.0)
    assert (dry.gap_busy_s, dry.gap_rounds) == (0.1, 2)
    gpu = selfcheck.Plan.for_mode(False)
    assert (gpu.gap_busy_s, gpu.gap_rounds) == (0.3, 5)
