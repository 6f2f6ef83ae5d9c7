"""``mrc-agent selfcheck``'s measurement: run each workload phase while polling the agent's
readers, then turn what they reported into :class:`~.compare.TruthCheck` rows.

:class:`AgentReaders` polls the agent's own sources (NVML device samples, GPM on its own
cadence, CUPTI PM sampling) and keeps every reading with its monotonic time; :func:`observe`
runs one workload call in a thread while polling, with a reading before and one after; the
``*_checks`` functions pick the readings of the steady part of each window and hand numbers to
the pure comparisons.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mrc_agent.agent.core.hw.base import (
    DeviceSample,
    DeviceSource,
    GpmSample,
    GpmSource,
    HardwareError,
    ProfilingSample,
    ProfilingSource,
    SourceUnavailable,
)
from mrc_agent.agent.tools.selfcheck import compare as cmp
from mrc_agent.agent.tools.selfcheck import timeline
from mrc_agent.agent.tools.selfcheck.compare import TruthCheck
from mrc_agent.agent.tools.selfcheck.workload import GapsDone, WorkDone, Workload

#: NVML's PCIe thread reads every 0.25 s (+40 ms of reads); a reading this far into a window
#: is the window's own.
PCIE_RATE_SETTLE_S = 0.6
#: nvmlDeviceGetUtilizationRates averages over up to 1 s (NVML: 1/6 s to 1 s by product).
GPU_UTIL_SETTLE_S = 1.2


@dataclass
class Poll:
    """One reading of every source at monotonic time ``t``; ``gpm`` is None when GPM was not
    due. Sources that failed are missing (their error is kept by :class:`AgentReaders`).
    ``devices_returned`` is when the device call returned: its utilisation samples may be
    as new as that, not only as ``t``. Rows are keyed by UUID: a MIG device shares its
    parent's index and would otherwise overwrite the parent's row."""

    t: float
    devices_returned: float = 0.0
    devices: dict[str, DeviceSample] = field(default_factory=dict)
    gpm: dict[str, GpmSample] | None = None
    profiling: dict[str, ProfilingSample] = field(default_factory=dict)


class AgentReaders:
    """The agent's readers under test, polled; GPM at most every ``gpm_interval`` seconds.

    ``before_poll`` runs before each poll (the tests use it to move hand-written fakes on).
    ``pcie_settle`` and ``util_settle`` are how far into a window PCIe rates and NVML
    utilisation rates are the window's own.
    """

    def __init__(self, device: DeviceSource, gpm: GpmSource | None,
                 profiling: ProfilingSource | None, gpm_interval: float, poll_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 before_poll: Callable[[], None] | None = None,
                 pcie_settle: float = PCIE_RATE_SETTLE_S,
                 util_settle: float = GPU_UTIL_SETTLE_S) -> None:
        self.device, self.gpm_source, self.profiling = device, gpm, profiling
        self.pcie_settle, self.util_settle = pcie_settle, util_settle
        self.gpm_interval = gpm_interval
        self.poll_s = poll_s
        self.clock = clock
        self.before_poll = before_poll
        #: source -> the first error it raised, for the notes of the checks it starves.
        self.errors: dict[str, str] = {}
        self.polls: list[Poll] = []
        # A GPM call a hair early could be answered from the sampler's previous window; the
        # margin keeps every call a fresh window.
        self._gpm_every = gpm_interval + min(0.05, poll_s / 2)
        self._next_gpm = 0.0

    @property
    def gpm_settle(self) -> float:
        """How far into a window a GPM value only covers that window: the window the sampler
        returns may have begun up to two GPM calls before."""
        return 2 * (self._gpm_every + self.poll_s) + self.poll_s

    def _call(self, name: str, fn: Callable[[], list[Any]]) -> list[Any] | None:
        try:
            return fn()
        except (SourceUnavailable, HardwareError) as exc:
            self.errors.setdefault(name, f"{type(exc).__name__}: {exc}")
            return None

    def poll(self) -> Poll:
        if self.before_poll is not None:
            self.before_poll()
        now = self.clock()
        p = Poll(now)
        got = self._call("device", self.device.sample_devices)
        p.devices = {s.gpu.uuid: s for s in got or ()}
        p.devices_returned = self.clock()
        if self.gpm_source is not None and now >= self._next_gpm:
            self._next_gpm = now + self._gpm_every
            gpm = self._call("gpm", self.gpm_source.sample_gpm)
            p.gpm = {s.gpu.uuid: s for s in gpm} if gpm is not None else None
        if self.profiling is not None:
            prof = self._call("profiling", self.profiling.sample_profiling)
            p.profiling = {s.gpu.uuid: s for s in prof or ()}
        self.polls.append(p)
        return p

    def note(self, source: str) -> str:
        err = self.errors.get(source)
        return f"{source} source: {err}" if err else ""


@dataclass
class Phase:
    """One workload call and the readings around it: ``before`` right before it started,
    ``polls`` while it ran, ``after`` once it ended and the counters settled."""

    name: str
    work: WorkDone | None
    before: Poll
    after: Poll
    polls: list[Poll]
    start: float
    end: float


def observe(readers: AgentReaders, name: str, action: Callable[[], WorkDone | None],
            settle_s: float) -> Phase:
    """Run ``action`` in a thread, polling the readers until it returns."""
    before = readers.poll()
    result: list[WorkDone | None] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(action())
        except BaseException as exc:  # re-raised below, in the caller's thread
            failure.append(exc)

    start = readers.clock()
    thread = threading.Thread(target=target, name=f"selfcheck-{name}", daemon=True)
    thread.start()
    polls = []
    while thread.is_alive():
        thread.join(readers.poll_s)
        if thread.is_alive():
            polls.append(readers.poll())
    end = readers.clock()
    if failure:
        raise failure[0]
    time.sleep(settle_s)
    after = readers.poll()
    work = result[0] if result else None
    if work is not None:
        # The workload's own window: from its first enqueue to its final synchronisation.
        start, end = work.start, work.end
    return Phase(name, work, before, after, polls, start, end)


# --- picking readings ------------------------------------------------------------------------

def device_value(poll: Poll, gpu: str, attr: str) -> float | None:
    s = poll.devices.get(gpu)
    return getattr(s, attr, None) if s is not None else None


def device_series(phase: Phase, gpu: str, attr: str) -> list[tuple[float, float | None]]:
    return [(p.t, device_value(p, gpu, attr)) for p in phase.polls]


def gpm_series(phase: Phase, gpu: str, attr: str) -> list[tuple[float, float | None]]:
    out: list[tuple[float, float | None]] = []
    for p in phase.polls:
        if p.gpm is not None and gpu in p.gpm:
            out.append((p.t, getattr(p.gpm[gpu], attr, None)))
    return out


def counter_delta(phase: Phase, gpu: str, attr: str, kind: str = "device") -> float | None:
    """Growth of a cumulative counter from just before the phase to after it settled."""
    if kind == "device":
        return cmp.delta(device_value(phase.before, gpu, attr), device_value(phase.after, gpu,
                                                                             attr))
    b, a = phase.before.profiling.get(gpu), phase.after.profiling.get(gpu)
    return cmp.delta(getattr(b, attr, None) if b else None, getattr(a, attr, None) if a else None)


def steady(phase: Phase, series: list[tuple[float, float | None]],
           settle: float) -> float | None:
    """Median of the readings from ``settle`` seconds into the phase to its end."""
    return cmp.median(cmp.window_values(series, phase.start + settle, phase.end))


# --- the checks --------------------------------------------------------------------------------

def pcie_checks(phase: Phase, gpu: str, readers: AgentReaders) -> list[TruthCheck]:
    """A one-way copy against the GPU's PCIe counters and rates. Host->device arrives on the
    GPU's RX; device->host leaves on its TX."""
    assert phase.work is not None
    wanted, other = ("rx", "tx") if phase.name == "h2d" else ("tx", "rx")
    p = f"pcie.{phase.name}"
    ref = float(phase.work.bytes)
    bw = phase.work.bandwidth
    why = readers.note("device")
    d_wanted = counter_delta(phase, gpu, f"pcie_{wanted}_bytes_total")
    d_other = counter_delta(phase, gpu, f"pcie_{other}_bytes_total")
    out = [cmp.ratio_check(f"{p}.{wanted}_counter", d_wanted, ref, cmp.PCIE_COUNTER_BAND, "B",
                           why or f"pcie_{wanted}_bytes_total delta / bytes copied")]
    rate_wanted = steady(phase, device_series(phase, gpu, f"pcie_{wanted}_bytes_per_second"),
                         readers.pcie_settle)
    rate_other = steady(phase, device_series(phase, gpu, f"pcie_{other}_bytes_per_second"),
                        readers.pcie_settle)
    if d_wanted is not None and d_other is not None:
        out.append(cmp.direction_check(f"{p}.direction", d_wanted, d_other,
                                       what=" (byte counters)"))
    else:
        check = cmp.direction_check(f"{p}.direction", rate_wanted, rate_other,
                                    what=" (NVML throughput)")
        check.unit = "B/s"
        out.append(check)
    # Where the backend reports which reading its rates come from (throughput call or
    # byte counters), the note says so.
    sample = phase.after.devices.get(gpu)
    source = (getattr(sample, "sources", None) or {}).get("pcie") if sample else None
    out.append(cmp.ratio_check(f"{p}.{wanted}_rate", rate_wanted, bw, cmp.PCIE_RATE_BAND, "B/s",
                               why or "NVML rate / copy bandwidth (CUDA events)"
                               + (f", rate from {source}" if source else "")))
    gpm_rate = steady(phase, gpm_series(phase, gpu, f"pcie_{wanted}_bytes_per_second"),
                      readers.gpm_settle)
    out.append(cmp.ratio_check(f"{p}.gpm_{wanted}_rate", gpm_rate, bw, cmp.GPM_PCIE_RATE_BAND,
                               "B/s", readers.note("gpm") or "GPM window / copy bandwidth"))
    return out


