"""The runner owns health: timing, isolation of failures, once-only logging, recovery."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from mrc_agent.agent.core.collectors import PASS_FINISHERS
from mrc_agent.agent.core.collectors.base import PassView, Update
from mrc_agent.agent.core.collectors.gpm import GpmReadings
from mrc_agent.agent.core.hw.base import HardwareError, SourceUnavailable
from mrc_agent.agent.core.runner import INTERVAL, SAMPLES, Runner
from mrc_agent.agent.core.sample import Snapshot, first
from mrc_agent.agent.core.targets import TargetResolver
from tests.support import Clock as ManualClock


class Scripted:
    """A collector that follows a script of results: a value, or an exception to raise."""

    def __init__(self, name: str, script: Sequence[float | Exception],
                 outputs: tuple[object, ...] = ()) -> None:
        self.name = name
        self.script = list(script)
        self.outputs = outputs  # published with each value

    def update(self, view: PassView) -> Update:
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, Exception):
            raise step
        return Update([("mrc_gpu_power_watts", ("0", "GPU-a", "H"), float(step))], self.outputs)


def _health(snap, metric: str) -> dict[str, float]:
    return {labels[0]: v for name, labels, v in snap.samples if name == metric}


def test_one_failing_collector_never_breaks_the_others(caplog) -> None:
    ok = Scripted("gpu", [100.0])
    broken = Scripted("gpm", [HardwareError("GPU is lost")] * 3 + [5.0], (GpmReadings(()),))
    absent = Scripted("profiling", [SourceUnavailable("no_permission", "admin only")])
    runner = Runner([ok, broken, absent], TargetResolver(), interval=1.0,
                    finishers=PASS_FINISHERS)
    with caplog.at_level(logging.INFO, logger="mrc_agent.agent.core.runner"):
        for _ in range(3):
            snap = runner.sample_once()
    assert _health(snap, "mrc_agent_collector_success") == {
        "gpu": 1.0, "gpm": 0.0, "profiling": 0.0}
    assert _health(snap, "mrc_agent_collector_available") == {
        "gpu": 1.0, "gpm": 1.0, "profiling": 0.0}
    assert set(_health(snap, "mrc_agent_collector_duration_seconds")) == {"gpu", "gpm",
                                                                          "profiling"}
    assert [v for n, _, v in snap.samples if n == "mrc_gpu_power_watts"] == [100.0]
    # Each reason is said once, not once per pass.
    assert sum("GPU is lost" in r.message for r in caplog.records) == 1
    assert sum("no_permission" in r.message for r in caplog.records) == 1
    # The broken collector recovers when its source answers again.
    with caplog.at_level(logging.INFO, logger="mrc_agent.agent.core.runner"):
        snap = runner.sample_once()
    assert _health(snap, "mrc_agent_collector_success")["gpm"] == 1.0
    assert any("gpm recovered" in r.message for r in caplog.records)
    info = [labels for n, labels, _ in snap.samples
            if n == "mrc_agent_compute_memory_source_info"]
    assert info == [("gpm_activity_proxy", "not_requested")]


def test_each_collector_sees_what_those_before_it_published_and_a_failure_may_leave_some(
        caplog) -> None:
    """A pass hands typed outputs on: the second collector sees the first one's, even from a
    pass in which the first failed yet left them (its :attr:`Update.error`), which the
    runner reports as a failure all the same."""
    seen: list[object] = []

    class First:
        name = "gpu"
        fail = False

        def update(self, view: PassView) -> Update:
            error = HardwareError("GPU is lost") if self.fail else None
            return Update([], (GpmReadings(()),), error=error)

    class Second:
        name = "derived"

        def update(self, view: PassView) -> Update:
            seen.append(view.get(GpmReadings))
            return Update([])

    first = First()
    runner = Runner([first, Second()], TargetResolver(), interval=1.0)
    assert _health(runner.sample_once(), "mrc_agent_collector_success") == {
        "gpu": 1.0, "derived": 1.0}
    first.fail = True
    with caplog.at_level(logging.INFO, logger="mrc_agent.agent.core.runner"):
        snap = runner.sample_once()
    assert _health(snap, "mrc_agent_collector_success") == {"gpu": 0.0, "derived": 1.0}
    assert _health(snap, "mrc_agent_collector_available") == {"gpu": 1.0, "derived": 1.0}
    assert seen == [GpmReadings(()), GpmReadings(())]
    assert sum("GPU is lost" in r.message for r in caplog.records) == 1


def test_background_loop_keeps_sampling_at_100ms() -> None:
    runner = Runner([Scripted("gpu", [1.0])], TargetResolver(), interval=0.1)
    runner.start()
    try:
        assert runner.ready.wait(2.0)
        time.sleep(1.0)
    finally:
        runner.stop()
    snap = runner.latest()
    assert (first(snap, SAMPLES) or 0) >= 6
    assert first(snap, INTERVAL) == 0.1
    seq = runner.version()
    time.sleep(0.3)
    assert runner.version() == seq  # stopped means stopped


def test_collectors_register_in_an_order_that_honours_what_they_read() -> None:
    import pytest

    from mrc_agent.agent.core.catalog import CATALOG
    from mrc_agent.agent.core.collectors import COLLECTORS, derived, gpu, process
    from mrc_agent.agent.core.collectors.base import check_order

    with pytest.raises(ValueError, match="derived"):
        check_order([process.DEFINITION, derived.DEFINITION, gpu.DEFINITION])
    with pytest.raises(ValueError, match="twice"):
        check_order([process.DEFINITION, process.DEFINITION])
    # Every metric a collector declares is in the catalogue under that collector's name.
    for c in COLLECTORS:
        assert c.metrics and all(spec.collector == c.name for spec in c.metrics), c.name
        assert set(c.metrics) <= set(CATALOG)
    assert len({spec.name for spec in CATALOG}) == len(CATALOG)


class Stalling:
    """A gpu collector that, when told to, stays in update() for ``seconds`` of the runner's
    clock and lets a scrape look at the runner meanwhile."""

    name = "gpu"

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.stall = 0.0
        self.runner: Runner | None = None
        self.seen: list[tuple[object, str | None, int]] = []

    def update(self, view: PassView) -> Update:
        if self.stall and self.runner is not None:
            self.clock.t += self.stall
            r = self.runner
            self.seen.append((r.latest(), r.not_ready_reason(), r.version()))
        return Update([("mrc_gpu_power_watts", ("0", "GPU-a", "H"), 1.0)])


def test_a_stuck_collector_shows_as_failed_and_not_ready_while_it_is_stuck() -> None:
    clock = ManualClock(100.0)
    stalling = Stalling(clock)
    runner = Runner([stalling], TargetResolver(), interval=1.0, clock=clock)
    stalling.runner = runner
    first = runner.sample_once()
    assert runner.not_ready_reason() is None
    assert _health(first, "mrc_agent_collector_success") == {"gpu": 1.0}
    stalling.stall = 2.5  # more than two intervals inside one update()
    runner.sample_once()
    (snap, reason, version), = stalling.seen
    assert isinstance(snap, Snapshot)
    assert _health(snap, "mrc_agent_collector_success") == {"gpu": 0.0}
    assert snap.timestamp == first.timestamp  # the data is the old pass's: not passed off as new
    assert version > first.seq  # a new version, so cached renders are not reused
    assert reason is not None and "collector gpu has run for 2.5 s" in reason
    # The pass finished: current again.
    assert runner.not_ready_reason() is None
    assert _health(runner.latest(), "mrc_agent_collector_success") == {"gpu": 1.0}


def test_reading_the_latest_snapshot_changes_nothing() -> None:
    """While a collector is stuck, every read names the same copy: the version, the copy and
    the next pass's version do not depend on how many scrapes came meanwhile."""
    clock = ManualClock(100.0)
    reads: list[tuple[int, int, int]] = []

    class Reading(Stalling):
        def update(self, view: PassView) -> Update:
            out = super().update(view)
            if self.stall and self.runner is not None:
                r = self.runner
                for _ in range(3):
                    reads.append((r.version(), r.latest().seq, r.version()))
            return out

    def two_passes(collector: Stalling) -> tuple[Snapshot, Snapshot]:
        runner = Runner([collector], TargetResolver(), interval=1.0, clock=clock)
        collector.runner = runner
        first = runner.sample_once()
        collector.stall = 2.5
        return first, runner.sample_once()

    first, second = two_passes(Reading(clock))
    (v, seq, again), = set(reads)
    assert v == seq == again and first.seq < v < second.seq
    class Unread(Stalling):
        def update(self, view: PassView) -> Update:
            self.clock.t += self.stall
            return Update([("mrc_gpu_power_watts", ("0", "GPU-a", "H"), 1.0)])

    # The same passes with nobody reading: the same versions.
    assert [s.seq for s in two_passes(Unread(clock))] == [first.seq, second.seq]


