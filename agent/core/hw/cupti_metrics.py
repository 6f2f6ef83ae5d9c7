"""Which CUPTI PM-sampling metrics the profiling source configures on a chip.

PM sampling refuses any configuration that needs more than one pass, and what fits in one pass
differs per chip. cupti-python (>= 13.4) lists the chip's single-pass metric sets
(``profiler_host.get_single_pass_sets`` / ``get_metrics_in_single_pass_set``); the SM and DRAM
metric are chosen from the same set, so together they fit in one pass, and the set's name is
passed to ``Collector.configure(single_pass_metric_set_name=...)``. Where that API is absent or
fails, the sampler falls back to trying :func:`fallback_choices` in order.

Where the names come from:

- ``sm__inst_executed_realtime``: the "realtime" SM counters are what PM-sampling users
  configure (NVIDIA's C ``pm_sampling`` sample, Nsight Compute's PM-sampling section);
  ``sm__inst_executed`` is the range-profiler name, kept for chips whose set offers it.
- ``dram__bytes_read`` / ``dramc__bytes_read`` / ``dram__bytes_op_read``: DRAM read byte
  counters under the names the libnvperf_host.so 13.x tables use on different chips.
- ``dramc__read_throughput`` / ``dram__read_throughput``: what Hopper's PM-sampling sets offer
  instead of a byte count (per the project's issue; to be confirmed on an H200). Their
  ``.avg.pct_of_peak_sustained_elapsed`` is a percentage of peak, never added to a byte total.

``.sum`` is the rollup over all unit instances, so one sample of a counter is the device-wide
count during that interval. A set may list full names or base names without rollups, so names
are matched by base name (the part before the first ``.``) and always configured with the
rollup wanted here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

log = logging.getLogger(__name__)

#: Metric names, most preferred first, with the rollup each is configured with.
SM_INSTRUCTION_METRICS: tuple[str, ...] = (
    "sm__inst_executed_realtime.sum",
    "sm__inst_executed.sum",
)
DRAM_READ_METRICS: tuple[str, ...] = (
    "dram__bytes_read.sum",
    "dramc__bytes_read.sum",
    "dram__bytes_op_read.sum",
)
DRAM_THROUGHPUT_METRICS: tuple[str, ...] = (
    "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__read_throughput.avg.pct_of_peak_sustained_elapsed",
)
#: The preferred pair; the names actually configured per GPU are logged when sampling starts.
PROFILING_METRICS: tuple[str, str] = (SM_INSTRUCTION_METRICS[0], DRAM_READ_METRICS[0])


@dataclass(frozen=True)
class MetricChoice:
    """The metrics configured on one GPU and the single-pass set they came from (if any)."""

    sm_metric: str | None
    dram_metric: str | None
    metric_set: str | None = None

    @property
    def metrics(self) -> list[str]:
        return [m for m in (self.sm_metric, self.dram_metric) if m is not None]

    @property
    def dram_is_ratio(self) -> bool:
        """The DRAM metric is a throughput percentage of peak, not a byte count."""
        return self.dram_metric in DRAM_THROUGHPUT_METRICS

    def describe(self) -> str:
        where = f"set {self.metric_set}" if self.metric_set else "no single-pass set"
        return f"metrics {self.sm_metric}, {self.dram_metric} ({where})"

    def without_set(self) -> MetricChoice:
        return MetricChoice(self.sm_metric, self.dram_metric, None)


def base_name(metric: str) -> str:
    """``dram__bytes_read.sum`` -> ``dram__bytes_read``."""
    return metric.partition(".")[0]


def best_offered(names: Iterable[str], wanted: Sequence[str]) -> str | None:
    """The most preferred of ``wanted`` whose base name is among ``names``, in its full name."""
    bases = {base_name(name.strip()) for name in names}
    return next((w for w in wanted if base_name(w) in bases), None)


def choose_from_sets(sets: Sequence[tuple[str, Sequence[str]]]) -> MetricChoice | None:
    """The best choice any one set offers, ``None`` when no set offers any wanted metric.

    Order: an SM metric with a DRAM byte counter; an SM metric with a DRAM throughput
    percentage; then one metric alone (SM, DRAM bytes, DRAM throughput). Within that, the more
    preferred names; between equals, the set CUPTI lists first.
    """
    best: MetricChoice | None = None
    best_rank: tuple[bool, bool, int, int] | None = None
    for set_name, names in sets:
        names = list(names)
        sm = best_offered(names, SM_INSTRUCTION_METRICS)
        dram = best_offered(names, DRAM_READ_METRICS) or best_offered(
            names, DRAM_THROUGHPUT_METRICS
        )
        if sm is None and dram is None:
            continue
        rank = _rank(sm, dram)
        if best_rank is None or rank < best_rank:
            best, best_rank = MetricChoice(sm, dram, set_name), rank
    return best


def fallback_choices() -> list[MetricChoice]:
    """Every choice in order of preference, for configuring without the set API."""
    sm = SM_INSTRUCTION_METRICS
    pairs = list(product(sm, DRAM_READ_METRICS)) + list(product(sm, DRAM_THROUGHPUT_METRICS))
    out = [MetricChoice(s, d) for s, d in pairs]
    out += [MetricChoice(s, None) for s in sm]
    out += [MetricChoice(None, d) for d in DRAM_READ_METRICS + DRAM_THROUGHPUT_METRICS]
    return out


def query_sets(lib: Any, chip: str, errors: tuple[type[BaseException], ...]
               ) -> list[tuple[str, list[str]]] | None:
    """``(set name, metric names)`` for each single-pass set of ``chip``; ``None`` when the
    installed cupti-python has no set API (older than 13.4) or it fails (``errors``), so the
    caller falls back to trying names in order."""
    host = getattr(lib, "profiler_host", None)
    get_sets = getattr(host, "get_single_pass_sets", None)
    get_metrics = getattr(host, "get_metrics_in_single_pass_set", None)
    if not callable(get_sets) or not callable(get_metrics):
        return None
    try:
        # Both raise ValueError for a chip get_supported_chips() does not list.
        return [(str(name), [str(m) for m in get_metrics(chip, name)]) for name in get_sets(chip)]
    except errors as exc:
        log.info("CUPTI single-pass metric sets of %s unavailable (%s: %s); trying metric "
                 "names in order", chip, type(exc).__name__, exc)
        return None


def _rank(sm: str | None, dram: str | None) -> tuple[bool, bool, int, int]:
    """Lower is better: a pair before one metric alone, a byte counter before a throughput
    percentage, then the more preferred names. One metric alone needs no more: an SM name's
    index is below ``len(SM_INSTRUCTION_METRICS)``, the index a missing SM metric gets, so SM
    alone comes before DRAM bytes alone, which the throughput flag puts before throughput."""
    return (sm is None or dram is None, dram in DRAM_THROUGHPUT_METRICS,
            _index(SM_INSTRUCTION_METRICS, sm),
            _index(DRAM_READ_METRICS + DRAM_THROUGHPUT_METRICS, dram))


def _index(names: tuple[str, ...], name: str | None) -> int:
    return names.index(name) if name is not None else len(names)