def dram_checks(d2d: Phase, idle: Phase, gpu: str, readers: AgentReaders) -> list[TruthCheck]:
    """A device-to-device copy against CUPTI's DRAM read bytes and GPM's DRAM bandwidth."""
    assert d2d.work is not None
    out = []
    read = counter_delta(d2d, gpu, "dram_read_bytes_total", kind="profiling")
    ratio_busy = cmp.median(v for _, v in _prof_series(d2d, gpu, "dram_read_throughput_ratio")
                            if v is not None)
    if read is None and ratio_busy is not None:
        ratio_idle = cmp.median(v for _, v in _prof_series(idle, gpu,
                                                           "dram_read_throughput_ratio")
                                if v is not None)
        check = cmp.busy_idle_check("cupti.dram_read", ratio_busy, ratio_idle,
                                    cmp.DRAM_RATIO_BUSY_MIN, cmp.DRAM_RATIO_IDLE_MAX,
                                    d2d.work.duty)
        check.note = ("weaker check: this chip's PM sampling has only a read-throughput "
                      "ratio, no byte counter; " + check.note)
        out.append(check)
    else:
        out.append(cmp.ratio_check("cupti.dram_read_bytes", read, float(d2d.work.bytes),
                                   cmp.DRAM_READ_BAND, "B", readers.note("profiling")
                                   or "dram_read_bytes_total delta / bytes the copy read"))
    out.append(_busy_idle("gpm.dram_bw_util", d2d, idle, gpu, readers,
                          cmp.GPM_DRAM_BUSY_MIN, cmp.GPM_DRAM_IDLE_MAX))
    return out


