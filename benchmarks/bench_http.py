"""The exposition server alone, two trees side by side: requests a second and latency of
back-to-back keep-alive scrapes, and the server's CPU time per request.

Each tree's ``ExpositionServer`` runs in a child process of its own (``PYTHONPATH`` set to that
tree's import root, ``.ci/namespace``) serving a registry of ``--series`` gauges; this process
drives ``--clients`` keep-alive connections, each sending ``GET /metrics`` (or ``--path``) as
soon as its last answer is whole, for ``--seconds``. Pacing is lifted in both (its budget of 20
requests a second per address is what a client loop would measure otherwise). The trees run in
turn, A B B A per round, so that drift of the shared machine falls on both.

    python benchmarks/bench_http.py --baseline WORKTREE [--rounds 3] [--out FILE]

``--baseline`` is another checkout (a ``git worktree`` of an earlier commit); the tree this
script lies in is the candidate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from support import report

REPO = Path(__file__).resolve().parent.parent
CLK = os.sysconf("SC_CLK_TCK")
#: What Prometheus 2.42 sends with a scrape (its scrape.go), so that the head parsed is a real
#: one: gzip asked, OpenMetrics preferred.
PROMETHEUS_HEADERS = (
    "Host: 127.0.0.1:9478\r\nUser-Agent: Prometheus/2.42.0\r\n"
    "Accept: application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n"
    "Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n")

SERVER = """
import sys, threading
from prometheus_client import CollectorRegistry, Gauge
from mrc_agent.exporters.exposition.http import ExpositionServer, Limits
registry = CollectorRegistry()
gauge = Gauge("bench_value", "A gauge per series.", ["i"], registry=registry)
for i in range(int(sys.argv[1])):
    gauge.labels(str(i)).set(i)
limits = Limits(pace_rate=1e9, pace_burst=10**9)
server = ExpositionServer(registry, "127.0.0.1", 0, lambda: 1, lambda: None, limits=limits)
server.start()
print(server.port, flush=True)
sys.stdin.read()
server.stop()
"""


@dataclass
class Run:
    tree: str
    requests: int
    seconds: float
    latencies_ms: list[float]
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    def p(self, q: float) -> float:
        return statistics.quantiles(self.latencies_ms, n=1000)[int(q * 1000) - 1]

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s / self.requests * 1e6


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


async def _client(port: int, path: str, until: float, latencies: list[float]) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = f"GET {path} HTTP/1.1\r\n{PROMETHEUS_HEADERS}\r\n".encode()
    done = 0
    try:
        while time.monotonic() < until:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            latencies.append((time.perf_counter() - t0) * 1000)
            done += 1
    finally:
        writer.close()
    return done


async def _drive(port: int, path: str, clients: int, seconds: float) -> tuple[int, list[float]]:
    latencies: list[float] = []
    until = time.monotonic() + seconds
    counts = await asyncio.gather(*(_client(port, path, until, latencies)
                                    for _ in range(clients)))
    return sum(counts), latencies


def run_once(tree: Path, label: str, args: argparse.Namespace) -> Run:
    env = {**os.environ, "PYTHONPATH": str(tree / ".ci" / "namespace")}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(args.series)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        asyncio.run(_drive(port, args.path, args.clients, 1.0))  # warm: render cache, imports
        cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
        requests, latencies = asyncio.run(_drive(port, args.path, args.clients, args.seconds))
        wall, cpu = time.monotonic() - t0, _cpu_s(proc.pid) - cpu0
    finally:
        proc.communicate("", timeout=30)
    return Run(label, requests, wall, latencies, cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--series", type=int, default=500)
    ap.add_argument("--path", default="/metrics")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trees = {"baseline": args.baseline.resolve(), "candidate": REPO}
    runs: dict[str, list[Run]] = {"baseline": [], "candidate": []}
    for _ in range(args.rounds):
        for label in ("baseline", "candidate", "candidate", "baseline"):
            run = run_once(trees[label], label, args)
            runs[label].append(run)
            print(f"{label}: {run.rate:,.0f} req/s, p50 {run.p(0.5):.2f} ms, "
                  f"p99 {run.p(0.99):.2f} ms, {run.cpu_us_per_request:.0f} µs CPU/request",
                  file=sys.stderr)

    def med(label: str, f: str) -> float:
        return statistics.median(getattr(r, f) if f in ("rate", "cpu_us_per_request")
                                 else r.p(float(f)) for r in runs[label])

    rows = [f"`{args.clients}` keep-alive clients back to back, each sending Prometheus 2.42's "
            f"scrape head (gzip) for `GET {args.path}` of "
            f"{args.series} series, {args.seconds:.0f} s a run, {2 * args.rounds} runs a tree "
            f"(A B B A), pacing lifted; medians of the runs. Machine: {os.cpu_count()} cores.",
            "", "| figure | baseline | candidate | candidate / baseline |",
            "| --- | --- | --- | --- |"]
    for name, key, fmt in (("requests/s", "rate", "{:,.0f}"), ("p50 ms", "0.5", "{:.2f}"),
                           ("p99 ms", "0.99", "{:.2f}"),
                           ("server CPU µs/request", "cpu_us_per_request", "{:.0f}")):
        a, b = med("baseline", key), med("candidate", key)
        rows.append(f"| {name} | {fmt.format(a)} | {fmt.format(b)} | {b / a:.3f} |")
    report("\n".join(rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
