"""Benchmark of the ``mrc-agent`` sidecar against its goals, side by side with ``pidstat``.

Run as ``python3 benchmarks/bench_agent.py [--quick] [--out benchmarks/results/agent.md]``.
It is a measurement, not a test: it prints a Markdown table (metric | measured | goal | result)
and exits 0 whether or not a goal is met; it exits 1 only when it cannot measure (the agent
did not start, for instance).

What one run does:

1. Writes an 8-GPU replay trace (``python3 -m mrc_agent.agent.tools.tracegen busy 8 20``) to a
   temp dir and
   starts four real target processes: a single-threaded spinner, a 4-thread process with one
   hot thread and three sleepers, one that alternates 0.5 s busy / 0.5 s idle, and an idle one.
2. Runs ``mrc-agent run`` on them at ``--interval 1.0`` and then ``0.1``: the agent's own CPU
   (utime+stime from ``/proc/PID/stat``, cross-checked with ``schedstat`` nanoseconds) and
   memory (VmRSS / VmHWM) over an idle window with no scraping.
3. At each interval, keep-alive scrapers (separate processes, ``http.client``) load
   ``/metrics``: one back to back (the latency of a lone request), 50 back to back (the goal)
   and 50 at one scrape per second each: latency p50/p99/max, the agent's CPU and run-queue
   wait meanwhile, and whether sampling kept its pace (``mrc_agent_samples_total`` and
   ``mrc_agent_sample_overruns_total`` before and after).
4. Accuracy at 1 s: ``mrc_process_cpu_user_ratio`` of every agent pass against ground truth
   from this script's own 100 Hz reads of ``/proc/PID/stat`` over the same windows.
5. ``pidstat -u -t -p PIDS 1`` runs alongside at 1 s: its own CPU cost and its %usr per
   process against the agent's ratio and the same ground truth.

Everything spawned is bounded in time and killed in a ``finally``; traffic goes only to
127.0.0.1. Linux only (it reads ``/proc``).
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import http.client
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_agent_probes import (  # beside this script: Python puts its folder on the path
    BUSY_TARGETS,
    CLK_TCK,
    HOST,
    PIDSTAT_LAG,
    REPO,
    SCRAPER_PROCS,
    SCRAPERS,
    TARGETS,
    CpuWindow,
    MachineWindow,
    Procs,
    Row,
    Scrape,
    agent_argv,
    pct,
    scrape,
    scraper_child,
    sleep_until,
    status_kb,
    user_ticks,
    verdict,
)
from support import free_port

#: Goals from the agent's design brief.
GOAL_CPU = {1.0: 0.3, 0.1: 2.0}  # % of one core while idle (not scraped)


GOAL_RSS_MB = 50.0  # MB = 10**6 bytes, the stricter reading of "50 MB"


GOAL_P99_MS = 5.0


GOAL_ACCURACY_CORES = 0.05


GOAL_PACE = 0.95  # samples taken / samples expected while being scraped


@dataclass
class Plan:
    idle: float  # idle window (no scraping) per interval
    accuracy: float  # accuracy + pidstat comparison window at 1 s
    load: float  # each scrape-load window
    warmup: float = 2.5


class Bench:
    def __init__(self, plan: Plan, workdir: str) -> None:
        self.plan = plan
        self.workdir = workdir
        self.procs = Procs()
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.targets: dict[str, int] = {}
        self.trace = ""

    # -- setup --
    def setup(self) -> None:
        self.trace = os.path.join(self.workdir, "busy-8gpu.jsonl")
        with open(self.trace, "w", encoding="utf-8") as f:
            subprocess.run([sys.executable, "-m", "mrc_agent.agent.tools.tracegen",
                            "busy", "8", "20"],
                           stdout=f, check=True, cwd=REPO, timeout=60)
        p = self.plan
        lifetime = 2 * (p.warmup + p.idle + 3 * (p.load + 3)) + p.accuracy + 90
        for name, code in TARGETS.items():
            proc = self.procs.start([sys.executable, "-c", code, str(lifetime)],
                                    stdin=subprocess.DEVNULL)
            self.targets[name] = proc.pid
        time.sleep(0.5)
        for name, pid in self.targets.items():
            if not os.path.exists(f"/proc/{pid}"):
                raise RuntimeError(f"target {name} (pid {pid}) exited at once")

    def start_agent(self, interval: float) -> tuple[subprocess.Popen[Any], int, str]:
        port = free_port()
        log = os.path.join(self.workdir, f"agent-{interval:g}.log")
        argv = [*agent_argv(), "run"]
        for pid in self.targets.values():
            argv += ["--pid", str(pid)]
        argv += ["--gpu-backend", f"replay:{self.trace}", "--listen", f"{HOST}:{port}",
                 "--interval", str(interval)]
        with open(log, "wb") as logf:
            agent = self.procs.start(argv, stdout=logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.workdir)
        deadline = time.monotonic() + 30
        while True:
            if agent.poll() is not None:
                raise RuntimeError(f"agent exited with {agent.returncode}:\n" + tail(log))
            try:
                conn = http.client.HTTPConnection(HOST, port, timeout=2)
                conn.request("GET", "/readyz", headers={"Connection": "close"})
                ready = conn.getresponse().status == 200
                conn.close()
                if ready:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("agent not ready after 30 s:\n" + tail(log))
            time.sleep(0.05)
        # At least two passes, so that the ratios exist, and the start-up cost is behind us.
        time.sleep(max(self.plan.warmup, 2.5 * interval))
        return agent, port, log

    # -- phases --
    def idle_window(self, agent_pid: int, port: int, interval: float,
                    extra: Sequence[tuple[str, int]] = ()) -> dict[str, Any]:
        """No scraping between the two CPU readings (the pace scrapes sit outside them)."""
        before = scrape(port)
        machine = MachineWindow().begin()
        win = CpuWindow(agent_pid).begin()
        others = {name: CpuWindow(pid).begin() for name, pid in extra}
        targets = {name: CpuWindow(pid).begin() for name, pid in self.targets.items()}
        time.sleep(self.plan.idle)
        win.end()
        for w in [*others.values(), *targets.values()]:
            w.end()
        machine.end()
        rss_kb = status_kb(agent_pid, "VmRSS")
        after = scrape(port)
        return {"cpu": win, "others": others, "targets": targets, "machine": machine,
                "rss_kb": rss_kb, "before": before, "after": after}

    def load_window(self, agent_pid: int, port: int, interval: float, pace: float,
                    nprocs: int = SCRAPER_PROCS, per: int = SCRAPERS // SCRAPER_PROCS,
                    duration: float | None = None) -> dict[str, Any]:
        """``nprocs`` x ``per`` keep-alive scrapers for ``duration`` (the plan's load window)."""
        duration = duration or self.plan.load
        start_at = time.time() + 2.0  # python start-up of the children on a busy machine
        outs = []
        children = []
        for i in range(nprocs):
            out = os.path.join(self.workdir,
                               f"scrape-{interval:g}-{pace:g}-{nprocs * per}-{i}.json")
            outs.append(out)
            children.append(self.procs.start(
                [sys.executable, str(Path(__file__).resolve()), "--scraper-child",
                 "--port", str(port), "--threads", str(per), "--start-at", repr(start_at),
                 "--duration", str(duration), "--pace", str(pace), "--child-out", out,
                 "--first-address", str(i * per)],
                stdin=subprocess.DEVNULL))
        sleep_until(start_at - 0.3)
        before = scrape(port)
        sleep_until(start_at)
        win = CpuWindow(agent_pid).begin()
        sleep_until(start_at + duration)
        win.end()
        after = scrape(port)
        hwm_kb = status_kb(agent_pid, "VmHWM")
        lat: list[float] = []
        errors = 0
        body = 0
        for child, out in zip(children, outs, strict=True):
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                errors += 1
                continue
            if child.returncode == 0 and os.path.exists(out):
                with open(out, encoding="utf-8") as f:
                    data = json.load(f)
                lat += data["latencies_ms"]
                errors += data["errors"]
                body = max(body, data["body_bytes"])
            else:
                errors += 1
        return {"lat": lat, "errors": errors, "body": body, "cpu": win, "before": before,
                "after": after, "hwm_kb": hwm_kb, "seconds": duration}

    def accuracy_window(self, port: int) -> tuple[list[Scrape], list[tuple[float, dict[int, int]]]]:
        """Scrape at 10 Hz (the agent samples at 1 Hz) while reading the targets' utime at
        100 Hz; returns one scrape per agent pass and the utime readings."""
        pids = list(self.targets.values())
        polls: list[tuple[float, dict[int, int]]] = []
        passes: list[Scrape] = []
        stop = threading.Event()

        def poller() -> None:
            while not stop.is_set():
                t = time.time()
                reading = {}
                for pid in pids:
                    with contextlib.suppress(OSError):
                        reading[pid] = user_ticks(pid)
                polls.append((t, reading))
                stop.wait(0.01)

        th = threading.Thread(target=poller, daemon=True)
        th.start()
        end = time.monotonic() + self.plan.accuracy
        try:
            while time.monotonic() < end:
                s = scrape(port)
                if not passes or s.samples_total != passes[-1].samples_total:
                    passes.append(s)
                time.sleep(0.1)
        finally:
            stop.set()
            th.join(5)
        return passes, polls

    # -- whole run --
    def run(self) -> None:
        self.setup()
        pidstat = shutil.which("pidstat")
        self.notes.append(
            "Targets: " + ", ".join(f"{n} (pid {p})" for n, p in self.targets.items())
            + "; their demand is ~2.5 cores (spin1 1, spin4 1, alt 0.5) on this "
            f"{os.cpu_count()}-core machine, so the agent and the scrapers compete for CPU.")
        for interval in (1.0, 0.1):
            self.run_interval(interval, pidstat if interval == 1.0 else None)
        if pidstat is None:
            self.rows.append(Row("pidstat comparison", "skipped: pidstat not found "
                                 "(Debian package sysstat)", "—", "SKIP"))

    def start_pidstat(self, pidstat: str, port: int, count: int,
                      lines: list[tuple[float, str]]) -> tuple[subprocess.Popen[str],
                                                               threading.Thread]:
        """Start ``pidstat -u -t -p PIDS 1`` in phase with the agent's 1 s passes, so that
        both tools measure (nearly) the same windows and can be compared one by one."""
        argv = [pidstat, "-u", "-t", "-p", ",".join(map(str, self.targets.values())), "1",
                str(count)]
        stdbuf = shutil.which("stdbuf")
        if stdbuf:  # line-buffered, so that a line's arrival time is the end of its window
            argv = [stdbuf, "-oL", *argv]
        last = scrape(port).last_sample_ts
        sleep_until(last + math.ceil(time.time() - last + 0.2) + PIDSTAT_LAG)
        ps = self.procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL, text=True,
                              env={**os.environ, "LC_ALL": "C"})

        def read(stream: Any = ps.stdout) -> None:
            for line in stream:
                lines.append((time.time(), line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(1.5)  # past pidstat's start-up and first report
        return ps, reader

    def run_interval(self, interval: float, pidstat: str | None) -> None:
        agent, port, log = self.start_agent(interval)
        ps: subprocess.Popen[str] | None = None
        ps_lines: list[tuple[float, str]] = []
        reader: threading.Thread | None = None
        passes: list[Scrape] = []
        polls: list[tuple[float, dict[int, int]]] = []
        try:
            if pidstat is not None:
                count = int(self.plan.idle + self.plan.accuracy + 30)
                ps, reader = self.start_pidstat(pidstat, port, count, ps_lines)
            extra = [("pidstat", ps.pid)] if ps is not None else []
            idle = self.idle_window(agent.pid, port, interval, extra)
            if interval == 1.0:
                passes, polls = self.accuracy_window(port)
            if ps is not None:
                Procs.stop(ps)  # pidstat is compared at rest, not while the machine is flooded
            one = self.load_window(agent.pid, port, interval, pace=0.0, nprocs=1, per=1,
                                   duration=min(self.plan.load, 5.0))
            tight = self.load_window(agent.pid, port, interval, pace=0.0)
            paced = self.load_window(agent.pid, port, interval, pace=1.0)
            hwm_kb = status_kb(agent.pid, "VmHWM")
        finally:
            if ps is not None:
                Procs.stop(ps)
                if reader is not None:
                    reader.join(5)
            rc = Procs.stop(agent)
        if rc not in (0, None):
            self.notes.append(f"agent at {interval:g} s exited with {rc} on SIGTERM:\n"
                              + tail(log))
        self.cost_rows(interval, idle, hwm_kb)
        self.load_rows(interval, [("1 keep-alive scraper back to back (no concurrency)", one,
                                   False),
                                  (f"{SCRAPERS} keep-alive scrapers back to back", tight, True),
                                  (f"{SCRAPERS} keep-alive scrapers at 1 scrape/s each "
                                   "(Prometheus-like)", paced, False)])
        if interval == 1.0:
            self.accuracy_rows(passes, polls)
            if ps is not None:
                self.pidstat_rows(idle, passes, polls, parse_pidstat(ps_lines))

    # -- rows --
    def cost_rows(self, interval: float, idle: dict[str, Any], hwm_kb: int) -> None:
        tag = f"{interval:g} s"
        cpu: CpuWindow = idle["cpu"]
        goal = GOAL_CPU[interval]
        text = cpu.text()
        if len(cpu.per_thread) == 3:
            # cmd_run starts the sampler thread before the HTTP thread: tids come in that order.
            names = dict(zip(sorted(cpu.per_thread), ("main", "sampler", "http"), strict=True))
            text += " (" + ", ".join(f"{names[t]} {v:.3f}" for t, v in
                                     cpu.per_thread.items()) + ")"
        # The kernel scales utime+stime to the scheduler's exact runtime and prints it in
        # ticks, so schedstat is the same quantity without the ±1 tick: judge on it if there.
        judged = cpu.pct_sched if cpu.pct_sched is not None else cpu.pct_ticks
        self.rows.append(Row(f"agent CPU, idle (not scraped), interval {tag}", text,
                             f"≤ {goal} % of a core", verdict(judged <= goal)))
        self.rows.append(pace_row(f"sampling pace, idle, interval {tag}", idle["before"],
                                  idle["after"], interval))
        m: MachineWindow = idle["machine"]
        ours = sum(w.pct_ticks for w in idle["targets"].values()) / 100
        rest = m.busy_cores - ours - cpu.pct_ticks / 100
        self.rows.append(Row(
            f"machine CPU busy during the idle window, interval {tag}",
            f"{m.busy_cores:.2f} of {os.cpu_count()} cores (targets {ours:.2f}, agent "
            f"{cpu.pct_ticks / 100:.3f}, everything else {rest:.2f})"))
        rss = idle["rss_kb"] * 1024 / 1e6
        self.rows.append(Row(f"agent RSS (VmRSS) after idle window, interval {tag}",
                             f"{rss:.1f} MB", f"≤ {GOAL_RSS_MB:g} MB",
                             verdict(rss <= GOAL_RSS_MB)))
        hwm = hwm_kb * 1024 / 1e6
        self.rows.append(Row(f"agent peak RSS (VmHWM) over the run incl. scrape load, "
                             f"interval {tag}", f"{hwm:.1f} MB", f"≤ {GOAL_RSS_MB:g} MB",
                             verdict(hwm <= GOAL_RSS_MB)))

    def load_rows(self, interval: float, runs: list[tuple[str, dict[str, Any], bool]]) -> None:
        tag = f"{interval:g} s"
        for name, res, has_goal in runs:
            lat = res["lat"]
            n = len(lat)
            if n:
                measured = (f"p50 {pct(lat, 0.5):.2f} / p99 {pct(lat, 0.99):.2f} / max "
                            f"{max(lat):.1f} ms; {n} scrapes, {n / res['seconds']:.0f}/s, "
                            f"{res['errors']} errors, body {res['body']} B")
                ok = pct(lat, 0.99) <= GOAL_P99_MS and res["errors"] == 0
            else:
                measured, ok = f"no successful scrape ({res['errors']} errors)", False
            self.rows.append(Row(f"scrape latency, {name}, interval {tag}", measured,
                                 f"p99 ≤ {GOAL_P99_MS:g} ms" if has_goal else "—",
                                 verdict(ok) if has_goal else "info"))
            w: CpuWindow = res["cpu"]
            cpu_text = f"{w.pct_ticks:.1f} % of a core over {w.seconds:.1f} s"
            if n:
                cpu_text += (f", {w.pct_ticks / 100 * w.seconds / n * 1000:.2f} ms CPU "
                             "per scrape")
            if w.wait_s is not None:
                cpu_text += (f"; its threads waited {w.wait_s:.2f} s in the run queue"
                             + (f" ({w.wait_s / n * 1000:.2f} ms per scrape)" if n else ""))
            self.rows.append(Row(f"agent CPU while scraped, {name}, interval {tag}", cpu_text))
            self.rows.append(pace_row(f"sampling pace while scraped, {name}, interval {tag}",
                                      res["before"], res["after"], interval))

    def accuracy_rows(self, passes: list[Scrape],
                      polls: list[tuple[float, dict[int, int]]]) -> None:
        errs = agent_errors(passes, polls)
        for name in BUSY_TARGETS:
            e = errs.get(self.targets[name], [])
            if e:
                worst = max(abs(x) for x in e)
                mean = statistics.fmean(abs(x) for x in e)
                self.rows.append(Row(
                    f"accuracy of mrc_process_cpu_user_ratio vs /proc truth, {name}, "
                    "interval 1 s",
                    f"max {worst:.4f} / mean {mean:.4f} cores abs error ({len(e)} windows)",
                    f"max ≤ {GOAL_ACCURACY_CORES} cores",
                    verdict(worst <= GOAL_ACCURACY_CORES)))
            else:
                self.rows.append(Row(f"accuracy vs /proc truth, {name}", "no window measured",
                                     f"max ≤ {GOAL_ACCURACY_CORES} cores", "FAIL"))

    def pidstat_rows(self, idle: dict[str, Any], passes: list[Scrape],
                     polls: list[tuple[float, dict[int, int]]],
                     reports: list[tuple[float, dict[int, float]]]) -> None:
        cpu: CpuWindow = idle["cpu"]
        pcpu: CpuWindow = idle["others"]["pidstat"]
        self.rows.append(Row("pidstat -u -t -p PIDS 1: own CPU, same idle window",
                             pcpu.text()))
        a_cost = cpu.pct_sched if cpu.pct_sched is not None else cpu.pct_ticks
        p_cost = pcpu.pct_sched if pcpu.pct_sched is not None else pcpu.pct_ticks
        basis = "schedstat" if cpu.pct_sched is not None else "ticks"
        self.rows.append(Row("agent cost / pidstat cost (both at 1 s, same idle window)",
                             f"{a_cost / p_cost:.1f}x ({basis}: {a_cost:.3f} % vs "
                             f"{p_cost:.3f} % of a core)" if p_cost > 0
                             else "pidstat's cost is below the resolution"))
        if not reports or len(passes) < 2:
            self.rows.append(Row("pidstat comparison", "no pidstat report or agent pass to "
                                 "compare", "—", "SKIP"))
            return
        by_pid = {pid: name for name, pid in self.targets.items()}
        ends = [p.last_sample_ts for p in passes]
        diffs: dict[int, list[float]] = {}
        pairs: dict[int, list[tuple[float, float]]] = {}
        offsets: list[float] = []
        truth_err: list[float] = []
        for i, (end, usr) in enumerate(reports):
            k = min(range(len(ends)), key=lambda c: abs(ends[c] - end))
            if abs(ends[k] - end) <= 0.25 and k > 0:
                offsets.append(end - ends[k])
                for pid, ratio in usr.items():
                    if pid in passes[k].user_ratio:
                        diffs.setdefault(pid, []).append(passes[k].user_ratio[pid] - ratio)
                        pairs.setdefault(pid, []).append((passes[k].user_ratio[pid], ratio))
            if i > 0 and end - reports[i - 1][0] < 1.5:
                for pid, ratio in usr.items():
                    truth = truth_ratio(polls, pid, reports[i - 1][0], end)
                    if truth is not None:
                        truth_err.append(abs(ratio - truth))
        all_d = [abs(x) for xs in diffs.values() for x in xs]
        if not all_d:
            self.rows.append(Row("agent vs pidstat", "no matching windows", "—", "SKIP"))
            return
        self.rows.append(Row(
            "agent ratio vs pidstat %usr/100, same 1 s windows, all targets",
            f"max {max(all_d):.4f} / mean {statistics.fmean(all_d):.4f} cores abs diff "
            f"({len(all_d)} pairs; pidstat's windows end a median "
            f"{statistics.median(offsets) * 1000:+.0f} ms after the agent's)"))
        per = "; ".join(
            f"{by_pid[pid]} {statistics.fmean(a for a, _ in xs):.3f} vs "
            f"{statistics.fmean(p for _, p in xs):.3f} (max diff "
            f"{max(abs(a - p) for a, p in xs):.3f})"
            for pid, xs in sorted(pairs.items(), key=lambda kv: by_pid[kv[0]]))
        self.rows.append(Row("mean user CPU per target over the matched windows, agent vs "
                             "pidstat (cores)", per))
        if truth_err:
            self.rows.append(Row("pidstat %usr/100 vs /proc truth (its own windows)",
                                 f"max {max(truth_err):.4f} / mean "
                                 f"{statistics.fmean(truth_err):.4f} cores abs error "
                                 f"({len(truth_err)} windows)"))


def pace_row(metric: str, before: Scrape, after: Scrape, interval: float) -> Row:
    """Passes taken between two scrapes against the passes the interval calls for over the
    span between the two passes seen (exact for the runner's fixed-phase clock)."""
    taken = after.samples_total - before.samples_total
    span = after.last_sample_ts - before.last_sample_ts
    expected = round(span / interval)
    over = after.overruns_total - before.overruns_total
    return Row(metric, f"{taken:.0f} passes / {expected} expected over {span:.1f} s, "
               f"{over:.0f} overruns", f"≥ {GOAL_PACE:.0%} of expected",
               verdict(taken >= GOAL_PACE * expected))


def truth_ratio(polls: list[tuple[float, dict[int, int]]], pid: int, t0: float,
                t1: float) -> float | None:
    """User CPU (cores) of ``pid`` over [t0, t1] from the 100 Hz utime readings, linearly
    interpolated at both ends; None if the readings do not cover the window."""
    times = [t for t, _ in polls]

    def at(t: float) -> float | None:
        i = bisect.bisect_right(times, t)
        if i == 0 or i == len(times):
            return None
        (ta, ra), (tb, rb) = polls[i - 1], polls[i]
        if pid not in ra or pid not in rb or tb - ta > 0.1:
            return None
        return ra[pid] + (rb[pid] - ra[pid]) * (t - ta) / (tb - ta)

    u0, u1 = at(t0), at(t1)
    if u0 is None or u1 is None or t1 <= t0:
        return None
    return (u1 - u0) / CLK_TCK / (t1 - t0)


def agent_errors(passes: list[Scrape],
                 polls: list[tuple[float, dict[int, int]]]) -> dict[int, list[float]]:
    """agent ratio - ground truth, per pid, for every pair of consecutive agent passes."""
    out: dict[int, list[float]] = {}
    for prev, cur in zip(passes, passes[1:], strict=False):
        if cur.samples_total != prev.samples_total + 1:
            continue  # a pass was missed between two scrapes: the window is unknown
        for pid, ratio in cur.user_ratio.items():
            truth = truth_ratio(polls, pid, prev.last_sample_ts, cur.last_sample_ts)
            if truth is not None:
                out.setdefault(pid, []).append(ratio - truth)
    return out


def parse_pidstat(lines: list[tuple[float, str]]) -> list[tuple[float, dict[int, float]]]:
    """Per-process rows (TID ``-``) of ``pidstat -u -t`` grouped into reports:
    (arrival time of the report's first row, {tgid: %usr / 100})."""
    cols: dict[str, int] = {}
    reports: list[tuple[float, dict[int, float]]] = []
    stamp = None
    for at, line in lines:
        parts = line.split()
        if "%usr" in parts and "TGID" in parts:
            cols = {name: i for i, name in enumerate(parts)}
            continue
        if not cols or len(parts) < len(cols) or parts[0].startswith("Average"):
            continue
        tgid, tid = parts[cols["TGID"]], parts[cols["TID"]]
        if tid != "-" or not tgid.isdigit():
            continue
        if stamp != parts[0] or not reports:
            reports.append((at, {}))
            stamp = parts[0]
        with contextlib.suppress(ValueError):
            reports[-1][1][int(tgid)] = float(parts[cols["%usr"]]) / 100
    return reports


def tail(path: str, n: int = 20) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def machine_facts() -> list[str]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    ver = subprocess.run([*agent_argv(), "--version"], capture_output=True, text=True,
                         timeout=30).stdout.strip()
    pidstat = shutil.which("pidstat")
    ps_ver = ""
    if pidstat:
        out = subprocess.run([pidstat, "-V"], capture_output=True, text=True, timeout=10)
        ps_ver = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else ""
    return [
        f"nproc: {os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})",
        f"CPU: {model or 'unknown'}",
        f"kernel: {platform.release()}; CLK_TCK {CLK_TCK}",
        f"python: {platform.python_version()} ({sys.executable})",
        f"agent: {ver}",
        f"pidstat: {ps_ver or 'not installed'}",
    ]


def render(rows: list[Row], facts: list[str], notes: list[str], quick: bool,
           plan: Plan, started: str) -> str:
    out = [f"# mrc-agent benchmark ({'quick' if quick else 'full'} run, {started})", "",
           "| metric | measured | goal | pass/fail |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.metric} | {r.measured} | {r.goal} | {r.result} |")
    out += ["", "Machine:", ""] + [f"- {f}" for f in facts]
    out += ["", f"Windows: idle {plan.idle:g} s per interval, accuracy {plan.accuracy:g} s, "
            f"each scrape-load window {plan.load:g} s. CPU is utime+stime from /proc/PID/stat "
            f"(± one tick over the window) and the sum of /proc/PID/task/*/schedstat (exact; "
            f"the idle-CPU verdict uses it). The {SCRAPERS} scrapers run as {SCRAPER_PROCS} "
            f"processes on the same machine as the agent and the targets."]
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="short windows (8 s idle, 5 s load)")
    ap.add_argument("--out", metavar="FILE", help="also write the Markdown table here")
    ap.add_argument("--scraper-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--duration", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--pace", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--first-address", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.scraper_child:
        return scraper_child(args.port, args.threads, args.start_at, args.duration, args.pace,
                             args.child_out, args.first_address)

    plan = Plan(idle=8, accuracy=8, load=5) if args.quick else Plan(idle=20, accuracy=20,
                                                                      load=10)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")  # so that ``finally`` kills children

    signal.signal(signal.SIGTERM, on_term)
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        bench = Bench(plan, tmp)
        try:
            bench.run()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            print(f"bench_agent: cannot measure: {exc}", file=sys.stderr)
            return 1
        finally:
            bench.procs.kill_all()
    text = render(bench.rows, machine_facts(), bench.notes, args.quick, plan, started)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
