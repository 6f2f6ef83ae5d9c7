"""What ``bench_agent.py`` measures with: the target processes it starts, readers of
``/proc/PID`` (CPU ticks, schedstat, status), windows of a process's and the machine's CPU, the
``/metrics`` scrape and the scraper processes, and the process group that bounds them all.
Imported by ``bench_agent.py`` from this folder (Python puts a script's folder on its path).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


REPO = Path(__file__).resolve().parents[1]


HOST = "127.0.0.1"


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


# -- scraper child process -----------------------------------------------------------------------
def scraper_address(k: int) -> str:
    """Scraper ``k``'s own loopback source address (127.0.1.k+1): 50 Prometheus servers come
    from 50 addresses, and the agent paces requests per client address (20 a second), so 50
    scrapers sharing one address would measure that budget, not the server."""
    return f"127.0.{1 + k // 250}.{1 + k % 250}"


def scraper_child(port: int, threads: int, start_at: float, duration: float, pace: float,
                  out: str, first_address: int = 0) -> int:
    """Run ``threads`` keep-alive scrapers from ``start_at`` (epoch) for ``duration`` seconds,
    back to back (``pace`` 0) or one scrape every ``pace`` seconds each at a random phase, each
    from its own address (:func:`scraper_address` of ``first_address`` + its index); write
    latencies (ms) to ``out`` as JSON."""
    lat: list[list[float]] = [[] for _ in range(threads)]
    errors = [0] * threads
    body_bytes = [0] * threads
    end_at = start_at + duration

    def worker(i: int) -> None:
        rnd = random.Random(i * 7919 + os.getpid())
        source = (scraper_address(first_address + i), 0)
        conn = http.client.HTTPConnection(HOST, port, timeout=10, source_address=source)
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
                conn = http.client.HTTPConnection(HOST, port, timeout=10, source_address=source)
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
