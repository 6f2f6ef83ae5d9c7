"""CPU cost of one agent sampling pass, warm and at the agent's real cadence, beside a baseline.

On some virtual machines a thread that slept for a second runs its next few milliseconds of
Python many times slower (cold caches and TLB after the vCPU idled; memory-tiering daemons such
as DAMON add to it). The agent at 1 s sampling is exactly such a thread, so its idle CPU there
measures the platform as much as the agent. This benchmark separates the two in one run: the
same pass (4 idle targets, an 8-GPU replayed trace) back to back and with 0.1 s / 1 s sleeps in
between, and beside it a fixed pure-Python baseline workload of similar warm cost at the same
cadences. The ratio "cold / warm" of the baseline is the platform's wake-up penalty; the agent's
own cost is its warm pass.

A last row: the narrow PCIe byte-counter thread's round over 8 simulated GPUs whose counters
are taken as 32 bits wide (NVML's hand-written fake, ``agent/tools/simgpu``), at the period the
thread runs at on a Gen5 x16 link (~22 ms); its share of a core is the goal (at most 0.5 %).
The fake answers in tens of microseconds of Python where the driver takes its own time in C,
so the fake's field reads alone (the same calls at the same cadence, interleaved with the
rounds) are measured too and taken off: what is left is the agent's Python side of each read,
not NVML's.

    python3 benchmarks/bench_pass_cost.py [--out benchmarks/results/pass_cost.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pynvml
from support import report

from mrc_agent.agent.core.config import AgentConfig, validate
from mrc_agent.agent.core.hw.nvml import NvmlBackend
from mrc_agent.agent.core.wiring import build_runner, make_sources
from mrc_agent.agent.tools.simgpu.nvml import FakeNvml, gpu
from mrc_agent.agent.tools.tracegen import write_trace

REPO = Path(__file__).resolve().parent.parent


_DATA = [{"a": i, "b": str(i)} for i in range(20000)]


def baseline_work() -> int:
    """A fixed pure-Python workload: dict reads and string lengths over 3000 records."""
    s = 0
    for d in _DATA[:3000]:
        s += int(d["a"]) + len(str(d["b"]))
    return s


def per_call_cpu(fn: Callable[[], object], gap: float, n: int) -> float:
    """Median thread CPU seconds of ``fn`` when called every ``gap`` seconds."""
    costs = []
    for _ in range(n):
        t = time.thread_time()
        fn()
        costs.append(time.thread_time() - t)
        if gap:
            time.sleep(gap)
    costs.sort()
    return costs[len(costs) // 2]


def narrow_reader_cost(gpus: int = 8, n: int = 400) -> tuple[float, float, float]:
    """Median thread CPU of one narrow-counter round over ``gpus`` simulated GPUs with 32-bit
    counters, called at the thread's own period, and of the fake's field reads alone,
    interleaved with the rounds at the same period, so both see the same cache and wake-up
    conditions; (seconds per round, seconds of them in the fake, period)."""
    fake = FakeNvml([gpu(index=i, pcie_count={"tx_bytes": 0, "rx_bytes": 0,
                                              "value_type": "NVML_VALUE_TYPE_UNSIGNED_INT"})
                     for i in range(gpus)])
    backend = NvmlBackend(lib=fake, pcie_thread=False)
    try:
        backend.sample_devices()
        period = backend._pcie_counters.narrow_period()
        snapshot = backend._session.snapshot()
        assert period is not None and snapshot is not None
        fields = [pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]
        rounds, fakes = [], []
        for k in range(n):
            for g in fake.gpus:  # the counters move (1 MiB a round), as under load
                g["pcie_count"]["tx_bytes"] = g["pcie_count"]["rx_bytes"] = (k << 20) % 2**32
            t = time.thread_time()
            backend._narrow.run_round()
            rounds.append(time.thread_time() - t)
            time.sleep(period)
            t = time.thread_time()
            for g in snapshot[1]:
                fake.nvmlDeviceGetFieldValues(g.handle, fields)
            fakes.append(time.thread_time() - t)
            time.sleep(period)
        return statistics.median(rounds), statistics.median(fakes), period
    finally:
        backend.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trace = Path(tempfile.mkdtemp(prefix="mrc-bench-")) / "busy8.jsonl"
    with open(trace, "w") as f:
        write_trace(f, gpus=8, duration=20, pattern="busy")
    targets = [subprocess.Popen([sys.executable, "-c",
                                 "import time\nwhile True: time.sleep(0.5)"]) for _ in range(4)]
    try:
        time.sleep(0.5)
        cfg = validate(AgentConfig(pids=[p.pid for p in targets],
                                   gpu_backend=f"replay:{trace}"))
        runner = build_runner(cfg, make_sources(cfg))
        runner.sample_once()
        rows = []
        for gap, n in ((0.0, 300), (0.1, 60), (1.0, 15)):
            agent = per_call_cpu(runner.sample_once, gap, n)
            base = per_call_cpu(baseline_work, gap, n)
            rows.append((gap, agent, base))
        narrow, narrow_fake, narrow_period = narrow_reader_cost()
        narrow_agent = narrow - narrow_fake
    finally:
        for p in targets:
            p.kill()
            p.wait()
    warm_agent, warm_base = rows[0][1], rows[0][2]
    lines = ["# Sampling-pass CPU: warm vs at cadence, beside a fixed baseline", "",
             "Median thread CPU per call; 4 targets, 8 replayed GPUs; same run, interleaved by "
             "cadence.", "",
             "| cadence | agent pass | baseline workload | agent / warm agent | "
             "baseline / warm baseline | implied agent CPU at this cadence |",
             "|---|---:|---:|---:|---:|---:|"]
    for gap, agent, base in rows:
        share = f"{agent / gap * 100:.3f} % of a core" if gap else "-"
        lines.append(f"| {'back to back' if not gap else f'every {gap:g} s'} | "
                     f"{agent * 1e3:.2f} ms | {base * 1e3:.2f} ms | {agent / warm_agent:.1f}x | "
                     f"{base / warm_base:.1f}x | {share} |")
    lines += ["", f"Warm, the agent's pass costs {warm_agent * 1e3:.2f} ms: "
              f"{warm_agent / 1.0 * 100:.3f} % of a core at 1 s sampling and "
              f"{warm_agent / 0.1 * 100:.2f} % at 0.1 s. The baseline's cold/warm ratio is the "
              "platform's wake-up penalty, which the agent pays like any thread that sleeps.", "",
              "| narrow PCIe counter thread, 8 simulated GPUs | round | of it, the fake's "
              "reads | agent's side | agent's share of a core |", "|---|---:|---:|---:|---:|",
              f"| every {narrow_period * 1e3:.1f} ms | {narrow * 1e3:.3f} ms | "
              f"{narrow_fake * 1e3:.3f} ms | {narrow_agent * 1e3:.3f} ms | "
              f"{narrow_agent / narrow_period * 100:.3f} % |", "",
              "Medians over 400 rounds, each followed by the fake's reads alone; the agent's "
              "side is the round's median less theirs. A share of a core is CPU seconds per "
              "second of one core, in percent: the thread CPU over the period it runs at.", "",
              f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python "
              f"{platform.python_version()}, kernel {platform.release()}."]
    text = "\n".join(lines)
    report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
