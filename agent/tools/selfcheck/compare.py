"""``mrc-agent selfcheck``'s verdicts: the agent's readings against an independent reference,
as pure functions of numbers (no GPU, no NVML, no torch), with every tolerance in one place.

Each check returns a :class:`TruthCheck` whose verdict is ``PASS``, ``FAIL`` or ``SKIP``;
``SKIP`` means "not verified" (the agent reports no value, or the reference itself is not
trustworthy), never "fine". Ratios are reported whatever the verdict, so a run that passes
still says how close it was.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

# --- tolerances, each with why it is what it is -----------------------------------------------

#: NVML_FI_DEV_PCIE_COUNT_{TX,RX}_BYTES / copied payload. PCIe counters may count whole TLPs:
#: a memory-write TLP carries at most the max payload size (256 B on most servers) behind
#: ~20-26 B of header, sequence number and LCRC (+8-10 %), and the completions that carry a
#: host->device DMA read are often split at the root complex's 64 B read completion boundary
#: (+25-40 %); DLLPs (ACK, flow control) add 1-2 %. A counter of payload only reads 1.0. The
#: floor allows 10 % for the counter's update latency at the edge of the window.
PCIE_COUNTER_BAND = (0.90, 1.45)
#: The opposite direction's bytes / the copy direction's, during a one-way copy: DMA read
#: requests (one ~24 B TLP per <=512 B read) and ACK/flow-control DLLPs stay under ~10 %; a
#: swapped TX/RX reads > 1.
PCIE_DIRECTION_MAX_SHARE = 0.25
#: nvmlDeviceGetPcieThroughput (a 20 ms window, "KB/s") / the copy's bandwidth timed with CUDA
#: events. Same protocol overhead as the counters, NVML's unstated kilo (1000 or 1024: 2.4 %),
#: and a 20 ms window that can straddle the gap between two batches of copies.
PCIE_RATE_BAND = (0.70, 1.60)
#: GPM's PCIe MiB/s over >= 1 s windows / the same reference: averaged, so a tighter floor.
GPM_PCIE_RATE_BAND = (0.80, 1.50)
#: CUPTI dram__bytes_read.sum over a device-to-device copy / the bytes the copy reads. The
#: buffers (1 GiB) are ~20x the H200's 50 MB L2, so the L2 can serve at most ~5 % of the next
#: pass; the ceiling allows background traffic and the counter interval at the window edge.
DRAM_READ_BAND = (0.85, 1.30)
#: Where the chip's PM sampling only has a read-throughput percentage: a D2D copy saturates
#: HBM (reads are about half of its traffic), so anything above 10 % of peak while copying and
#: below 5 % idle is plausible. Weaker: it checks the signal, not the byte count.
DRAM_RATIO_BUSY_MIN, DRAM_RATIO_IDLE_MAX = 0.10, 0.05
#: GPM dram_bw_util while a 1 GiB D2D copy loops: HBM-bound, so well above 30 %; idle means
#: no process but this one on the GPU, so below 5 %.
GPM_DRAM_BUSY_MIN, GPM_DRAM_IDLE_MAX = 0.30, 0.05
#: GPM sm_util during back-to-back 8192^3 bf16 GEMMs (every SM holds CTAs for the whole run)
#: and when idle.
GPM_SM_BUSY_MIN, GPM_SM_IDLE_MAX = 0.80, 0.05
#: GPM tensor_util (any tensor pipe active, of peak) for the same GEMMs: cuBLAS reaches well
#: over half of peak on this shape; 0.30 leaves room for GPM's normalisation to peak.
GPM_TENSOR_BUSY_MIN, GPM_TENSOR_IDLE_MAX = 0.30, 0.05
#: NVML gpu_util is "a kernel ran during the sample period": back-to-back GEMMs read ~100 %.
GPU_UTIL_BUSY_MIN, GPU_UTIL_IDLE_MAX = 0.90, 0.10
#: A workload that kept the GPU busy less than this fraction of its window (CUDA events) does
#: not make a busy reference; the check is then SKIP, not blamed on the agent.
MIN_WORKLOAD_DUTY = 0.90
#: SM instructions of 2N identical GEMMs / of N: 2 within +-15 %.
DOUBLING_BAND = (1.70, 2.30)
#: A utilisation sample may be at most this much older than the run's first reading (NVML's
#: buffer is read from the priming call on; one sample period plus clock disagreement).
TIMESTAMP_SLACK_S = 1.0
#: NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{TX,RX} count data payload (the DATA, not RAW, fields),
#: so a peer copy's bytes read ~1.0; the band allows flits' padding and the window edge.
NVLINK_BAND = (0.90, 1.30)
#: The hardware activity timeline (a CUPTI point every 20 ms) against idle gaps made on
#: purpose: the share of gaps of each planned length the agent's idle detection must find. A
#: 50 ms gap holds at least one whole 20 ms interval, but only just (two where its start falls
#: early enough in an interval), so one in five may blur into its neighbours' busy edges; from
#: 100 ms on every gap holds four whole intervals and must be found.
GAP_RECALL_MIN = {0.05: 0.80}
GAP_RECALL_MIN_DEFAULT = 1.0
#: |median(detected start - true start)| over the gaps found, in PM-sampling intervals. A
#: point is dated by its interval's end and only an interval wholly idle reads idle, so a
#: correct clock mapping trails by one to two intervals (~+30 ms at 20 ms); a stamp clock off
#: by 100 ms reads -70 or +130 ms.
GAP_OFFSET_MAX_INTERVALS = 2.0


@dataclass
class TruthCheck:
    """One row of the table: what was compared, both numbers, the verdict and why."""

    name: str
    verdict: str
    measured: float | None = None
    reference: float | None = None
    ratio: float | None = None
    band: tuple[float, float] | None = None
    unit: str = ""
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: How the band reads in the table where "low-high" would mislead (thresholds, bounds).
    band_text: str = ""
    #: SKIP because the agent reported nothing (not because the reference was unusable):
    #: what :func:`require` turns into a FAIL on a part that has the metric.
    missing: bool = False

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["band"] = list(self.band) if self.band is not None else None
        return out


def median(values: Iterable[float]) -> float | None:
    """The median of the finite values, or None when there are none."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def window_values(points: Iterable[tuple[float, float | None]], start: float,
                  end: float) -> list[float]:
    """The values of ``(time, value)`` points with ``start <= time <= end``, None dropped."""
    return [v for t, v in points if start <= t <= end and v is not None]


