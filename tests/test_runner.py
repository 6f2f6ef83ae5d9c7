"""The runner owns health: timing, isolation of failures, once-only logging, recovery."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from agent.core.collectors import PASS_FINISHERS
from agent.core.collectors.base import SampleContext
from agent.core.hw.base import HardwareError, SourceUnavailable
from agent.core.runner import INTERVAL, SAMPLES, Runner
from agent.core.sample import Sample, first
from agent.core.targets import TargetResolver


class Scripted:
    """A collector that follows a script of results: a value, or an exception to raise."""

    def __init__(self, name: str, script: Sequence[float | Exception]) -> None:
        self.name = name
        self.script = list(script)

    def update(self, ctx: SampleContext) -> list[Sample]:
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, Exception):
            raise step
        return [("mrc_gpu_power_watts", ("0", "GPU-a", "H"), float(step))]


def _health(snap, metric: str) -> dict[str, float]:
    return {labels[0]: v for name, labels, v in snap.samples if name == metric}


def test_one_failing_collector_never_breaks_the_others(caplog) -> None:
    ok = Scripted("gpu", [100.0])
    broken = Scripted("gpm", [HardwareError("GPU is lost")] * 3 + [5.0])
    absent = Scripted("profiling", [SourceUnavailable("no_permission", "admin only")])
    runner = Runner([ok, broken, absent], TargetResolver(), interval=1.0,
                    finishers=PASS_FINISHERS)
    with caplog.at_level(logging.INFO, logger="agent.core.runner"):
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
    with caplog.at_level(logging.INFO, logger="agent.core.runner"):
        snap = runner.sample_once()
    assert _health(snap, "mrc_agent_collector_success")["gpm"] == 1.0
    assert any("gpm recovered" in r.message for r in caplog.records)
    info = [labels for n, labels, _ in snap.samples
            if n == "mrc_agent_compute_memory_source_info"]
    assert info == [("gpm_activity_proxy", "not_requested")]


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

    from agent.core.catalog import CATALOG
    from agent.core.collectors import COLLECTORS, derived, gpu, process
    from agent.core.collectors.base import check_order

    with pytest.raises(ValueError, match="derived"):
        check_order([process.DEFINITION, derived.DEFINITION, gpu.DEFINITION])
    with pytest.raises(ValueError, match="twice"):
        check_order([process.DEFINITION, process.DEFINITION])
    # Every metric a collector declares is in the catalogue under that collector's name.
    for c in COLLECTORS:
        assert c.metrics and all(spec.collector == c.name for spec in c.metrics), c.name
        assert set(c.metrics) <= set(CATALOG)
    assert len({spec.name for spec in CATALOG}) == len(CATALOG)
