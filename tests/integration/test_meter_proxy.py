"""The OpenAI meter on real sockets: ``mrc-agent proxy`` and the ASGI middleware in front of an
OpenAI-shaped server on loopback. What ``/metrics`` counts must equal what the clients saw, by
cell and by outcome, and the proxy must forward exactly what the server would have received."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mrc_agent.exporters.instrumentation import MRCMeterMiddleware, MRCMetrics
from tests.conftest import parse_metrics, series, wait_until
from tests.openai_support import (
    FakeEngine,
    ProxyThread,
    ServerThread,
    chat,
    data_url,
    leave_after,
    send_chat,
    stream_lines,
)
from tests.raw_upstream import RawUpstream, chunked_answer, unchunk
from tests.support import free_port

SMALL, MID, LARGE = data_url(640, 480), data_url(1600, 1200), data_url(3000, 2000)
REMOTE = "https://images.example/cat.jpg"


@pytest.fixture
def proxy(engine: tuple[FakeEngine, ServerThread]) -> Iterator[ProxyThread]:
    p = ProxyThread(engine[1].url)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def wrapped() -> Iterator[tuple[FakeEngine, ServerThread, CollectorRegistry]]:
    """The same server with the middleware, on a registry of its own."""
    fake = FakeEngine()
    app = fake.app()
    reg = CollectorRegistry()
    app.add_middleware(MRCMeterMiddleware, metrics=MRCMetrics(registry=reg,
                                                              resolution_unknown=True))
    server = ServerThread(app)
    yield fake, server, reg
    server.stop()


def _values(reg: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return parse_metrics(generate_latest(reg).decode())


#: (prompt, images, stream): the client's own view of which cell each request belongs to.
MIX: list[tuple[str, tuple[str, ...], bool, str, str]] = [
    ("short", (SMALL,), False, "0-50", "<1MP"),
    ("short", (SMALL,), True, "0-50", "<1MP"),
    ("m" * 70, (MID,), True, "50-100", "1-4MP"),
    ("l" * 150, (LARGE,), False, "100+", ">4MP"),
    ("l" * 150, (SMALL, LARGE), True, "100+", ">4MP"),
    ("remote", (REMOTE,), True, "0-50", "unknown"),
    ("remote", (SMALL, REMOTE), False, "0-50", "unknown"),
    ("text only", (), True, "0-50", "<1MP"),
]


def _drive(url: str) -> tuple[Counter[tuple[str, str]], int, int, int]:
    """Send MIX; returns the cells, the streams, and the usage tokens the clients were told."""
    cells: Counter[tuple[str, str]] = Counter()
    streams = prompt = completion = 0
    for text, images, stream, p, r in MIX:
        body = chat(text, *images, stream=stream, max_tokens=4)
        if stream:
            status, lines = stream_lines(url + "/v1/chat/completions", body)
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            usage = [e["usage"] for e in events if e.get("usage")]
            streams += 1
        else:
            resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            status, usage = resp.status_code, [resp.json()["usage"]]
        assert status == 200
        assert len(usage) == 1
        prompt += usage[0]["prompt_tokens"]
        completion += usage[0]["completion_tokens"]
        cells[(p, r)] += 1
    return cells, streams, prompt, completion


def _check(values: dict[tuple[str, frozenset[tuple[str, str]]], float],
           cells: Counter[tuple[str, str]], streams: int, prompt: int, completion: int) -> None:
    for (p, r), n in cells.items():
        assert series(values, "mrc_request_duration_seconds_count", prompt_length=p,
                      resolution=r) == [float(n)], (p, r)
    assert sum(series(values, "mrc_request_duration_seconds_count")) == sum(cells.values())
    assert sum(series(values, "mrc_time_to_first_token_seconds_count")) == streams
    assert sum(series(values, "mrc_time_per_output_token_seconds_count")) == streams
    assert series(values, "mrc_requests_total", outcome="ok") == [float(len(MIX))]
    assert series(values, "mrc_prompt_tokens_total") == [float(prompt)]
    assert series(values, "mrc_generation_tokens_total") == [float(completion)]
    assert series(values, "mrc_request_images_sum") == [float(sum(len(m[1]) for m in MIX))]
    assert series(values, "mrc_requests_in_flight") == [0.0]


def _settled(reg: CollectorRegistry, requests: int
             ) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The values once ``requests`` are counted: a request is recorded as its exchange ends,
    just after the client read the last byte."""
    deadline = time.monotonic() + 10
    while sum(series(values := _values(reg), "mrc_requests_total")) < requests:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return values


