"""Benchmark: GPU idle-window detection and duty cycle, side by side on one replayed trace.

A GPU utilisation timeline is generated with idle windows injected between busy stretches:
twenty each of 50 ms, 100 ms, 200 ms, 500 ms, 1 s, 2 s, 5 s and 10 s, in random order. NVML's
utilisation samples are computed from it exactly as NVML defines them (each sample: the share of
its period, 1/6 s on datacenter parts, during which a kernel ran), and the same samples are read
four ways:

- **the agent at 1 s and at 0.1 s**: its own :class:`IdleTracker` over every sample of NVML's
  buffer, read at each pass (the code ``mrc-agent run`` runs, fed pass by pass);
- **``nvidia-smi dmon -d 1``**: one reading a second, the latest sample's utilisation;
- **dcgm-exporter at its defaults**: one collection every 30 s (the latest sample's
  utilisation), scraped every 15 s.

And the hardware timeline where profiling runs: CUPTI PM sampling's GPU-activity percentage
(``gr__cycles_active`` on GH100), one point per 20 ms interval computed the same way from the
trace, read by the agent at 1 s and 0.1 s through its profiling and derived collectors' code.

Measured per window duration: recall (a true window is found when a detected idle stretch
overlaps it) and precision (detected stretches that overlap a true window); per way, the delay
from a window's onset to the first pass or reading that shows the GPU idle. Then the duty cycle
read through ``rate(mrc_gpu_busy_seconds_total[W])`` at scrape intervals of 15, 30 and 60 s
(the counter from the agent's gpu and derived collectors reading the buffer pass by pass, at
1 s and at 0.1 s, and at 0.1 s with a buffer that runs dry while the GPU idles) against the
true duty cycle of each window, beside ``avg_over_time`` of a utilisation gauge scraped at the
same interval.

Goals: >= 95 % recall of windows of 200 ms or more at 0.1 s; duty cycle within +-1 percentage
point at every scrape interval; on the hardware timeline, >= 95 % recall of windows of 200 ms
or more, >= 80 % of 50 ms ones, and >= 95 % precision. The time from onset to
``mrc_gpu_starved`` and to the page, and the share of starved seconds on the right function,
need a real process (``tests/e2e/test_stacks_e2e.py`` shows the latter on one); they are not in
this run.

    python3 benchmarks/bench_detection.py [--seed 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from support import report

from mrc_agent.agent.core.collectors.base import DerivedThresholds, PassView
from mrc_agent.agent.core.collectors.derived import BUSY_SECONDS, DerivedCollector, IdleTracker
from mrc_agent.agent.core.collectors.gpu import GpuCollector
from mrc_agent.agent.core.collectors.profiling import HardwareActivity
from mrc_agent.agent.core.hw.base import DeviceSample, GPUIdentity

REPO = Path(__file__).resolve().parent.parent


#: NVML's utilisation sample period on datacenter parts (nvmlDeviceGetSamples).
PERIOD = 1 / 6
#: The PM-sampling interval of the hardware activity timeline (``mrc-agent run``'s default).
PM_PERIOD = 0.02
DURATIONS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
PER_DURATION = 20
IDLE_UTIL = 0.05  # the agent's default --idle-util-threshold
SCRAPES = (15.0, 30.0, 60.0)
#: How long after its stamp NVML's sample shows in the buffer (an assumption: half a period),
#: so an agent faster than NVML's period reads passes with nothing new.
LAG = PERIOD / 2
GPU = GPUIdentity(0, "GPU-bench", "NVIDIA H200")


def timeline(seed: int) -> tuple[list[tuple[float, float]], float]:
    """Idle windows ``(start, end)`` between busy stretches of 2-6 s, and the trace's end."""
    rng = random.Random(seed)
    order = [d for d in DURATIONS for _ in range(PER_DURATION)]
    rng.shuffle(order)
    t, windows = 0.0, []
    for d in order:
        t += rng.uniform(2.0, 6.0)
        windows.append((t, t + d))
        t += d
    return windows, t + rng.uniform(2.0, 6.0)


def busy_between(windows: Sequence[tuple[float, float]], a: float, b: float) -> float:
    """Seconds of ``[a, b]`` outside every idle window (a kernel ran)."""
    idle = 0.0
    i = max(bisect.bisect_left(windows, (a, a)) - 1, 0)
    while i < len(windows) and windows[i][0] < b:
        s, e = windows[i]
        idle += max(0.0, min(e, b) - max(s, a))
        i += 1
    return (b - a) - idle


