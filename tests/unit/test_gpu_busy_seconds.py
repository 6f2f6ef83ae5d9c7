"""GPU busy time as a counter: ``mrc_gpu_busy_seconds_total`` integrated from the utilisation
samples at their own granularity, so ``rate()`` over any window gives the duty cycle whatever
the scrape interval, where a utilisation gauge scraped every 15-60 s shows only the instants
the scrapes land on."""

from __future__ import annotations

import math

import pytest

from mrc_agent.agent.core.collectors.derived import DerivedCollector, IdleTracker
from mrc_agent.agent.core.collectors.gpu import GpuCollector
from mrc_agent.agent.core.hw.base import DeviceSample
from mrc_agent.agent.core.sample import HistogramValue, Sample
from tests.support import GPU0, pass_view, run_pass

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


def metric(samples: list[Sample], name: str) -> float:
    [value] = [v for n, labels, v in samples if n == name and labels == GPU0.labels]
    assert isinstance(value, float)
    return value


def windows_of(samples: list[Sample]) -> tuple[int, float]:
    """The idle-window histogram's count and sum."""
    [value] = [v for n, labels, v in samples
               if n == "mrc_gpu_idle_window_seconds" and labels == GPU0.labels]
    assert isinstance(value, HistogramValue)
    return value.total, value.sum


class LateBuffer:
    """A DeviceSource whose sample buffer posts each sample ``lag`` seconds after its stamp
    (NVML posts a period's sample once the period is over), read at ``now``; its gauge is the
    mean of the samples of the last second (GetUtilizationRates' period on many parts)."""

    def __init__(self, samples: list[tuple[float, float]], lag: float) -> None:
        self.samples = samples
        self.lag = lag
        self.now = 0.0
        self.seen = -math.inf

    def sample_devices(self) -> list[DeviceSample]:
        posted = [p for p in self.samples if p[0] + self.lag <= self.now]
        new = [p for p in posted if p[0] > self.seen]
        if new:
            self.seen = new[-1][0]
        recent = [u for t, u in posted if t > self.now - self.lag - 1.0]
        gauge = sum(recent) / len(recent) if recent else 0.0
        return [DeviceSample(gpu=GPU0, gpu_util=gauge, util_samples=new)]


def agent(source: LateBuffer, passes: list[float]) -> list[list[Sample]]:
    """The gpu and derived collectors run at each of ``passes`` on ``source``."""
    gpu, derived, out = GpuCollector(source), DerivedCollector(), []
    for now in passes:
        source.now = now
        out.append(run_pass(pass_view(now), (gpu, derived))[1])
    return out


def test_a_pass_without_a_new_sample_does_not_hide_the_samples_posted_after_it() -> None:
    """The agent samples every 50 ms, faster than NVML posts (every 1/6 s, 0.1 s late): most
    passes find nothing new. A point stamped "now" from the gauge would be newer than the
    samples still to be posted, and they would be skipped. Every sample counts instead: busy
    seconds are exactly those of the samples, and the 0.5 s idle windows (which a one-second
    gauge never shows) are all seen."""
    # 1 s of work, then two idle samples: windows of 1/3 s, which the gauge never shows.
    samples = [(k * PERIOD, 0.0 if k % 9 in (7, 8) else 1.0) for k in range(1, 91)]
    source = LateBuffer(samples, lag=0.1)
    # From the first pass on the buffer holds a sample (NVML's buffer predates the agent).
    last = agent(source, [k * 0.05 for k in range(6, 20 * 16)])[-1]
    expected = sum(u * PERIOD for _, u in samples[1:])  # the first only starts the count
    assert metric(last, "mrc_gpu_busy_seconds_total") == pytest.approx(expected)
    assert windows_of(last) == (10, pytest.approx(10 * 2 * PERIOD))  # one per 1.5 s cycle


def test_a_sample_after_a_pause_counts_its_own_period_not_the_pause() -> None:
    """The agent (or NVML's buffer) paused 30 s: the busy sample after it was busy for its own
    period, not for 30 s. A gap up to twice the spacing (one sample missed) still counts."""
    tracker = IdleTracker(threshold=0.05)
    tracker.feed([(k * PERIOD, 1.0) for k in range(13)])  # 2 s busy: spacing 1/6 s
    assert tracker.busy_seconds == pytest.approx(2.0)
    tracker.feed([(2.0 + 2 * PERIOD, 0.5)])  # one sample missed: counted whole
    assert tracker.busy_seconds == pytest.approx(2.0 + PERIOD)
    tracker.feed([(32.0, 1.0)])
    assert tracker.busy_seconds == pytest.approx(2.0 + 2 * PERIOD)
    tracker.feed([(32.0 + PERIOD, 1.0)])  # and the spacing is still NVML's
    assert tracker.busy_seconds == pytest.approx(2.0 + 3 * PERIOD)


def test_an_empty_buffer_while_the_gauge_reads_idle_is_idle_time() -> None:
    """NVML's buffer runs dry while the GPU idles (polarsignals/gpu-metrics-agent#37): passes
    find nothing new and the gauge reads 0. That time is idle: the counter does not move, the
    idle window runs from where the next sample was due, and the first sample after it counts
    its own period only. A sample posted after an idle pass, stamped before it, still counts."""
    busy = [(k * PERIOD, 1.0) for k in range(1, 13)]  # 1/6 s .. 2 s, busy
    resumed = [(12.0, 1.0), (12.0 + PERIOD, 1.0)]
    late = (2.0 + PERIOD, 0.5)  # stamped before the pass at 2.25 that saw nothing new
    script = {2.0: (busy, 1.0), 2.25: ([], 0.0), 2.5: ([late], 0.0), 7.0: ([], 0.0),
              12.0: ([], 0.0), 12.25: (resumed, 1.0)}
    gpu, derived = GpuCollector(Scripted(script)), DerivedCollector()
    seen = {}
    for now in script:
        seen[now] = run_pass(pass_view(now), (gpu, derived))[1]
    busy_at = {now: metric(s, "mrc_gpu_busy_seconds_total") for now, s in seen.items()}
    idle_at = {now: metric(s, "mrc_gpu_idle_current_seconds") for now, s in seen.items()}
    assert busy_at[2.0] == pytest.approx(11 * PERIOD)
    assert busy_at[2.5] == pytest.approx(11.5 * PERIOD)  # the late sample counted
    assert busy_at[7.0] == busy_at[12.0] == busy_at[2.5]  # idle, not missing
    # Half busy: the gauge's idle at 2.25 was a moment, the window starts after the late one.
    assert idle_at[7.0] == pytest.approx(7.0 - (2.0 + 2 * PERIOD))
    assert busy_at[12.25] == pytest.approx(busy_at[2.5] + 2 * PERIOD)  # not + 10 s
    assert windows_of(seen[12.25]) == (1, pytest.approx(10 - 2 * PERIOD))


class Scripted:
    """A DeviceSource answering, pass by pass, the new samples and the gauge it was given."""

    def __init__(self, script: dict[float, tuple[list[tuple[float, float]], float]]) -> None:
        self.answers = iter(script.values())

    def sample_devices(self) -> list[DeviceSample]:
        points, gauge = next(self.answers)
        return [DeviceSample(gpu=GPU0, gpu_util=gauge, util_samples=list(points))]
