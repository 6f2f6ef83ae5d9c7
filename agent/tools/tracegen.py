"""Synthetic replay traces for the demo, the tests and the benchmarks.

These are made-up numbers in the replay format, shaped like the failure modes the agent is for;
they are labelled synthetic in their GPU UUIDs (``GPU-synthetic-…``) so that nobody mistakes
them for a recording. Recordings from real GPUs (``mrc-agent record``) live in ``tests/data/``.
A trace stands in for what the GPU adapters return; the simulated libraries beneath the
adapters, for the tests and ``selfcheck --dry``, are ``agent/tools/simgpu/`` (whose docstring
says how the two relate).

Patterns:
- ``starved``: the GPU runs a 0.6 s burst every 3 s and idles in between (a CPU-bound
  preprocessing thread feeds it), NVLink quiet, PCIe bursts with each batch.
- ``busy``: a steady memory-bound decode: utilisation ~0.95, DRAM busy, NVLink ~120 GB/s.
- ``low_nvlink``: busy GPU whose NVLink moves only ~10 GB/s.

``mig=N`` puts every GPU in MIG mode with N MIG devices (GPU instances 1..N, one compute
instance each), as ``mrc-agent record`` writes them: rows keyed by UUID, the MIG devices'
under their GPU's ``gpu`` index with ``MIG-synthetic-…`` UUIDs, memory and GPM (with its
``gpu_instance``) per MIG device, and the GPU's own row without what NVML and CUPTI do not
answer in MIG mode (utilisation, GPM, profiling counters).
"""

from __future__ import annotations

import json
import math
from typing import Any, TextIO

PATTERNS = ("starved", "busy", "low_nvlink")
H200_MEMORY = 143_771_000_832  # bytes NVML reports on an H200 141 GB
#: An H200 has at most seven GPU instances.
MAX_MIG_DEVICES = 7
#: Fields a GPU in MIG mode does not report for itself (NVML answers NOT_SUPPORTED for
#: utilisation and whole-GPU GPM; CUPTI refuses MIG).
_NOT_IN_MIG_MODE = ("gpu_util", "sm_util", "sm_occupancy", "tensor_util", "dram_bw_util",
                    "sm_instructions_executed_total", "dram_read_bytes_total")
#: The GPM fields each MIG device carries (its GPU instance's).
_GPM_FIELDS = ("sm_util", "sm_occupancy", "tensor_util", "dram_bw_util")


def _row(t: float, gpu: int, pattern: str, counters: dict[str, float],
         step: float) -> dict[str, Any]:
    if pattern == "starved":
        busy = (t % 3.0) < 0.6
        util = 0.97 if busy else 0.0
        nvlink_rate = 2e9 if busy else 0.0
        pcie_rx = 6e9 if busy else 2e7
        sm, dram, tensor = (0.8, 0.35, 0.5) if busy else (0.0, 0.0, 0.0)
        inst_rate, dram_rate = (4.0e12, 1.2e12) if busy else (0.0, 0.0)
    else:
        wobble = 0.02 * math.sin(t * 2.0 + gpu)
        util = 0.95 + wobble
        nvlink_rate = 1.2e11 if pattern == "busy" else 1.0e10
        pcie_rx = 1.5e9
        sm, dram, tensor = 0.9, 0.85 + wobble, 0.3
        inst_rate, dram_rate = 9.0e12, 3.0e12  # ~3 instructions per byte: memory-bound
    counters["nvlink_tx_bytes_total"] += nvlink_rate * step
    counters["nvlink_rx_bytes_total"] += nvlink_rate * 0.9 * step
    counters["sm_instructions_executed_total"] += inst_rate * step
    counters["dram_read_bytes_total"] += dram_rate * step
    return {
        "t": round(t, 3), "gpu": gpu, "uuid": f"GPU-synthetic-{gpu:04d}",
        "name": "NVIDIA H200 (synthetic)",
        "gpu_util": round(util, 4), "sm_util": sm, "sm_occupancy": round(sm * 0.6, 4),
        "tensor_util": tensor, "dram_bw_util": round(dram, 4),
        "mem_used_bytes": 60e9 + gpu * 1e9, "mem_total_bytes": H200_MEMORY,
        "pcie_tx_bytes_per_second": pcie_rx * 0.1, "pcie_rx_bytes_per_second": pcie_rx,
        "power_watts": 180.0 + 450.0 * util,
        **{k: round(v) for k, v in counters.items()},
    }


def _mig_rows(row: dict[str, Any], gpu: int, mig: int) -> list[dict[str, Any]]:
    """The GPU's own row in MIG mode, then one row per MIG device."""
    rows = [{k: v for k, v in row.items() if k not in _NOT_IN_MIG_MODE}]
    for k in range(mig):
        rows.append({
            "t": row["t"], "gpu": gpu, "uuid": f"MIG-synthetic-{gpu:04d}-{k + 1:02d}",
            "name": f"{row['name']} MIG GI {k + 1}", "gpu_instance": k + 1,
            "mem_used_bytes": round(row["mem_used_bytes"] / mig),
            "mem_total_bytes": H200_MEMORY // MAX_MIG_DEVICES,
            **{f: row[f] for f in _GPM_FIELDS},
        })
    return rows


def write_trace(out: TextIO, gpus: int = 1, duration: float = 12.0, step: float = 0.1,
                pattern: str = "starved", mig: int = 0) -> int:
    """Write ``duration / step`` samples per GPU (and per MIG device with ``mig``); returns
    the number of lines written."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}")
    if not 0 <= mig <= MAX_MIG_DEVICES:
        raise ValueError(f"mig must be 0-{MAX_MIG_DEVICES}, not {mig}")
    counters = [dict.fromkeys(("nvlink_tx_bytes_total", "nvlink_rx_bytes_total",
                               "sm_instructions_executed_total", "dram_read_bytes_total"), 0.0)
                for _ in range(gpus)]
    lines = 0
    for i in range(int(round(duration / step))):
        t = i * step
        for gpu in range(gpus):
            row = _row(t, gpu, pattern, counters[gpu], step)
            for line in _mig_rows(row, gpu, mig) if mig else [row]:
                out.write(json.dumps(line) + "\n")
                lines += 1
    return lines


if __name__ == "__main__":  # python -m mrc_agent.agent.tools.tracegen PATTERN GPUS DURATION [MIG]
    import sys

    pat, n, dur = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    write_trace(sys.stdout, gpus=n, duration=dur, pattern=pat,
                mig=int(sys.argv[4]) if len(sys.argv) > 4 else 0)
