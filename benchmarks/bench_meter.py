"""Benchmark: the OpenAI meter's cost, side by side, in one run.

Run as ``python3 benchmarks/bench_meter.py [--quick] [--out benchmarks/results/meter.md]``. A
measurement, not a test: it prints a Markdown table, writes it to ``--out`` and exits 0 whether
or not the goals are met (1 only when it cannot measure: a server that does not start).

Goals:

* ``mrc-agent proxy`` (one process) runs at most 3x nginx's CPU per stream; adds at most 0.5 ms
  at p50 at 1 stream, 1 ms at p50 and 2 ms at p99 at 64 streams; loses at most 1 % of the
  streams per second at 64; holds at most 64 MiB over its idle RSS while it carries 64
  concurrent uploads of a 12 MP photo;
* the ASGI middleware costs at most 20 us of CPU per request answered in one JSON body and
  at most 2 us per streamed event.

**Proxy.** One upstream (uvicorn, one process, an OpenAI-shaped handler streaming 16 content
events 2 ms apart and a ``usage`` event) is reached four ways: directly, through
``mrc-agent proxy`` (one process, and ``--workers 2``) and through nginx (``proxy_buffering
off`` so events stream, HTTP/1.1 and a keep-alive pool to the upstream, one worker process:
the proxy is one process too). Clients in this process keep one connection each and send a
chat request with a small data-URL image; a request's latency runs from its first byte sent to
the stream's last byte, its TTFT to the first content event. Per concurrency and round the ways
take turns (order rotated each round); "added" is the median over rounds of the per-round
difference to direct access. CPU per stream is what the way's own processes ran on a CPU
(``schedstat``, every thread; nginx's master and worker, the proxy's workers and their parent)
over all its rounds, divided by the streams it carried; per event divides that by the events a
stream puts on the wire. ``--pin`` runs the proxies on CPU 1 and the clients and the upstream
on CPU 0 (``taskset``), so a proxy's latency is not its neighbours' CPU (and two workers share
that one core: only an unpinned run can show them scale).

With ``--litellm EXE`` LiteLLM's proxy (``litellm[proxy]`` in an environment of its own, one
worker, no database, the bench's model as an ``openai/`` deployment on the same upstream) is a
fifth way: what users would pick instead.

**Memory.** Each proxy carries 64 concurrent uploads of a 12 MP photo as a data URL; its RSS
(every process's ``VmRSS``) is sampled every 10 ms, and the peak is reported over the idle
figure.

**Middleware.** The same Starlette app, with and without ``MRCMeterMiddleware``, called in
process through a hand-written ASGI ``receive``/``send`` (no HTTP, so the figure is the
middleware's and the app's alone); ``time.process_time`` per request, apps interleaved per
round, overhead = median of per-round differences. Three requests: a question with a 640x480
PNG (a few KB) answered in one JSON body, the same streamed, and a 12 MP photo-like JPEG
(about 5 MB, 6.5 MB as a data URL) streamed.

Needs nginx (Debian's ``nginx-light``), uvicorn and starlette (``pip install -e '.[all]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from support import free_port, host, parser, report, rss_mb

REPO = Path(__file__).resolve().parents[1]


EVENTS = 16
#: Content events of the long stream the middleware's per-event cost is measured with.
LONG_EVENTS = 64
_MAX_TOKENS = re.compile(rb'"max_tokens": ?(\d+)')
_STREAM = re.compile(rb'"stream": ?true')
EVENT_GAP_S = 0.002
#: The proxy's goals: added p50 at 1 and 64 streams, added p99 at 64, CPU per stream against
#: nginx's, throughput lost at 64 streams, RSS over idle during the upload test.
GOAL_P50_1_MS = 0.5
GOAL_P50_64_MS = 1.0
GOAL_P99_64_MS = 2.0
GOAL_CPU_RATIO = 3.0
GOAL_LOSS = 0.01
GOAL_RSS_MB = 64.0
#: Concurrent uploads of a 12 MP photo in the memory test.
UPLOADS = 64
#: The middleware's goals: CPU per request answered in one JSON, and per streamed event.
GOAL_FIXED_US = 20.0
GOAL_EVENT_US = 2.0


# --- the upstream -------------------------------------------------------------------------------


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def upstream_app(gap: float) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    chunk = [_sse({"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": f"w{i} "}}]}) for i in range(LONG_EVENTS)]
    usage = _sse({"choices": [], "usage": {"prompt_tokens": 80, "completion_tokens": EVENTS}})

    answer = JSONResponse({"object": "chat.completion", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "w " * EVENTS}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 80, "completion_tokens": EVENTS}}).body

    async def chat(request: Request) -> Response:
        body = await request.body()
        if not _STREAM.search(body):  # with or without a blank (LiteLLM sends none)
            return Response(answer, media_type="application/json")
        # As many content events as max_tokens asks, up to LONG_EVENTS.
        wanted = _MAX_TOKENS.search(body)
        count = min(int(wanted.group(1)), LONG_EVENTS) if wanted else EVENTS

        async def events() -> Any:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for c in chunk[:count]:
                if gap:
                    await asyncio.sleep(gap)
                yield c
            yield usage
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app(EVENT_GAP_S), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, timeout_keep_alive=30)


# --- processes ----------------------------------------------------------------------------------


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 60
              ) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not listen on {port} within {timeout:g} s"
                                 ) from None
            time.sleep(0.05)


NGINX_CONF = """
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_max_body_size 0;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    upstream up {{ server 127.0.0.1:{up}; keepalive 128; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def start_nginx(tmp: Path, up: int, port: int, prefix: list[str] | None = None
                ) -> subprocess.Popen[bytes]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("nginx is needed (Debian's nginx-light)")
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, up=up, port=port))
    proc = subprocess.Popen([*(prefix or []), nginx, "-p", str(tmp), "-c", str(conf), "-g",
                             "daemon off;"],
                            stderr=subprocess.DEVNULL)
    wait_port(port, proc, "nginx")
    return proc


