"""``mrc-agent proxy`` as a strict HTTP/1.1 intermediary (RFC 9112), on real sockets, against a
hand-written upstream that misbehaves on demand (:mod:`tests.raw_upstream`): one client's bytes
never reach another, a message whose framing is ambiguous is refused rather than guessed at,
an answer without a body is framed by its status and method, and the limits on client
connections hold what the docs promise. Each answer names the request it answers, so a client
that got another's answer is seen."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import generate_latest

from mrc_agent.agent.tools import proxy as proxy_module
from tests.conftest import parse_metrics, series, wait_until
from tests.openai_support import ProxyThread, chat
from tests.raw_upstream import (
    AnswerReader,
    RawUpstream,
    Seen,
    length_answer,
    status_of,
)

#: A whole answer that an upstream smuggles after its real one: served to the next client
#: if the connection it came on were reused.
EVIL = length_answer(b'{"for": "evil"}')


def named(seen: Seen) -> bytes:
    """An answer naming the request's target."""
    return length_answer(b'{"for": "%s"}' % seen.target)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _connect(p: ProxyThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", _port(p.url)), timeout=10)


def _outcomes(p: ProxyThread, requests: int) -> dict[str, float]:
    """The proxy's ``mrc_requests_total`` by outcome once ``requests`` are counted (each is
    counted as its exchange ends, just after the client read the last byte)."""
    deadline = time.monotonic() + 10
    while True:
        values = parse_metrics(generate_latest(p.metrics.registry).decode())
        if sum(series(values, "mrc_requests_total")) >= requests:
            break
        assert time.monotonic() < deadline, values
        time.sleep(0.02)
    assert series(values, "mrc_requests_in_flight") == [0.0]
    return {dict(labels)["outcome"]: v for (name, labels), v in values.items()
            if name == "mrc_requests_total" and v}


@pytest.fixture
def pair() -> Iterator[tuple[RawUpstream, ProxyThread]]:
    """An upstream answering :func:`named` (a test may set another ``answer``) and a proxy
    to it."""
    up = RawUpstream(named)
    p = ProxyThread(up.url)
    yield up, p
    p.stop()
    up.close()


# --- the request's framing ---------------------------------------------------------------------


def test_a_request_with_both_lengths_is_refused_and_nothing_reaches_the_upstream(
        pair: tuple[RawUpstream, ProxyThread]) -> None:
    """RFC 9112 §6.3: a request with both is a smuggling attempt or an error; nginx (1.21.1+)
    and Envoy refuse it with 400 and close. A server that reads Content-Length first would
    otherwise see the body's tail as a second request of the attacker's choosing."""
    up, p = pair
    body = b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(p) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n%s" % (len(body), body))
        answers = AnswerReader(s)
        head, _ = answers.read()
        assert status_of(head) == 400
        assert answers.read() == (b"", b""), "the connection must close after the refusal"
    r = httpx.get(p.url + "/next", timeout=10)
    assert r.json() == {"for": "/next"}
    assert [x.target for x in up.seen] == [b"/next"]
    assert _outcomes(p, 1) == {"client_error": 1.0}


def test_a_content_length_named_by_connection_still_frames_the_body(
        pair: tuple[RawUpstream, ProxyThread]) -> None:
    """``Connection: content-length`` is the client's mistake (RFC 9110 §7.6.1), but dropping
    the header would leave the body without a length: the body is forwarded whole, once."""
    up, p = pair
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    with _connect(p) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: "
                  b"content-length\r\nContent-Type: application/json\r\nContent-Length: %d"
                  b"\r\n\r\n%s" % (len(raw), raw))
        head, body = AnswerReader(s).read()
    assert status_of(head) == 200 and body == b'{"for": "/v1/chat/completions"}'
    assert [x.body for x in up.seen] == [raw]
    assert _outcomes(p, 1) == {"ok": 1.0}