def _prof_series(phase: Phase, gpu: str, attr: str) -> list[tuple[float, float | None]]:
    return [(p.t, getattr(p.profiling.get(gpu), attr, None)) for p in phase.polls]


def _busy_idle(name: str, busy: Phase, idle: Phase, gpu: str, readers: AgentReaders,
               busy_min: float, idle_max: float) -> TruthCheck:
    assert busy.work is not None
    attr = name.split(".", 1)[1]
    if name.startswith("gpm."):
        settle = readers.gpm_settle
        b = steady(busy, gpm_series(busy, gpu, attr), settle)
        i = steady(idle, gpm_series(idle, gpu, attr), settle)
        why = readers.note("gpm")
    else:
        b = steady(busy, device_series(busy, gpu, attr), readers.util_settle)
        i = steady(idle, device_series(idle, gpu, attr), readers.util_settle)
        why = readers.note("device")
    check = cmp.busy_idle_check(name, b, i, busy_min, idle_max, busy.work.duty)
    if why and check.verdict == cmp.SKIP:
        check.note += f" ({why})"
    return check


def gemm_checks(gemm: Phase, idle: Phase, gpu: str, readers: AgentReaders) -> list[TruthCheck]:
    """Back-to-back bf16 GEMMs against GPM sm_util and tensor_util and NVML gpu_util."""
    return [
        _busy_idle("gpm.sm_util", gemm, idle, gpu, readers, cmp.GPM_SM_BUSY_MIN,
                   cmp.GPM_SM_IDLE_MAX),
        _busy_idle("gpm.tensor_util", gemm, idle, gpu, readers, cmp.GPM_TENSOR_BUSY_MIN,
                   cmp.GPM_TENSOR_IDLE_MAX),
        _busy_idle("nvml.gpu_util", gemm, idle, gpu, readers, cmp.GPU_UTIL_BUSY_MIN,
                   cmp.GPU_UTIL_IDLE_MAX),
    ]


