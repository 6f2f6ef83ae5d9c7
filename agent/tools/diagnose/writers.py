"""The files of one diagnosis (:data:`FILES`): ``samples.jsonl``, ``golden_triangle.csv`` and
the text of ``report.txt``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from typing import Any

from mrc_agent.agent.core.catalog import CATALOG
from mrc_agent.agent.core.collectors import derived, gpm, gpu, process, profiling
from mrc_agent.agent.core.collectors.base import GPU
from mrc_agent.agent.core.sample import HistogramValue, Snapshot, first, readings

#: The files of one diagnosis, in the order report.txt lists them.
FILES = {
    "flamegraph": "flamegraph.svg",
    "stacks": "stacks.txt",
    "samples": "samples.jsonl",
    "golden_triangle": "golden_triangle.csv",
    "report_json": "report.json",
    "report_txt": "report.txt",
}


_LABELS = {s.name: s.labels for s in CATALOG}


def _jsonable(value: Any) -> Any:
    if isinstance(value, HistogramValue):
        return {"buckets": dict(zip((str(b) for b in value.bounds), value.counts, strict=True)),
                "count": value.total, "sum": value.sum}
    return value


def write_samples(path: str, snaps: Sequence[Snapshot], start_wall: float) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for snap in snaps:
            rows = [{"name": n, "labels": dict(zip(_LABELS.get(n, ()), labels, strict=False)),
                     "value": _jsonable(v)} for n, labels, v in snap.samples]
            f.write(json.dumps({"time": round(snap.timestamp, 4),
                                "elapsed_seconds": round(snap.timestamp - start_wall, 4),
                                "samples": rows}) + "\n")


CSV_COLUMNS = ("time", "elapsed_seconds", "pid", "cpu_user_ratio", "hottest_thread_cpu_user_ratio",
               "gpu", "gpu_utilization_ratio", "pcie_tx_bytes_per_second",
               "pcie_rx_bytes_per_second", "nvlink_tx_bytes_per_second",
               "nvlink_rx_bytes_per_second", "sm_active_ratio",
               "dram_bandwidth_utilization_ratio", "gpm_sm_to_dram_activity",
               "sm_instructions_per_dram_byte", "gpu_starved")


#: Every per-GPU series with only the GPU's labels: a GPU with any of them gets a row.
_PER_GPU = [spec for spec in CATALOG if spec.labels == GPU]
#: Counters whose column is their increase per second since the previous pass.
_COUNTERS = (gpu.NVLINK_TX, gpu.NVLINK_RX, profiling.SM_INSTRUCTIONS, profiling.DRAM_READ_BYTES)


def write_golden_triangle(path: str, snaps: Sequence[Snapshot], pid: int,
                          start_wall: float) -> None:
    """One row per pass and GPU: the three corners side by side. Counter-based columns are the
    increase since the previous pass."""
    prev: dict[tuple[str, tuple[str, ...]], tuple[float, float]] = {}
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for snap in snaps:
            cpu_user = first(snap, process.CPU_USER_RATIO, pid=str(pid))
            hottest = first(snap, process.HOTTEST_THREAD_USER_RATIO, pid=str(pid))
            starved = first(snap, derived.STARVED, pid=str(pid))
            per_gpu: dict[tuple[str, ...], dict[str, float]] = {}
            for spec in _PER_GPU:
                for reading in readings(snap, spec):
                    if isinstance(reading.value, (int, float)):
                        per_gpu.setdefault(reading.key(GPU), {})[spec.name] = float(reading.value)
            rates: dict[tuple[str, ...], dict[str, float]] = {}
            for g, vals in per_gpu.items():
                for spec in _COUNTERS:
                    if spec.name in vals:
                        before = prev.get((spec.name, g))
                        if before is not None and snap.timestamp > before[0]:
                            rates.setdefault(g, {})[spec.name] = (
                                vals[spec.name] - before[1]) / (snap.timestamp - before[0])
                        prev[(spec.name, g)] = (snap.timestamp, vals[spec.name])

            def fmt(v: float | None) -> str:
                return "" if v is None else f"{v:.6g}"

            base = [f"{snap.timestamp:.3f}", f"{snap.timestamp - start_wall:.3f}", str(pid),
                    fmt(cpu_user), fmt(hottest)]
            if not per_gpu:
                w.writerow(base + [""] * (len(CSV_COLUMNS) - len(base) - 1) + [fmt(starved)])
            for g, vals in sorted(per_gpu.items()):
                r = rates.get(g, {})
                ipb = None
                if r.get(profiling.DRAM_READ_BYTES.name):
                    ipb = (r.get(profiling.SM_INSTRUCTIONS.name, 0.0)
                           / r[profiling.DRAM_READ_BYTES.name])
                w.writerow(base + [
                    g[0], fmt(vals.get(gpu.UTILIZATION.name)),
                    fmt(vals.get(gpu.PCIE_TX.name)),
                    fmt(vals.get(gpu.PCIE_RX.name)),
                    fmt(vals.get(gpm.NVLINK_TX.name, r.get(gpu.NVLINK_TX.name))),
                    fmt(vals.get(gpm.NVLINK_RX.name, r.get(gpu.NVLINK_RX.name))),
                    fmt(vals.get(gpm.SM_ACTIVE.name)),
                    fmt(vals.get(gpm.DRAM_BANDWIDTH.name)),
                    fmt(vals.get(gpm.SM_TO_DRAM_ACTIVITY.name)),
                    fmt(ipb), fmt(starved)])


def render_text(report: dict[str, Any]) -> str:
    lines = [f"mrc-agent diagnose: pid {report['pid']} ({report['cpu']['process'] or '?'}), "
             f"{report['window']['duration_seconds']:g} s from {report['window']['started']}",
             f"verdict: {report['verdict']} - {report['summary']}", "", "evidence:"]
    lines += [f"  - {e}" for e in report["evidence"]]
    lines += ["", "top functions (self time, busy thread):"]
    for row in report["top_functions"]["self"][:10]:
        lines.append(f"  {row['self_ratio']:6.1%} self {row['total_ratio']:6.1%} total  "
                     f"{row['frame']}")
    if not report["top_functions"]["self"]:
        lines.append("  (no samples: the target ran no Python code)")
    windows = report["gpu"].get("idle_windows") or []
    if windows:
        lines += ["", "GPU idle windows (seconds from the start):"]
        for w in windows[:10]:
            lines.append(f"  gpu {w['gpu']}: {w['start_seconds']:.2f}-{w['end_seconds']:.2f} "
                         f"({w['duration_seconds']:.2f} s{', open' if w.get('open') else ''})")
        if len(windows) > 10:
            lines.append(f"  ... {len(windows) - 10} more in report.json")
    lines += ["", "files:"] + [f"  {name}" for name in report["files"]]
    return "\n".join(lines) + "\n"