def test_forwarded_headers_are_the_proxys_view_not_the_clients(
        pair: tuple[RawUpstream, ProxyThread]) -> None:
    """``X-Forwarded-For`` is appended to, unless the client named it a connection option
    (then it is dropped before being rebuilt); ``-Proto`` and ``-Host`` are replaced."""
    up, p = pair
    httpx.get(p.url + "/a", timeout=10, headers={
        "X-Forwarded-For": "spoofed", "X-Forwarded-Proto": "https",
        "X-Forwarded-Host": "chosen.example", "Host": "asked.example"})
    httpx.get(p.url + "/b", timeout=10, headers={
        "Connection": "keep-alive, x-forwarded-for", "X-Forwarded-For": "spoofed"})
    a, b = up.seen
    assert a.header(b"x-forwarded-for") == [b"spoofed, 127.0.0.1"]
    assert a.header(b"x-forwarded-proto") == [b"http"]
    assert a.header(b"x-forwarded-host") == [b"asked.example"]
    assert a.header(b"host") == [up.url.split("//")[1].encode()]
    assert b.header(b"x-forwarded-for") == [b"127.0.0.1"]


# --- bytes past the end of an answer ------------------------------------------------------------


#: Answers after which bytes are left that no answer owns: each a whole answer of its own.
EXTRA = {
    "past content-length": lambda seen: named(seen) + EVIL,
    "204 with a body": lambda seen: b"HTTP/1.1 204 No Content\r\n\r\n" + EVIL,
    "304 with a body": lambda seen: b"HTTP/1.1 304 Not Modified\r\ncontent-length: 15\r\n\r\n"
                                    + EVIL,
    "HEAD answered with a body": lambda seen: named(seen) + EVIL,
}


@pytest.mark.parametrize("case", list(EXTRA))
def test_bytes_past_an_answer_never_reach_the_next_client(case: str) -> None:
    up = RawUpstream(lambda seen: EXTRA[case](seen) if seen.target == b"/first"
                     else named(seen))
    p = ProxyThread(up.url)
    try:
        method = b"HEAD" if case.startswith("HEAD") else b"GET"
        with _connect(p) as s:
            s.sendall(method + b" /first HTTP/1.1\r\nHost: x\r\n\r\n")
            head, _ = AnswerReader(s).read(head_request=method == b"HEAD")
            assert status_of(head) in (200, 204, 304)
        r = httpx.get(p.url + "/second", timeout=10)
        assert r.json() == {"for": "/second"}, "another client's bytes were served"
        assert up.accepted == 2, "the connection with bytes left over went back to the pool"
    finally:
        p.stop()
        up.close()


def test_bytes_arriving_on_an_idle_pooled_connection_close_it() -> None:
    """Bytes an upstream writes after its answer, later: the connection is in the pool by
    then, owing nothing, and closes as they arrive."""
    up = RawUpstream(named, late=EVIL, late_s=0.2)
    p = ProxyThread(up.url)
    try:
        assert httpx.get(p.url + "/first", timeout=10).json() == {"for": "/first"}
        wait_until(lambda: up.sent >= len(EVIL) + len(named(Seen(b"", b"/first", []))))
        wait_until(lambda: all(c.transport is None or c.transport.is_closing()
                               for c in p.proxy._pool))
        assert httpx.get(p.url + "/second", timeout=10).json() == {"for": "/second"}
        assert up.accepted == 2
    finally:
        p.stop()
        up.close()


def test_a_pooled_connection_idle_past_its_limit_is_not_reused(
        pair: tuple[RawUpstream, ProxyThread], monkeypatch: pytest.MonkeyPatch) -> None:
    up, p = pair
    monkeypatch.setattr(proxy_module, "POOL_IDLE_S", 0.3)
    with httpx.Client(timeout=10) as client:
        assert client.get(p.url + "/a").status_code == 200
        assert client.get(p.url + "/b").status_code == 200
        assert up.accepted == 1, "within its idle limit a connection is reused"
        time.sleep(0.5)
        assert client.get(p.url + "/c").status_code == 200
    assert up.accepted == 2


# --- answers without a body --------------------------------------------------------------------


def _bodyless_chunked(seen: Seen) -> bytes:
    if seen.method == b"HEAD":  # as uvicorn answers HEAD on a streaming route
        return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
    if seen.target == b"/204":
        return b"HTTP/1.1 204 No Content\r\ntransfer-encoding: chunked\r\n\r\n"
    if seen.target == b"/304":
        return b"HTTP/1.1 304 Not Modified\r\ntransfer-encoding: chunked\r\n\r\n"
    return named(seen)


