"""``mrc-agent selfcheck``'s check of the hardware activity timeline: the idle windows the agent
finds in CUPTI's GPU-activity points against idle gaps the workload made on purpose.

The points (``ProfilingSample.activity_points``: ``(monotonic seconds, 0-1 share of the PM
interval the GPU was active)``, one per interval, dated by the interval's end) go through the
agent's own idle detection, :class:`~mrc_agent.agent.core.collectors.derived.IdleTracker` at the
agent's default idle threshold, which returns each window it completes: from its first idle
point to the first busy point after it. Only points inside the workload's
window count: the GPU idles on purpose before and after it. Three things are judged:

- recall per planned gap length: a gap is found when a detected window overlaps it
  (:data:`~.compare.GAP_RECALL_MIN`);
- precision: a detected window that overlaps no gap is a false one, and any is a FAIL (the
  GEMMs keep the GPU busy between the gaps);
- the clock mapping: the median of (detected start - true start) over the gaps found, within
  :data:`~.compare.GAP_OFFSET_MAX_INTERVALS` PM intervals.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mrc_agent.agent.core.collectors.base import DerivedThresholds
from mrc_agent.agent.core.collectors.derived import IdleTracker
from mrc_agent.agent.tools.selfcheck import compare as cmp
from mrc_agent.agent.tools.selfcheck.compare import TruthCheck

NAME = "cupti.activity_idle_gaps"
#: The agent's default idle threshold (``--idle-util-threshold``).
IDLE_THRESHOLD = DerivedThresholds().idle_util
#: Slack at the workload window's edges for the GPU's own start and finish (launch and
#: synchronisation latency), seconds.
EDGE_SLACK_S = 0.005

Point = tuple[float, float]
#: A gap made on purpose: (planned seconds, start, end), monotonic.
Gap = tuple[float, float, float]


def detect_windows(points: Iterable[Point], threshold: float = IDLE_THRESHOLD
                   ) -> list[tuple[float, float]]:
    """The idle windows :class:`IdleTracker` finds in ``points``, ``(start, end)``: from the
    first idle point to the first busy point after it. A window still open after the last
    point ends there."""
    tracker = IdleTracker(threshold)
    windows = tracker.feed(sorted(points))
    if tracker.idle_since is not None and tracker.last_t is not None:
        windows.append((tracker.idle_since, tracker.last_t))
    return windows


def in_workload(points: Iterable[Point], start: float, end: float, interval_s: float
                ) -> list[Point]:
    """The points whose whole interval lies inside the workload's window ``[start, end]``."""
    lo, hi = start + interval_s - EDGE_SLACK_S, end + EDGE_SLACK_S
    return [(t, u) for t, u in points if lo <= t <= hi]


def _overlaps(a0: float, a1: float, b0: float, b1: float) -> bool:
    return a0 < b1 and b0 < a1


def idle_gaps_check(points: Sequence[Point], gaps: Sequence[Gap], start: float, end: float,
                    interval_s: float, threshold: float = IDLE_THRESHOLD,
                    name: str = NAME) -> TruthCheck:
    """The windows found in ``points`` (all the phase's, window cut here) against ``gaps``
    made inside the workload window ``[start, end]`` at a PM interval of ``interval_s``."""
    max_offset = cmp.GAP_OFFSET_MAX_INTERVALS * interval_s
    band = (-max_offset, max_offset)
    text = f"|offset|<={max_offset:g}s"
    inside = in_workload(points, start, end, interval_s)
    if not gaps:
        return TruthCheck(name, cmp.SKIP, None, None, None, band, "s",
                          "the workload made no idle gaps", band_text=text)
    if not inside:
        return TruthCheck(name, cmp.SKIP, None, 0.0, None, band, "s",
                          f"the agent reports no value: no activity points inside the "
                          f"workload's window ({len(points)} in the phase)", band_text=text,
                          missing=True)
    windows = detect_windows(inside, threshold)
    offsets: list[float] = []
    end_offsets: list[float] = []
    found: dict[float, list[int]] = {}
    for planned, g0, g1 in gaps:
        hit = next(((w0, w1) for w0, w1 in windows if _overlaps(w0, w1, g0, g1)), None)
        key = round(planned, 3)
        count = found.setdefault(key, [0, 0])
        count[1] += 1
        if hit is not None:
            count[0] += 1
            offsets.append(hit[0] - g0)
            end_offsets.append(hit[1] - g1)
    false = [(w0, w1) for w0, w1 in windows
             if not any(_overlaps(w0, w1, g0, g1) for _, g0, g1 in gaps)]
    offset, end_offset = cmp.median(offsets), cmp.median(end_offsets)
    problems = []
    for planned, (hits, total) in sorted(found.items()):
        goal = cmp.GAP_RECALL_MIN.get(planned, cmp.GAP_RECALL_MIN_DEFAULT)
        if hits < goal * total - 1e-9:
            problems.append(f"found {hits}/{total} of the {planned * 1e3:g} ms gaps "
                            f"(goal >= {goal:.0%})")
    if false:
        problems.append(f"{len(false)} idle window(s) overlap no gap, first "
                        f"{false[0][0] - start:+.3f}..{false[0][1] - start:+.3f} s into the "
                        f"workload")
    if offset is None:
        problems.append("no gap found, no offset")
    elif abs(offset) > max_offset:
        problems.append(f"median start offset {offset * 1e3:+.0f} ms (max +-"
                        f"{max_offset * 1e3:.0f} ms): the stamps' clock mapping is off")
    recall = ", ".join(f"{p * 1e3:g} ms {h}/{n}" for p, (h, n) in sorted(found.items()))
    note = (f"found {recall}; {len(false)} window(s) outside the gaps; median offset start "
            + (f"{offset * 1e3:+.0f} ms" if offset is not None else "-")
            + (f", end {end_offset * 1e3:+.0f} ms" if end_offset is not None else "")
            + f"; {len(inside)} points at {interval_s * 1e3:g} ms, idle <= {threshold:g}")
    extra = {"recall": {str(p): {"found": h, "gaps": n} for p, (h, n) in found.items()},
             "false_windows": [[w0, w1] for w0, w1 in false], "offsets_s": offsets,
             "end_offsets_s": end_offsets, "windows": len(windows), "points": len(inside)}
    return TruthCheck(name, cmp.FAIL if problems else cmp.PASS, offset, 0.0, None, band, "s",
                      "; ".join(problems) + f" ({note})" if problems else note, extra, text)
