"""Noisy neighbours: good clients' latency and errors, clean and beside hostile clients.

The reference service (embedded model, CPU) and ``mrc-agent run`` watching it (basic auth on,
bcrypt cost 12) run as real processes on loopback. The good clients are a fixed mix:

- six service clients, together an open-loop stream of ``--rate`` requests a second (JSON and
  multipart in turn, an 800x600 photo, a distinct prompt so the cache never answers, 4 new
  tokens), each answer expected 200;
- two scrapers of the agent's ``/metrics``, four scrapes a second each (so that a p99 is
  not merely the slowest of a few dozen), credentials already
  accepted once (as a scraper's are after its first scrape), one on a kept-alive connection
  and one on a new connection for every scrape (as after any reset), each expected 200;
- one first login every 2 s: a user whose credentials the agent has not seen since it
  started, so the full bcrypt check runs (expected 200 within Prometheus's 10 s timeout).

Each run adds two hostile clients (25 % of the eight steady clients) of one kind, in a process
of their own (niced, so that the attacker's own CPU competes as little as possible with the
servers on a small machine); a client may hold many connections:

- ``crafted-headers``: uploads of a JPEG start marker and 19 MB of fill bytes, and of a 19 MB
  PNG of empty chunks, back to back;
- ``dense-ocr``: uploads of a PNG of dense text (OCR runs to its timeout);
- ``slow-heads``: 135 connections each to the agent and to the service (270 on each) that
  send a request line and nothing more, reconnecting when closed;
- ``slow-bodies``: 32 connections each to the service (an upload whose body comes one byte a
  second) and to the agent (a POST body likewise);
- ``auth-flood``: 24 connections each (48 in all) sending wrong passwords to the agent;
- ``header-floods``: 4 connections each to both, every request with 90 headers of 150 bytes;
- ``deep-json``: a JSON body nested 100,000 deep, back to back;
- ``all``: every kind at once (two clients of each).

The agent is restarted for every run (so first logins are first and no run inherits another's
connections); the service stays up. Goal per hostile run: the good clients' p99 within 1.5x of
the clean run's and 0 good requests refused or failed.

    python3 benchmarks/bench_isolation.py [--duration 40] [--rate 3] [--kinds all] [--out FILE]
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
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import httpx
from support import free_port as _free_port
from support import report

from mrc_agent.reference_service.loadgen import make_photo, percentile

REPO = Path(__file__).resolve().parent.parent
KINDS = ("crafted-headers", "dense-ocr", "slow-heads", "slow-bodies", "auth-flood",
         "header-floods", "deep-json")
USER, PASSWORD = "prometheus", "scrape-secret"
FIRST_LOGINS = 40  # users per agent run that log in once each
COST = 12
SCRAPE_EVERY_S = 0.25
#: Loopback source addresses: the good clients' and the two hostile clients'. As on a real
#: network, a server can tell its clients apart by address (127.0.0.0/8 is all loopback).
GOOD = "127.0.0.2"
ATTACKERS = ("127.0.0.3", "127.0.0.4")


def _from(src: str, limits: httpx.Limits | None = None) -> httpx.AsyncHTTPTransport:
    """A transport whose connections leave from ``src`` (a loopback address of its own)."""
    return httpx.AsyncHTTPTransport(local_address=src, limits=limits or httpx.Limits())


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ------------------------------------------------------------------------- hostile payloads


def _fill_jpeg(size: int) -> bytes:
    return b"\xff\xd8" + b"\xff" * (size - 2)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(
        ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _empty_chunk_png(size: int) -> bytes:
    head = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0))
    empty = _chunk(b"aaAa", b"")  # an ancillary chunk a decoder must skip
    return head + empty * ((size - len(head)) // len(empty)) + _chunk(b"IEND", b"")


def _dense_text_png() -> bytes:
    """A page of small dense text: tesseract works on it until its timeout."""
    from PIL import Image, ImageDraw

    rng = random.Random(7)
    words = ["parcel", "label", "fragile", "track", "route", "depot", "scan", "seal", "box",
             "return", "invoice", "weight", "postage", "sender", "address", "customs"]
    img = Image.new("L", (2400, 2400), 255)
    draw = ImageDraw.Draw(img)
    for y in range(0, 2400, 11):
        draw.text((2, y), " ".join(rng.choice(words) for _ in range(60)), fill=0)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


async def _read_answer(reader: asyncio.StreamReader) -> int:
    """Read one HTTP answer (head and Content-Length body); its status, 0 when closed."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    if length:
        await reader.readexactly(length)
    return int(lines[0].split(" ")[1])


