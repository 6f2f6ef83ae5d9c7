"""``mrc-agent proxy``'s answer paths on real loopback sockets, byte for byte: the head a client
gets (framing headers the proxy writes itself, ``connection: close`` when the client asked for
it), the connection kept or closed after it, the 502 a client gets when the first chunk of an
answer is malformed, the close of a connection answered before its request body ended; and,
called directly, the count of a refused head whose request line names a metered path and the
pool's admission and reuse rules (its idle limit exact, on a stubbed clock); an upstream that
cannot be reached, a request body that arrives in pieces, the headers the proxy forwards, an
upstream on another loopback address; and an HTTPS upstream spoken to over TLS, verified against
the CA the proxy is given (or the system's, by default).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from mrc_agent.agent.tools import proxy as proxy_module
from mrc_agent.agent.tools.proxy import POOL_IDLE_S, POOL_SIZE, Proxy
from mrc_agent.agent.tools.proxy_http import raw_error
from tests.conftest import parse_metrics, series
from tests.openai_support import ProxyThread
from tests.pki import make_pki
from tests.raw_upstream import AnswerReader, RawUpstream, chunked_answer, length_answer
from tests.support import free_port
from tests.unit.test_proxy_units import _conn, _proxy


@contextmanager
def fronting(up: RawUpstream | EarlyAnswer) -> Iterator[ProxyThread]:
    """A proxy in front of ``up``; both stopped at the end, whatever happened."""
    p = ProxyThread(up.url)
    try:
        yield p
    finally:
        p.stop()
        up.close()

def _connect(p: ProxyThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(p.url.rsplit(":", 1)[1])), timeout=10)


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the proxy writes until it closes the connection (a timeout fails)."""
    got = b""
    while data := sock.recv(65536):
        got += data
    return got


@pytest.fixture
def proxied() -> Iterator[tuple[RawUpstream, ProxyThread]]:
    up = RawUpstream(length_answer(b'{"ok":1}'))
    p = ProxyThread(up.url)
    yield up, p
    p.stop()
    up.close()


@pytest.mark.parametrize("value", [b"close", b"Keep-Alive, CLOSE", b"te ,Close"])
def test_a_client_that_asks_to_close_gets_connection_close_and_the_close(
        proxied: tuple[RawUpstream, ProxyThread], value: bytes) -> None:
    up, p = proxied
    with _connect(p) as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: h\r\nConnection: " + value + b"\r\n\r\n")
        assert _until_closed(sock) == (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 8\r\n"
            b"connection: close\r\n\r\n{\"ok\":1}")
    assert [s.header(b"connection") for s in up.seen] == [[]]


def test_a_client_that_does_not_ask_to_close_keeps_its_connection(
        proxied: tuple[RawUpstream, ProxyThread]) -> None:
    up, p = proxied
    with _connect(p) as sock:
        reader = AnswerReader(sock)
        for target in (b"/a", b"/b"):
            sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: h\r\n"
                         b"Connection: keep-alive\r\n\r\n")
            assert reader.read() == (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: 8", b'{"ok":1}')
    assert [s.target for s in up.seen] == [b"/a", b"/b"]
    assert up.accepted == 1


def test_a_chunked_answer_gets_the_proxys_own_framing_headers() -> None:
    up = RawUpstream(chunked_answer(b"data: 1\n\n", b"data: 2\n\n",
                                    tail=b"0\r\nx-trailer: t\r\n\r\n"))
    with fronting(up) as p, _connect(p) as sock:
        sock.sendall(b"GET /s HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        assert _until_closed(sock) == (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")


@pytest.mark.parametrize(("answer", "why"), [
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
     "the upstream server's answer is malformed"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
     "the upstream server's answer has a transfer coding other than chunked"),
], ids=["a malformed first chunk", "a transfer coding other than chunked"])
def test_an_answer_the_proxy_cannot_relay_is_a_502_saying_why(answer: bytes, why: str) -> None:
    up = RawUpstream(answer)
    with fronting(up) as p, _connect(p) as sock:
        sock.sendall(b"GET /s HTTP/1.1\r\nHost: h\r\n\r\n")
        assert _until_closed(sock) == raw_error(502, why)


