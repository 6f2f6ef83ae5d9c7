"""The whole thing: :func:`diagnose` runs py-spy and the collectors over one window on a pid and
writes the report; :func:`run_diagnose_command` is ``mrc-agent diagnose``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mrc_agent.agent.core.collectors import process
from mrc_agent.agent.core.collectors.base import Collector
from mrc_agent.agent.core.config import DIAGNOSE, AgentConfig, ConfigError, add_flags
from mrc_agent.agent.core.hw.procfs import ProcessGone, ProcFS
from mrc_agent.agent.core.runner import Runner
from mrc_agent.agent.core.sample import Snapshot, first
from mrc_agent.agent.core.stacks import StackSample
from mrc_agent.agent.core.targets import TargetResolver
from mrc_agent.agent.tools.diagnose import flamegraph
from mrc_agent.agent.tools.diagnose.pyspy import PY_SPY_RATE, PySpy, PySpyError, find_py_spy
from mrc_agent.agent.tools.diagnose.remote import AgentError, diagnose_via_agent, read_token
from mrc_agent.agent.tools.diagnose.sampling import (
    IdleWindows,
    _Watched,
    runnable,
    steal_ratio,
)
from mrc_agent.agent.tools.diagnose.stacks import (
    collapsed,
    from_samples,
    image_share,
    parse_collapsed,
    thread_samples,
    top_functions,
)
from mrc_agent.agent.tools.diagnose.verdict import Rules, Verdict, analyse_cpu, analyse_gpu, decide
from mrc_agent.agent.tools.diagnose.writers import (
    FILES,
    render_text,
    write_golden_triangle,
    write_samples,
)

#: 1: py-spy is missing or cannot attach; or, with --agent, the agent or its capture failed.
EXIT_OK, EXIT_PY_SPY = 0, 1
MIN_DURATION, MAX_DURATION = 1.0, 600.0


@dataclass(frozen=True)
class StackHistory:
    """The agent's continuous stack samples of the target, for a diagnosis run inside the agent:
    ``read(since)`` gives the samples taken at ``since`` (monotonic) or later, or None while the
    target is not sampled; ``rate`` is the samples' rate (Hz); a diagnosis takes them from
    ``lookback`` seconds before its window."""

    read: Callable[[float], list[StackSample] | None]
    rate: float
    lookback: float


@dataclass
class Diagnosis:
    out_dir: str
    report: dict[str, Any]

    @property
    def verdict(self) -> str:
        return str(self.report["verdict"])

    @property
    def files(self) -> list[str]:
        return list(self.report["files"])


def check_pid(pid: int) -> None:
    """ConfigError when there is no such process."""
    if pid <= 0 or not os.path.isdir(f"/proc/{pid}"):
        raise ConfigError(f"no process with pid {pid}")


def diagnose(
    cfg: AgentConfig,
    pid: int,
    out_dir: str,
    duration: float,
    interval: float = 0.2,
    *,
    py_spy: str | None = None,
    collectors: Sequence[str] = ("process", "gpu", "gpm", "profiling", "derived"),
    extra: Sequence[Collector] = (),
    cancel: threading.Event | None = None,
    rules: Rules = Rules(),  # noqa: B008 (a frozen dataclass: immutable)
    history: StackHistory | None = None,
) -> Diagnosis:
    """Run py-spy and the collectors over one window on ``pid`` and write the report into
    ``out_dir``. Raises PySpyError (py-spy missing or cannot attach), ConfigError (no such
    process) and ReplayFormatError (bad replay trace).

    With ``history`` (inside the agent, when its stacks collector samples ``pid``), no py-spy
    runs: the stacks are the agent's own samples from ``history.lookback`` seconds before the
    window to its end."""
    from mrc_agent.agent.core.wiring import build_collectors, make_sources

    check_pid(pid)
    if history is not None and history.read(time.monotonic()) is None:
        history = None  # not sampled (now): py-spy it is
    exe = find_py_spy(py_spy) if history is None else ""
    cancel = cancel or threading.Event()
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, v) for k, v in FILES.items()}
    sources = make_sources(cfg)
    try:
        start = time.monotonic()
        start_wall = time.time()
        idle = IdleWindows(cfg.idle_util_threshold, start)
        built: list[Collector] = build_collectors(cfg, sources, collectors)
        # The derived collector reads what the others published this pass: it goes last.
        watched = [_Watched(c) for c in built if c.name != "derived"]
        tail = [_Watched(c) for c in built if c.name == "derived"]
        runner = Runner([*watched, *(_Watched(c) for c in extra), *tail, idle],
                        TargetResolver([pid]), interval)
        spy = PySpy(exe, pid, paths["flamegraph"], paths["stacks"], duration) if exe else None
        node = ProcFS()
        sched_before, sched_t0 = node.thread_schedstat(pid), time.monotonic()
        ticks_before = node.cpu_ticks()
        snaps: list[Snapshot] = []
        try:
            tick = start
            while True:
                snaps.append(runner.sample_once())
                if spy is not None and spy.failed_early():
                    break
                tick += interval
                if tick - start > duration + 1e-6 or cancel.wait(max(tick - time.monotonic(), 0)):
                    break
        except KeyboardInterrupt:
            # Ctrl-C in a terminal: py-spy got it too and writes what it has; so do we.
            cancel.set()
        except BaseException:
            if spy is not None:
                spy.kill()
            raise
        try:
            sched_after = node.thread_schedstat(pid)
        except ProcessGone:  # it exited in the window
            sched_after = {}
        hottest_runnable = runnable(sched_before, sched_after, time.monotonic() - sched_t0,
                                    steal_ratio(ticks_before, node.cpu_ticks()))
        if spy is not None:
            spy.stop()
    finally:
        sources.close()
    end = time.monotonic()
    elapsed = end - start
    reasons = {w.name: w.reason for w in runner.collectors if isinstance(w, _Watched)}

    origin: dict[str, Any]
    if history is None:
        with open(paths["stacks"], encoding="utf-8", errors="replace") as f:
            stacks = parse_collapsed(f.read())
        rate, origin = float(PY_SPY_RATE), {"source": "py-spy"}
    else:
        kept = [s for s in history.read(start - history.lookback) or [] if s.t <= end]
        stacks = from_samples(kept)
        with open(paths["stacks"], "w", encoding="utf-8") as f:
            f.write(collapsed(stacks))
        flamegraph.write(paths["flamegraph"], stacks,
                         f"pid {pid}: the agent's samples, {history.lookback:g} s before the "
                         f"window to its end")
        rate = history.rate
        origin = {"source": "agent", "from_seconds": -history.lookback,
                  "first_sample_seconds": round(kept[0].t - start, 3) if kept else None}
    threads = thread_samples(stacks)
    busy = threads.most_common(1)[0][0] if threads else ""
    busy_stacks = [s for s in stacks if s.thread == busy]
    share, image_frames = image_share(busy_stacks)
    top = top_functions(busy_stacks, rate=rate)
    stack_info = {
        **origin, "samples": sum(threads.values()), "rate_hz": rate,
        "threads": dict(threads.most_common()), "busy_thread": busy,
        "busy_thread_samples": threads.get(busy, 0),
        "image_share": round(share, 4), "image_frames": image_frames,
        "top_self": top["self"],
    }
    cpu = analyse_cpu(snaps, pid, cfg.starvation_cpu_threshold, hottest_runnable)
    gpu = analyse_gpu(snaps, pid, idle, reasons, start)
    verdict = decide(cpu, gpu, stack_info, rules)
    exited = _exited_at(snaps, pid, start_wall)
    if exited is not None:
        # What was measured covers only part of the window (or none): no verdict from it.
        verdict = Verdict("inconclusive", f"the target exited {exited:.1f} s into the window; "
                          "too little to decide", [f"the target's last sample is {exited:.1f} s "
                                                   "into the window", *verdict.evidence])
    write_samples(paths["samples"], snaps, start_wall)
    write_golden_triangle(paths["golden_triangle"], snaps, pid, start_wall)
    report: dict[str, Any] = {
        "verdict": verdict.verdict,
        "summary": verdict.summary,
        "evidence": verdict.evidence,
        "pid": pid,
        "window": {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_wall)),
                   "duration_seconds": round(elapsed, 3), "interval_seconds": interval,
                   "passes": len(snaps), "cancelled": cancel.is_set()},
        "cpu": cpu,
        "gpu": gpu,
        "stacks": {k: v for k, v in stack_info.items() if k != "top_self"},
        "top_functions": {"self": top["self"], "total": top["total"],
                          "all_threads": top_functions(stacks, rate=rate)["self"]},
        "thresholds": {"starvation_cpu": cfg.starvation_cpu_threshold,
                       "idle_util": cfg.idle_util_threshold, **dataclasses.asdict(rules)},
        "files": list(FILES.values()),
    }
    report["cpu"]["collector_reasons"] = {k: v for k, v in reasons.items() if v}
    with open(paths["report_json"], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    with open(paths["report_txt"], "w", encoding="utf-8") as f:
        f.write(render_text(report))
    return Diagnosis(out_dir, report)


def _exited_at(snaps: Sequence[Snapshot], pid: int, start_wall: float) -> float | None:
    """Seconds into the window of the target's last sample, when it is missing from the last
    pass (it exited or was reaped); None while it is still there."""
    present = [s for s in snaps if first(s, process.THREADS, pid=str(pid)) is not None]
    if snaps and present and present[-1] is snaps[-1]:
        return None
    return (present[-1].timestamp - start_wall) if present else 0.0


def run_diagnose_command(args: Any) -> int:
    """``mrc-agent diagnose``; bad input raises ConfigError (exit 2 in cli.py)."""
    from mrc_agent.agent.core.config import config_from_args
    from mrc_agent.agent.core.hw.replay import ReplayFormatError

    if not MIN_DURATION <= args.duration <= MAX_DURATION:
        raise ConfigError(f"--duration must be {MIN_DURATION:g}-{MAX_DURATION:g} seconds")
    if not 0.05 <= args.interval <= args.duration:
        raise ConfigError("--interval must be 0.05 seconds or more and at most --duration")
    if args.agent_token_file and not args.agent:
        raise ConfigError("--agent-token-file goes with --agent")
    # The settings flags diagnose takes (agent/core/config.py), its window's own interval and
    # the one target.
    cfg = config_from_args(args, pids=[args.pid], interval=args.interval)
    if args.agent:
        if not args.agent_token_file:
            raise ConfigError("--agent needs --agent-token-file (the agent's webhook token)")
        token = read_token(args.agent_token_file)
    else:
        check_pid(args.pid)
    out = args.out or f"mrc-diagnose-{args.pid}-{time.strftime('%Y%m%dT%H%M%S')}"
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out!r} exists and is not a directory")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out!r}: {exc.strerror or exc}") from exc
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.agent:
        try:
            report = diagnose_via_agent(args.agent, token, args.pid, args.duration, out)
        except AgentError as exc:
            print(f"mrc-agent diagnose: error: {exc}", file=sys.stderr)
            return EXIT_PY_SPY
        sys.stdout.write(render_text(report))
        sys.stdout.write(f"\nwritten to {os.path.abspath(out)} (by the agent at {args.agent})\n")
        return EXIT_OK
    try:
        result = diagnose(cfg, args.pid, out, args.duration, args.interval, py_spy=args.py_spy)
    except ReplayFormatError as exc:
        raise ConfigError(str(exc)) from exc
    except PySpyError as exc:
        print(f"mrc-agent diagnose: error: {exc}", file=sys.stderr)
        return EXIT_PY_SPY
    sys.stdout.write(render_text(result.report))
    sys.stdout.write(f"\nwritten to {os.path.abspath(out)}\n")
    return EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mrc_agent.agent.tools.flags import DIAGNOSE_FLAGS

    # Its own flags, then the sidecar settings it takes (agent/core/config.py).
    DIAGNOSE_FLAGS.add_flags(parser, DIAGNOSE)
    add_flags(parser, DIAGNOSE)


run = run_diagnose_command