@dataclass
class Attack:
    svc_port: int
    agent_port: int
    end: float
    sent: Counter[str] = field(default_factory=Counter)

    def note(self, kind: str, outcome: object) -> None:
        self.sent[f"{kind}: {outcome}"] += 1

    async def _uploads(self, kind: str, src: str, payloads: list[bytes], name: str) -> None:
        async with httpx.AsyncClient(timeout=60, transport=_from(src)) as client:
            i = 0
            while time.monotonic() < self.end:
                data = payloads[i % len(payloads)]
                i += 1
                try:
                    r = await client.post(
                        f"http://127.0.0.1:{self.svc_port}/mrc/upload",
                        # A new prompt each time, so the cache never answers for OCR.
                        data={"text_prompt": f"what does it say? #{i}", "max_new_tokens": "4"},
                        files={"file": (name, data, "application/octet-stream")})
                    self.note(kind, r.status_code)
                except httpx.HTTPError as exc:
                    self.note(kind, type(exc).__name__)

    async def _connect(self, kind: str, src: str, port: int, backoff: float
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to ``port`` from ``src``; None (noted, after ``backoff`` s) when the
        server refuses it."""
        try:
            return await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))
        except OSError as exc:
            self.note(kind, type(exc).__name__)
            await asyncio.sleep(backoff)
            return None

    async def _held(self, kind: str, src: str, port: int, conns: int, first: bytes,
                    drip: bool) -> None:
        async def one() -> None:
            while time.monotonic() < self.end:
                conn = await self._connect(kind, src, port, 0.5)
                if conn is None:
                    continue
                reader, writer = conn
                self.note(kind, "connected")
                try:
                    writer.write(first)
                    while time.monotonic() < self.end:
                        if drip:
                            writer.write(b"x")
                        await writer.drain()
                        try:
                            got = await asyncio.wait_for(reader.read(1024), 1.0)
                        except asyncio.TimeoutError:
                            continue
                        if not got:
                            break
                except OSError:
                    pass
                finally:
                    writer.close()
        await asyncio.gather(*(one() for _ in range(conns)))

    async def _keepalive(self, kind: str, src: str, port: int, conns: int,
                         make: Callable[[], bytes]) -> None:
        async def one() -> None:
            while time.monotonic() < self.end:
                conn = await self._connect(kind, src, port, 0.2)
                if conn is None:
                    continue
                reader, writer = conn
                try:
                    while time.monotonic() < self.end:
                        writer.write(make())
                        await writer.drain()
                        status = await asyncio.wait_for(_read_answer(reader), 30)
                        self.note(kind, status)
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                        asyncio.LimitOverrunError, ValueError) as exc:
                    self.note(kind, type(exc).__name__)
                finally:
                    writer.close()
        await asyncio.gather(*(one() for _ in range(conns)))

    async def _deep(self, kind: str, src: str, body: bytes) -> None:
        async with httpx.AsyncClient(timeout=60, transport=_from(src)) as client:
            while time.monotonic() < self.end:
                try:
                    r = await client.post(f"http://127.0.0.1:{self.svc_port}/mrc", content=body,
                                          headers={"Content-Type": "application/json"})
                    self.note(kind, r.status_code)
                except httpx.HTTPError as exc:
                    self.note(kind, type(exc).__name__)

    def client(self, kind: str, src: str) -> Awaitable[Any]:
        """One hostile client of ``kind``, its connections from the address ``src``."""
        svc, agent = self.svc_port, self.agent_port
        if kind == "crafted-headers":
            payloads = [_fill_jpeg(19_000_000), _empty_chunk_png(19_000_000)]
            return self._uploads(kind, src, payloads, "x.jpg")
        if kind == "dense-ocr":
            return self._uploads(kind, src, [_dense_text_png()], "page.png")
        if kind == "slow-heads":
            line = b"GET /metrics HTTP/1.1\r\n"
            return asyncio.gather(self._held(kind, src, agent, 135, line, False),
                                  self._held(kind, src, svc, 135, line, False))
        if kind == "slow-bodies":
            up = (b"POST /mrc/upload HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
                  b"boundary=b\r\nContent-Length: 1000000\r\n\r\n--b\r\n")
            post = (b"POST /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: "
                    + _basic(USER, PASSWORD).encode() + b"\r\nContent-Length: 1000000\r\n\r\n")
            return asyncio.gather(self._held(kind, src, svc, 16, up, True),
                                  self._held(kind, src, agent, 16, post, True))
        if kind == "auth-flood":
            def wrong() -> bytes:
                token = _basic(USER, f"guess-{random.random()}")
                return (f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {token}\r\n"
                        "\r\n").encode()
            return self._keepalive(kind, src, agent, 24, wrong)
        if kind == "header-floods":
            filler = "".join(f"X-Filler-{i}: {'v' * 130}\r\n" for i in range(90))
            auth = _basic(USER, PASSWORD)

            def flood(path: str) -> Callable[[], bytes]:
                data = (f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n{filler}"
                        "\r\n").encode()
                return lambda: data
            return asyncio.gather(self._keepalive(kind, src, svc, 2, flood("/health")),
                                  self._keepalive(kind, src, agent, 2, flood("/metrics")))
        if kind == "deep-json":
            return self._deep(kind, src, b"[" * 100_000 + b"]" * 100_000)
        raise ValueError(kind)


def _attack_main(kind: str, svc_port: int, agent_port: int, duration: float) -> None:
    """The hostile process: runs ``kind`` (or every kind) and prints what it sent as JSON."""
    os.nice(19)
    attack = Attack(svc_port, agent_port, time.monotonic() + duration)

    async def go() -> None:
        kinds = KINDS if kind == "all" else (kind,)
        await asyncio.gather(*(attack.client(k, src) for k in kinds for src in ATTACKERS),
                             return_exceptions=True)
    asyncio.run(go())
    print(json.dumps(dict(attack.sent)))


# ----------------------------------------------------------------------------- good clients


@dataclass
class Good:
    service: list[float] = field(default_factory=list)
    service_errors: Counter[str] = field(default_factory=Counter)
    scrapes: list[float] = field(default_factory=list)
    scrape_errors: Counter[str] = field(default_factory=Counter)
    logins: list[float] = field(default_factory=list)
    login_errors: Counter[str] = field(default_factory=Counter)


async def _timed(client: httpx.AsyncClient, request: object, out: list[float],
                 errors: Counter[str]) -> None:
    t0 = time.perf_counter()
    try:
        r = await request  # type: ignore[misc]
    except httpx.HTTPError as exc:
        errors[type(exc).__name__] += 1
        return
    if r.status_code == 200:
        out.append(time.perf_counter() - t0)
    else:
        errors[str(r.status_code)] += 1


async def _good(svc: str, agent: str, rate: float, duration: float, photo: bytes,
                run: int) -> Good:
    good = Good()
    end = time.monotonic() + duration
    rng = random.Random(run)
    b64 = base64.b64encode(photo).decode()
    limits = httpx.Limits(max_connections=6, max_keepalive_connections=6)
    async with httpx.AsyncClient(timeout=60, transport=_from(GOOD, limits)) as svc_client, \
            httpx.AsyncClient(timeout=10, transport=_from(GOOD)) as scraper:
        tasks: list[asyncio.Task[None]] = []

        async def service_stream() -> None:
            i = 0
            t = time.monotonic()
            while t < end:
                prompt = f"Is the parcel damaged? run {run} #{i} {rng.random():.6f}"
                if i % 2:
                    req = svc_client.post(svc + "/mrc", json={
                        "image": b64, "text_prompt": prompt, "max_new_tokens": 4})
                else:
                    req = svc_client.post(svc + "/mrc/upload", data={
                        "text_prompt": prompt, "max_new_tokens": "4"},
                        files={"file": ("p.jpg", photo, "image/jpeg")})
                tasks.append(asyncio.create_task(
                    _timed(svc_client, req, good.service, good.service_errors)))
                i += 1
                t += 1 / rate
                await asyncio.sleep(max(0.0, t - time.monotonic()))

        async def scrapes(phase: float, fresh: bool) -> None:
            await asyncio.sleep(phase)
            while time.monotonic() < end:
                t = time.monotonic()
                headers = {"Authorization": _basic(USER, PASSWORD)}
                if fresh:  # a new connection for every scrape, as after any reset
                    async with httpx.AsyncClient(timeout=10, transport=_from(GOOD)) as once:
                        await _timed(once, once.get(agent + "/metrics", headers=headers),
                                     good.scrapes, good.scrape_errors)
                else:
                    await _timed(scraper, scraper.get(agent + "/metrics", headers=headers),
                                 good.scrapes, good.scrape_errors)
                await asyncio.sleep(max(0.0, SCRAPE_EVERY_S - (time.monotonic() - t)))

        async def first_logins() -> None:
            k = 0
            while time.monotonic() < end and k < FIRST_LOGINS:
                t = time.monotonic()
                # A fresh connection and a user not yet seen: the full bcrypt check.
                async with httpx.AsyncClient(timeout=10, transport=_from(GOOD)) as fresh:
                    await _timed(fresh, fresh.get(agent + "/metrics", headers={
                        "Authorization": _basic(f"user{k}", f"pw{k}")}), good.logins,
                        good.login_errors)
                k += 1
                await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - t)))

        await asyncio.gather(service_stream(), scrapes(0.05, False), scrapes(0.17, True),
                             first_logins())
        await asyncio.gather(*tasks)
    return good


# ----------------------------------------------------------------------------------- the run


def _wait(url: str, what: str, timeout: float, auth: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": auth} if auth else {}
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{what} not ready")


def _web_config(directory: Path) -> Path:
    users = {USER: bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(COST)).decode()}
    for k in range(FIRST_LOGINS):
        users[f"user{k}"] = bcrypt.hashpw(f"pw{k}".encode(), bcrypt.gensalt(COST)).decode()
    path = directory / "web.yml"
    path.write_text(json.dumps({"basic_auth_users": users}))  # JSON is YAML
    return path


@dataclass
class Row:
    kind: str
    good: Good
    sent: dict[str, int]


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1000 if values else float("nan")


def _num(value: float, fmt: str = ".0f") -> str:
    return "-" if value != value else format(value, fmt)  # NaN: nothing succeeded


def _errors(c: Counter[str]) -> str:
    return str(sum(c.values())) + (f" ({', '.join(f'{k} x{v}' for k, v in c.most_common(3))})"
                                   if c else "")


def _table(rows: list[Row], args: argparse.Namespace) -> str:
    clean = rows[0].good
    base = _ms(clean.service, 99)
    base_scrape = _ms(clean.scrapes, 99)
    out = [f"# Noisy neighbours: {args.rate:g} good service requests/s, 2 scrapers at "
           f"{1 / SCRAPE_EVERY_S:g}/s, a first login every 2 s; {args.duration:g} s a run",
           "", "| run | service p50 / p99 ms (p99 vs clean) | service errors | scrape p50 / p99"
           " ms (p99 vs clean) | scrape errors | first login p50 / max ms | login errors |"
           " verdict |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        g = row.good
        p99, s99 = _ms(g.service, 99), _ms(g.scrapes, 99)
        errors = (sum(g.service_errors.values()) + sum(g.scrape_errors.values())
                  + sum(g.login_errors.values()))
        ok = errors == 0 and (row.kind == "clean" or (p99 <= 1.5 * base and s99 <= max(
            1.5 * base_scrape, 5.0)))
        out.append(
            f"| {row.kind} | {_num(_ms(g.service, 50))} / {_num(p99)} "
            f"({_num(p99 / base, '.2f')}x) | {_errors(g.service_errors)} | "
            f"{_num(_ms(g.scrapes, 50), '.1f')} / {_num(s99, '.1f')} "
            f"({_num(s99 / base_scrape, '.2f')}x) | {_errors(g.scrape_errors)} | "
            f"{_num(_ms(g.logins, 50))} / {_num(_ms(g.logins, 100))} | "
            f"{_errors(g.login_errors)} | {'PASS' if ok else 'FAIL'} |")
    out += ["", "What the hostile clients sent and got (answers by status, or the error):", ""]
    for row in rows[1:]:
        top = sorted(row.sent.items(), key=lambda kv: -kv[1])[:8]
        if row.kind != "all":
            top = [(k.split(": ", 1)[-1], v) for k, v in top]
        out.append(f"- {row.kind}: " + ", ".join(f"{k} x{v}" for k, v in top))
    out += ["", f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}; the "
            "clients, the attackers (nice 19), the service and the agent share it. Goal: p99 "
            "within 1.5x of the clean run (scrapes: or under 5 ms) and 0 good requests refused "
            "or failed."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--kinds", default="all", help="comma-separated kinds, or all")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--attack", nargs=4, metavar=("KIND", "SVC_PORT", "AGENT_PORT", "SECONDS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.attack:
        kind, svc_port, agent_port, seconds = args.attack
        _attack_main(kind, int(svc_port), int(agent_port), float(seconds))
        return 0
    kinds = list(KINDS) + ["all"] if args.kinds == "all" else args.kinds.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="mrc-isolation-"))
    web = _web_config(tmp)
    cache = os.environ.get("MRC_CACHE_DIR") or str(tmp / "cache")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    svc_port = _free_port()
    svc = f"http://127.0.0.1:{svc_port}"
    svc_log = open(tmp / "service.log", "wb")  # noqa: SIM115
    service = subprocess.Popen(
        [sys.executable, "-m", "mrc_agent.reference_service", "--host", "127.0.0.1", "--port",
         str(svc_port), "--cache-dir", cache, "--log-level", "warning"],
        stdout=svc_log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    photo = make_photo(800, 600, 3)
    rows: list[Row] = []
    try:
        _wait(svc + "/ready", "service", 600)
        for run, kind in enumerate(["clean", *kinds]):
            agent_port = _free_port()
            agent = f"http://127.0.0.1:{agent_port}"
            agent_log = open(tmp / f"agent-{kind}.log", "wb")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, "-m", "mrc_agent.agent", "run", "--listen",
                 f"127.0.0.1:{agent_port}", "--gpu-backend", "none", "--pid",
                 str(service.pid), "--interval", "1", "--web-config-file", str(web)],
                stdout=agent_log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
            attacker = None
            try:
                # With the scrapers' credentials: they pass once before the attack starts, as
                # a scraper's do at its first scrape.
                _wait(agent + "/readyz", "agent", 60, _basic(USER, PASSWORD))
                if kind != "clean":
                    attacker = subprocess.Popen(
                        [sys.executable, __file__, "--attack", kind, str(svc_port),
                         str(agent_port), str(args.duration + 4)],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO, env=env)
                    time.sleep(3)  # the attack is under way before the good clients start
                good = asyncio.run(_good(svc, agent, args.rate, args.duration, photo, run))
                sent: dict[str, int] = {}
                if attacker is not None:
                    stdout, _ = attacker.communicate(timeout=120)
                    sent = json.loads(stdout or b"{}")
                rows.append(Row(kind, good, sent))
                print(f"{kind}: service p99 {_ms(good.service, 99):.0f} ms, errors "
                      f"{_errors(good.service_errors)}; scrape p99 {_ms(good.scrapes, 99):.1f} "
                      f"ms, errors {_errors(good.scrape_errors)}; logins max "
                      f"{max(good.logins, default=0) * 1000:.0f} ms, errors "
                      f"{_errors(good.login_errors)}", flush=True)
            finally:
                if attacker is not None and attacker.poll() is None:
                    attacker.kill()
                proc.terminate()
                proc.wait(30)
                agent_log.close()
            time.sleep(2)  # the service's held connections time out between runs
    finally:
        service.terminate()
        service.wait(30)
        svc_log.close()
    text = _table(rows, args) + f"\nLogs: {tmp}"
    report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