class EarlyAnswer:
    """An upstream that answers as soon as a request head arrives, then reads what else
    comes until the proxy closes the connection."""

    def __init__(self, answer: bytes, then_close: bool = False) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer = answer
        self.then_close = then_close
        self.received = b""
        self.closed = threading.Event()
        threading.Thread(target=self._one, daemon=True).start()

    def _one(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            while b"\r\n\r\n" not in self.received:
                self.received += conn.recv(65536)
            conn.sendall(self.answer)
            if self.then_close:
                conn.shutdown(socket.SHUT_RDWR)
            conn.settimeout(10)
            while not self.then_close and (data := conn.recv(65536)):
                self.received += data
        self.closed.set()

    def close(self) -> None:
        self.sock.close()


def test_an_answer_before_the_whole_request_body_ends_both_connections() -> None:
    up = EarlyAnswer(length_answer(b"early"))
    with fronting(up) as p:
        with _connect(p) as sock:
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n12345")
            assert _until_closed(sock) == (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5"
                b"\r\n\r\nearly")
        assert up.closed.wait(10)
        assert up.received.endswith(b"\r\n\r\n12345")


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\ncontent-le"],
                         ids=["nothing", "part-of-a-head"])
def test_an_upstream_that_ends_before_its_answer_head_is_a_502_naming_it(
        answer: bytes) -> None:
    up = EarlyAnswer(answer, then_close=True)
    with fronting(up) as p, _connect(p) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
        assert _until_closed(sock) == raw_error(502, "the upstream server failed")


def test_interim_answers_pass_on_less_their_hop_by_hop_headers() -> None:
    up = RawUpstream(b"HTTP/1.1 102 Processing\r\n\r\n"
                     b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\nConnection: x\r\n\r\n"
                     + length_answer(b"{}"))
    with fronting(up) as p, _connect(p) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        assert _until_closed(sock) == (
            b"HTTP/1.1 102 Processing\r\n\r\n"
            b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
            b"connection: close\r\n\r\n{}")


# --- the count of a refused head -----------------------------------------------------------


def _counted(p: Proxy) -> dict[str, float]:
    values = parse_metrics(generate_latest(p.metrics.registry).decode())
    return {dict(labels)["outcome"]: v for (name, labels), v in values.items()
            if name == "mrc_requests_total" and v}


@pytest.mark.parametrize(("raw", "counted"), [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", True),
    (b"POST /v1/completions HTTP/1.1\r\n\r\n", True),
    (b"POST /v1/chat/completions?stream=1 HTTP/1.1\r\n\r\n", True),
    (b"POST /v1/chat/completions?a?b HTTP/1.1\r\n\r\n", True),
    (b"POST /v1/chat/completions HTTP/1.1\nHost: x\n\n", True),
    (b"POST /v1/chat/completions HTTP/1.1", True),
    (b"POST /v1/chat/completions HTTP/1.1 \r\n\r\n", False),
    (b"POST  /v1/chat/completions HTTP/1.1\r\n\r\n", False),
    (b"POST /v1/chat/completions\tHTTP/1.1\r\n\r\n", False),
    (b"POST /v1/chat/completions\r\n\r\n", False),
    (b"GET /v1/chat/completions HTTP/1.1\r\n\r\n", False),
    (b"POST /v1/models HTTP/1.1\r\n\r\n", False),
    (b"POST /v1/chat/completions/x HTTP/1.1\r\n\r\n", False),
    (None, False),
], ids=["chat", "completions", "query", "two-question-marks", "bare-lf", "no-line-end",
        "trailing-blank", "double-blank", "tab", "two-parts", "get", "other-path",
        "longer-path", "no-head"])
