"""Profiling collector: true SM instructions executed and DRAM bytes read (CUPTI PM sampling,
opt-in), and the pass-level statement of which source feeds the compute-to-memory signal.

Where the chip's PM-sampling set offers a GPU-activity metric, its 20 ms timeline
(``hw.cupti_timeline``) is published as :class:`HardwareActivity` for the derived collector,
which finds idle windows on it in place of NVML's 1/6 s samples.

``mrc_agent_compute_memory_source_info`` is written every pass by :func:`compute_memory_source`
(a pass finisher), whether or not this collector is on, so a dashboard never passes the GPM
activity quotient off as an instruction count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from mrc_agent.agent.core.attribution import MODE_TARGETS, MODE_UNKNOWN, Attribution
from mrc_agent.agent.core.collectors.base import (
    GPU,
    BuildContext,
    CollectorDef,
    FinisherDef,
    PassView,
    Processes,
    Update,
    field_samples,
    require,
)
from mrc_agent.agent.core.collectors.gpm import GpmReadings
from mrc_agent.agent.core.collectors.gpu import GpuReadings
from mrc_agent.agent.core.hw.base import (
    GPUIdentity,
    ProfilingSample,
    ProfilingScope,
    ProfilingSource,
    ScopedProfilingSource,
    SourceUnavailable,
)
from mrc_agent.agent.core.hw.cupti_metrics import SECTOR_BYTES, UNIT_BYTES, UNIT_SECTORS
from mrc_agent.agent.core.sample import Sample, counter, gauge, info

NAME = "profiling"

SM_INSTRUCTIONS = counter(NAME, "mrc_gpu_sm_instructions_executed_total", GPU,
                          "SM instructions executed (CUPTI PM sampling of sm__inst_executed).")
DRAM_READ_BYTES = counter(NAME, "mrc_gpu_dram_read_bytes_total", GPU,
                          "Bytes read from DRAM (CUPTI PM sampling of a DRAM read byte counter, "
                          "named by mrc_gpu_profiling_metrics_info).")
DRAM_READ_THROUGHPUT = gauge(
    NAME, "mrc_gpu_dram_read_throughput_ratio", GPU,
    "PM-sampling DRAM read throughput as a fraction of peak (0-1), the mean over the "
    "intervals since the last pass, where the chip's single-pass set has no DRAM byte "
    "counter. Not a byte count.")
PROFILING_METRICS_INFO = info(
    NAME, "mrc_gpu_profiling_metrics_info",
    (*GPU, "sm_metric", "dram_metric", "metric_set", "dram_unit", "dram_unit_bytes",
     "dram_unit_basis", "activity_metric", "activity_clock"),
    "Which CUPTI PM-sampling metrics feed the profiling counters of a sampling GPU: the "
    "SM-instruction metric, the DRAM metric and the single-pass metric set (none where "
    "there is none), and the basis of mrc_gpu_dram_read_bytes_total: what the DRAM metric "
    "counts (bytes, sectors or percent_of_peak), the bytes in one such unit, whether "
    "CUPTI's metric properties or the metric's name said so, and the GPU-activity metric "
    "whose timeline the idle windows are found on (none: NVML's utilisation samples), and "
    "the clock its sample stamps were found on (realtime, boottime or monotonic; unknown: "
    "none fits and the timeline is not used; none: no stamp yet).")
METRICS = (SM_INSTRUCTIONS, DRAM_READ_BYTES, DRAM_READ_THROUGHPUT, PROFILING_METRICS_INFO)

#: Source values of :data:`COMPUTE_MEMORY_SOURCE`.
SOURCE_PROFILING, SOURCE_GPM, SOURCE_NONE = "cupti_pm_sampling", "gpm_activity_proxy", "none"

COMPUTE_MEMORY_SOURCE = info(
    "agent", "mrc_agent_compute_memory_source_info", ("source", "reason"),
    "Which source feeds the compute-to-memory signal: cupti_pm_sampling (true "
    "instructions and DRAM bytes), gpm_activity_proxy (GPM activity ratios), or none, "
    "and why the profiling counters are not used.")

_FIELDS = {
    "sm_instructions_executed_total": SM_INSTRUCTIONS,
    "dram_read_bytes_total": DRAM_READ_BYTES,
    "dram_read_throughput_ratio": DRAM_READ_THROUGHPUT,
}


@dataclass(frozen=True)
class ProfilingStatus:
    """The profiling collector's output: whether its source works (``reason`` "ok"), and
    why not."""

    reason: str
    detail: str = ""


@dataclass(frozen=True)
class HardwareActivity:
    """The PM-sampling GPU-activity points decoded this pass, ``(monotonic seconds, 0-1)``
    oldest first, for each watched GPU that samples a GPU-activity metric (possibly none this
    pass); a GPU not in it has no hardware timeline."""

    points: Mapping[GPUIdentity, tuple[tuple[float, float], ...]]


def timelines(readings: GpuReadings, hardware: HardwareActivity | None
              ) -> dict[GPUIdentity, Sequence[tuple[float, float]]]:
    """Each GPU's utilisation points this pass: its hardware timeline where it has one (its
    NVML points left out: mixed in, they would mark later hardware points as already seen),
    else NVML's (or the replayed trace's)."""
    out: dict[GPUIdentity, Sequence[tuple[float, float]]] = dict(readings.util_points)
    if hardware is not None:
        out.update(hardware.points)
    return out


class ProfilingCollector:
    """True instruction and DRAM-read counters; ``status`` (also published as
    :class:`ProfilingStatus`) says whether the profiling source works, and why not."""

    name = NAME

    def __init__(self, source: ProfilingSource | None, gpus: str = MODE_TARGETS) -> None:
        self._source = source
        self._gpus = gpus
        self.status: tuple[str, str] = ("not_requested", "")

    def update(self, view: PassView) -> Update:
        decided: list[Attribution] = []  # the decision made while sampling, if one was

        def scope_of(gpus: Sequence[GPUIdentity]) -> ProfilingScope:
            # This pass's decision (the gpu collector's, or made here from ``gpus``): a source
            # that holds hardware per GPU takes only the pod's GPUs (agent.core.attribution).
            att = view.decide_gpus(self._gpus, gpus)
            decided.append(att)
            return profiling_scope(att, gpus)

        try:
            source = require(self._source)
            if isinstance(source, ScopedProfilingSource):
                samples = source.sample_profiling_for(scope_of)
            else:  # a recorded trace holds nothing: filtered below
                samples = source.sample_profiling()
        except Exception as exc:
            if isinstance(exc, SourceUnavailable):
                self.status = (exc.reason, exc.detail)
            return Update([], (ProfilingStatus(*self.status), *decided[:1]), error=exc)
        out: list[Sample] = []
        att = decided[0] if decided else view.decide_gpus(self._gpus, [s.gpu for s in samples])
        one_sided: list[str] = []
        for s in samples:
            if att.watches(s.gpu):  # only this pod's targets' GPUs (agent.core.attribution)
                out.extend(field_samples(s, _FIELDS, s.gpu.labels))
                out.extend(_metrics_info(s))
                missing = _missing_side(s)
                if missing:
                    one_sided.append(f"GPU {s.gpu.index}: no {missing} counter")
        # Instructions per DRAM byte needs both counters: with one, the profiling source
        # runs but cannot feed the compute-to-memory signal, and must not say "ok".
        self.status = ("degraded", "; ".join(one_sided)) if one_sided else ("ok", "")
        activity = HardwareActivity(MappingProxyType({
            s.gpu: s.activity_points for s in samples
            if s.activity_metric is not None and att.watches(s.gpu)}))
        return Update(out, (ProfilingStatus(*self.status), att, activity))


def profiling_scope(att: Attribution, gpus: Sequence[GPUIdentity]) -> ProfilingScope:
    """The GPUs of ``gpus`` a profiling source may hold under ``att``: the pod's, or every one
    (marked undecided) while no target says which are its own. ``doctor`` uses it too, so it
    tries the GPUs the agent would profile and no others."""
    return ProfilingScope(frozenset(g for g in gpus if att.watches(g)),
                          undecided=att.mode == MODE_UNKNOWN)


def _missing_side(s: ProfilingSample) -> str:
    """Which true counter a GPU that samples lacks ("" when it has both, or samples nothing):
    a DRAM throughput percentage is no byte count."""
    has_sm = s.sm_instructions_executed_total is not None
    has_dram = s.dram_read_bytes_total is not None
    if has_sm == has_dram and (has_sm or s.dram_read_throughput_ratio is None):
        return ""
    return "SM instruction" if not has_sm else "DRAM read byte"


def _metrics_info(s: ProfilingSample) -> list[Sample]:
    """The live CUPTI names of a GPU that samples; nothing for one that does not (or a replay
    trace, which records values, not names)."""
    if s.sm_metric is None and s.dram_metric is None:
        return []
    names = tuple(n or "none" for n in (s.sm_metric, s.dram_metric, s.metric_set))
    unit = s.dram_unit or "none"
    per_unit = {UNIT_BYTES: "1", UNIT_SECTORS: str(SECTOR_BYTES)}.get(unit, "none")
    basis = (s.dram_unit_basis or "none", s.activity_metric or "none",
             s.activity_clock or "none")
    return [(PROFILING_METRICS_INFO.name, (*s.gpu.labels, *names, unit, per_unit, *basis), {})]


def compute_memory_source(view: PassView) -> list[Sample]:
    """(source, reason) of the compute-to-memory signal: never pass one off as the other."""
    status = view.get(ProfilingStatus)
    reason = status.reason if status is not None else "not_requested"
    if reason == "ok":
        labels = (SOURCE_PROFILING, "ok")
    else:
        labels = (SOURCE_GPM if view.get(GpmReadings) is not None else SOURCE_NONE, reason)
    return [(COMPUTE_MEMORY_SOURCE.name, labels, {})]


def _build(ctx: BuildContext) -> ProfilingCollector:
    return ProfilingCollector(ctx.sources.profiling, ctx.gpus)


DEFINITION = CollectorDef(
    name=NAME, default_on=False, factory=_build, metrics=METRICS,
    reads=(Processes, Attribution), provides=(Attribution, ProfilingStatus, HardwareActivity),
    description="CUPTI PM sampling: true SM instructions and DRAM bytes read, or DRAM read "
                "throughput where the chip has no byte counter (opt-in).")
#: Says, once per pass, which source feeds the compute-to-memory signal.
FINISHER = FinisherDef("compute_memory_source", compute_memory_source, (COMPUTE_MEMORY_SOURCE,))
