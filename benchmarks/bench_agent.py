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
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"

#: Goals from the agent's design brief.
GOAL_CPU = {1.0: 0.3, 0.1: 2.0}  # % of one core while idle (not scraped)
GOAL_RSS_MB = 50.0  # MB = 10**6 bytes, the stricter reading of "50 MB"
GOAL_P99_MS = 5.0
GOAL_ACCURACY_CORES = 0.05
GOAL_PACE = 0.95  # samples taken / samples expected while being scraped

#: pidstat starts this long after an agent pass, so its 1 s windows trail the agent's slightly
#: (its first read happens a few ms after exec).
PIDSTAT_LAG = 0.005
SCRAPERS = 50
SCRAPER_PROCS = 5  # 50 scrapers as 5 processes x 10 threads: less client-side GIL queueing
#: What Prometheus 2.x sends, so the agent's negotiation and gzip paths are the ones exercised.
PROM_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
              "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
    "User-Agent": "bench-agent-scraper",
}

# -- target processes ---------------------------------------------------------------------------
# Each takes its lifetime in seconds as argv[1] and exits by itself when it is over.
_SPIN_LOOP = """
def spin(end):
    while time.monotonic() < end:
        for _ in range(20000):
            pass
"""
TARGETS: dict[str, str] = {
    "spin1": "import sys, time\n" + _SPIN_LOOP + "spin(time.monotonic() + float(sys.argv[1]))\n",
    # Four threads in all: the main thread spins, three others sleep.
    "spin4": "import sys, threading, time\n" + _SPIN_LOOP + """
end = time.monotonic() + float(sys.argv[1])
def sleepy():
    while time.monotonic() < end:
        time.sleep(0.2)
others = [threading.Thread(target=sleepy, daemon=True) for _ in range(3)]
for t in others:
    t.start()
spin(end)
""",
    # 0.5 s busy, 0.5 s idle: any 1 s window holds ~0.5 s of CPU whatever its phase, so two
    # tools sampling at different phases can still be compared window by window.
    "alt": "import sys, time\n" + _SPIN_LOOP + """
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    spin(min(time.monotonic() + 0.5, end))
    time.sleep(max(min(0.5, end - time.monotonic()), 0))
""",
    "idle": """import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    time.sleep(min(0.5, max(end - time.monotonic(), 0)))
""",
}
BUSY_TARGETS = ("spin1", "spin4", "alt")