def nvml_samples(windows: Sequence[tuple[float, float]], end: float,
                 phase: float, period: float = PERIOD) -> list[tuple[float, float]]:
    """NVML's samples (or PM sampling's with its ``period``): at each period's end, the share
    of the period a kernel ran."""
    out, k = [], 1
    while phase + k * period <= end:
        t = phase + k * period
        out.append((t, busy_between(windows, t - period, t) / period))
        k += 1
    return out


def agent_stretches(samples: list[tuple[float, float]], interval: float, end: float,
                    period: float = PERIOD) -> tuple[list[tuple[float, float]], list[float]]:
    """The agent's idle windows, pass by pass, and the pass times at which it showed the GPU
    idle (``mrc_gpu_idle_current_seconds`` above 0)."""
    tracker = IdleTracker(IDLE_UTIL)
    stretches: list[tuple[float, float]] = []
    flagged: list[float] = []
    i, now = 0, interval
    while now <= end + interval:
        batch = []
        while i < len(samples) and samples[i][0] <= now:
            batch.append(samples[i])
            i += 1
        # The idle samples' own periods: from the first one's start to the last's end.
        stretches += [(was - period, t - period) for was, t in tracker.feed(batch)]
        if tracker.idle_since is not None:
            flagged.append(now)
        now += interval
    if tracker.idle_since is not None:
        stretches.append((tracker.idle_since - period, end))
    return stretches, flagged


def reading_stretches(samples: list[tuple[float, float]], every: float, phase: float,
                      end: float) -> tuple[list[tuple[float, float]], list[float]]:
    """A tool that reads the latest sample every ``every`` seconds: its idle stretches are the
    periods of the idle samples it read (consecutive readings of idle samples merged), and the
    idle reading times."""
    times = [s[0] for s in samples]
    stretches: list[tuple[float, float]] = []
    flagged: list[float] = []
    current: tuple[float, float] | None = None
    t = phase
    while t <= end:
        i = bisect.bisect_right(times, t) - 1
        if i >= 0 and samples[i][1] <= IDLE_UTIL:
            flagged.append(t)
            period = (times[i] - PERIOD, times[i])
            current = period if current is None else (current[0], period[1])
        elif current is not None:
            stretches.append(current)
            current = None
        t += every
    if current is not None:
        stretches.append(current)
    return stretches, flagged


def score(windows: Sequence[tuple[float, float]], stretches: Sequence[tuple[float, float]],
          flagged: Sequence[float]) -> tuple[dict[float, float], float, dict[float, float]]:
    """Recall per duration, precision, and the median onset-to-flag delay per duration."""
    def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a[0] < b[1] and b[0] < a[1]

    found: dict[float, list[bool]] = {d: [] for d in DURATIONS}
    delay: dict[float, list[float]] = {d: [] for d in DURATIONS}
    flags = sorted(flagged)
    for w in windows:
        d = round(w[1] - w[0], 3)
        hit = any(overlaps(w, s) for s in stretches)
        found[d].append(hit)
        j = bisect.bisect_left(flags, w[0])
        if hit and j < len(flags) and flags[j] <= w[1] + 1.0:
            delay[d].append(flags[j] - w[0])
    good = sum(1 for s in stretches if any(overlaps(w, s) for w in windows))
    precision = good / len(stretches) if stretches else 1.0
    return ({d: sum(v) / len(v) for d, v in found.items()}, precision,
            {d: statistics.median(v) if v else float("nan") for d, v in delay.items()})


class Buffer:
    """NVML for one GPU as the agent's gpu collector reads it at ``now``: the samples posted
    since the last read (each ``LAG`` after its stamp) and the gauge (the latest posted
    period's utilisation). ``dry``: no sample is posted for a period without a kernel, as
    NVML's buffer runs dry while the GPU idles."""

    def __init__(self, samples: list[tuple[float, float]], dry: bool) -> None:
        self.samples = samples
        self.times = [t for t, _ in samples]
        self.dry = dry
        self.now = 0.0
        self.read = 0

    def sample_devices(self) -> list[DeviceSample]:
        j = bisect.bisect_right(self.times, self.now - LAG)
        new = [p for p in self.samples[self.read:j] if not (self.dry and p[1] == 0.0)]
        self.read = j
        gauge = self.samples[j - 1][1] if j else 1.0
        return [DeviceSample(gpu=GPU, gpu_util=gauge, util_samples=new)]


