"""Idle windows and the starvation signal, computed in the agent."""

from __future__ import annotations

from typing import Any

from mrc_agent.agent.core.collectors.base import (
    BuildContext,
    DerivedThresholds,
    PassView,
    TargetState,
    Update,
)
from mrc_agent.agent.core.collectors.derived import (
    DEFINITION,
    DerivedCollector,
    IdleTracker,
    Starvation,
)
from mrc_agent.agent.core.hw.base import GPUIdentity
from tests.support import GPU0, GPU1, pass_view, published


def test_idle_windows_are_measured_from_first_idle_to_first_busy_point() -> None:
    tracker = IdleTracker(threshold=0.05)
    # busy, then idle 2.0 s, busy, idle 0.3 s, busy, then idle still running
    points = [(0.0, 0.9), (0.5, 0.0), (1.5, 0.02), (2.5, 0.8), (3.0, 0.0), (3.3, 0.5),
              (4.0, 0.0)]
    tracker.feed(points[:4])
    tracker.feed(points[3:])  # overlapping points are not counted twice
    h = tracker.histogram
    assert h.total == 2
    assert abs(h.sum - 2.3) < 1e-9
    assert h.counts[h.bounds.index(0.5)] == 1 and h.counts[h.bounds.index(2.0)] == 2
    assert abs(tracker.current(5.5) - 1.5) < 1e-9


def _ctx(now: float, user: float, hot: float, utils: dict[GPUIdentity, float],
         held: dict[int, set[GPUIdentity]] | None = None) -> PassView:
    return pass_view(now, (7,), processes={7: TargetState(7, "python", user, hot)},
                     util=utils, points={g: [(now, u)] for g, u in utils.items()},
                     gpus_of_pid=held or {})


def _starved(update: Update) -> tuple[float, float]:
    d: dict[str, Any] = {name: v for name, labels, v in update.samples
                         if labels == ("7", "python")}
    return d["mrc_gpu_starved"], d["mrc_gpu_starved_seconds_total"]


def test_starved_when_a_thread_is_hot_and_the_gpu_waits() -> None:
    c = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    assert _starved(c.update(_ctx(0.0, 0.5, 0.98, {GPU0: 0.05}))) == (1.0, 0.0)
    assert _starved(c.update(_ctx(1.0, 0.5, 0.98, {GPU0: 0.05}))) == (1.0, 1.0)
    # GPU busy again: not starved, the counter keeps its total.
    assert _starved(c.update(_ctx(2.0, 0.5, 0.98, {GPU0: 0.9}))) == (0.0, 1.0)
    # CPU cool: not starved.
    assert _starved(c.update(_ctx(3.0, 0.3, 0.3, {GPU0: 0.0}))) == (0.0, 1.0)


def test_starvation_looks_only_at_the_gpus_the_target_holds() -> None:
    c = DerivedCollector()
    held = {7: {GPU1}}
    # GPU0 is busy with someone else's work; the target's GPU1 idles.
    assert _starved(c.update(_ctx(0.0, 1.0, 1.0, {GPU0: 0.95, GPU1: 0.0}, held)))[0] == 1.0
    # Without attribution all GPUs count, and a busy one means not starved.
    assert _starved(c.update(_ctx(1.0, 1.0, 1.0, {GPU0: 0.95, GPU1: 0.0})))[0] == 0.0


def test_no_gpu_data_means_no_starvation_series() -> None:
    c = DerivedCollector()
    assert c.update(_ctx(0.0, 1.0, 1.0, {})).samples == []


def test_idle_threshold_is_at_or_below_on_both_sides() -> None:
    """README: idle is utilisation at or below --idle-util-threshold (0.05)."""
    at = IdleTracker(threshold=0.05)
    at.feed([(0.0, 0.9), (1.0, 0.05), (2.0, 0.9)])  # exactly at the line: idle
    assert at.histogram.total == 1 and abs(at.histogram.sum - 1.0) < 1e-9
    above = IdleTracker(threshold=0.05)
    above.feed([(0.0, 0.9), (1.0, 0.0501), (2.0, 0.9)])  # just above: busy
    assert above.histogram.total == 0