def doubling_check(single: Phase, double: Phase, gpu: str, readers: AgentReaders) -> TruthCheck:
    """SM instructions over N GEMMs and over 2N."""
    attr = "sm_instructions_executed_total"
    check = cmp.doubling_check("cupti.sm_instructions_2x",
                               counter_delta(single, gpu, attr, kind="profiling"),
                               counter_delta(double, gpu, attr, kind="profiling"))
    n = single.work.count if single.work else 0
    check.note = (readers.note("profiling") or check.note) + f" (N = {n})"
    return check


def timestamp_check(readers: AgentReaders, gpu: str, start: float,
                    after: int) -> TruthCheck:
    """Utilisation samples of every poll after the ``after``-th against the monotonic clock."""
    calls = []
    for p in readers.polls[after:]:
        s = p.devices.get(gpu)
        if s is not None:
            calls.append((p.devices_returned, list(s.util_samples)))
    check = cmp.timestamps_check("nvml.util_samples_time", calls, start)
    if check.verdict == cmp.SKIP and readers.note("device"):
        check.note += f" ({readers.note('device')})"
    return check


def activity_gap_check(phase: Phase, gpu: str, readers: AgentReaders,
                       interval_s: float) -> TruthCheck:
    """The activity points CUPTI gave while GEMM stretches alternated with idle gaps (every
    poll of the phase and the one after it; each carries the points decoded since the one
    before) against the gaps (:mod:`.timeline`)."""
    name = timeline.NAME
    work = phase.work
    if not isinstance(work, GapsDone):
        return cmp.skip(name, "the workload made no idle gaps", "s")
    samples = [s for s in (p.profiling.get(gpu) for p in [*phase.polls, phase.after])
               if s is not None]
    if not any(s.sm_metric or s.dram_metric or s.activity_metric for s in samples):
        why = readers.note("profiling") or "PM sampling is not running on this GPU"
        return cmp.skip(name, f"the agent reports no value: profiling unavailable ({why})",
                        "s", missing=True)
    if not any(s.activity_metric for s in samples):
        metric_set = next((s.metric_set for s in samples if s.metric_set), None)
        return cmp.skip(name, "unverifiable: this chip's PM sampling offers no GPU-activity "
                        f"metric (set {metric_set}), so the agent keeps NVML's points", "s")
    if work.busy_duty < cmp.MIN_WORKLOAD_DUTY:
        return cmp.skip(name, f"the GEMMs kept the GPU busy only {work.busy_duty:.2f} of the "
                        f"stretches between the gaps (< {cmp.MIN_WORKLOAD_DUTY:.2f}); no busy "
                        "reference", "s")
    # Through JSON (the sampler's process) a point arrives as a list.
    points = [(float(t), float(u)) for s in samples for t, u in s.activity_points]
    return timeline.idle_gaps_check(points, work.gaps, work.start, work.end, interval_s)


