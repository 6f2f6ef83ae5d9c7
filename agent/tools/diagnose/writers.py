"""The files of one diagnosis (:data:`FILES`): ``samples.jsonl``, ``golden_triangle.csv`` and
the text of ``report.txt``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from typing import Any

from agent.core.catalog import CATALOG
from agent.core.sample import HistogramValue, Snapshot

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


def write_golden_triangle(path: str, snaps: Sequence[Snapshot], pid: int,
                          start_wall: float) -> None:
    """One row per pass and GPU: the three corners side by side. Counter-based columns are the
    increase since the previous pass."""
    prev: dict[tuple[str, tuple[str, ...]], tuple[float, float]] = {}
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for snap in snaps:
            proc: dict[str, float] = {}
            gpu: dict[tuple[str, ...], dict[str, float]] = {}
            for n, labels, v in snap.samples:
                if not isinstance(v, (int, float)):
                    continue
                if n.startswith("mrc_process_") or n == "mrc_gpu_starved":
                    if labels and labels[0] == str(pid):
                        proc[n] = float(v)
                elif n.startswith("mrc_gpu_") and len(labels) == 3:
                    gpu.setdefault(labels, {})[n] = float(v)
            rates: dict[tuple[str, ...], dict[str, float]] = {}
            for g, vals in gpu.items():
                for n in ("mrc_gpu_nvlink_tx_bytes_total", "mrc_gpu_nvlink_rx_bytes_total",
                          "mrc_gpu_sm_instructions_executed_total",
                          "mrc_gpu_dram_read_bytes_total"):
                    if n in vals:
                        before = prev.get((n, g))
                        if before is not None and snap.timestamp > before[0]:
                            rates.setdefault(g, {})[n] = (vals[n] - before[1]) / (
                                snap.timestamp - before[0])
                        prev[(n, g)] = (snap.timestamp, vals[n])

            def fmt(v: float | None) -> str:
                return "" if v is None else f"{v:.6g}"

            base = [f"{snap.timestamp:.3f}", f"{snap.timestamp - start_wall:.3f}", str(pid),
                    fmt(proc.get("mrc_process_cpu_user_ratio")),
                    fmt(proc.get("mrc_process_hottest_thread_cpu_user_ratio"))]
            if not gpu:
                w.writerow(base + [""] * (len(CSV_COLUMNS) - len(base) - 1)
                           + [fmt(proc.get("mrc_gpu_starved"))])
            for g, vals in sorted(gpu.items()):
                r = rates.get(g, {})
                ipb = None
                if r.get("mrc_gpu_dram_read_bytes_total"):
                    ipb = (r.get("mrc_gpu_sm_instructions_executed_total", 0.0)
                           / r["mrc_gpu_dram_read_bytes_total"])
                w.writerow(base + [
                    g[0], fmt(vals.get("mrc_gpu_utilization_ratio")),
                    fmt(vals.get("mrc_gpu_pcie_tx_bytes_per_second")),
                    fmt(vals.get("mrc_gpu_pcie_rx_bytes_per_second")),
                    fmt(vals.get("mrc_gpu_gpm_nvlink_tx_bytes_per_second",
                                 r.get("mrc_gpu_nvlink_tx_bytes_total"))),
                    fmt(vals.get("mrc_gpu_gpm_nvlink_rx_bytes_per_second",
                                 r.get("mrc_gpu_nvlink_rx_bytes_total"))),
                    fmt(vals.get("mrc_gpu_sm_active_ratio")),
                    fmt(vals.get("mrc_gpu_dram_bandwidth_utilization_ratio")),
                    fmt(vals.get("mrc_gpu_gpm_sm_to_dram_activity")),
                    fmt(ipb), fmt(proc.get("mrc_gpu_starved"))])


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