def agent_counter(samples: list[tuple[float, float]], interval: float, end: float,
                  dry: bool, hardware: list[tuple[float, float]] | None = None
                  ) -> list[tuple[float, float]]:
    """``mrc_gpu_busy_seconds_total`` at each pass of the agent's gpu and derived collectors
    (the code ``mrc-agent run`` runs) reading :class:`Buffer` every ``interval``; with
    ``hardware``, the PM-sampling points completed by each pass are published as the profiling
    collector publishes them."""
    source = Buffer(samples, dry)
    hw_times = [t for t, _ in hardware or []]
    taken = 0
    gpu = GpuCollector(source)
    derived = DerivedCollector(DerivedThresholds(idle_util=IDLE_UTIL))
    out, k = [], 1
    while k * interval <= end + interval:
        now = source.now = k * interval
        view = PassView(now=now, wall=now, targets=())
        view = view.with_outputs(gpu.update(view).outputs)
        if hardware is not None:
            done = bisect.bisect_right(hw_times, now)
            view = view.with_outputs([HardwareActivity({GPU: tuple(hardware[taken:done])})])
            taken = done
        busy = [v for name, _, v in derived.update(view).samples
                if name == BUSY_SECONDS.name and isinstance(v, float)]
        out.append((now, busy[0] if busy else 0.0))
        k += 1
    return out