def test_starvation_thresholds_are_inclusive_on_both_sides() -> None:
    """Starved: the target's CPU at or above --starvation-cpu-threshold and its GPUs at or
    below --starvation-gpu-threshold (0.9 and 0.2 by default)."""
    def starved(user: float, gpu: float) -> float:
        c = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
        return _starved(c.update(_ctx(0.0, user, user, {GPU0: gpu})))[0]

    assert starved(0.9, 0.2) == 1.0
    assert starved(0.8999, 0.2) == 0.0
    assert starved(0.9, 0.2001) == 0.0
    assert starved(1.0, 0.0) == 1.0


def test_the_hottest_thread_alone_can_make_a_target_starved() -> None:
    """A GIL-bound preprocessing thread at one core while the process total is spread."""
    c = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    assert _starved(c.update(_ctx(0.0, 0.5, 0.95, {GPU0: 0.0})))[0] == 1.0
    c = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    assert _starved(c.update(_ctx(0.0, 0.5, 0.85, {GPU0: 0.0})))[0] == 0.0


def _ctx2(now: float, states: dict[int, tuple[float | None, float | None]],
          utils: dict[GPUIdentity, float]) -> PassView:
    return pass_view(now, tuple(states),
                     processes={pid: TargetState(pid, "python", user, hot)
                                for pid, (user, hot) in states.items()},
                     util=utils, points={g: [(now, u)] for g, u in utils.items()})


def _by_pid(update: Update) -> dict[str, tuple[float, float]]:
    out: dict[str, dict[str, Any]] = {}
    for name, labels, v in update.samples:
        if name.startswith("mrc_gpu_starved"):
            out.setdefault(labels[0], {})[name] = v
    return {pid: (d["mrc_gpu_starved"], d["mrc_gpu_starved_seconds_total"])
            for pid, d in out.items()}


def test_an_idle_target_beside_an_idle_gpu_is_not_starved() -> None:
    c = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    assert _by_pid(c.update(_ctx2(100.0, {7: (0.0, 0.0)}, {GPU0: 0.0}))) == {"7": (0.0, 0.0)}


def test_each_target_has_its_own_starved_time_from_the_measured_window() -> None:
    """Two targets, the first still without a CPU window (no series yet), the clock far
    from zero: seconds accumulate per target, by the time between passes (a pass judges the
    window that ends with it, so a target's first judged window counts in full)."""
    c = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    out = _by_pid(c.update(_ctx2(100.0, {5: (None, None), 7: (1.0, 1.0)}, {GPU0: 0.0})))
    assert out == {"7": (1.0, 0.0)}
    out = _by_pid(c.update(_ctx2(102.5, {5: (0.95, 0.95), 7: (1.0, 1.0)}, {GPU0: 0.0})))
    assert out == {"5": (1.0, 2.5), "7": (1.0, 2.5)}
    out = _by_pid(c.update(_ctx2(103.0, {5: (0.95, 0.95), 7: (0.1, 0.1)}, {GPU0: 0.0})))
    assert out == {"5": (1.0, 3.0), "7": (0.0, 2.5)}


def test_an_idle_window_spanning_passes_is_measured_once_it_ends() -> None:
    """The collector keeps one tracker per GPU across passes: a window that starts in one pass
    and ends in a later one is one window, and while it runs it is reported as current."""
    c = DerivedCollector(DerivedThresholds(idle_util=0.05))

    def idle(update: Update) -> tuple[float, int, float]:
        d: dict[str, Any] = {name: v for name, labels, v in update.samples
                             if labels == GPU0.labels}
        h = d["mrc_gpu_idle_window_seconds"]
        return d["mrc_gpu_idle_current_seconds"], h.total, h.sum

    view = pass_view(100.0, points={GPU0: [(99.0, 0.9), (99.5, 0.0)]})
    assert idle(c.update(view)) == (0.5, 0, 0.0)
    view = pass_view(101.0, points={GPU0: [(99.5, 0.0), (100.5, 0.01)]})  # the buffer overlaps
    assert idle(c.update(view)) == (1.5, 0, 0.0)
    view = pass_view(102.0, points={GPU0: [(101.75, 0.8)]})
    current, total, seconds = idle(c.update(view))
    assert (current, total) == (0.0, 1) and abs(seconds - 2.25) < 1e-9