def delta(before: float | None, after: float | None) -> float | None:
    """How much a cumulative counter grew; None when either reading is missing."""
    if before is None or after is None:
        return None
    return after - before


def in_band(value: float, band: tuple[float, float]) -> bool:
    return band[0] <= value <= band[1]


def ratio_check(name: str, measured: float | None, reference: float | None,
                band: tuple[float, float], unit: str, why: str = "") -> TruthCheck:
    """PASS when ``measured / reference`` lies in ``band`` (inclusive)."""
    if measured is None:
        return TruthCheck(name, SKIP, None, reference, None, band, unit,
                          "the agent reports no value" + (f"; {why}" if why else ""),
                          missing=True)
    if reference is None or not reference > 0:
        return TruthCheck(name, SKIP, measured, reference, None, band, unit,
                          "no usable reference (the workload measured nothing)")
    ratio = measured / reference
    verdict = PASS if in_band(ratio, band) else FAIL
    return TruthCheck(name, verdict, measured, reference, ratio, band, unit, why)


def direction_check(name: str, wanted: float | None, other: float | None,
                    max_share: float = PCIE_DIRECTION_MAX_SHARE, what: str = "") -> TruthCheck:
    """During a one-way transfer the other direction carries at most ``max_share`` of it.

    ``wanted`` is the direction the copy must show up in (host->device is the GPU's RX).
    """
    band = (0.0, max_share)
    if wanted is None or other is None:
        return TruthCheck(name, SKIP, other, wanted, None, band, "B", "the agent reports no value",
                          missing=True)
    if not wanted > 0:
        return TruthCheck(name, FAIL, other, wanted, None, band, "B",
                          f"no traffic at all in the copy's direction{what}")
    share = other / wanted
    verdict = PASS if 0 <= share <= max_share else FAIL
    note = f"other direction / copy direction{what}"
    if share > 1:
        note += "; TX and RX look swapped"
    return TruthCheck(name, verdict, other, wanted, share, band, "B", note,
                      band_text=f"<={max_share:g}")


