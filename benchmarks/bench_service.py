"""Soak: 16 concurrent clients for 60 s against the reference service on the embedded model (CPU).

Goals: zero 5xx and flat memory. The service runs as a real process on loopback; the
clients are closed-loop (each sends its next request when the previous answer arrives) over the
nine prompt-length x resolution buckets, with one request in twenty a bad input (truncated JPEG,
non-image bytes) so error paths are soaked too. The service's RSS is sampled every second from
/proc; "flat" is judged on the second half of the run (after caches and allocator pools have
warmed): growth under 10 % of the half-time RSS.

    python3 benchmarks/bench_service.py [--clients 16] [--duration 60] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from reference_service.loadgen import (  # noqa: E402
    PROMPT_BUCKETS,
    RESOLUTIONS,
    make_photo,
    make_prompt,
    percentile,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def _client(url: str, photos: dict[str, bytes], bad: list[bytes], end: float,
                  seed: int, statuses: Counter[int], latencies: list[float]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < end:
            if rng.random() < 0.05:
                body = {"image": base64.b64encode(rng.choice(bad)).decode(),
                        "text_prompt": "What is this?", "max_new_tokens": 8}
            else:
                res = rng.choice([r for r, _, _ in RESOLUTIONS])
                body = {"image": base64.b64encode(photos[res]).decode(),
                        "text_prompt": make_prompt(rng.choice(PROMPT_BUCKETS), rng),
                        "max_new_tokens": 8}
            t0 = time.perf_counter()
            try:
                r = await client.post(url + "/mrc", json=body)
                statuses[r.status_code] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
            except httpx.HTTPError as exc:
                statuses[-1] += 1
                print(f"client error: {type(exc).__name__}: {exc}", file=sys.stderr)


async def _soak(url: str, pid: int, clients: int, duration: float
                ) -> tuple[Counter[int], list[float], list[tuple[float, int]]]:
    photos = {label: make_photo(w, h, i) for i, (label, w, h) in enumerate(RESOLUTIONS)}
    bad = [photos["<1MP"][:3000], b"definitely not an image" * 20]
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    rss: list[tuple[float, int]] = []
    start = time.monotonic()
    end = start + duration

    async def sample() -> None:
        while time.monotonic() < end:
            rss.append((time.monotonic() - start, _rss(pid)))
            await asyncio.sleep(1.0)

    await asyncio.gather(sample(), *(_client(url, photos, bad, end, i, statuses, latencies)
                                     for i in range(clients)))
    rss.append((time.monotonic() - start, _rss(pid)))
    return statuses, latencies, rss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cache = tempfile.mkdtemp(prefix="mrc-bench-cache-")
    log = open(os.path.join(cache, "service.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "reference_service", "--host", "127.0.0.1",
                             "--port", str(port), "--cache-dir", cache, "--log-level",
                             "warning"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("service not ready")
        statuses, latencies, rss = asyncio.run(_soak(url, proc.pid, args.clients,
                                                     args.duration))
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    fivexx = sum(v for k, v in statuses.items() if k >= 500 or k < 0)
    half = [m for t, m in rss if t >= args.duration / 2]
    growth = (half[-1] - half[0]) / half[0] if len(half) >= 2 and half[0] else 0.0
    lat = (f"p50 {percentile(latencies, 50) * 1000:.0f} / p90 "
           f"{percentile(latencies, 90) * 1000:.0f} / p99 "
           f"{percentile(latencies, 99) * 1000:.0f} ms" if latencies else "-")
    rows = [
        ("requests answered (all statuses)", str(sum(statuses.values())), "", ""),
        ("statuses", ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())), "", ""),
        ("5xx and transport errors", str(fivexx), "0", "PASS" if fivexx == 0 else "FAIL"),
        ("latency of 200 answers (client side)", lat, "", ""),
        ("service RSS start / half-time / end", " / ".join(
            f"{m / 2**20:.0f} MB" for m in (rss[0][1], half[0] if half else 0, rss[-1][1])),
         "", ""),
        ("RSS growth over the second half", f"{growth * 100:+.1f} %", "< 10 %",
         "PASS" if growth < 0.10 else "FAIL"),
    ]
    text = [f"# Service soak ({args.clients} clients, {args.duration:g} s, embedded model, CPU)",
            "", "| measure | value | goal | verdict |", "|---|---|---|---|"]
    text += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    text += ["", f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}; "
             "clients and service share the machine."]
    out = "\n".join(text) + "\n"
    print(out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
