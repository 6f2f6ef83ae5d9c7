"""Idle-connection flood against a real ``mrc-agent run``: memory and ``/metrics`` latency while
N idle connections are held, and how soon ``/metrics`` answers after they all close.

Run side by side with a baseline checkout (``--baseline REPO``, e.g. a ``git worktree`` of an
earlier commit): the same flood against both agents in the same run, reported as ratios.
Only loopback is used; the flood is bounded in count and time and stops by itself.

    python benchmarks/bench_connections.py --connections 3000 [--baseline /tmp/old] [--out F]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from support import report, rss_mb, stop

REPO = Path(__file__).resolve().parent.parent


def _start(repo: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "mrc_agent.agent", "run",
                             "--listen", "127.0.0.1:0", "--gpu-backend", "none",
                             "--pid", str(os.getpid())],
                            cwd=repo, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo / ".ci" / "namespace")})
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        m = re.search(r"listening on http://[^ ]+:(\d+)/metrics", line)
        if m:
            return proc, int(m.group(1))
        if not line:
            break
    proc.kill()
    raise SystemExit(f"agent in {repo} did not start")


def _scrape(port: int, timeout: float = 10.0) -> float:
    """Seconds one fresh-connection GET /metrics takes (inf when it fails)."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return time.perf_counter() - t0 if data.startswith(b"HTTP/1.1 200") else float("inf")
    except OSError:
        return float("inf")


@dataclass
class Result:
    rss_before: float
    rss_held: float
    rss_after: float
    held_p50_ms: float
    held_max_ms: float
    failed_while_held: int
    recovery_s: float
    open_at_end: int


def flood(repo: Path, n: int, hold_s: float) -> Result:
    proc, port = _start(repo)
    try:
        time.sleep(2.0)
        rss_before = rss_mb(proc.pid)
        socks = []
        for _ in range(n):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(1.0)
        lat = [_scrape(port) for _ in range(int(hold_s / 0.25))]
        rss_held = max(rss_mb(proc.pid), 0.0)
        open_at_end = sum(1 for s in socks if _still_open(s))
        for s in socks:
            s.close()
        t0 = time.perf_counter()
        while _scrape(port, 1.0) == float("inf") and time.perf_counter() - t0 < 30:
            pass
        recovery = time.perf_counter() - t0
        time.sleep(1.0)
        ok = [x for x in lat if x != float("inf")]
        return Result(rss_before, rss_held, rss_mb(proc.pid),
                      statistics.median(ok) * 1000 if ok else float("inf"),
                      max(ok) * 1000 if ok else float("inf"), len(lat) - len(ok), recovery,
                      open_at_end)
    finally:
        stop(proc, 10)


def _still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=3000)
    p.add_argument("--hold", type=float, default=5.0, help="seconds the flood is held (5)")
    p.add_argument("--baseline", type=Path, help="a checkout of an earlier commit to compare")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    runs = {"this tree": flood(REPO, args.connections, args.hold)}
    if args.baseline:
        runs["baseline"] = flood(args.baseline, args.connections, args.hold)
    rows = ["| run | RSS before | RSS with the flood held | RSS after | /metrics p50 / max while "
            "held | failed scrapes while held | /metrics again after the flood closes | flood "
            "connections still open |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in runs.items():
        rows.append(f"| {name} | {r.rss_before:.1f} MB | {r.rss_held:.1f} MB | "
                    f"{r.rss_after:.1f} MB | {r.held_p50_ms:.1f} / {r.held_max_ms:.1f} ms | "
                    f"{r.failed_while_held} | {r.recovery_s:.2f} s | {r.open_at_end} |")
    if "baseline" in runs:
        a, b = runs["this tree"], runs["baseline"]
        rows.append("")
        growth = (a.rss_held - a.rss_before) / max(b.rss_held - b.rss_before, 0.1)
        rows.append(f"This tree against the baseline, same run: RSS with the flood held "
                    f"{a.rss_held / b.rss_held:.2f}x, RSS growth from the flood {growth:.2f}x, "
                    f"time until /metrics answers after the flood closes {a.recovery_s:.2f} s "
                    f"against {b.recovery_s:.2f} s.")
    text = (f"# Idle-connection flood: {args.connections} connections held {args.hold:g} s\n\n"
            + "\n".join(rows))
    report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