def test_a_short_hiccup_is_not_a_stall() -> None:
    clock = ManualClock(100.0)
    stalling = Stalling(clock)
    runner = Runner([stalling], TargetResolver(), interval=1.0, clock=clock)
    stalling.runner = runner
    runner.sample_once()
    stalling.stall = 1.5  # late, but within two intervals
    runner.sample_once()
    (snap, reason, _), = stalling.seen
    assert reason is None and _health(snap, "mrc_agent_collector_success") == {"gpu": 1.0}


def test_no_completed_pass_within_two_intervals_is_not_ready() -> None:
    clock = ManualClock(100.0)
    runner = Runner([Scripted("gpu", [1.0])], TargetResolver(), interval=1.0, clock=clock)
    assert runner.not_ready_reason() == "no sample taken yet"
    runner.sample_once()
    clock.t += 2.0
    assert runner.not_ready_reason() is None
    clock.t += 0.5
    reason = runner.not_ready_reason()
    assert reason is not None and "no sampling pass completed for 2.5 s" in reason


class BreaksAfterOnePass(TargetResolver):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def resolve(self):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls > 1:
            raise OSError("the /proc mount went away")
        return []


def test_a_failing_pass_turns_not_ready_and_is_logged_once(caplog) -> None:
    resolver = BreaksAfterOnePass()
    runner = Runner([Scripted("gpu", [1.0])], resolver, interval=0.05)
    with caplog.at_level(logging.ERROR, logger="mrc_agent.agent.core.runner"):
        runner.start()
        try:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and resolver.calls < 6:
                time.sleep(0.02)
        finally:
            runner.stop()
    assert resolver.calls >= 6
    reason = runner.not_ready_reason()
    assert reason is not None and "failed: OSError: the /proc mount went away" in reason
    assert sum("sampling pass failed" in r.message for r in caplog.records) == 1


def test_readyz_says_why_it_is_not_ready() -> None:
    import httpx

    from mrc_agent.agent.core.config import AgentConfig
    from mrc_agent.agent.core.wiring import build_server

    clock = ManualClock(100.0)
    runner = Runner([Scripted("gpu", [1.0])], TargetResolver(), interval=1.0, clock=clock)
    server = build_server(AgentConfig(listen="127.0.0.1:0"), runner)
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/readyz"
        first = httpx.get(url, timeout=5)
        assert first.status_code == 503 and "no sample taken yet" in first.text
        runner.sample_once()
        assert httpx.get(url, timeout=5).status_code == 200
        clock.t += 10
        stale = httpx.get(url, timeout=5)
        assert stale.status_code == 503 and "no sampling pass completed for 10.0 s" in stale.text
    finally:
        server.stop()