def test_the_proxy_counts_what_the_clients_saw(proxy: ProxyThread) -> None:
    cells, streams, prompt, completion = _drive(proxy.url)
    _check(_settled(proxy.metrics.registry, len(MIX)), cells, streams, prompt, completion)


def test_the_middleware_counts_what_the_clients_saw(
        wrapped: tuple[FakeEngine, ServerThread, CollectorRegistry]) -> None:
    _, server, reg = wrapped
    before = _values(reg)
    assert sum(series(before, "mrc_requests_total")) == 0.0
    cells, streams, prompt, completion = _drive(server.url)
    _check(_settled(reg, len(MIX)), cells, streams, prompt, completion)


def test_the_proxy_serves_its_metrics_on_its_own_port(
        engine: tuple[FakeEngine, ServerThread]) -> None:
    """``mrc-agent proxy`` as an operator runs it: a child process, two ports."""
    import subprocess
    import sys

    listen, metrics = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mrc_agent.agent", "proxy", "--listen",
                             f"127.0.0.1:{listen}", "--upstream", engine[1].url,
                             "--metrics-listen", f"127.0.0.1:{metrics}"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{listen}/v1/chat/completions",
                               json=chat("hi", SMALL), timeout=10)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert r.status_code == 200
        text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        values = parse_metrics(text)
        assert series(values, "mrc_requests_total", outcome="ok") == [1.0]
        assert series(values, "mrc_request_duration_seconds_count", prompt_length="0-50",
                      resolution="<1MP") == [1.0]
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
    bad = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "proxy", "--listen",
                          "127.0.0.1:1", "--upstream", "ftp://x", "--metrics-listen",
                          "127.0.0.1:2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not an http(s)://host[:port] URL" in bad.stderr


def test_on_sigterm_the_proxy_lets_streams_under_way_finish(
        engine: tuple[FakeEngine, ServerThread]) -> None:
    import signal
    import subprocess
    import sys

    listen, metrics = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mrc_agent.agent", "proxy", "--listen",
                             f"127.0.0.1:{listen}", "--upstream", engine[1].url,
                             "--metrics-listen", f"127.0.0.1:{metrics}", "--drain-timeout",
                             "20"], stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _listening(listen), timeout=60)
        idle = socket.create_connection(("127.0.0.1", listen))
        body = chat("x", stream=True, x_fail="slow", x_slow_events=20)
        with httpx.stream("POST", f"http://127.0.0.1:{listen}/v1/chat/completions", json=body,
                          timeout=30) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        events = [x for x in [first, *rest] if x.startswith("data: ")]
        assert len(events) == 1 + 20, "the stream under way was cut"
        assert proc.wait(20) == 0
        assert idle.recv(1) == b""  # the idle keep-alive connection was closed, not kept
        idle.close()
        assert not _listening(listen)
    finally:
        proc.kill()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_bodies_pass_byte_for_byte_and_hop_by_hop_headers_do_not(
        proxy: ProxyThread, engine: tuple[FakeEngine, ServerThread]) -> None:
    fake = engine[0]
    payload = os.urandom(3 << 20)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the upload is chunked
        for i in range(0, len(payload), 100_000):
            yield payload[i:i + 100_000]

    r = httpx.post(proxy.url + "/echo", content=chunks(), timeout=30, headers={
        "Connection": "keep-alive, x-hop", "X-Hop": "1", "Keep-Alive": "timeout=5",
        "TE": "trailers", "X-End-To-End": "kept", "X-Forwarded-For": "unknown"})
    assert r.status_code == 200 and r.content == payload
    seen = fake.headers[-1]
    assert seen["x-end-to-end"] == "kept"
    for hop in ("x-hop", "keep-alive", "te"):
        assert hop not in seen, hop
    assert seen["host"] == f"127.0.0.1:{engine[1].port}"
    assert seen["x-forwarded-for"] == "unknown, 127.0.0.1"
    raw = json.dumps(chat("é" * 10, SMALL)).encode()
    r = httpx.post(proxy.url + "/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200 and fake.bodies[-1] == raw


def test_a_stream_reaches_the_client_event_by_event(proxy: ProxyThread) -> None:
    """The first event arrives while the server is still generating: nothing is buffered."""
    body = chat("slow", SMALL, stream=True, x_fail="slow")
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                      timeout=30) as r:
        t0 = time.monotonic()
        lines = r.iter_lines()
        first = [next(lines) for _ in range(3)]
        assert time.monotonic() - t0 < 5.0
    assert first[0].startswith("data: {")