# --- clients ------------------------------------------------------------------------------------


def png_data_url(width: int, height: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (40, 80, 120)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def photo_data_url() -> str:
    """A 4000x3000 photo-like JPEG (noise compresses like a photo's detail)."""
    from PIL import Image

    rnd = Image.frombytes("RGB", (1000, 750), os.urandom(1000 * 750 * 3))
    buf = io.BytesIO()
    rnd.resize((4000, 3000)).save(buf, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(url: str, stream: bool = True, events: int = EVENTS) -> bytes:
    return json.dumps({"model": "m", "stream": stream, "stream_options": {"include_usage": True},
                       "max_tokens": events, "messages": [{"role": "user", "content": [
                           {"type": "text", "text": "What is damaged on this parcel?"},
                           {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


def request_bytes(port: int, body: bytes) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {LITELLM_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


async def one_client(port: int, raw: bytes, n: int, out: list[tuple[float, float]]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            writer.write(raw)
            await writer.drain()
            buf = b""
            first = 0.0
            while not buf.endswith(b"\r\n0\r\n\r\n"):
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("the server closed the connection")
                buf += data
                if not first and b'"content"' in buf:
                    first = time.perf_counter()
            out.append((time.perf_counter() - t0, first - t0))
    finally:
        writer.close()


async def load(port: int, body: bytes, concurrency: int, per_client: int
               ) -> tuple[list[tuple[float, float]], float]:
    raw = request_bytes(port, body)
    out: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(port, raw, per_client, out) for _ in range(concurrency)))
    return out, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` have run, every thread's, in nanoseconds' precision
    (``/proc/PID/task/TID/schedstat``; ``/proc/PID/stat`` counts whole clock ticks, 10 ms,
    too coarse for a stream's hundreds of microseconds)."""
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, IndexError, ValueError):
                continue  # a thread that ended between the listing and the read
    return total / 1e9


def family(pid: int) -> list[int]:
    """``pid`` and its child processes (nginx's workers)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        out += [int(c) for c in children]
    return out


#: Concurrent streams measured; each proxy sees the same load in turn.
CONCURRENCY = (1, 16, 64, 256)
#: Events of one streamed answer on the wire: the role event, the content events, usage, [DONE].
WIRE_EVENTS = EVENTS + 3


def start_proxy(port: int, metrics: int, up: int, prefix: list[str], workers: int = 1
                ) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "mrc_agent.agent", "proxy",
                             "--listen", f"127.0.0.1:{port}", "--upstream",
                             f"http://127.0.0.1:{up}", "--metrics-listen",
                             f"127.0.0.1:{metrics}", "--log-level", "warning",
                             "--workers", str(workers)])
    wait_port(port, proc, "mrc-agent proxy")
    if workers > 1:  # the parent holds the port before its workers listen: wait for them
        deadline = time.monotonic() + 60
        while len(family(proc.pid)) < workers + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
    return proc


def stop_all(procs: list[subprocess.Popen[bytes]], tmp: Path) -> None:
    """Stop the processes together (SIGTERM to all, then a wait for each), then remove
    ``tmp``."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
    shutil.rmtree(tmp, ignore_errors=True)


def verdict(conc: int, added: dict[str, tuple[float, float]], cpu: dict[str, float],
            rate: dict[str, float]) -> str:
    """One concurrency's goals, for the one-process proxy."""
    p50, p99 = added["mrc-agent proxy"]
    ratio = cpu["mrc-agent proxy"] / max(cpu["nginx"], 1e-9)
    loss = 1 - rate["mrc-agent proxy"] / max(rate["direct"], 1e-9)
    parts = [f"CPU per stream {ratio:.1f}x nginx's (goal <= {GOAL_CPU_RATIO:g}x: "
             f"{'met' if ratio <= GOAL_CPU_RATIO else 'NOT met'})"]
    goal50 = {1: GOAL_P50_1_MS, 64: GOAL_P50_64_MS}.get(conc)
    if goal50 is not None:
        parts.append(f"adds {p50:.2f} ms at p50 (goal <= {goal50:g} ms: "
                     f"{'met' if p50 <= goal50 else 'NOT met'})")
    else:
        parts.append(f"adds {p50:.2f} ms at p50")
    if conc == 64:
        parts.append(f"{p99:.2f} ms at p99 (goal <= {GOAL_P99_64_MS:g} ms: "
                     f"{'met' if p99 <= GOAL_P99_64_MS else 'NOT met'})")
        parts.append(f"{loss:.1%} fewer streams/s than direct (goal <= {GOAL_LOSS:.0%}: "
                     f"{'met' if loss <= GOAL_LOSS else 'NOT met'})")
    return f"- {conc} streams: the proxy's " + "; ".join(parts)


async def upload(port: int, raw: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        buf = b""
        while not buf.endswith(b"\r\n0\r\n\r\n"):
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            buf += data
    finally:
        writer.close()


def bench_uploads(rounds: int) -> list[str]:
    """RSS over idle of each proxy while it carries :data:`UPLOADS` concurrent uploads of a
    12 MP photo as a base64 data URL (the peak of ``VmRSS`` sampled every 10 ms, every
    process of the proxy's summed)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-meter-rss-"))
    up, px, pxm, ng = free_port(), free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(up)]))
        wait_port(up, procs[-1], "the upstream")
        procs.append(start_proxy(px, pxm, up, []))
        procs.append(start_nginx(tmp, up, ng))
        body = chat_body(photo_data_url())
        rows = [f"| way | idle RSS (MiB) | peak RSS during {UPLOADS} uploads (MiB) | over idle "
                f"(MiB) | goal |", "| --- | ---: | ---: | ---: | --- |"]
        for way, port, proc in (("mrc-agent proxy", px, procs[1]), ("nginx", ng, procs[2])):
            raw = request_bytes(port, body)
            asyncio.run(load(port, chat_body(png_data_url(64, 64)), 4, 2))  # warm
            idle = sum(rss_mb(p) for p in family(proc.pid))
            peak = idle
            for _ in range(rounds):
                async def run(port: int = port, raw: bytes = raw, proc: Any = proc) -> float:
                    top = 0.0
                    task = asyncio.gather(*(upload(port, raw) for _ in range(UPLOADS)))
                    while not task.done():
                        top = max(top, sum(rss_mb(p) for p in family(proc.pid)))
                        await asyncio.sleep(0.01)
                    await task
                    return top
                peak = max(peak, asyncio.run(run()))
            over = peak - idle
            goal = ("" if way == "nginx" else f"<= {GOAL_RSS_MB:g} MiB: "
                    f"{'met' if over <= GOAL_RSS_MB else 'NOT met'}")
            rows.append(f"| {way} | {idle:.1f} | {peak:.1f} | **{over:.1f}** | {goal} |")
        return rows + ["", f"Body: {len(body) / 1e6:.1f} MB each."]
    finally:
        stop_all(procs, tmp)


LITELLM_CONF = """
model_list:
  - model_name: m
    litellm_params: {{model: openai/m, api_base: "http://127.0.0.1:{up}/v1", api_key: none}}
litellm_settings: {{drop_params: true}}
"""
#: The master key LiteLLM's proxy refuses to start without; every way gets it in the header.
LITELLM_KEY = "sk-bench-0123456789abcdef"


def start_litellm(exe: str, tmp: Path, up: int, port: int, prefix: list[str]
                  ) -> subprocess.Popen[bytes]:
    """LiteLLM's proxy (``litellm[proxy]``, one worker) in front of the upstream, with no
    database, no telemetry and its model cost map from its own package (no download)."""
    conf = tmp / "litellm.yaml"
    conf.write_text(LITELLM_CONF.format(up=up))
    env = dict(os.environ, LITELLM_MASTER_KEY=LITELLM_KEY, LITELLM_LOCAL_MODEL_COST_MAP="True",
               LITELLM_TELEMETRY="False", LITELLM_LOG="ERROR")
    proc = subprocess.Popen([*prefix, exe, "--config", str(conf), "--host", "127.0.0.1",
                             "--port", str(port), "--num_workers", "1"], env=env, cwd=tmp,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc, "LiteLLM's proxy", timeout=180)
    return proc


def bench_proxy(rounds: int, per_client: int, pin: bool, litellm: str | None = None
                ) -> list[str]:
    """The latency table, and CPU per stream of each proxy's own processes. With ``pin`` the
    proxies run on CPU 1 and this process (the clients) and the upstream on CPU 0."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-meter-"))
    up, px, pxm, ng = free_port(), free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    other = ["taskset", "-c", "0"] if pin else []
    own = ["taskset", "-c", "1"] if pin else []
    if pin:
        os.sched_setaffinity(0, {0})
    try:
        procs.append(subprocess.Popen([*other, sys.executable, __file__, "--serve-upstream",
                                       str(up)]))
        wait_port(up, procs[-1], "the upstream")
        procs.append(start_proxy(px, pxm, up, own))
        px2, pxm2 = free_port(), free_port()
        procs.append(start_proxy(px2, pxm2, up, own, workers=2))
        procs.append(start_nginx(tmp, up, ng, own))
        ways = {"direct": up, "mrc-agent proxy": px, "mrc-agent proxy, 2 workers": px2,
                "nginx": ng}
        pids = {"direct": [procs[0].pid], "mrc-agent proxy": [procs[1].pid],
                "mrc-agent proxy, 2 workers": family(procs[2].pid),
                "nginx": family(procs[3].pid)}
        if litellm:
            ll = free_port()
            procs.append(start_litellm(litellm, tmp, up, ll, own))
            ways["LiteLLM proxy"] = ll
            pids["LiteLLM proxy"] = family(procs[-1].pid)
        body = chat_body(png_data_url(640, 480))
        rows = ["| concurrent streams | way | latency p50 (ms) | p99 (ms) | TTFT p50 (ms) | "
                "streams/s | added p50 (ms) | added p99 (ms) | CPU per stream (us) | "
                "per event (us) |",
                "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        verdicts: list[str] = []
        for conc in CONCURRENCY:
            stats: dict[str, list[tuple[float, float, float, float]]] = {w: [] for w in ways}
            cpu = {w: 0.0 for w in ways}
            streams = {w: 0 for w in ways}
            for port in ways.values():  # warm every connection pool
                asyncio.run(load(port, body, conc, 2))
            for r in range(rounds):
                order = list(ways)[r % len(ways):] + list(ways)[:r % len(ways)]
                for way in order:
                    c0 = cpu_seconds(pids[way])
                    n = per_client if conc <= 64 else max(per_client // 4, 2)
                    out, wall = asyncio.run(load(ways[way], body, conc, n))
                    cpu[way] += cpu_seconds(pids[way]) - c0
                    streams[way] += len(out)
                    lat = [o[0] * 1e3 for o in out]
                    ttft = [o[1] * 1e3 for o in out]
                    stats[way].append((pct(lat, 0.5), pct(lat, 0.99), pct(ttft, 0.5),
                                       len(out) / wall))
            added: dict[str, tuple[float, float]] = {}
            rate: dict[str, float] = {}
            for way, per_round in stats.items():
                med = [statistics.median(x[i] for x in per_round) for i in range(4)]
                d50 = statistics.median(a[0] - b[0] for a, b in
                                        zip(per_round, stats["direct"], strict=True))
                d99 = statistics.median(a[1] - b[1] for a, b in
                                        zip(per_round, stats["direct"], strict=True))
                added[way] = (d50, d99)
                rate[way] = med[3]
                extra = ("-", "-") if way == "direct" else (f"{d50:.2f}", f"{d99:.2f}")
                per_stream = cpu[way] / max(streams[way], 1) * 1e6
                rows.append(f"| {conc} | {way} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | "
                            f"{med[3]:.0f} | {extra[0]} | {extra[1]} | {per_stream:.0f} | "
                            f"{per_stream / WIRE_EVENTS:.1f} |")
                cpu[way] = per_stream
            verdicts.append(verdict(conc, added, cpu, rate))
        return rows + [""] + verdicts
    finally:
        stop_all(procs, tmp)


# --- the middleware's CPU -----------------------------------------------------------------------


async def call(app: Any, body: bytes) -> None:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    await app(scope, receive, send)


def bench_middleware(rounds: int, requests: int) -> list[str]:
    from prometheus_client import CollectorRegistry

    from mrc_agent.exporters.instrumentation import MRCMeterMiddleware, MRCMetrics

    plain = upstream_app(0.0)
    metered = upstream_app(0.0)
    metered.add_middleware(MRCMeterMiddleware, metrics=MRCMetrics(
        registry=CollectorRegistry(), resolution_unknown=True))
    png = png_data_url(640, 480)
    bodies = {"question + 640x480 PNG, answer in one JSON": chat_body(png, stream=False),
              f"question + 640x480 PNG, streamed ({EVENTS + 3} events)": chat_body(png),
              f"question + 640x480 PNG, streamed ({LONG_EVENTS + 3} events)": chat_body(
                  png, events=LONG_EVENTS),
              f"question + 12 MP JPEG, streamed ({EVENTS + 3} events)": chat_body(
                  photo_data_url())}
    rows = ["| request | body (bytes) | app alone (us) | with the middleware (us) | "
            "overhead (us) | IQR (us) |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    over_by: dict[str, float] = {}

    async def per_request(app: Any, body: bytes, n: int) -> float:
        t0 = time.process_time()
        for _ in range(n):
            await call(app, body)
        return (time.process_time() - t0) / n * 1e6

    loop = asyncio.new_event_loop()
    for name, body in bodies.items():
        n = requests if len(body) < 100_000 else max(requests // 20, 20)
        loop.run_until_complete(per_request(metered, body, 20))
        loop.run_until_complete(per_request(plain, body, 20))
        base, with_mw, diff = [], [], []
        for r in range(rounds):
            pair = [("plain", plain), ("metered", metered)]
            if r % 2:
                pair.reverse()
            got = {k: loop.run_until_complete(per_request(a, body, n)) for k, a in pair}
            base.append(got["plain"])
            with_mw.append(got["metered"])
            diff.append(got["metered"] - got["plain"])
        q = statistics.quantiles(diff, n=4)
        over_by[name] = over = statistics.median(diff)
        rows.append(f"| {name} | {len(body)} | {statistics.median(base):.1f} | "
                    f"{statistics.median(with_mw):.1f} | **{over:.1f}** | {q[0]:.1f} .. "
                    f"{q[2]:.1f} |")
    loop.close()
    whole, short, long_ = list(over_by.values())[:3]
    # Per event: the slope between the two streams of the same request; a stream's fixed
    # cost is what is left of the short one's overhead.
    per_event = (long_ - short) / (LONG_EVENTS - EVENTS)
    fixed = short - (EVENTS + 3) * per_event
    return rows + [
        "", f"- per request answered in one JSON body: {whole:.1f} us (goal <= "
        f"{GOAL_FIXED_US:g} us: {'met' if whole <= GOAL_FIXED_US else 'NOT met'})",
        f"- per streamed event ({LONG_EVENTS + 3}- against {EVENTS + 3}-event streams): "
        f"{per_event:.2f} us (goal <= {GOAL_EVENT_US:g} us: "
        f"{'met' if per_event <= GOAL_EVENT_US else 'NOT met'}); a stream's fixed cost "
        f"{fixed:.1f} us"]


def main() -> int:
    ap = parser(__doc__, "fewer rounds (~1 min)")
    ap.add_argument("--pin", action="store_true",
                    help="the proxies on CPU 1, the clients and the upstream on CPU 0")
    ap.add_argument("--litellm", metavar="EXE",
                    help="also LiteLLM's proxy: the litellm command of an environment with "
                    "litellm[proxy] installed (not this project's: its pins differ)")
    ap.add_argument("--middleware-only", action="store_true",
                    help="only the middleware's CPU table (no proxy, no nginx)")
    ap.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return 0
    rounds = 3 if args.quick else 11
    if args.middleware_only:
        report("\n".join(bench_middleware(rounds * 2 + 1, 400 if args.quick else 1000)),
               args.out)
        return 0
    proxy = bench_proxy(rounds, 10 if args.quick else 25, args.pin, args.litellm)
    uploads = bench_uploads(1 if args.quick else 3)
    mw = bench_middleware(rounds * 2 + 1, 400 if args.quick else 1000)
    import httptools
    import starlette
    import uvicorn
    import uvloop

    nginx = subprocess.run([shutil.which("nginx") or "/usr/sbin/nginx", "-v"],
                           capture_output=True, text=True).stderr.strip()
    text = "\n".join([
        "# OpenAI meter: proxy latency and middleware CPU", "",
        "Generated by `python3 benchmarks/bench_meter.py`" + (" --quick" if args.quick else "")
        + f"; {rounds} rounds, the ways interleaved. Loopback, one upstream process streaming "
        f"{EVENTS} content events {EVENT_GAP_S * 1e3:g} ms apart plus a usage event; latency "
        "from the request's first byte to the stream's last, TTFT to the first content event. "
        "Added = median over rounds of the per-round difference to direct access.", "",
        *proxy, "",
        f"Memory while each proxy carries {UPLOADS} concurrent uploads of a 12 MP photo as a "
        "base64 data URL (answered with a stream):", "", *uploads, "",
        "Middleware CPU per request (`time.process_time`, in process, no HTTP; a stream is the "
        f"role event, {EVENTS} content events, usage and [DONE]), {rounds * 2 + 1} rounds:",
        "", *mw, "",
        f"{host()}; {nginx}, uvicorn {uvicorn.__version__}, starlette {starlette.__version__}, "
        f"httptools {httptools.__version__}, uvloop {uvloop.__version__}. "
        + ("The proxies (both workers of the two-worker one) on CPU 1, the clients and the "
           "upstream on CPU 0." if args.pin else
           "The clients, the upstream and the proxies share the machine's cores."),
    ])
    report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