# -- /proc readers --------------------------------------------------------------------------------
def _stat_fields(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return raw[raw.rfind(b")") + 2:].split()  # fields[0] is field 3 (state)


def cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process (exited threads included), in clock ticks."""
    f = _stat_fields(pid)
    return int(f[11]) + int(f[12])


def user_ticks(pid: int) -> int:
    """utime - guest_time, the quantity pidstat's %usr and the agent's ratio are built on."""
    f = _stat_fields(pid)
    guest = int(f[39]) if len(f) > 39 else 0
    return int(f[11]) - guest


def schedstat_ns(pid: int) -> dict[int, tuple[int, int]]:
    """(ns on CPU, ns runnable but waiting for a CPU) per live thread, from
    ``/proc/PID/task/TID/schedstat``; {} where the kernel does not provide it."""
    out: dict[int, tuple[int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                cols = f.read().split()
            out[int(tid)] = (int(cols[0]), int(cols[1]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(key.encode() + b":"):
                return int(line.split()[1])
    raise KeyError(key)


@dataclass
class CpuWindow:
    """CPU a process used between :meth:`begin` and :meth:`end`, as % of one core."""

    pid: int
    t0: float = 0.0
    ticks0: int = 0
    ns0: dict[int, tuple[int, int]] = field(default_factory=dict)
    seconds: float = 0.0
    pct_ticks: float = 0.0
    pct_sched: float | None = None  # None where schedstat is not available
    wait_s: float | None = None  # summed run-queue wait of its threads, from schedstat
    per_thread: dict[int, float] = field(default_factory=dict)  # tid -> % of a core

    def begin(self) -> CpuWindow:
        self.ns0 = schedstat_ns(self.pid)
        self.ticks0 = cpu_ticks(self.pid)
        self.t0 = time.monotonic()
        return self

    def end(self) -> CpuWindow:
        ticks = cpu_ticks(self.pid)
        ns = schedstat_ns(self.pid)
        self.seconds = time.monotonic() - self.t0
        self.pct_ticks = (ticks - self.ticks0) / CLK_TCK / self.seconds * 100
        if ns:
            # Threads born in the window count from zero; threads that died in it are lost, so
            # this is only exact for windows without thread churn (the idle windows).
            used = sum(v[0] - self.ns0.get(tid, (0, 0))[0] for tid, v in ns.items())
            wait = sum(v[1] - self.ns0.get(tid, (0, 0))[1] for tid, v in ns.items())
            self.pct_sched = used / 1e9 / self.seconds * 100
            self.wait_s = wait / 1e9
            self.per_thread = {tid: (v[0] - self.ns0.get(tid, (0, 0))[0]) / 1e7 / self.seconds
                               for tid, v in sorted(ns.items())}
        return self

    def text(self) -> str:
        res = 100 / CLK_TCK / self.seconds  # one tick over the window, in %
        out = f"{self.pct_ticks:.3f} % (±{res:.3f}, {self.seconds:.1f} s)"
        if self.pct_sched is not None:
            out += f"; schedstat {self.pct_sched:.3f} %"
        return out


@dataclass
class MachineWindow:
    """Busy CPU of the whole machine (all processes) from ``/proc/stat``, in cores."""

    busy0: int = 0
    t0: float = 0.0
    busy_cores: float = 0.0

    @staticmethod
    def _busy() -> int:
        with open("/proc/stat", "rb") as f:
            cols = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal (guest is inside user already)
        return sum(cols[:8]) - cols[3] - cols[4]

    def begin(self) -> MachineWindow:
        self.busy0, self.t0 = self._busy(), time.monotonic()
        return self

    def end(self) -> MachineWindow:
        self.busy_cores = (self._busy() - self.busy0) / CLK_TCK / (time.monotonic() - self.t0)
        return self


# -- metrics over HTTP ----------------------------------------------------------------------------
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_PID = re.compile(r'pid="(\d+)"')


@dataclass
class Scrape:
    at: float  # time.time() when the body arrived
    samples_total: float
    overruns_total: float
    last_sample_ts: float
    user_ratio: dict[int, float]


def scrape(port: int, timeout: float = 10.0) -> Scrape:
    """One plain-text scrape on a fresh connection (closed after)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", "/metrics", headers={"Connection": "close"})
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", "replace")
        if resp.status != 200:
            raise RuntimeError(f"/metrics answered {resp.status}")
    finally:
        conn.close()
    at = time.time()
    values: dict[str, float] = {}
    ratios: dict[int, float] = {}
    for line in body.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        if name == "mrc_process_cpu_user_ratio" and labels:
            pm = _PID.search(labels)
            if pm:
                ratios[int(pm.group(1))] = float(value)
        elif not labels:
            values[name] = float(value)
    return Scrape(at, values.get("mrc_agent_samples_total", 0.0),
                  values.get("mrc_agent_sample_overruns_total", 0.0),
                  values.get("mrc_agent_last_sample_timestamp_seconds", 0.0), ratios)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# -- scraper child process -----------------------------------------------------------------------
def scraper_child(port: int, threads: int, start_at: float, duration: float, pace: float,
                  out: str) -> int:
    """Run ``threads`` keep-alive scrapers from ``start_at`` (epoch) for ``duration`` seconds,
    back to back (``pace`` 0) or one scrape every ``pace`` seconds each at a random phase;
    write latencies (ms) to ``out`` as JSON."""
    lat: list[list[float]] = [[] for _ in range(threads)]
    errors = [0] * threads
    body_bytes = [0] * threads
    end_at = start_at + duration

    def worker(i: int) -> None:
        rnd = random.Random(i * 7919 + os.getpid())
        conn = http.client.HTTPConnection(HOST, port, timeout=10)
        with contextlib.suppress(OSError):
            conn.connect()  # connect before the window: Prometheus reuses its connection
        next_at = start_at + (rnd.random() * pace if pace else 0.0)
        time.sleep(max(start_at - time.time(), 0.0))
        while True:
            if pace:
                time.sleep(max(next_at - time.time(), 0.0))
                next_at += pace
            if time.time() >= end_at:
                break
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/metrics", headers=PROM_HEADERS)
                resp = conn.getresponse()
                body = resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection(HOST, port, timeout=10)
            if ok:
                lat[i].append((time.perf_counter() - t0) * 1000)
                body_bytes[i] = len(body)
            else:
                errors[i] += 1
        conn.close()

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=max(end_at - time.time(), 0) + 20)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"latencies_ms": [x for xs in lat for x in xs], "errors": sum(errors),
                   "body_bytes": max(body_bytes)}, f)
    return 0


# -- the benchmark --------------------------------------------------------------------------------
@dataclass
class Row:
    metric: str
    measured: str
    goal: str = "—"
    result: str = "info"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0-1) by nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


class Procs:
    """Every child process the benchmark starts, so that ``finally`` can kill them all."""

    def __init__(self) -> None:
        self.all: list[subprocess.Popen[Any]] = []

    def start(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        p = subprocess.Popen(list(argv), **kw)
        self.all.append(p)
        return p

    @staticmethod
    def stop(p: subprocess.Popen[Any], grace: float = 5.0) -> int | None:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        return p.returncode

    def kill_all(self) -> None:
        for p in self.all:
            if p.poll() is None:
                p.kill()
        for p in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


def sleep_until(t_epoch: float) -> None:
    time.sleep(max(t_epoch - time.time(), 0.0))


def agent_argv() -> list[str]:
    beside = Path(sys.executable).parent / "mrc-agent"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("mrc-agent")
    return [found] if found else [sys.executable, "-m", "mrc_agent.agent"]


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
                 "--duration", str(duration), "--pace", str(pace), "--child-out", out],
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
    args = ap.parse_args(argv)
    if args.scraper_child:
        return scraper_child(args.port, args.threads, args.start_at, args.duration, args.pace,
                             args.child_out)

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