@pytest.mark.parametrize("way", ["proxy", "middleware"])
def test_a_client_that_leaves_mid_stream_is_counted_and_cancels_the_server(
        way: str, proxy: ProxyThread, engine: tuple[FakeEngine, ServerThread],
        wrapped: tuple[FakeEngine, ServerThread, CollectorRegistry]) -> None:
    fake, url, reg = ((engine[0], proxy.url, proxy.metrics.registry) if way == "proxy"
                      else (wrapped[0], wrapped[1].url, wrapped[2]))
    fake.disconnected.clear()
    before = sum(series(_values(reg), "mrc_requests_total", outcome="client_error"))
    leave_after(url, chat("bye", SMALL, stream=True, x_fail="slow"))
    assert fake.disconnected.wait(10), "the server went on generating for a client that left"
    deadline = time.monotonic() + 10
    while sum(series(_values(reg), "mrc_requests_total", outcome="client_error")) == before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert series(_values(reg), "mrc_requests_in_flight") == [0.0]


def test_an_upstream_that_is_down_gets_502_counted(engine: tuple[FakeEngine, ServerThread]
                                                   ) -> None:
    p = ProxyThread(f"http://127.0.0.1:{free_port()}", connect_timeout=2.0)
    try:
        r = httpx.post(p.url + "/v1/chat/completions", json=chat("x", SMALL), timeout=30)
        assert r.status_code == 502
        assert r.json()["error"]["type"] == "bad_gateway"
        # Counted as its exchange ends, just after the client read the answer.
        assert series(_settled(p.metrics.registry, 1), "mrc_requests_total",
                      outcome="error") == [1.0]
    finally:
        p.stop()


def test_an_upstream_that_dies_mid_answer_truncates_it_and_counts_an_error(
        proxy: ProxyThread) -> None:
    body = chat("x", SMALL, stream=True, x_fail="midstream")
    with pytest.raises(httpx.RemoteProtocolError):
        stream_lines(proxy.url + "/v1/chat/completions", body)
    deadline = time.monotonic() + 10
    while series(_values(proxy.metrics.registry), "mrc_requests_total", outcome="error") != [1.0]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_refused_request_is_forwarded_and_counted_as_the_clients_error(
        proxy: ProxyThread, engine: tuple[FakeEngine, ServerThread]) -> None:
    for raw in (b'{"messages": [', b"\xff\xfe not json", json.dumps(
            chat("x", SMALL, x_fail="status")).encode()):
        r = httpx.post(proxy.url + "/v1/chat/completions", content=raw, timeout=30)
        assert r.status_code == 400
        assert engine[0].bodies[-1] == raw
    v = _settled(proxy.metrics.registry, 3)
    assert series(v, "mrc_requests_total", outcome="client_error") == [3.0]
    assert sum(series(v, "mrc_requests_total")) == 3.0