def busy_idle_check(name: str, busy: float | None, idle: float | None, busy_min: float,
                    idle_max: float, duty: float | None,
                    min_duty: float = MIN_WORKLOAD_DUTY) -> TruthCheck:
    """A 0-1 activity metric reads at least ``busy_min`` under load and at most ``idle_max``
    idle. ``duty`` is the fraction of the busy window the workload kept the GPU busy (CUDA
    events): the independent evidence that the GPU was in fact busy."""
    band = (idle_max, busy_min)
    extra = {"busy": busy, "idle": idle, "duty": duty}
    text = f"idle<={idle_max:g} busy>={busy_min:g}"
    if busy is None or idle is None:
        return TruthCheck(name, SKIP, busy, duty, None, band, "ratio",
                          "the agent reports no value " + ("under load" if busy is None
                                                           else "when idle"), extra, text,
                          missing=True)
    if duty is None or duty < min_duty:
        return TruthCheck(name, SKIP, busy, duty, None, band, "ratio",
                          f"the workload kept the GPU busy only {_fmt_ratio(duty)} of the "
                          f"window (< {min_duty:.2f}); no busy reference", extra, text)
    failures = []
    if busy < busy_min:
        failures.append(f"busy {busy:.2f} < {busy_min:.2f}")
    if idle > idle_max:
        failures.append(f"idle {idle:.2f} > {idle_max:.2f}")
    note = (f"busy {busy:.2f} (min {busy_min:.2f}), idle {idle:.2f} (max {idle_max:.2f}); "
            f"reference: workload duty {duty:.2f} (CUDA events)")
    if failures:
        note = "; ".join(failures) + f"; workload duty {duty:.2f}"
    return TruthCheck(name, FAIL if failures else PASS, busy, duty, None, band, "ratio", note,
                      extra, text)


def doubling_check(name: str, single: float | None, double: float | None,
                   band: tuple[float, float] = DOUBLING_BAND) -> TruthCheck:
    """A counter's growth over 2N units of work is twice its growth over N."""
    check = ratio_check(name, double, single, band, "inst",
                        "2N GEMMs / N GEMMs, expected 2")
    if check.verdict == SKIP and single is not None and not single > 0:
        check.note = "no instructions counted over N GEMMs"
        check.verdict = FAIL
    return check


def timestamps_check(name: str, calls: Sequence[tuple[float, Sequence[tuple[float, float]]]],
                     start: float, slack: float = TIMESTAMP_SLACK_S) -> TruthCheck:
    """Every utilisation sample ``(monotonic time, ratio)`` returned by a call made at
    monotonic time ``called`` lies in ``[start - slack, called]``, oldest first within a call.

    ``calls`` is ``[(called, points), ...]`` for the calls after the priming one (whose points
    are NVML's buffer from before the run and are not checked).
    """
    points = [(called, t) for called, pts in calls for t, _ in pts]
    band = (-slack, 0.0)
    if not points:
        return TruthCheck(name, SKIP, None, None, None, band, "s",
                          "the agent returned no utilisation samples (GetSamples unsupported?)",
                          missing=True)
    too_old = [t for _, t in points if t < start - slack]
    future = [t for called, t in points if t > called]
    unordered = sum(1 for _, pts in calls
                    for (a, _), (b, _) in zip(pts, pts[1:], strict=False) if b < a)
    worst_early = min(t - start for _, t in points)
    worst_late = max(t - called for called, t in points)
    problems = []
    if too_old:
        problems.append(f"{len(too_old)} point(s) older than the run's start - {slack:g} s "
                        f"(earliest {worst_early:+.3f} s)")
    if future:
        problems.append(f"{len(future)} point(s) after the call that returned them "
                        f"(by up to {worst_late:.3f} s)")
    if unordered:
        problems.append(f"{unordered} point(s) out of order")
    note = (f"{len(points)} points in {len(calls)} calls, earliest {worst_early:+.3f} s from "
            f"the start, latest {worst_late:+.3f} s from their call")
    return TruthCheck(name, FAIL if problems else PASS, worst_early, -slack, None, band, "s",
                      "; ".join(problems) if problems else note,
                      {"points": len(points), "latest_after_call_s": worst_late},
                      f"start-{slack:g}s..call")


