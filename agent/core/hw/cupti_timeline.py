"""The hardware GPU-activity timeline from CUPTI PM sampling, on the agent's monotonic clock.

Where the chip's PM-sampling set offers a GPU-activity metric (``cupti_metrics``:
``gr__cycles_active.avg.pct_of_peak_sustained_elapsed`` on GH100), each decoded interval gives
the share of that interval the graphics/compute engine was active. At the sampler's 20 ms
interval that is a utilisation point every 20 ms, where NVML gives one every 1/6 s: an idle
window of 50 ms spans two points here and none of NVML's.

Each sample carries its start and end stamp in nanoseconds
(``CUpti_PmSampling_CounterData_GetSampleInfo_Params``: ``startTimestamp``, ``endTimestamp``;
cupti-python's samples: ``start_timestamp``, ``end_timestamp``), CPU-based per the CUPTI User
Guide but on a clock it does not name. So the clock is identified the way NVML's sample
timestamps are (:func:`identify_clock`), from the newest stamp of the first batch: realtime,
boottime or monotonic, whichever "now" it is closest to without being ahead of it. A point is
dated by its end stamp (the interval's value is complete there, as NVML's samples are). Stamps
on no known clock give no points (the GPU's NVML points stay in use) and are logged once. The
hardware check (``benchmarks/h200_check.sh``) is where the clock is confirmed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mrc_agent.agent.core.hw.base import ratio_of_percent
from mrc_agent.agent.core.hw.nvml.units import identify_clock, nvml_timestamp_to_monotonic

log = logging.getLogger(__name__)

#: Points kept between two takes: a minute at 20 ms. Older ones are dropped first (a pass that
#: never comes must not grow the agent), and the busy time they stood for is not counted.
MAX_PENDING_POINTS = 3000
_NS_PER_US = 1000
#: Not yet identified (``None`` is "identified: on no known clock").
_UNSET = "unset"

#: One decoded interval: the metric values in configured order, and the end stamp (ns).
Row = tuple[list[float | None], int | None]


def decode_rows(data: Any, metrics: Sequence[str | None]) -> list[Row]:
    """Each completed sample of a ``decode()`` answer as its values for ``metrics`` (``None``
    for a name that is ``None`` or that the answer lacks) and its end stamp (``None`` when it
    has none)."""
    names = list(data.metrics)
    at = [names.index(m) if m in names else None for m in metrics]
    rows: list[Row] = []
    for sample in data:  # evaluates each completed sample on the host
        values = sample.metric_values
        stamp = getattr(sample, "end_timestamp", None)
        rows.append(([values[i] if i is not None else None for i in at],
                     stamp if isinstance(stamp, int) and stamp > 0 else None))
    return rows


class ActivityTimeline:
    """One GPU's activity points, ``(monotonic seconds, 0-1 ratio)``, waiting to be taken.

    ``clock`` is the agent's monotonic clock; ``sample_clocks`` the clocks a stamp may be on,
    by name (``nvml.device.default_sample_clocks``)."""

    def __init__(self, label: str, clock: Callable[[], float],
                 sample_clocks: dict[str, Callable[[], float]]) -> None:
        self._label = label
        self._clock = clock
        self._sample_clocks = sample_clocks
        self._stamp_clock: str | None = _UNSET
        self._pending: deque[tuple[float, float]] = deque(maxlen=MAX_PENDING_POINTS)
        self._last_stamp = 0

    @property
    def stamp_clock(self) -> str | None:
        """The clock the stamps were found on (``realtime``, ``boottime``, ``monotonic``), or
        ``unknown`` when they fit none; ``None`` before the first stamp."""
        if self._stamp_clock == _UNSET:
            return None
        return self._stamp_clock or "unknown"

    def add(self, points: Iterable[tuple[int | None, float | None]]) -> None:
        """``(end stamp in ns, activity percentage)`` per decoded interval, oldest first."""
        fresh = [(stamp, pct) for stamp, pct in points
                 if stamp is not None and stamp > self._last_stamp]
        if not fresh:
            return
        newest = max(stamp for stamp, _ in fresh)
        self._last_stamp = newest
        mono_now = self._clock()
        nows = {name: read() for name, read in self._sample_clocks.items()}
        if self._stamp_clock == _UNSET:
            self._stamp_clock = identify_clock(newest // _NS_PER_US, nows)
            if self._stamp_clock is None:
                log.warning("%s: PM-sampling stamps fit no known clock; its hardware activity "
                            "timeline is not used", self._label)
            else:
                log.info("%s: PM-sampling stamps are on the %s clock", self._label,
                         self._stamp_clock)
        if self._stamp_clock is None:
            return
        wall_now = nows[self._stamp_clock]
        for stamp, pct in sorted(fresh, key=lambda p: p[0]):
            ratio = ratio_of_percent(pct)
            if ratio is not None:
                when = nvml_timestamp_to_monotonic(stamp // _NS_PER_US, mono_now=mono_now,
                                                   wall_now=wall_now)
                self._pending.append((when, ratio))

    def take(self) -> tuple[tuple[float, float], ...]:
        """The points added since the last take, oldest first."""
        out = tuple(self._pending)
        self._pending.clear()
        return out