def test_the_current_idle_time_is_zero_while_busy_and_exact_when_short() -> None:
    tracker = IdleTracker(threshold=0.05)
    assert tracker.current(10.0) == 0.0  # nothing seen yet
    tracker.feed([(10.0, 0.9)])
    assert tracker.current(11.0) == 0.0  # busy
    tracker.feed([(11.0, 0.0)])
    assert tracker.current(11.0) == 0.0  # idle since just now
    assert abs(tracker.current(11.3) - 0.3) < 1e-9
    assert tracker.current(10.5) == 0.0  # a clock behind the last point never reads negative


def test_points_already_seen_are_not_counted_again() -> None:
    """A source's buffer is read again from a little before the last pass: points at or before
    the last one seen are skipped, even when the same instant comes back with another value."""
    tracker = IdleTracker(threshold=0.05)
    tracker.feed([(0.0, 0.9), (1.0, 0.0), (2.0, 0.9)])
    tracker.feed([(1.0, 0.0), (2.0, 0.9), (3.0, 0.9)])  # one idle window, not two
    assert tracker.histogram.total == 1 and abs(tracker.histogram.sum - 1.0) < 1e-9
    tracker.feed([(4.0, 0.0)])
    tracker.feed([(4.0, 0.9)])  # the same instant again: ignored, the window still runs
    assert tracker.histogram.total == 1
    assert abs(tracker.current(5.0) - 1.0) < 1e-9


def test_a_held_gpu_without_a_utilisation_reading_does_not_break_the_judgement() -> None:
    """The target holds memory on two GPUs and only one reports utilisation (a device whose
    utilisation NVML cannot read): the one that reports, busy here, decides."""
    c = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    held = {7: {GPU0, GPU1}}
    assert _starved(c.update(_ctx(0.0, 1.0, 1.0, {GPU0: 0.9}, held))) == (0.0, 0.0)


def test_a_held_gpu_without_a_reading_is_not_taken_for_idle() -> None:
    """The target holds only GPU1, which gives no utilisation reading, while GPU0 (not the
    target's) is idle: no verdict (the gauge is absent) instead of "starved", and the counter
    keeps its total; once GPU1 reads idle, the target is starved."""
    c = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    held = {7: {GPU1}}
    assert _starved(c.update(_ctx(0.0, 1.0, 1.0, {GPU1: 0.0}, held))) == (1.0, 0.0)
    assert _starved(c.update(_ctx(1.0, 1.0, 1.0, {GPU1: 0.0}, held))) == (1.0, 1.0)
    samples = c.update(_ctx(2.0, 1.0, 1.0, {GPU0: 0.0}, held)).samples
    d = {name: v for name, labels, v in samples if labels == ("7", "python")}
    assert d == {"mrc_gpu_starved_seconds_total": 1.0}
    assert _starved(c.update(_ctx(3.0, 1.0, 1.0, {GPU1: 0.0}, held))) == (1.0, 2.0)


def test_the_registered_factory_passes_the_configured_thresholds_on() -> None:
    """``--starvation-cpu-threshold`` and friends reach the collector the runner builds."""
    thresholds = DerivedThresholds(idle_util=0.1, starved_cpu=0.5, starved_gpu=0.3)
    c = DEFINITION.factory(BuildContext(thresholds=thresholds))
    assert isinstance(c, DerivedCollector) and c.thresholds == thresholds
    assert _starved(c.update(_ctx(0.0, 0.6, 0.6, {GPU0: 0.25})))[0] == 1.0  # not by the defaults


def test_the_verdict_is_published_for_the_collectors_after_it() -> None:
    """The stacks collector reads each target's verdict from the derived phase's output: the
    verdict where a GPU of the target gave a reading, nothing where none did."""
    c = DerivedCollector(DerivedThresholds(starved_cpu=0.9, starved_gpu=0.2))
    held = {7: {GPU1}}
    starvation = published(c.update(_ctx(0.0, 1.0, 1.0, {GPU1: 0.0}, held)), Starvation)
    assert starvation is not None and dict(starvation.by_pid) == {7: True}
    starvation = published(c.update(_ctx(1.0, 1.0, 1.0, {GPU1: 0.9}, held)), Starvation)
    assert starvation is not None and dict(starvation.by_pid) == {7: False}
    starvation = published(c.update(_ctx(2.0, 1.0, 1.0, {GPU0: 0.0}, held)), Starvation)
    assert starvation is not None and dict(starvation.by_pid) == {}
