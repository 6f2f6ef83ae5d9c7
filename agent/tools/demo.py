"""``mrc-agent demo``: the whole thing on the embedded default, live in the terminal.

It starts the reference MRC service (embedded tiny Llava, built on first run with a progress
display), the agent beside it watching the service's process, and the load generator (by default
through the paths real clients take: ``/mrc/upload`` and the OpenAI chat API, whole and
streamed, in turn); it prints the golden triangle once a second and the per-bucket latency table
at the end. Where NVML
answers, the GPU side is the real GPU; elsewhere it replays the embedded synthetic trace of a
starved H200 (``tracegen``'s ``starved`` pattern, recorded from the simulated GPU through the
agent's own adapters) and says so. The agent's ``/metrics`` and the service's stay up while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from typing import Any

from mrc_agent.agent.core.collectors import (
    DEFAULT_ON,
    derived,
    gpm,
    gpu,
    process,
    profiling,
    stacks,
)
from mrc_agent.agent.core.config import AgentConfig, validate
from mrc_agent.agent.core.hw.base import SourceUnavailable
from mrc_agent.agent.core.sample import HistogramValue, Snapshot, first, readings
from mrc_agent.agent.core.wiring import build_runner, build_server, make_sources, open_gpu_backend
from mrc_agent.exporters.exposition.snapshot import MetricSpec


def embedded_trace() -> str:
    return str(resources.files("mrc_agent.agent.tools") / "data" / "demo_starved.jsonl")


def _value(snap: Snapshot | None, spec: MetricSpec) -> float | None:
    """The first float sample of ``spec`` (the demo has one target and one GPU)."""
    return None if snap is None else first(snap, spec)


def _fmt_rate(bps: float | None) -> str:
    return "      -   " if bps is None else f"{bps / 1e9:6.2f} GB/s"


def _pct(x: float | None) -> str:
    return "   -" if x is None else f"{x * 100:3.0f}%"


def golden_line(snap: Snapshot, prev: Snapshot | None, dt: float) -> str:
    """One line of the golden triangle from two consecutive snapshots."""
    def rate(spec: MetricSpec) -> float | None:
        now = _value(snap, spec)
        before = _value(prev, spec)
        if now is None or before is None or dt <= 0:
            return None
        return max(now - before, 0.0) / dt

    inst, dram = rate(profiling.SM_INSTRUCTIONS), rate(profiling.DRAM_READ_BYTES)
    proxy = _value(snap, gpm.SM_TO_DRAM_ACTIVITY)
    if inst is not None and dram:
        ratio = f"{inst / dram:5.1f} inst/B"
    elif proxy is not None:
        ratio = f"{proxy:5.2f} SM/DRAM act"
    else:
        ratio = "     -      "
    return (f"{time.strftime('%H:%M:%S')}  user {_pct(_value(snap, process.CPU_USER_RATIO))}"
            f"  hottest {_pct(_value(snap, process.HOTTEST_THREAD_USER_RATIO))}"
            f"  GPU {_pct(_value(snap, gpu.UTILIZATION))}"
            f"  idle {_value(snap, derived.IDLE_CURRENT) or 0:4.1f}s"
            f"  PCIe rx {_fmt_rate(_value(snap, gpu.PCIE_RX))}"
            f"  NVLink tx {_fmt_rate(rate(gpu.NVLINK_TX))}  {ratio}"
            f"{'  STARVED' if _value(snap, derived.STARVED) else ''}")


def while_waiting(snap: Snapshot | None, limit: int = 3) -> list[tuple[str, float]]:
    """The functions the target's hottest thread ran most while its GPU idled or it was
    starved (the stacks collector), with their seconds, most first."""
    if snap is None:
        return []
    seconds: dict[str, float] = {}
    for r in readings(snap, stacks.FUNCTION_SECONDS):
        if r.labels["gpu_state"] in ("idle", "starved") and isinstance(r.value, float):
            seconds[r.labels["function"]] = seconds.get(r.labels["function"], 0.0) + r.value
    return sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]


def _gpu_backend() -> tuple[str, str]:
    """NVML when it answers, else the embedded synthetic trace: (backend, what to tell)."""
    nvml = open_gpu_backend("nvml", pcie_thread=False)
    assert nvml is not None
    try:
        gpus = nvml.sample_devices()
        return "nvml", f"GPU side: NVML, {len(gpus)} GPU(s)"
    except SourceUnavailable as exc:
        return (f"replay:{embedded_trace()}",
                f"GPU side: no GPU here ({exc.reason}); replaying the embedded SYNTHETIC "
                "trace of a starved H200")
    finally:
        nvml.close()


def _start_service(port: int, log_path: str, preprocess: str = "naive"
                   ) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-m", "mrc_agent.reference_service",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                             "--preprocess", preprocess],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: str,
                timeout: float = 600) -> bool:
    import httpx

    said = ""
    spinner = "|/-\\"
    deadline = time.monotonic() + timeout
    i = 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                print(f"\nthe service exited ({proc.returncode}); its log:\n{f.read()[-3000:]}")
            return False
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                print(f"\r  model: ready{' ' * 60}", flush=True)
                return True
            step = httpx.get(url + "/health", timeout=2).json().get("model", "")
        except (httpx.HTTPError, ValueError):
            step = "starting the service"
        if step != said:
            if said:
                print(f"\r  model: {said[:70]:<70} done", flush=True)
            said = step
        print(f"\r  {spinner[i % 4]} model: {step[:70]:<70}", end="", flush=True)
        i += 1
        time.sleep(0.25)
    print("\nthe model did not get ready in time")
    return False


#: How the load's request path is told, by ``--api``.
_API_TOLD = {"mix": "in turn through /mrc/upload and the OpenAI chat API (POST "
                    "/v1/chat/completions), whole and streamed",
             "upload": "through /mrc/upload", "chat": "through POST /v1/chat/completions",
             "chat-stream": "through POST /v1/chat/completions, streamed"}


def run_demo(duration: float, listen: str, trace: str | None, port: int = 8000,
             rate: float = 2.0, api: str = "mix", preprocess: str = "naive") -> int:
    from mrc_agent.reference_service.loadgen import Outcome, percentile, run_load, table

    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(tempfile.mkdtemp(prefix="mrc-demo-"), "service.log")
    print(f"mrc-agent demo: starting the reference MRC service on {url} (embedded tiny model, "
          f"random weights: its answers are NOT meaningful; log {log_path})", flush=True)
    if preprocess == "naive":
        print("  its preprocessing is the NAIVE one on purpose (--preprocess naive): one thread "
              "decodes whole photos and converts pixels in Python, as many services start; "
              "--preprocess tuned runs the service's own", flush=True)
    service = _start_service(port, log_path, preprocess)
    runner = server = sources = None
    try:
        if not _wait_ready(url, service, log_path):
            return 1
        backend, told = (f"replay:{trace}", f"GPU side: replaying {trace}") if trace \
            else _gpu_backend()
        cfg = validate(AgentConfig(
            pids=[service.pid], listen=listen, interval=0.5, gpu_backend=backend,
            collectors={**DEFAULT_ON, "profiling": backend.startswith("replay:")}))
        sources = make_sources(cfg)
        runner = build_runner(cfg, sources)
        server = build_server(cfg, runner)
        runner.start()
        server.start()
        host, _ = cfg.host_port
        print(f"agent watching the service (pid {service.pid}); {told}.\n"
              f"agent metrics: http://{host}:{server.port}/metrics   service metrics: "
              f"{url}/metrics\nload: {rate:g} requests/s for {duration:g} s over all nine "
              f"prompt-length x resolution buckets, {_API_TOLD.get(api, api)} (Ctrl-C "
              "stops)\n", flush=True)

        live: dict[str, Outcome] = {}
        result: dict[str, Any] = {}

        def keep(o: Outcome) -> None:
            live["o"] = o

        def load() -> None:
            result["outcome"] = asyncio.run(run_load(
                url, rate, duration, max_new_tokens=16, max_in_flight=32, on_progress=keep,
                api=api))

        loader = threading.Thread(target=load, name="mrc-demo-load", daemon=True)
        loader.start()
        prev: Snapshot | None = None
        prev_t = time.monotonic()
        while loader.is_alive():
            loader.join(1.0)
            snap, now = runner.latest(), time.monotonic()
            line = golden_line(snap, prev, now - prev_t)
            o = live.get("o")
            if o is not None:
                done = [x for v in o.latencies.values() for x in v]
                if done:
                    line += (f"  | {len(done)} answered, p50 "
                             f"{percentile(done, 50) * 1000:.0f} ms, p90 "
                             f"{percentile(done, 90) * 1000:.0f} ms")
            print(line, flush=True)
            prev, prev_t = snap, now
        outcome = result.get("outcome")
        if outcome is not None:
            print("\nlatency per bucket (client side):\n" + table(outcome))
        last = runner.latest()
        windows = next((s.value.total for s in readings(last, derived.IDLE_WINDOW)
                        if isinstance(s.value, HistogramValue)), 0)
        print(f"GPU idle windows measured: {windows}; target starved for "
              f"{_value(last, derived.STARVED_SECONDS) or 0.0:.1f} s")
        top = while_waiting(last)
        if top:
            print("while its GPU idled, the service's hottest thread ran: " + ", ".join(
                f"{name} ({secs:.1f} s)" for name, secs in top))
        else:
            why = next((r.labels["reason"] for r in readings(last, stacks.AVAILABLE)), "")
            print("no stack samples while the GPU idled"
                  + (f" (stacks: {why}; see docs/stacks.md)" if why and why != "ok" else ""))
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        if server is not None:
            server.stop()
        if runner is not None:
            runner.stop()
        if sources is not None:
            sources.close()
        service.terminate()
        try:
            service.wait(15)
        except subprocess.TimeoutExpired:
            service.kill()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.agent.tools.flags import DEMO, DEMO_FLAGS

    DEMO_FLAGS.add_flags(parser, DEMO)


def run(args: argparse.Namespace) -> int:
    from mrc_agent.agent.core.config import ConfigError

    if args.duration <= 0 or args.rate <= 0 or not 0 < args.port < 65536:
        raise ConfigError("--duration and --rate must be > 0, --port 1-65535")
    return run_demo(args.duration, args.listen, args.trace, args.port, args.rate, args.api,
                    args.preprocess)
