"""GPU busy time as a counter: ``mrc_gpu_busy_seconds_total`` integrated from the utilisation
samples at their own granularity, so ``rate()`` over any window gives the duty cycle whatever
the scrape interval, where a utilisation gauge scraped every 15-60 s shows only the instants
the scrapes land on."""

from __future__ import annotations

import math

import pytest

from mrc_agent.agent.core.collectors.derived import DerivedCollector, IdleTracker
from mrc_agent.agent.core.sample import Sample
from tests.support import GPU0, pass_view

#: NVML's utilisation sample period on datacenter parts.
PERIOD = 1 / 6


def phases(t: float) -> float:
    """A starved MRC service's GPU: 1.2 s of work, then an idle window whose length cycles
    through 0.2, 0.5, 1, 3 and 10 s (preprocessing on one core while the GPU waits)."""
    idles = (0.2, 0.5, 1.0, 3.0, 10.0)
    cycle = sum(1.2 + i for i in idles)
    t %= cycle
    for idle in idles:
        if t < 1.2:
            return 1.0
        t -= 1.2
        if t < idle:
            return 0.0
        t -= idle
    return 1.0


def samples(start: float, end: float) -> list[tuple[float, float]]:
    """NVML's samples: each the share of its period a kernel ran, stamped at its end."""
    out = []
    k = math.ceil(start / PERIOD)
    while k * PERIOD <= end:
        t = k * PERIOD
        steps = 40
        busy = sum(phases(t - PERIOD + (i + 0.5) * PERIOD / steps) for i in range(steps))
        out.append((t, busy / steps))
        k += 1
    return out


def true_busy(start: float, end: float) -> float:
    steps = int((end - start) * 240)
    return sum(phases(start + (i + 0.5) / 240) for i in range(steps)) / 240


def busy_of(samples: list[Sample]) -> float:
    [value] = [v for name, labels, v in samples
               if name == "mrc_gpu_busy_seconds_total" and labels == GPU0.labels]
    assert isinstance(value, float)
    return value


def run(interval: float, seconds: float) -> list[tuple[float, float, float]]:
    """The agent sampling every ``interval``: (time, busy counter, utilisation gauge)."""
    c = DerivedCollector()
    out = []
    now, seen = interval, 0.0
    while now <= seconds + 1e-9:
        points = samples(seen, now)
        util = {GPU0: points[-1][1]} if points else {}
        busy = busy_of(c.update(pass_view(now, points={GPU0: points}, util=util)).samples)
        out.append((now, busy, util.get(GPU0, 0.0)))
        seen = now
        now += interval
    return out


@pytest.mark.parametrize("interval", [1.0, 0.1])
@pytest.mark.parametrize("scrape", [15.0, 30.0, 60.0])
def test_rate_of_busy_seconds_is_the_duty_cycle_at_every_scrape_interval(
    interval: float, scrape: float,
) -> None:
    series = run(interval, 240.0)
    errors, gauge_errors = [], []
    for k in range(2, int(240 // scrape)):
        t0, t1 = (k - 1) * scrape, k * scrape
        a = min(series, key=lambda r: abs(r[0] - t0))
        b = min(series, key=lambda r: abs(r[0] - t1))
        duty = (b[1] - a[1]) / (b[0] - a[0])  # rate() over one scrape interval
        truth = true_busy(a[0], b[0]) / (b[0] - a[0])
        errors.append(abs(duty - truth))
        gauge_errors.append(abs(b[2] - truth))  # what a scraped utilisation gauge shows
    assert max(errors) <= 0.01  # within one percentage point in every window
    assert max(gauge_errors) >= 0.25  # the gauge is off by a quarter or more somewhere


def test_busy_seconds_integrate_each_sample_over_its_own_span() -> None:
    tracker = IdleTracker(threshold=0.05)
    tracker.feed([(10.0, 0.7)])  # the first point only starts the count
    assert tracker.busy_seconds == 0.0
    tracker.feed([(10.0, 0.7), (10.5, 1.0), (11.5, 0.25)])  # overlap counted once
    assert tracker.busy_seconds == pytest.approx(0.5 + 0.25)
    tracker.feed([(12.0, 1.7), (12.5, -0.2)])  # out-of-range readings are clamped
    assert tracker.busy_seconds == pytest.approx(0.75 + 0.5)


def test_one_point_per_pass_stands_for_the_whole_pass() -> None:
    c = DerivedCollector()
    totals = []
    for now, util in ((100.0, 0.9), (101.0, 0.5), (103.0, 0.25)):
        view = pass_view(now, util={GPU0: util}, points={GPU0: [(now, util)]})
        totals.append(busy_of(c.update(view).samples))
    assert totals == [0.0, 0.5, 1.0]
