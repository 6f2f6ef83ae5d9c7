"""``mrc-agent demo``: the agent on an embedded default, printing the golden triangle live.

It starts a stand-in MRC process (one Python thread decoding and resizing a synthetic photo in
pure Python, as a CPU-bound preprocessing stage does, while the main thread waits), watches it
with the real process collector, replays the embedded synthetic trace of a starved H200 (a 0.6 s
GPU burst every 3 s) for the GPU side, serves ``/metrics`` and prints one line per second.
On a GPU host, ``mrc-agent run --pid PID`` watches a real service with NVML instead.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from importlib import resources

from agent.app import build_runner, build_server, make_sources
from agent.config import AgentConfig, validate
from exporters.snapshot import HistogramValue, Snapshot

_WORKLOAD = """
import threading, time
def preprocess():
    # Bilinear resize of a 1200x900 greyscale 'photo' in pure Python: GIL-bound, one core.
    w, h, W, H = 1200, 900, 448, 336
    src = [(x * 7 + y * 13) & 255 for y in range(h) for x in range(w)]
    while True:
        out = [0] * (W * H)
        for Y in range(H):
            sy = Y * h // H
            row = sy * w
            for X in range(W):
                out[Y * W + X] = src[row + X * w // W]
t = threading.Thread(target=preprocess, name="preprocess", daemon=True)
t.start()
time.sleep(float(__import__('sys').argv[1]))
"""


def embedded_trace() -> str:
    return str(resources.files("agent") / "data" / "demo_starved.jsonl")


def _value(snap: Snapshot, name: str) -> float | None:
    """The first float sample of ``name`` (the demo has one target and one GPU)."""
    for sample_name, _labels, value in snap.samples:
        if sample_name == name and isinstance(value, float):
            return value
    return None


def _fmt_rate(bps: float | None) -> str:
    return "-" if bps is None else f"{bps / 1e9:6.2f} GB/s"


def _line(snap: Snapshot, prev: Snapshot | None, dt: float) -> str:
    def v(name: str) -> float | None:
        return _value(snap, name)

    def rate(name: str) -> float | None:
        now = v(name)
        before = _value(prev, name) if prev else None
        if now is None or before is None or dt <= 0:
            return None
        return max(now - before, 0.0) / dt

    user, hot, util = (v("mrc_process_cpu_user_ratio"),
                       v("mrc_process_hottest_thread_cpu_user_ratio"),
                       v("mrc_gpu_utilization_ratio"))
    inst, dram = rate("mrc_gpu_sm_instructions_executed_total"), rate(
        "mrc_gpu_dram_read_bytes_total")
    ratio = f"{inst / dram:5.2f} inst/B" if inst is not None and dram else "     -     "
    starved = v("mrc_gpu_starved")

    def pct(x: float | None) -> str:
        return "   -" if x is None else f"{x * 100:3.0f}%"

    return (f"{time.strftime('%H:%M:%S')}  user {pct(user)}  hottest {pct(hot)}  "
            f"GPU {pct(util)}  idle {v('mrc_gpu_idle_current_seconds') or 0:4.1f}s  "
            f"PCIe rx {_fmt_rate(v('mrc_gpu_pcie_rx_bytes_per_second'))}  "
            f"NVLink tx {_fmt_rate(rate('mrc_gpu_nvlink_tx_bytes_total'))}  {ratio}  "
            f"{'STARVED' if starved else ''}")


def run_demo(duration: float, listen: str, trace: str | None) -> int:
    workload = subprocess.Popen([sys.executable, "-c", _WORKLOAD, str(duration + 5)])
    cfg = validate(AgentConfig(
        pids=[workload.pid], listen=listen, interval=0.5,
        gpu_backend=f"replay:{trace or embedded_trace()}",
        collectors={"process": True, "gpu": True, "gpm": True, "profiling": True,
                    "derived": True}))
    sources = make_sources(cfg)
    runner = build_runner(cfg, sources)
    server = build_server(cfg, runner)
    runner.start()
    server.start()
    host, _ = cfg.host_port
    print(f"mrc-agent demo: watching stand-in MRC process {workload.pid} (CPU-bound "
          f"preprocessing thread); GPU side replays the embedded synthetic trace of a starved "
          f"H200.\nmetrics: http://{host}:{server.port}/metrics   (Ctrl-C stops; "
          f"{duration:.0f} s)\n", flush=True)
    stop = threading.Event()
    prev: Snapshot | None = None
    prev_t = time.monotonic()
    end = prev_t + duration
    try:
        while not stop.wait(1.0):
            snap, now = runner.latest(), time.monotonic()
            print(_line(snap, prev, now - prev_t), flush=True)
            prev, prev_t = snap, now
            if now >= end:
                break
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        runner.stop()
        workload.kill()
        workload.wait()
    last = runner.latest()
    windows = next((v.total for n, _, v in last.samples
                    if n == "mrc_gpu_idle_window_seconds" and isinstance(v, HistogramValue)), 0)
    starved = _value(last, "mrc_gpu_starved_seconds_total") or 0.0
    print(f"\ndone: {windows} GPU idle windows measured, target starved for {starved:.1f} s.")
    return 0