def test_connections_to_the_upstream_are_reused(proxy: ProxyThread) -> None:
    with httpx.Client(timeout=30) as client:
        for _ in range(5):
            assert client.post(proxy.url + "/v1/chat/completions",
                               json=chat("x", SMALL)).status_code == 200
    wait_until(lambda: len(proxy.proxy._pool) == 1)  # released as the last answer ends
    assert len(proxy.proxy._pool) == 1


def test_a_huge_upload_holds_up_no_other_request(proxy: ProxyThread,
                                                 engine: tuple[FakeEngine, ServerThread]) -> None:
    """A 20 MB base64 image trickling in while small requests pass; it is forwarded whole."""
    head = json.dumps(chat("x", "data:image/png;base64,"))
    prefix, suffix = head.split("data:image/png;base64,")
    big = (prefix + "data:image/png;base64," + "QUFB" * (5 << 20) + suffix).encode()
    done = threading.Event()
    result: list[Any] = []

    def trickle() -> Iterator[bytes]:
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]
            time.sleep(0.05)

    def upload() -> None:
        result.append(httpx.post(proxy.url + "/v1/chat/completions", content=trickle(),
                                 timeout=60).status_code)
        done.set()

    t = threading.Thread(target=upload)
    t.start()
    small = 0
    while not done.is_set():
        assert httpx.post(proxy.url + "/v1/chat/completions", json=chat("x", SMALL),
                          timeout=30).status_code == 200
        small += 1
    t.join(60)
    assert result == [200] and small >= 3
    assert big in engine[0].bodies