def duty_errors(windows: Sequence[tuple[float, float]], samples: list[tuple[float, float]],
                counter: list[tuple[float, float]], end: float, scrape: float
                ) -> tuple[float, float]:
    """Largest error, in percentage points, of the duty cycle over each scrape-to-scrape window
    of 4 scrapes: from the agent's busy-seconds ``counter`` (``rate``; a scrape reads the last
    pass's value) and from ``avg_over_time`` of a scraped utilisation gauge (the latest sample
    at each scrape)."""
    times = [s[0] for s in samples]
    passes = [c[0] for c in counter]

    def counter_at(t: float) -> float:
        i = bisect.bisect_right(passes, t) - 1
        return counter[i][1] if i >= 0 else 0.0

    def gauge_at(t: float) -> float:
        i = bisect.bisect_right(times, t) - 1
        return samples[i][1] if i >= 0 else 1.0

    window = 4 * scrape
    worst_rate = worst_gauge = 0.0
    t = window
    while t <= end:
        true = busy_between(windows, t - window, t) / window
        rate = (counter_at(t) - counter_at(t - window)) / window
        gauge = statistics.mean(gauge_at(t - k * scrape) for k in range(4))
        worst_rate = max(worst_rate, abs(rate - true) * 100)
        worst_gauge = max(worst_gauge, abs(gauge - true) * 100)
        t += scrape
    return worst_rate, worst_gauge


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    windows, end = timeline(args.seed)
    samples = nvml_samples(windows, end, phase=random.Random(args.seed).uniform(0, PERIOD))
    pm = nvml_samples(windows, end, phase=random.Random(args.seed + 1).uniform(0, PM_PERIOD),
                      period=PM_PERIOD)
    hw_way = "agent, 0.1 s, PM-sampling timeline (20 ms)"
    ways = {
        hw_way: agent_stretches(pm, 0.1, end, PM_PERIOD),
        "agent, 1 s, PM-sampling timeline (20 ms)": agent_stretches(pm, 1.0, end, PM_PERIOD),
        "agent, 0.1 s": agent_stretches(samples, 0.1, end),
        "agent, 1 s": agent_stretches(samples, 1.0, end),
        "nvidia-smi dmon -d 1": reading_stretches(samples, 1.0, 0.37, end),
        "dcgm-exporter (30 s collection)": reading_stretches(samples, 30.0, 7.3, end),
    }
    head = " | ".join(f"{d * 1000:g} ms" if d < 1 else f"{d:g} s" for d in DURATIONS)
    rows = [f"| way | recall: {head} | precision |",
            "| --- | " + " | ".join("---:" for _ in DURATIONS) + " | ---: |"]
    delays = [f"| way | onset to idle shown, median: {head} |",
              "| --- | " + " | ".join("---:" for _ in DURATIONS) + " |"]
    verdicts = []
    for name, (stretches, flagged) in ways.items():
        recall, precision, delay = score(windows, stretches, flagged)
        rows.append(f"| {name} | " + " | ".join(f"{recall[d] * 100:.0f} %" for d in DURATIONS)
                    + f" | {precision * 100:.0f} % |")
        delays.append(f"| {name} | " + " | ".join(
            "-" if delay[d] != delay[d] else f"{delay[d]:.2f} s" for d in DURATIONS) + " |")
        if name == "agent, 0.1 s":
            long = [recall[d] for d in DURATIONS if d >= 0.2]
            verdicts.append(f"- agent at 0.1 s: {min(long) * 100:.0f} % recall of windows of "
                            f"200 ms or more, at the least (goal >= 95 %: "
                            f"{'met' if min(long) >= 0.95 else 'NOT met'})")
        if name == hw_way:
            long = [recall[d] for d in DURATIONS if d >= 0.2]
            short = recall[DURATIONS[0]]
            met = min(long) >= 0.95 and short >= 0.8 and precision >= 0.95
            verdicts.append(
                f"- agent at 0.1 s on the PM-sampling timeline: {min(long) * 100:.0f} % recall "
                f"of windows of 200 ms or more (goal >= 95 %), {short * 100:.0f} % of 50 ms "
                f"(goal >= 80 %), precision {precision * 100:.0f} % (goal >= 95 %): "
                f"{'met' if met else 'NOT met'}")
    counters = {
        "agent, 1 s": agent_counter(samples, 1.0, end, dry=False),
        "agent, 0.1 s": agent_counter(samples, 0.1, end, dry=False),
        "agent, 0.1 s, buffer dry while idle": agent_counter(samples, 0.1, end, dry=True),
        "agent, 1 s, PM-sampling timeline": agent_counter(samples, 1.0, end, dry=False,
                                                          hardware=pm),
    }
    duty = ["| scrape interval | " + " | ".join(
        f"rate(), {name}" for name in counters) + " | avg_over_time(gauge) |",
        "| ---: | " + " | ".join("---:" for _ in counters) + " | ---: |"]
    worst = 0.0
    for scrape in SCRAPES:
        cells = []
        for counter in counters.values():
            r, g = duty_errors(windows, samples, counter, end, scrape)
            worst = max(worst, r)
            cells.append(f"{r:.2f} pp")
        duty.append(f"| {scrape:g} s | " + " | ".join(cells) + f" | {g:.2f} pp |")
    verdicts.append(f"- duty cycle through rate(): worst error {worst:.2f} percentage points "
                    f"(goal <= 1: {'met' if worst <= 1.0 else 'NOT met'})")
    text = "\n".join([
        "# GPU idle-window detection and duty cycle, side by side", "",
        f"Generated by `python3 benchmarks/bench_detection.py --seed {args.seed}`: "
        f"{len(windows)} idle windows ({PER_DURATION} of each duration) between busy stretches "
        f"of 2-6 s, {end:.0f} s of trace; NVML's samples every {PERIOD:.3f} s computed from it. "
        "A window shorter than a sample period never makes a sample idle, and one shorter than "
        "two periods does only when a whole period falls inside it: no tool that reads NVML's "
        "utilisation against an idle threshold can see all of them (NVML's physical limit: "
        "windows of two sample periods, about 1/3 s, and more). The PM-sampling rows read the "
        f"GPU-activity percentage of every {PM_PERIOD * 1000:.0f} ms interval, computed from the "
        "same trace (simulated hardware: the H200 check compares it with a real workload).",
        "", *rows, "", *delays, "",
        "Duty cycle over each window of four scrapes, worst error against the trace's own. "
        f"The agent's gpu and derived collectors read NVML's buffer, each sample posted "
        f"{LAG * 1000:.0f} ms after its stamp; dry: no sample posted for a period without a "
        "kernel, as NVML's buffer runs dry while the GPU idles:", "", *duty, "",
        *verdicts, "",
        "Not measured here: the time from onset to mrc_gpu_starved and the share of starved "
        "seconds on the right function, which need a real process: "
        "`benchmarks/bench_starvation.py` (results/starvation.md).",
    ])
    report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
