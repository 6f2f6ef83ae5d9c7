"""Which CUPTI PM-sampling metrics the profiling source configures on a chip, and in what unit
the DRAM one counts.

PM sampling refuses any configuration that needs more than one pass, and what fits in one pass
differs per chip. cupti-python (>= 13.4) lists the chip's single-pass metric sets
(``profiler_host.get_single_pass_sets`` / ``get_metrics_in_single_pass_set``); the SM and DRAM
metric are chosen from the same set, so together they fit in one pass, and the set's name is
passed to ``Collector.configure(single_pass_metric_set_name=...)``. Where that API is absent or
fails, the sampler falls back to trying :func:`fallback_choices` in order.

What the chips offer (``libcupti.so.13`` 13.4.92 and 13.5.25 carry each set as a YAML
document; ``tests/data/cupti_sets`` keeps them, read out of the wheels):

- SM instructions: ``sm__inst_executed_realtime`` on GH100, GB100, GR100 and GB20x, the
  "realtime" counter PM sampling collects; ``sm__inst_executed`` is the range profiler's name,
  kept for chips whose set offers it.
- DRAM reads as **32-byte sectors**: ``dramc__sectors_op_read`` (GH100, the H100/H200),
  ``dram__sectors_read`` (GB100), ``dram__sectors_op_read`` (GR100, GB20x). No set of any chip
  offers a DRAM *read byte* counter; ``dram__bytes_read`` / ``dramc__bytes_read`` /
  ``dram__bytes_op_read`` are still tried first, for a chip that may.
- DRAM read throughput as a percentage of peak: the user metric
  ``Compute_Triage.dramc__read_throughput`` (GH100), ``Compute_Triage.dram__read_throughput``
  (GB100), ``dram__read_throughput`` (GR100). Its ``.avg.pct_of_peak_sustained_elapsed`` is
  never added to a byte total.

A name is matched on its ``__`` token, whatever ``<set>.`` or ``<UNIT>.<set>.`` prefix and
rollup suffix it carries (:func:`split_name`), and configured by its full name: the prefix it is
listed with, the token, and the rollup wanted here. ``.sum`` is the rollup over all unit
instances, so one sample of a counter is the device-wide count during that interval.

Sectors become bytes only once the unit is known (:func:`with_unit`): CUPTI's own answer for
the metric (``ProfilerHost.get_metric_properties(...).dim_unit``) where cupti-python has it,
else the metric's name; :class:`MetricChoice` carries both the factor and where it came from,
and the profiling collector exports them on ``mrc_gpu_profiling_metrics_info``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
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
DRAM_SECTOR_METRICS: tuple[str, ...] = (
    "dramc__sectors_op_read.sum",
    "dram__sectors_op_read.sum",
    "dram__sectors_read.sum",
)
DRAM_THROUGHPUT_METRICS: tuple[str, ...] = (
    "dramc__read_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__read_throughput.avg.pct_of_peak_sustained_elapsed",
)
#: GPU activity: the share of each interval the graphics/compute engine was active, the
#: hardware timeline idle windows are found on. GH100's ``Compute_Triage`` set offers
#: ``gr__cycles_active``; ``sm__cycles_active`` (some SM active) is the nearest stand-in.
GPU_ACTIVE_METRICS: tuple[str, ...] = (
    "gr__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm__cycles_active.avg.pct_of_peak_sustained_elapsed",
)
#: DRAM read counters, bytes before sectors: both sum to a byte total.
DRAM_COUNT_METRICS: tuple[str, ...] = DRAM_READ_METRICS + DRAM_SECTOR_METRICS
#: The preferred pair; the names actually configured per GPU are logged when sampling starts.
PROFILING_METRICS: tuple[str, str] = (SM_INSTRUCTION_METRICS[0], DRAM_READ_METRICS[0])

#: Bytes in one DRAM sector (Nsight Compute's metrics guide: "a sector is an aligned 32 byte
#: chunk of memory in a cache line or device memory").
SECTOR_BYTES = 32

#: Values of ``MetricChoice.dram_unit``.
UNIT_BYTES, UNIT_SECTORS, UNIT_PERCENT = "bytes", "sectors", "percent_of_peak"
#: Values of ``MetricChoice.dram_unit_basis``: where the unit was read.
BASIS_CUPTI, BASIS_NAME = "cupti_metric_properties", "metric_name"


def split_name(metric: str) -> tuple[str, str, str]:
    """``(prefix, token, rollup)`` of a CUPTI metric name, split around its ``__`` token.

    ``Compute_Triage.dramc__read_throughput.avg.pct_of_peak_sustained_elapsed`` ->
    ``("Compute_Triage.", "dramc__read_throughput", ".avg.pct_of_peak_sustained_elapsed")``;
    ``dram__bytes_read.sum`` -> ``("", "dram__bytes_read", ".sum")``. A name without ``__``
    is all token.
    """
    parts = metric.strip().split(".")
    at = next((i for i, part in enumerate(parts) if "__" in part), None)
    if at is None:
        return "", metric.strip(), ""
    prefix = ".".join(parts[:at])
    rollup = ".".join(parts[at + 1:])
    return (prefix + "." if prefix else "", parts[at], "." + rollup if rollup else "")


def token(metric: str) -> str:
    """The ``__`` token of a metric name: what two spellings of one metric share."""
    return split_name(metric)[1]


def base_name(metric: str) -> str:
    """The name without its rollup: ``Compute_Triage.dramc__read_throughput.avg.pct...`` ->
    ``Compute_Triage.dramc__read_throughput``."""
    prefix, tok, _ = split_name(metric)
    return prefix + tok


def _kind(metric: str | None) -> str | None:
    if metric is None:
        return None
    tok = token(metric)
    for names, kind in ((DRAM_READ_METRICS, UNIT_BYTES), (DRAM_SECTOR_METRICS, UNIT_SECTORS),
                        (DRAM_THROUGHPUT_METRICS, UNIT_PERCENT)):
        if tok in {token(n) for n in names}:
            return kind
    return None


@dataclass(frozen=True)
class MetricChoice:
    """The metrics configured on one GPU, the single-pass set they came from (if any), and
    how a DRAM count becomes bytes (``dram_bytes_per_unit``; ``None`` for a percentage)."""

    sm_metric: str | None
    dram_metric: str | None
    metric_set: str | None = None
    dram_unit: str | None = None
    dram_bytes_per_unit: int | None = None
    dram_unit_basis: str | None = None
    #: The GPU-activity percentage sampled beside them (:data:`GPU_ACTIVE_METRICS`), if any.
    active_metric: str | None = None

    @property
    def metrics(self) -> list[str]:
        return [m for m in (self.sm_metric, self.dram_metric, self.active_metric)
                if m is not None]

    @property
    def dram_is_ratio(self) -> bool:
        """The DRAM metric is a throughput percentage of peak, not a byte count."""
        return _kind(self.dram_metric) == UNIT_PERCENT

    @property
    def is_pair(self) -> bool:
        return self.sm_metric is not None and self.dram_metric is not None

    def describe(self) -> str:
        where = f"set {self.metric_set}" if self.metric_set else "no single-pass set"
        unit = ""
        if self.dram_unit == UNIT_SECTORS:  # the one conversion: say where its unit came from
            unit = (f"; DRAM read in {self.dram_bytes_per_unit}-byte sectors, unit from "
                    f"{self.dram_unit_basis}")
        active = f", activity {self.active_metric}" if self.active_metric else ""
        return f"metrics {self.sm_metric}, {self.dram_metric}{active} ({where}{unit})"


def best_offered(names: Iterable[str], wanted: Sequence[str]) -> str | None:
    """The most preferred of ``wanted`` whose ``__`` token is among ``names``, as the full
    name to configure: the prefix it is offered with, the token and the wanted rollup."""
    offered: dict[str, str] = {}
    for name in names:
        prefix, tok, _ = split_name(name)
        offered.setdefault(tok, prefix)
    for want in wanted:
        _, tok, rollup = split_name(want)
        if tok in offered:
            return offered[tok] + tok + rollup
    return None


def choices_from_sets(sets: Sequence[tuple[str, Sequence[str]]]) -> list[MetricChoice]:
    """Every choice the sets offer, best first.

    Order: an SM metric with a DRAM read counter (bytes, then sectors); an SM metric with a
    DRAM throughput percentage; then one metric alone (SM, DRAM count, DRAM throughput).
    Within that, the more preferred names; between equals, the set CUPTI lists first. A pair
    always comes from one set, so that it fits in one pass, and carries the set's GPU-activity
    metric where it offers one (:func:`ordered_choices` tries it without as well).
    """
    ranked: list[tuple[tuple[bool, bool, int, int], int, MetricChoice]] = []
    for set_name, names in sets:
        names = list(names)
        sm = best_offered(names, SM_INSTRUCTION_METRICS)
        count = best_offered(names, DRAM_COUNT_METRICS)
        pct = best_offered(names, DRAM_THROUGHPUT_METRICS)
        active = best_offered(names, GPU_ACTIVE_METRICS)
        options: list[tuple[str | None, str | None]] = [
            (sm, d) for d in (count, pct) if sm is not None and d is not None]
        options += [(sm, None), (None, count), (None, pct)]
        for s_metric, d_metric in options:
            if s_metric is None and d_metric is None:
                continue
            choice = MetricChoice(s_metric, d_metric, set_name, active_metric=active)
            ranked.append((_rank(s_metric, d_metric), len(ranked), choice))
    out: list[MetricChoice] = []
    for _, _, choice in sorted(ranked, key=lambda r: (r[0], r[1])):
        if choice not in out:
            out.append(choice)
    return out


def choose_from_sets(sets: Sequence[tuple[str, Sequence[str]]]) -> MetricChoice | None:
    """The best choice any one set offers (:func:`choices_from_sets`), ``None`` when no set
    offers any wanted metric."""
    return next(iter(choices_from_sets(sets)), None)


def fallback_choices() -> list[MetricChoice]:
    """Every choice in order of preference, for configuring without the set API."""
    sm = SM_INSTRUCTION_METRICS
    pairs = list(product(sm, DRAM_COUNT_METRICS)) + list(product(sm, DRAM_THROUGHPUT_METRICS))
    out = [MetricChoice(s, d) for s, d in pairs]
    out += [MetricChoice(s, None) for s in sm]
    out += [MetricChoice(None, d) for d in DRAM_COUNT_METRICS + DRAM_THROUGHPUT_METRICS]
    return out


def ordered_choices(from_sets: Sequence[MetricChoice], modes: Sequence[Any] = (None,)
                    ) -> list[tuple[MetricChoice, Any]]:
    """``(choice, trigger mode)`` to try, in order: the sets' pairs in every mode (with their
    GPU-activity metric, then without it), then per mode every fallback pair, and only then
    one metric alone (the sets' first). A set whose lists miss a DRAM name must not let an
    SM-only configuration, which configures fine, stop a working pair from being tried.
    Among the fallbacks a better trigger mode comes before a better name (both refusals are
    one ValueError to the caller)."""
    fallback = fallback_choices()
    lead = [c for c in from_sets if c.is_pair]
    lead += [replace(c, active_metric=None) for c in lead if c.active_metric is not None]
    pairs = [c for c in fallback if c.is_pair]
    singles = [c for c in from_sets if not c.is_pair] + [c for c in fallback if not c.is_pair]
    return ([(c, m) for c in lead for m in modes] + [(c, m) for m in modes for c in pairs]
            + [(c, m) for m in modes for c in singles])


UnitLookup = Callable[[str], "str | None"]


def with_unit(choice: MetricChoice, unit_of: UnitLookup | None) -> MetricChoice | None:
    """``choice`` with its DRAM unit settled, or ``None`` when CUPTI names a unit that is
    neither bytes nor sectors for a DRAM count (then it is not counted as bytes at all).

    ``unit_of(metric)`` is CUPTI's ``dim_unit`` for the metric, ``None`` where it cannot say;
    then the unit is the one the metric's name states, and the basis says so.
    """
    kind = _kind(choice.dram_metric)
    if choice.dram_metric is None or kind is None:
        return choice
    if kind == UNIT_PERCENT:
        return replace(choice, dram_unit=UNIT_PERCENT, dram_bytes_per_unit=None,
                       dram_unit_basis=BASIS_NAME)
    said = unit_of(choice.dram_metric) if unit_of is not None else None
    if said is None:
        unit, basis = kind, BASIS_NAME
    else:
        text = said.strip().lower()
        unit = UNIT_SECTORS if "sector" in text else UNIT_BYTES if "byte" in text else ""
        basis = BASIS_CUPTI
        if not unit:
            log.warning("CUPTI gives %s the unit %r, neither bytes nor sectors: not counted "
                        "as DRAM bytes", choice.dram_metric, said)
            return None
    return replace(choice, dram_unit=unit,
                   dram_bytes_per_unit=SECTOR_BYTES if unit == UNIT_SECTORS else 1,
                   dram_unit_basis=basis)


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


def unit_lookup(lib: Any, chip: str, errors: tuple[type[BaseException], ...]
                ) -> UnitLookup | None:
    """``metric -> dim_unit`` from ``profiler_host.ProfilerHost(chip, PM_SAMPLING)`` (host
    side only: no GPU, no context), or ``None`` where cupti-python has no such API. A metric
    it cannot describe answers ``None``; the host object is released after each question."""
    host_api = getattr(lib, "profiler_host", None)
    make = getattr(host_api, "ProfilerHost", None)
    kinds = getattr(host_api, "ProfilerType", None)
    if not callable(make) or kinds is None or not hasattr(kinds, "PM_SAMPLING"):
        return None

    known: dict[str, str | None] = {}

    def unit_of(metric: str) -> str | None:
        if metric not in known:  # asked once per metric, however many modes are tried
            known[metric] = _ask(metric)
        return known[metric]

    def _ask(metric: str) -> str | None:
        host = None
        try:
            host = make(chip, kinds.PM_SAMPLING)
            host.initialize()
            unit = getattr(host.get_metric_properties(metric), "dim_unit", None)
        except errors as exc:
            log.info("CUPTI metric properties of %s on %s unavailable (%s: %s); its unit is "
                     "taken from its name", metric, chip, type(exc).__name__, exc)
            return None
        finally:
            if host is not None:
                try:
                    host.deinitialize()
                except errors as exc:
                    log.debug("ProfilerHost.deinitialize(): %s", exc)
        return str(unit) if unit is not None else None

    return unit_of


def _rank(sm: str | None, dram: str | None) -> tuple[bool, bool, int, int]:
    """Lower is better: a pair before one metric alone, a count before a throughput
    percentage, then the more preferred names. One metric alone needs no more: an SM name's
    index is below ``len(SM_INSTRUCTION_METRICS)``, the index a missing SM metric gets, so SM
    alone comes before a DRAM count alone, which the throughput flag puts before throughput."""
    return (sm is None or dram is None, _kind(dram) == UNIT_PERCENT,
            _index(SM_INSTRUCTION_METRICS, sm),
            _index(DRAM_COUNT_METRICS + DRAM_THROUGHPUT_METRICS, dram))


def _index(names: tuple[str, ...], name: str | None) -> int:
    if name is None:
        return len(names)
    tokens = [token(n) for n in names]
    return tokens.index(token(name)) if token(name) in tokens else len(names)