def _hostile() -> dict[str, bytes]:
    jpeg = base64.b64encode(b"\xff\xd8\xff\xe0" + b"\xff" * (19 << 20)).decode()
    return {
        "deep": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "wide": b'{"messages": [' + b"1," * 500_000 + b"1]}",
        "crafted jpeg": json.dumps(chat("x", "data:image/jpeg;base64," + jpeg)).encode(),
        "invalid utf-8": b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3("}]}',
        "lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "truncated": json.dumps(chat("x", SMALL)).encode()[:-40],
    }


@pytest.mark.parametrize("name", list(_hostile()))
def test_hostile_bodies_pass_unchanged_and_get_the_servers_own_answer(
        name: str, proxy: ProxyThread, engine: tuple[FakeEngine, ServerThread],
        wrapped: tuple[FakeEngine, ServerThread, CollectorRegistry]) -> None:
    raw = _hostile()[name]
    direct = httpx.post(engine[1].url + "/v1/chat/completions", content=raw, timeout=60)
    for url, fake in ((proxy.url, engine[0]), (wrapped[1].url, wrapped[0])):
        r = httpx.post(url + "/v1/chat/completions", content=raw, timeout=60)
        assert r.status_code == direct.status_code < 500, (url, r.status_code)
        assert fake.bodies[-1] == raw
    wait_until(lambda: series(_values(proxy.metrics.registry), "mrc_requests_in_flight")
               == [0.0])


def test_chunked_answers_pass_chunk_by_chunk_with_extensions_trailers_and_big_chunks() -> None:
    big = b"data: " + json.dumps({"choices": [{"delta": {"content": "x" * 300_000}}]}).encode()
    events = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', big + b"\n\n",
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n']
    answer = chunked_answer(*events, tail=b"0;ext=1\r\nx-trailer: 1\r\n\r\n")
    answer = answer.replace(b"%x\r\n" % len(events[0]), b"%x;name=value\r\n" % len(events[0]), 1)
    up = RawUpstream(answer)
    p = ProxyThread(up.url)
    try:
        with httpx.Client(timeout=30) as client:
            for _ in range(2):  # the second over the connection the first released
                r = client.post(p.url + "/v1/chat/completions", json=chat("x", SMALL,
                                                                         stream=True))
                assert r.status_code == 200 and r.content == b"".join(events)
        v = _settled(p.metrics.registry, 2)
        assert series(v, "mrc_requests_total", outcome="ok") == [2.0]
        assert series(v, "mrc_generation_tokens_total") == [4.0]
        assert sum(series(v, "mrc_time_to_first_token_seconds_count")) == 2.0
        wait_until(lambda: len(p.proxy._pool) == 1)
    finally:
        p.stop()
        up.close()


@pytest.mark.parametrize("tail", [b"zz\r\nbad\r\n0\r\n\r\n", b"5\r\nabc", b"3\r\nabcXY"])
def test_a_broken_chunked_answer_is_cut_for_the_client_and_counted(tail: bytes) -> None:
    event = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    up = RawUpstream(chunked_answer(event, tail=tail), close_after=True)
    p = ProxyThread(up.url)
    try:
        try:  # cut after some of it reached the client, or a 502 when none had
            r = httpx.post(p.url + "/v1/chat/completions", json=chat("x", stream=True),
                           timeout=5)
        except httpx.RemoteProtocolError:
            pass
        else:
            assert r.status_code == 502, "a broken answer was passed on as complete"
        v = _settled(p.metrics.registry, 1)
        assert series(v, "mrc_requests_total", outcome="error") == [1.0]
    finally:
        p.stop()
        up.close()


def test_an_answer_faster_than_its_reader_waits_upstream_not_in_the_proxy() -> None:
    """Back-pressure down the stream: while the client reads nothing, the upstream's writes
    stall once the sockets' buffers are full; the proxy holds no more than a read of it."""
    event = b"data: " + json.dumps({"choices": [{"delta": {"content": "y" * 16_000}}]}
                                   ).encode() + b"\n\n"
    answer = chunked_answer(*[event] * 3000)  # 48 MB
    up = RawUpstream(answer)
    p = ProxyThread(up.url)
    try:
        with socket.create_connection(("127.0.0.1", int(p.url.rsplit(":", 1)[1]))) as s:
            send_chat(s, chat("x", stream=True))
            wait_until(lambda: up.sent > 0)
            last = -1
            while up.sent != last:  # until the upstream is blocked
                last = up.sent
                time.sleep(0.3)
            # The sockets' buffers on the way hold some megabytes; the answer is 48.
            assert up.sent < len(answer) // 2, up.sent
            got = bytearray()
            while not got.endswith(b"\r\n0\r\n\r\n"):
                data = s.recv(1 << 20)
                assert data, "the proxy closed the connection"
                got += data
        head, _, body = bytes(got).partition(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0]
        assert unchunk(body) == event * 3000
    finally:
        p.stop()
        up.close()


def test_slow_clients_hold_up_no_one(proxy: ProxyThread,
                                    engine: tuple[FakeEngine, ServerThread]) -> None:
    """A head sent a byte at a time and a stream nobody reads, while requests pass; the
    reader that leaves with bytes unread (a reset) still stops the server."""
    engine[0].disconnected.clear()
    slow_head = socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])))
    slow_reader = socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])))
    slow_reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    send_chat(slow_reader, chat("x", stream=True, x_fail="slow"))
    try:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        for i in range(10):
            slow_head.send(head[i:i + 1])
            t0 = time.monotonic()
            r = httpx.post(proxy.url + "/v1/chat/completions", json=chat("x", SMALL),
                           timeout=10)
            assert r.status_code == 200 and time.monotonic() - t0 < 5.0
    finally:
        slow_head.close()
        slow_reader.close()
    assert engine[0].disconnected.wait(10), "the server went on for a client that left"


def test_a_stopped_proxy_closes_the_upstream_streams_it_carried(
        engine: tuple[FakeEngine, ServerThread]) -> None:
    engine[0].disconnected.clear()
    p = ProxyThread(engine[1].url)
    with socket.create_connection(("127.0.0.1", int(p.url.rsplit(":", 1)[1]))) as s:
        send_chat(s, chat("x", stream=True, x_fail="slow"))
        assert b"data: " in s.recv(65536) or b"data: " in s.recv(65536)
        p.stop()
        assert engine[0].disconnected.wait(5), "the upstream stream outlived the proxy"