def skip(name: str, why: str, unit: str = "", missing: bool = False) -> TruthCheck:
    return TruthCheck(name, SKIP, unit=unit, note=why, missing=missing)


# --- what a part must report ----------------------------------------------------------------

#: Checks a single Hopper+ GPU cannot be asked for: NVLink needs a peer GPU.
NOT_REQUIRED_PREFIXES = ("nvlink.",)


def hopper_or_newer(capability: tuple[int, int] | None, architecture: str | None) -> bool:
    """Hopper (compute capability 9.0) or newer, by the capability CUDA reports, else by
    NVML's architecture name (``HOPPER``, ``BLACKWELL``, ``RUBIN``; NVML's DLA and NPU
    numbers are higher but are no GPUs)."""
    if capability is not None:
        return tuple(capability) >= (9, 0)
    return architecture in ("HOPPER", "BLACKWELL", "RUBIN")


def require(checks: Iterable[TruthCheck], part: str) -> list[TruthCheck]:
    """On a part that has every metric checked (``part`` says which, e.g. "Hopper+ (compute
    capability 9.0)"), a SKIP because the agent reported nothing becomes a FAIL: the agent
    missing a metric the hardware has is the failure the check exists to find."""
    out = []
    for c in checks:
        if c.verdict == SKIP and c.missing and not c.name.startswith(NOT_REQUIRED_PREFIXES):
            c.verdict = FAIL
            c.note = f"{part} has this metric: {c.note}"
        out.append(c)
    return out


def exit_code(checks: Iterable[TruthCheck]) -> int:
    """0 when nothing failed, 1 when anything did (a SKIP does not; on Hopper+ a metric the
    agent did not report is a FAIL, :func:`require`)."""
    return 1 if any(c.verdict == FAIL for c in checks) else 0


def counts(checks: Iterable[TruthCheck]) -> dict[str, int]:
    out = {PASS: 0, FAIL: 0, SKIP: 0}
    for c in checks:
        out[c.verdict] += 1
    return out


# --- the table --------------------------------------------------------------------------------

def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_value(value: float | None, unit: str) -> str:
    """A number in the table's units: GB (10^9) for bytes, GB/s for rates."""
    if value is None:
        return "-"
    if unit == "B":
        return f"{value / 1e9:.3f} GB"
    if unit == "B/s":
        return f"{value / 1e9:.2f} GB/s"
    if unit == "ratio":
        return f"{value:.2f}"
    if unit == "s":
        return f"{value:+.3f} s"
    if unit == "inst":
        return f"{value:.4g}"
    return f"{value:.4g}"


def format_table(checks: Sequence[TruthCheck]) -> str:
    """The PASS/FAIL/SKIP table as printed and written to gpu_truth.txt."""
    header = ("check", "verdict", "agent", "reference", "ratio", "band", "note")
    rows = [header]
    for c in checks:
        band = c.band_text or ("-" if c.band is None else f"{c.band[0]:g}-{c.band[1]:g}")
        rows.append((c.name, c.verdict, format_value(c.measured, c.unit),
                     format_value(c.reference, c.unit if c.unit != "ratio" else "ratio"),
                     _fmt_ratio(c.ratio), band, c.note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
             for r in rows]
    n = counts(checks)
    lines.append(f"{n[PASS]} PASS, {n[FAIL]} FAIL, {n[SKIP]} SKIP")
    return "\n".join(line.rstrip() for line in lines) + "\n"