def test_answers_without_a_body_are_framed_by_status_and_method(
        pair: tuple[RawUpstream, ProxyThread]) -> None:
    """HEAD, 204 and 304 have no body whatever their headers say: the proxy does not wait
    for chunks, and the requests pipelined behind them are answered in order."""
    up, p = pair
    up.answer = _bodyless_chunked
    with _connect(p) as s:
        s.sendall(b"HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /204 HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /304 HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /last HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = AnswerReader(s, timeout=5)
        assert status_of(answers.read(head_request=True)[0]) == 200
        assert status_of(answers.read()[0]) == 204
        assert status_of(answers.read()[0]) == 304
        head, body = answers.read()
        assert status_of(head) == 200 and body == b'{"for": "/last"}'
    assert up.accepted == 1, "each bodyless answer ended at a message boundary"


# --- answers whose framing is broken ------------------------------------------------------------

_EVENT = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"

BROKEN = {
    "both lengths": _STREAM_HEAD + b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"%x\r\n%s\r\n0\r\n\r\n" % (len(_EVENT) + 7, len(_EVENT), _EVENT),
    "0x size": _STREAM_HEAD + b"transfer-encoding: chunked\r\n\r\n0x%x\r\n%s\r\n0\r\n\r\n"
               % (len(_EVENT), _EVENT),
    "bare LF in an extension": _STREAM_HEAD + b"transfer-encoding: chunked\r\n\r\n"
                               b"%x;a=\nb\r\n%s\r\n0\r\n\r\n" % (len(_EVENT), _EVENT),
    "17-digit size": _STREAM_HEAD + b"transfer-encoding: chunked\r\n\r\n"
                     b"%017x\r\n%s\r\n0\r\n\r\n" % (len(_EVENT), _EVENT),
    "signed size": _STREAM_HEAD + b"transfer-encoding: chunked\r\n\r\n+%x\r\n%s\r\n0\r\n\r\n"
                   % (len(_EVENT), _EVENT),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_an_answer_with_broken_framing_is_a_502_counted_as_the_upstreams(case: str) -> None:
    """Refused before any of it reaches the client, counted as an upstream error (never as
    the client leaving), and the connection it came on is not reused."""
    up = RawUpstream(BROKEN[case])
    p = ProxyThread(up.url)
    try:
        r = httpx.post(p.url + "/v1/chat/completions", json=chat("x", stream=True), timeout=10)
        assert r.status_code == 502 and r.json()["error"]["type"] == "bad_gateway"
        assert _outcomes(p, 1) == {"error": 1.0}
        assert not p.proxy._pool
    finally:
        p.stop()
        up.close()


# --- limits on client connections --------------------------------------------------------------


def test_the_head_timeout_covers_the_whole_head(pair: tuple[RawUpstream, ProxyThread]) -> None:
    """A head trickled a byte every 0.2 s under a 1 s timeout is cut after about five bytes,
    not after the whole of it (each read alone is quick)."""
    up, _ = pair
    p = ProxyThread(up.url, head_timeout=1.0)
    try:
        head = b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"p" * 40 + b"\r\n\r\n"
        sent = 0
        with _connect(p) as s:
            s.settimeout(0.2)
            for byte in head:
                try:
                    s.send(bytes([byte]))
                    if s.recv(1) == b"":
                        break
                except TimeoutError:
                    sent += 1
                except OSError:
                    break
        assert sent < len(head) // 2, f"a head trickled for {sent * 0.2:.1f} s was kept"
        assert up.seen == []
    finally:
        p.stop()


@pytest.mark.parametrize("pieces", [False, True], ids=["at once", "in 1 KiB pieces"])
@pytest.mark.parametrize(("size", "status"), [(48 * 1024, 200), (64 * 1024, 200),
                                              (64 * 1024 + 1, 431), (100 * 1024, 431)])
def test_the_head_limit_is_exact_however_the_head_arrives(
        size: int, status: int, pieces: bool, pair: tuple[RawUpstream, ProxyThread]) -> None:
    """64 KiB, the blank line included, whether the head comes in one read or many (h11's
    own bound applies only to a head still incomplete, and differs from ours)."""
    up, p = pair
    start = b"GET /big HTTP/1.1\r\nHost: x\r\nX-Padding: "
    head = start + b"p" * (size - len(start) - 4) + b"\r\n\r\n"
    assert len(head) == size
    with _connect(p) as s:
        if pieces:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(0, size, 1024):
                try:
                    s.sendall(head[i:i + 1024])
                except OSError:  # refused part-way: the 431 is waiting
                    break
        else:
            s.sendall(head)
        answer, body = AnswerReader(s).read()
        assert status_of(answer) == status
        if status == 431:
            assert json.loads(body)["error"]["message"] == "the request head is over 64 KiB"
    assert len(up.seen) == (status == 200)


def test_at_the_connection_cap_the_longest_waiting_connection_makes_room(
        pair: tuple[RawUpstream, ProxyThread]) -> None:
    """Idle and part-way heads are closed, oldest first; a connection being answered never
    is, and when all are being answered a new one gets 503."""
    up, _ = pair
    release = threading.Event()

    def held(seen: Seen) -> bytes:
        if seen.target == b"/held":
            release.wait(20)
        return named(seen)

    up.answer = held
    p = ProxyThread(up.url, max_connections=3)
    idle: list[socket.socket] = []
    busy: list[socket.socket] = []
    try:
        for i in range(3):
            idle.append(_connect(p))
            if i == 1:
                idle[-1].sendall(b"GET /part HTTP/1.1\r\n")  # a head part-way
            wait_until(lambda: len(p.proxy._clients) == len(idle))
        fresh = _connect(p)
        fresh.sendall(b"GET /fresh HTTP/1.1\r\nHost: x\r\n\r\n")
        assert AnswerReader(fresh).read()[1] == b'{"for": "/fresh"}'
        assert idle[0].recv(1) == b"", "the oldest idle connection was not the one closed"
        idle[1].settimeout(0.3)
        with pytest.raises(TimeoutError):
            idle[1].recv(1)
        # Fill every slot with a request being answered; the next connection is refused.
        for c in (fresh, *idle[1:]):
            c.close()
        wait_until(lambda: len(p.proxy._clients) == 0)
        for _ in range(3):
            busy.append(_connect(p))
            busy[-1].sendall(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: len(up.seen) == 1 + 3)
        with _connect(p) as late:
            head, body = AnswerReader(late).read()
            assert status_of(head) == 503 and b"connection limit" in body
        release.set()
        for c in busy:
            assert AnswerReader(c).read()[1] == b'{"for": "/held"}'
    finally:
        release.set()
        for c in idle + busy:
            c.close()
        p.stop()


def test_the_metrics_port_answers_a_scraper_while_one_address_holds_300_heads(
        pair: tuple[RawUpstream, ProxyThread]) -> None:
    """``mrc-agent proxy`` as an operator runs it: 300 connections from 127.0.0.1 each send a
    request line and nothing more (past the exposition server's cap of 256); a scrape from
    127.0.0.2 is answered, since at the cap the address holding the most connections loses
    its longest-waiting one."""
    import subprocess
    import sys

    from tests.support import free_port

    up, _ = pair
    listen, metrics = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mrc_agent.agent", "proxy", "--listen",
                             f"127.0.0.1:{listen}", "--upstream", up.url,
                             "--metrics-listen", f"127.0.0.1:{metrics}"],
                            stderr=subprocess.DEVNULL)
    held: list[socket.socket] = []
    try:
        wait_until(lambda: _answers_scrape(metrics, "127.0.0.1"), timeout=60)
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", metrics), timeout=10)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(s)
        for _ in range(3):
            assert _answers_scrape(metrics, "127.0.0.2")
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(20)


def _answers_scrape(port: int, source: str) -> bool:
    """Whether a scrape from ``source`` gets a 200 within 5 s (it takes ~0.02 s here)."""
    try:
        with socket.socket() as s:
            s.bind((source, 0))
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            return status_of(AnswerReader(s, timeout=5).read()[0]) == 200
    except OSError:
        return False