def test_a_refused_head_is_counted_only_when_its_request_line_names_a_metered_path(
        raw: bytes | None, counted: bool) -> None:
    p = _proxy()
    p._meter_refusal(raw, 431)
    assert _counted(p) == ({"client_error": 1.0} if counted else {})


def test_a_refused_head_is_metered_by_the_proxys_own_paths() -> None:
    p = _proxy(paths=("/custom",))
    p._meter_refusal(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n", 400)
    assert _counted(p) == {}
    p._meter_refusal(b"POST /api/custom HTTP/1.1\r\n\r\n", 400)
    assert _counted(p) == {"client_error": 1.0}


@pytest.mark.parametrize(("already", "draining", "eof", "pooled"), [
    (0, False, False, True), (POOL_SIZE - 1, False, False, True),
    (POOL_SIZE, False, False, False), (0, True, False, False), (0, False, True, False),
], ids=["empty-pool", "one-place-left", "full-pool", "draining", "not-usable"])
def test_an_upstream_connection_is_pooled_only_usable_with_room_and_no_drain(
        already: int, draining: bool, eof: bool, pooled: bool) -> None:
    p = _proxy()
    p._pool = [_conn()[0] for _ in range(already)]
    p._draining = draining
    c, t = _conn(eof=eof)
    p._pool_add(c)
    assert (c in p._pool, c.pooled, t.closing) == (pooled, pooled, not pooled)
    assert len(p._pool) == already + pooled
    if pooled:
        assert c.idle_since > 0


def test_a_pooled_connection_is_reused_only_while_fresh_and_usable() -> None:
    p = _proxy()
    stale, stale_t = _conn(pooled=True, idle_since=0.0)
    ok, ok_t = _conn()
    p._pool = [stale]
    p._pool_add(ok)
    got = asyncio.run(p._connect())
    assert (got, got.pooled, ok_t.closing, p._pool) == (ok, False, False, [stale])
    closed, closed_t = _conn()
    p._pool_add(closed)
    closed_t.closing = True
    with pytest.raises(OSError):  # nothing listens on port 9: the pool had none to give
        asyncio.run(p._connect())
    assert (p._pool, stale_t.closing, stale.pooled, closed.pooled) == ([], True, False, False)


@pytest.mark.parametrize("trust", ["the test CA", "the system's"])
def test_an_https_upstream_is_spoken_to_over_tls_and_verified(tmp_path, trust: str) -> None:
    pki = make_pki(tmp_path)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(pki.server, pki.server_key)
    up = RawUpstream(length_answer(b'{"ok":1}'), tls=server)
    assert up.url.startswith("https://")
    tls = ssl.create_default_context(cafile=pki.ca) if trust == "the test CA" else None
    p = ProxyThread(up.url, tls=tls)
    try:
        client = http.client.HTTPConnection("127.0.0.1", int(p.url.rsplit(":", 1)[1]),
                                            timeout=10)
        client.request("GET", "/v1/models")
        answer = client.getresponse()
        body = answer.read()
        client.close()
    finally:
        p.stop()
        up.close()
    if tls is not None:
        assert (answer.status, body) == (200, b'{"ok":1}')
        assert [s.target for s in up.seen] == [b"/v1/models"]  # decrypted on the far side
    else:  # a certificate the system does not trust: no request reaches the upstream
        assert answer.status == 502 and not up.seen


@pytest.mark.parametrize("request_head", [
    b"GET /v1/models HTTP/1.1\r\nHost: h\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}",
], ids=["unmetered", "metered"])
def test_an_unreachable_upstream_is_a_502_saying_so_and_the_connection_closes(
        request_head: bytes) -> None:
    p = ProxyThread(f"http://127.0.0.1:{free_port()}", connect_timeout=2.0)
    try:
        with _connect(p) as sock:
            sock.sendall(request_head)
            answer = _until_closed(sock)
        want = {"error": 1.0} if b"POST" in request_head else {}
        deadline = time.monotonic() + 5  # counted as the exchange ends, after the close
        while _counted(p.proxy) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        counted = _counted(p.proxy)
    finally:
        p.stop()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
    assert json.loads(body)["error"] == {"message": "the upstream server is unreachable",
                                         "type": "bad_gateway", "param": None, "code": 502}
    assert counted == want


def test_a_request_body_in_pieces_is_metered_as_the_whole_body() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * 75}]})
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % len(body))
    up = RawUpstream(length_answer(b'{"choices":[]}'))
    with fronting(up) as p:
        for pieces in ([body.encode()], [body[:20].encode(), body[20:50].encode(),
                                         body[50:].encode()]):
            with _connect(p) as sock:
                reader = AnswerReader(sock)
                sock.sendall(head)
                for piece in pieces:
                    time.sleep(0.05)  # each piece its own read on the proxy's side
                    sock.sendall(piece)
                assert reader.read()[0].startswith(b"HTTP/1.1 200 OK")
        deadline = time.monotonic() + 10
        while sum(_counted(p.proxy).values()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        values = parse_metrics(generate_latest(p.metrics.registry).decode())
    assert [s.body for s in up.seen] == [body.encode()] * 2
    # 75 characters of prompt: both in the 50-100 cell, whole or in three pieces.
    assert [v for v in series(values, "mrc_request_duration_seconds_count",
                              prompt_length="50-100") if v] == [2.0]


def test_the_upstream_gets_the_clients_headers_less_the_named_and_the_proxys_view() -> None:
    up = RawUpstream(length_answer(b"{}"))
    with fronting(up) as p, _connect(p) as sock:
        # HTTP/1.0 without Host; Connection names two headers with no space between them.
        sock.sendall(b"GET /a HTTP/1.0\r\nConnection: x-one,x-two\r\nX-One: 1\r\nX-Two: 2\r\n"
                     b"X-Kept: X1 \t\r\n\r\n")
        assert _until_closed(sock).startswith(b"HTTP/1.1 200 OK")
    (seen,) = up.seen
    names = [n for n, _ in seen.headers]
    assert b"x-one" not in names and b"x-two" not in names
    assert seen.header(b"x-kept") == [b"X1"]  # only spaces and tabs are trimmed
    assert seen.header(b"x-forwarded-host") == []  # the client named no host
    assert seen.header(b"x-forwarded-proto") == [b"http"]


def test_an_upstream_on_another_loopback_address_is_reached_there() -> None:
    up = RawUpstream(length_answer(b"{}"), host="127.0.0.2")
    with fronting(up) as p, _connect(p) as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        assert _until_closed(sock).startswith(b"HTTP/1.1 200 OK")
    assert [s.target for s in up.seen] == [b"/a"]


def test_a_pooled_connection_idle_exactly_the_limit_is_not_reused(monkeypatch) -> None:
    now = 1000.0
    monkeypatch.setattr(proxy_module, "time", SimpleNamespace(monotonic=lambda: now))
    p = _proxy()
    at_limit, at_limit_t = _conn(pooled=True, idle_since=now - POOL_IDLE_S)
    fresh, _ = _conn(pooled=True, idle_since=now - POOL_IDLE_S + 0.001)
    p._pool = [at_limit, fresh]
    assert asyncio.run(p._connect()) is fresh
    p._pool = [at_limit]
    with pytest.raises(OSError):  # nothing listens on port 9: the pool had none to give
        asyncio.run(p._connect())
    assert at_limit_t.closing


def test_blank_lines_before_a_request_line_are_skipped() -> None:
    """RFC 9112 §2.2: a server ignores at least one empty line (CRLF or a bare LF) received
    before a request line, as after a body some clients send one."""
    up = RawUpstream(length_answer(b"{}"))
    with fronting(up) as p, _connect(p) as sock:
        reader = AnswerReader(sock)
        sock.sendall(b"\n\r\n\nGET /a HTTP/1.1\r\nHost: h\r\n\r\n")
        assert reader.read()[0].startswith(b"HTTP/1.1 200 OK")
        sock.sendall(b"\r\nGET /b HTTP/1.1\r\nHost: h\r\n\r\n")
        assert reader.read()[0].startswith(b"HTTP/1.1 200 OK")
    assert [s.target for s in up.seen] == [b"/a", b"/b"]


_CUT = "the connection ended part-way through a request head"
_LONG = "the request head is over 64 KiB"


@pytest.mark.parametrize(("sent", "status", "message", "counted"), [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\n", 400, _CUT, {"client_error": 1.0}),
    (b"\r\nGET /v1/models HTTP/1.1\r\nHost: h\r\n", 400, _CUT, {}),
    (b"POST /v1/chat/completions HTTP/1.1\r\nX: " + b"x" * (64 * 1024) + b"\r\n\r\n", 431,
     _LONG, {"client_error": 1.0}),
], ids=["cut-short-metered", "cut-short-unmetered", "over-64-kib-metered"])
def test_a_head_cut_short_or_too_long_is_refused_saying_why_and_counted_where_metered(
        sent: bytes, status: int, message: str, counted: dict[str, float]) -> None:
    """The request line is what a client sent first, so a refused head whose line names a
    metered path is counted as a client error even with no whole head to parse."""
    up = RawUpstream(length_answer(b"{}"))
    with fronting(up) as p:
        with _connect(p) as sock:
            try:
                sock.sendall(sent)
                sock.shutdown(socket.SHUT_WR)  # the client's end, part-way through the head
            except OSError:  # refused part-way: the answer is waiting
                pass
            answer = _until_closed(sock)
        deadline = time.monotonic() + 5
        while _counted(p.proxy) != counted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _counted(p.proxy) == counted
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status) and not up.seen
    assert json.loads(body)["error"]["message"] == message


