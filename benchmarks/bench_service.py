"""Soak: 16 clients, good and hostile requests mixed, against the reference service and the agent.

The service (embedded model, CPU) and ``mrc-agent run`` watching it run as real processes on
loopback. Sixteen closed-loop clients (each sends its next request when the previous answer
arrives) send the nine prompt-length x resolution buckets as JSON and multipart; one request
in four is hostile, drawn from a fixed corpus with the status each must get (truncated and
non-image bytes, a crafted JPEG header of fill bytes, a JPEG too short for its header, bad
JSON, a lone surrogate, 100k-deep nesting, a body over the cap, a non-UTF-8 form field, a
Unicode-digit token budget, a loopback ``image_url``). Meanwhile:

- ``/health`` is probed every 0.25 s (its latency is what a liveness probe sees);
- the agent is scraped every second (``/metrics`` and ``/readyz``) while 50 idle connections
  and a handful of half-sent requests sit on it, and a half-sent request sits on the service;
- both processes' RSS is read from ``/proc`` every second: the slope over the second half
  (after caches and allocator pools have warmed) is the leak figure;
- at the end, ``mrc_requests_total`` by outcome is compared with what the clients saw.

Goals: 0 unexpected statuses and 0 unexpected 5xx; counters equal to the clients' view.

    python3 benchmarks/bench_service.py [--clients 16] [--duration 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import random
import re
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from support import free_port as _free_port
from support import wait_http

from mrc_agent.exporters.instrumentation import outcome_for_status
from mrc_agent.reference_service.loadgen import (
    PROMPT_BUCKETS,
    RESOLUTIONS,
    make_photo,
    make_prompt,
    percentile,
)

REPO = Path(__file__).resolve().parent.parent


MAX_IMAGE = 4 * 1024 * 1024  # the service's --max-image-bytes: over-cap bodies stay cheap


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _slope_mb_per_min(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS over time."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    cov = sum((t - mt) * (r - mr) for t, r in points)
    return cov / var / 2**20 * 60 if var else 0.0


# ------------------------------------------------------------------------- the hostile corpus


@dataclass
class Hostile:
    name: str
    statuses: tuple[int, ...]  # what the service must answer
    send: Callable[[httpx.AsyncClient, str], Any]


def _short_jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.find(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", 6000, 6000)
    return bytes(data)


def _corpus(photo: bytes) -> list[Hostile]:
    def js(body: Any) -> Callable[[httpx.AsyncClient, str], Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return lambda c, url: c.post(url + "/mrc", content=raw,
                                     headers={"Content-Type": "application/json"})

    def up(data: bytes, prompt: str = "what is this?", tokens: str = "8"
           ) -> Callable[[httpx.AsyncClient, str], Any]:
        return lambda c, url: c.post(url + "/mrc/upload", data={
            "text_prompt": prompt, "max_new_tokens": tokens},
            files={"file": ("x.jpg", data, "image/jpeg")})

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    boundary = b"soak"
    not_utf8 = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="text_prompt"'
                b"\r\n\r\ncaf\xe9\r\n--" + boundary + b'\r\nContent-Disposition: form-data; '
                b'name="file"; filename="p.jpg"\r\n\r\n' + photo + b"\r\n--" + boundary
                + b"--\r\n")
    return [
        Hostile("truncated JPEG", (422,), js({"image": b64(photo[:3000]), "text_prompt": "x"})),
        Hostile("not an image", (415,), js({"image": b64(b"no image " * 40), "text_prompt": "x"})),
        Hostile("crafted header (1.5 MB of fill bytes)", (422,),
                up(b"\xff\xd8" + b"\xff" * 1_500_000)),
        Hostile("JPEG too short for its header", (422,), up(_short_jpeg())),
        Hostile("invalid JSON", (400,), js(b"{not json")),
        Hostile("lone surrogate", (422,), js(b'{"image": "%s", "text_prompt": "\\ud800"}'
                                             % b64(photo).encode())),
        Hostile("100k-deep nesting", (400,), js(b"[" * 100_000 + b"]" * 100_000)),
        Hostile("body over the cap", (413,), js(b"x" * (2 * MAX_IMAGE))),
        Hostile("form field not UTF-8", (400,), lambda c, url: c.post(
            url + "/mrc/upload", content=not_utf8,
            headers={"Content-Type": "multipart/form-data; boundary=soak"})),
        Hostile("token budget '²'", (422,), up(photo, tokens="²")),
        Hostile("loopback image_url", (400,), js({"image_url": "http://127.0.0.1:1/a.jpg",
                                                  "text_prompt": "x"})),
    ]


# ----------------------------------------------------------------------------------- the run


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)  # MRC requests only
    unexpected: Counter[str] = field(default_factory=Counter)
    hostile: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    health_failures: int = 0
    scrapes: list[float] = field(default_factory=list)
    scrape_failures: int = 0
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)


async def _client(url: str, photos: dict[str, bytes], corpus: list[Hostile], end: float,
                  seed: int, tally: Tally, hostile_share: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < end:
            expect: tuple[int, ...] = (200,)
            if rng.random() < hostile_share:
                h = rng.choice(corpus)
                name, expect, request = h.name, h.statuses, h.send(client, url)
                tally.hostile[name] += 1
            else:
                res = rng.choice([r for r, _, _ in RESOLUTIONS])
                prompt = make_prompt(rng.choice(PROMPT_BUCKETS), rng)
                name = "good"
                if rng.random() < 0.5:
                    request = client.post(url + "/mrc", json={
                        "image": base64.b64encode(photos[res]).decode(),
                        "text_prompt": prompt, "max_new_tokens": 8})
                else:
                    request = client.post(url + "/mrc/upload", data={
                        "text_prompt": prompt, "max_new_tokens": "8"},
                        files={"file": ("p.jpg", photos[res], "image/jpeg")})
            t0 = time.perf_counter()
            try:
                r = await request
            except httpx.HTTPError as exc:
                tally.statuses[-1] += 1
                tally.unexpected[f"{name}: {type(exc).__name__}"] += 1
                continue
            tally.statuses[r.status_code] += 1
            if r.status_code not in expect:
                tally.unexpected[f"{name}: {r.status_code}"] += 1
            elif r.status_code == 200:
                tally.latencies.append(time.perf_counter() - t0)


async def _probe(url: str, path: str, end: float, period: float, out: list[float],
                 on_fail: Callable[[], None]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                r = await client.get(url + path)
                if r.status_code != 200:
                    on_fail()
                out.append(time.perf_counter() - t0)
            except httpx.HTTPError:
                on_fail()
            await asyncio.sleep(period)


async def _hold(port: int, idle: int, partial: int, end: float) -> None:
    """Idle connections and half-sent request heads, held until the end (or the server's
    timeouts close them)."""
    conns = []
    for i in range(idle + partial):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            continue
        if i >= idle:
            w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        conns.append(w)
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    for w in conns:
        w.close()


async def _soak(svc: str, svc_port: int, agent: str, agent_port: int, pids: dict[str, int],
                clients: int, duration: float, hostile_share: float) -> Tally:
    photos = {label: make_photo(w, h, i) for i, (label, w, h) in enumerate(RESOLUTIONS)}
    corpus = _corpus(photos["<1MP"])
    tally = Tally(rss={k: [] for k in pids})
    start = time.monotonic()
    end = start + duration

    def health_failed() -> None:
        tally.health_failures += 1

    def scrape_failed() -> None:
        tally.scrape_failures += 1

    async def sample() -> None:
        while time.monotonic() < end:
            for k, pid in pids.items():
                tally.rss[k].append((time.monotonic() - start, _rss(pid)))
            await asyncio.sleep(1.0)

    await asyncio.gather(
        sample(),
        _probe(svc, "/health", end, 0.25, tally.health, health_failed),
        _probe(agent, "/metrics", end, 1.0, tally.scrapes, scrape_failed),
        _probe(agent, "/readyz", end, 1.0, [], scrape_failed),
        _hold(agent_port, 50, 5, end), _hold(svc_port, 0, 5, end),
        *(_client(svc, photos, corpus, end, i, tally, hostile_share) for i in range(clients)))
    return tally


def _requests_total(url: str) -> Counter[str]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out: Counter[str] = Counter()
    for m in re.finditer(r'^mrc_requests_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        out[labels["outcome"]] += int(float(m[2]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--hostile-share", type=float, default=0.25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    svc_port, agent_port = _free_port(), _free_port()
    svc, agent = f"http://127.0.0.1:{svc_port}", f"http://127.0.0.1:{agent_port}"
    cache = os.environ.get("MRC_CACHE_DIR") or tempfile.mkdtemp(prefix="mrc-bench-cache-")
    logdir = Path(tempfile.mkdtemp(prefix="mrc-soak-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    svc_log = open(logdir / "service.log", "wb")  # noqa: SIM115
    agent_log = open(logdir / "mrc_agent.agent.log", "wb")  # noqa: SIM115
    procs = [subprocess.Popen(
        [sys.executable, "-m", "mrc_agent.reference_service", "--host", "127.0.0.1", "--port",
         str(svc_port), "--cache-dir", cache, "--max-image-bytes", str(MAX_IMAGE),
         "--log-level", "warning"], stdout=svc_log, stderr=subprocess.STDOUT, cwd=REPO, env=env)]
    try:
        wait_http(svc + "/ready", "service", 300)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mrc_agent.agent", "run", "--listen", f"127.0.0.1:{agent_port}",
             "--gpu-backend", "none", "--pid", str(procs[0].pid), "--interval", "1"],
            stdout=agent_log, stderr=subprocess.STDOUT, cwd=REPO, env=env))
        wait_http(agent + "/readyz", "agent", 60)
        pids = {"service": procs[0].pid, "agent": procs[1].pid}
        before = _requests_total(svc)
        cpu0 = {k: _cpu_s(p) for k, p in pids.items()}
        t0 = time.monotonic()
        tally = asyncio.run(_soak(svc, svc_port, agent, agent_port, pids, args.clients,
                                  args.duration, args.hostile_share))
        wall = time.monotonic() - t0
        cpu = {k: (_cpu_s(p) - cpu0[k]) / wall for k, p in pids.items()}
        counted = _requests_total(svc) - before
        alive = {k: p.poll() is None for k, p in zip(pids, procs, strict=True)}
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(30)
        svc_log.close()
        agent_log.close()
    seen: Counter[str] = Counter()
    for status, n in tally.statuses.items():
        if status > 0:
            seen[outcome_for_status(status)] += n
    fivexx = sum(v for k, v in tally.statuses.items() if k >= 500 or k < 0)
    unexpected = sum(tally.unexpected.values())
    tracebacks = sum((logdir / f).read_text(errors="replace").count("Traceback")
                     for f in ("service.log", "mrc_agent.agent.log"))

    def ms(values: list[float], q: float) -> str:
        return f"{percentile(values, q) * 1000:.0f}" if values else "-"

    def rss_row(name: str) -> tuple[str, str, str, str]:
        pts = tally.rss[name]
        half = [p for p in pts if p[0] >= args.duration / 2]
        slope = _slope_mb_per_min(half)
        return (f"{name} RSS start / end; slope over the second half",
                f"{pts[0][1] / 2**20:.0f} / {pts[-1][1] / 2**20:.0f} MB; "
                f"{slope:+.2f} MB/min", "", "")

    rows = [
        ("MRC requests answered", f"{sum(tally.statuses.values())} ({sum(tally.hostile.values())}"
         " hostile)", "", ""),
        ("statuses", ", ".join(f"{k}: {v}" for k, v in sorted(tally.statuses.items())), "", ""),
        ("unexpected statuses or transport errors", str(unexpected) + (
            f" ({', '.join(f'{k} x{v}' for k, v in tally.unexpected.most_common(5))})"
            if unexpected else ""), "0", "PASS" if unexpected == 0 else "FAIL"),
        ("5xx and transport errors", str(fivexx), "0", "PASS" if fivexx == 0 else "FAIL"),
        ("latency of 200 answers, p50 / p90 / p99", f"{ms(tally.latencies, 50)} / "
         f"{ms(tally.latencies, 90)} / {ms(tally.latencies, 99)} ms", "", ""),
        ("`/health` p50 / p99 / max", f"{ms(tally.health, 50)} / {ms(tally.health, 99)} / "
         f"{max(tally.health, default=0) * 1000:.0f} ms ({len(tally.health)} probes, "
         f"{tally.health_failures} failed)", "max < 2000 ms (liveness timeout)",
         "PASS" if tally.health and max(tally.health) < 2 and not tally.health_failures
         else "FAIL"),
        ("agent `/metrics` p50 / p99 / max", f"{ms(tally.scrapes, 50)} / "
         f"{ms(tally.scrapes, 99)} / {max(tally.scrapes, default=0) * 1000:.0f} ms "
         f"({tally.scrape_failures} failed scrapes or not-ready)", "0 failed",
         "PASS" if not tally.scrape_failures else "FAIL"),
        ("`mrc_requests_total` by outcome vs the clients' view",
         f"counted {dict(sorted(counted.items()))}; seen {dict(sorted(seen.items()))}",
         "equal", "PASS" if counted == seen else "FAIL"),
        rss_row("service"), rss_row("agent"),
        ("CPU (cores, user+system)", f"service {cpu['service']:.2f}, agent "
         f"{cpu['agent'] * 100:.2f} %", "", ""),
        ("tracebacks in the logs", str(tracebacks), "0", "PASS" if tracebacks == 0 else "FAIL"),
        ("both processes alive at the end", str(all(alive.values())), "True",
         "PASS" if all(alive.values()) else "FAIL"),
    ]
    text = [f"# Soak: {args.clients} clients, {args.duration:g} s, {args.hostile_share:.0%} "
            "hostile; service (embedded model, CPU) and agent side by side",
            "", "| measure | value | goal | verdict |", "|---|---|---|---|"]
    text += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    text += ["", "Hostile requests sent: " + ", ".join(
        f"{k} {v}" for k, v in sorted(tally.hostile.items())) + ".",
        "", f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}; clients, "
        "service and agent share the machine. Logs: " + str(logdir)]
    out = "\n".join(text) + "\n"
    print(out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(out)
    return 0 if "FAIL" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