def nvlink_checks(peer: Phase, src: str, dst: str) -> list[TruthCheck]:
    """A peer copy against the source GPU's NVLink TX and the destination's RX counters."""
    assert peer.work is not None
    ref = float(peer.work.bytes)
    return [
        cmp.ratio_check("nvlink.peer_tx", counter_delta(peer, src, "nvlink_tx_bytes_total"), ref,
                        cmp.NVLINK_BAND, "B", f"GPU {src} TX delta / bytes copied to GPU {dst}"),
        cmp.ratio_check("nvlink.peer_rx", counter_delta(peer, dst, "nvlink_rx_bytes_total"), ref,
                        cmp.NVLINK_BAND, "B", f"GPU {dst} RX delta / bytes copied from GPU {src}"),
    ]


def nvlink_peer(poll: Poll, gpu: str, work: Workload,
                nvml_uuid: Callable[[int], str | None]) -> tuple[int, str] | None:
    """A CUDA peer of device 0 whose GPU, like the one under test, has active NVLink links;
    ``(cuda index, NVML UUID)``, or None."""
    here = poll.devices.get(gpu)
    if here is None or not here.nvlink_links:
        return None
    for a, b in work.peers():
        if a != 0:
            continue
        uuid = nvml_uuid(b)
        there = poll.devices.get(uuid) if uuid is not None else None
        if uuid is not None and there is not None and there.nvlink_links:
            return b, uuid
    return None


def _mib(memory: dict[str, Any] | None) -> str:
    if not memory:
        return "unknown"
    if "error" in memory:
        return f"unknown ({memory['error']})"
    return f"{memory.get('bytes', 0) / 2**20:.0f} MiB" + ("" if memory.get("listed") else
                                                         " (not listed by NVML)")


def sampler_check(report: dict[str, Any], readers: AgentReaders) -> TruthCheck:
    """The CUPTI sampler's own process: PM sampling started in it, without torch, and what
    the process holds on the GPU before and after (the retained primary context's cost)."""
    name = "cupti.sampler_process"
    if "error" in report:
        return cmp.skip(name, f"the sampler process gave no report: {report['error']}",
                        missing=True)
    before, after = report.get("memory_before"), report.get("memory_started")
    libs = (report.get("libcupti") or {}).get("mapped") or []
    where = "its own process" if report.get("own_process") else "this process (dry run)"
    note = (f"sampler in {where}, pid {report.get('pid')}; GPU memory before "
            f"{_mib(before)}, after PM sampling started {_mib(after)}; retained primary "
            f"contexts {report.get('retained_contexts')}; libcupti "
            f"{', '.join(libs) if libs else 'not mapped'}")
    measured = float(after["bytes"]) if after and "bytes" in after else None
    reference = float(before["bytes"]) if before and "bytes" in before else None
    if report.get("own_process") and report.get("torch_imported"):
        return TruthCheck(name, cmp.FAIL, measured, reference, None, None, "B",
                          "torch was imported in the sampler's process; " + note)
    if not report.get("started"):
        statuses = report.get("statuses") or []
        last = statuses[-1] if statuses else ("not_started", "")
        why = readers.note("profiling") or f"status {last[0]}: {last[1]}"
        return TruthCheck(name, cmp.SKIP, measured, reference, None, None, "B",
                          f"the agent reports no value: PM sampling never started ({why}); "
                          + note, missing=True)
    metrics = ", ".join(report.get("metrics") or [])
    return TruthCheck(name, cmp.PASS, measured, reference, None, None, "B",
                      f"started with {metrics} (set {report.get('metric_set')}); " + note)