def test_a_client_that_ends_between_requests_gets_nothing_more() -> None:
    up = RawUpstream(length_answer(b"{}"))
    with fronting(up) as p, _connect(p) as sock:
        reader = AnswerReader(sock)
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n")
        assert reader.read()[0].startswith(b"HTTP/1.1 200 OK")
        sock.shutdown(socket.SHUT_WR)  # after its answer, before any next request
        assert _until_closed(sock) == b""  # closed, no 400 for a head never begun
    assert [s.target for s in up.seen] == [b"/a"]


def test_the_proxy_listens_on_exactly_the_address_and_port_it_is_given() -> None:
    async def bound(host: str, port: int) -> list[tuple[str, int]]:
        p = _proxy()
        got = await p.start(host, port)
        assert got == port
        server = p._server
        assert isinstance(server, asyncio.Server)
        names = [s.getsockname()[:2] for s in server.sockets]
        await p.stop()
        return names

    port = free_port()
    assert asyncio.run(bound("127.0.0.1", port)) == [("127.0.0.1", port)]
    if socket.has_ipv6:
        port = free_port()
        assert asyncio.run(bound("[::1]", port)) == [("::1", port)]  # brackets are not a name


@pytest.mark.parametrize("target", [b"/v1/chat/completions?stream=0",
                                    b"/v1/chat/completions?a=1?b=2"])
def test_a_metered_path_with_a_query_is_metered(target: bytes) -> None:
    up = RawUpstream(length_answer(b'{"choices":[]}'))
    with fronting(up) as p, _connect(p) as sock:
        sock.sendall(b"POST " + target + b" HTTP/1.1\r\nHost: h\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        assert _until_closed(sock).startswith(b"HTTP/1.1 200 OK")
        deadline = time.monotonic() + 5
        while _counted(p.proxy) != {"ok": 1.0} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _counted(p.proxy) == {"ok": 1.0}
