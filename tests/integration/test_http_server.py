"""The agent's HTTP server under clients that misbehave: keep-alive of both HTTP versions,
slow and oversized heads, two framings, early answers to large bodies, idle floods. Real
sockets on loopback against the real server; small limits so that nothing waits long."""

from __future__ import annotations

import contextlib
import http.client
import socket
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.registry import CollectorRegistry

from mrc_agent.exporters.exposition.http import (
    ExpositionServer,
    Limits,
    Request,
    Response,
    Routes,
)
from tests.conftest import read_http_response, socket_closed

LIMITS = Limits(max_connections=64, idle_timeout_s=1.0, head_timeout_s=0.5,
                body_timeout_s=0.5, write_timeout_s=2.0, linger_s=2.0, linger_bytes=16 << 20)


class Echo(Routes):
    """A route that takes bodies up to 1 MiB and says how many bytes it got."""

    max_body_bytes = 1 << 20

    def handle(self, request: Request) -> Response | None:
        if request.path != "/hook":
            return None
        return Response(200, f"{len(request.body)}\n".encode(), "text/plain")


@contextlib.contextmanager
def _serving(limits: Limits = LIMITS, routes: Any = None) -> Iterator[ExpositionServer]:
    """A started server with ``limits`` and ``routes`` (:class:`Echo` by default), stopped
    on leaving."""
    srv = ExpositionServer(CollectorRegistry(), "127.0.0.1", 0, lambda: 1, lambda: None,
                           routes=routes if routes is not None else Echo(), limits=limits)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def server() -> Iterator[ExpositionServer]:
    with _serving() as srv:
        yield srv


def _connect(server: ExpositionServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


#: Bytes read past one response, per socket: by the socket object, never by its descriptor
#: number, which the next socket reuses (a stale response would be read as the new one's).
_LEFT: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response off ``sock``: status, headers, body (by Content-Length)."""
    line, headers, body, rest = read_http_response(sock, _LEFT.pop(sock, b""))
    if rest:
        _LEFT[sock] = rest
    return int(line.split(" ")[1]), headers, body



def test_http10_keep_alive_is_honoured_and_said(server: ExpositionServer) -> None:
    with _connect(server) as s:
        for _ in range(3):
            s.sendall(b"GET /healthz HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
            status, headers, body = _read_response(s)
            assert (status, body) == (200, b"ok\n")
            assert headers["connection"].lower() == "keep-alive"


def test_http10_without_keep_alive_is_closed_after_the_answer(server: ExpositionServer) -> None:
    with _connect(server) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        status, headers, _ = _read_response(s)
        assert status == 200 and headers["connection"] == "close"
        assert socket_closed(s)


def test_http11_keeps_alive_until_close_is_asked(server: ExpositionServer) -> None:
    with _connect(server) as s:
        for _ in range(3):
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(s)[0] == 200
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, headers, _ = _read_response(s)
        assert status == 200 and headers["connection"] == "close" and socket_closed(s)


def test_pipelined_requests_are_answered_in_order(server: ExpositionServer) -> None:
    with _connect(server) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(s)[2] == b"ok\n"
        assert _read_response(s)[2] == b"ready\n"


@pytest.mark.parametrize(("raw", "status"), [
    (b"GET /healthz HTTP/2.0\r\n\r\n", 505),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET healthz HTTP/1.1\r\n\r\n", 400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", 431),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
    (b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"abc", 400),
    (b"POST /hook HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
     411),
    (b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: \xc2\xb2\r\n\r\n", 400),
    (b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 30 + b"\r\n\r\n", 400),
    (b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 501),
    # RFC 9112 3.2: a server MUST answer 400 to an HTTP/1.1 request without Host.
    (b"GET /healthz HTTP/1.1\r\n\r\n", 400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
     400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
])
def test_malformed_requests_get_a_status_and_a_close(server: ExpositionServer, raw: bytes,
                                                    status: int) -> None:
    with _connect(server) as s:
        s.sendall(raw)
        got, headers, _ = _read_response(s)
        assert got == status and headers["connection"] == "close"
        assert socket_closed(s)


def test_a_slow_head_is_cut(server: ExpositionServer) -> None:
    with _connect(server) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finishes the head
        started = time.monotonic()
        status, _, _ = _read_response(s)
        assert status == 408 and time.monotonic() - started < 3
        assert socket_closed(s)


def test_a_silent_connection_is_closed_after_the_head_timeout(server: ExpositionServer) -> None:
    with _connect(server) as s:
        assert socket_closed(s, within=3.0)


def test_an_idle_kept_alive_connection_is_closed(server: ExpositionServer) -> None:
    with _connect(server) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(s)[0] == 200
        assert socket_closed(s, within=3.0)  # idle_timeout_s is 1 s here


def test_after_a_response_the_idle_timeout_applies_not_the_head_timeout() -> None:
    """Head timeout 0.3 s, idle 2.5 s: a kept-alive connection outlives the head timeout after
    its answer (so the idle one is what applies) and is closed once the idle one runs out."""
    with _serving(replace(LIMITS, idle_timeout_s=2.5, head_timeout_s=0.3)) as srv, \
            _connect(srv) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(s)[0] == 200
        assert not socket_closed(s, within=1.0)  # past the head timeout, still open
        assert socket_closed(s, within=6.0)


def test_a_slow_body_is_cut(server: ExpositionServer) -> None:
    with _connect(server) as s:
        s.sendall(b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly a little")
        assert _read_response(s)[0] == 408


def test_a_body_is_read_and_the_connection_kept(server: ExpositionServer) -> None:
    with _connect(server) as s:
        for n in (0, 5, 1000):
            s.sendall(b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % n
                      + b"x" * n)
            assert _read_response(s)[2] == f"{n}\n".encode()


def test_an_oversized_body_gets_413_that_a_stdlib_client_can_read(
        server: ExpositionServer) -> None:
    # http.client sends the whole body before it reads the answer: without the lingering
    # close it would see a connection reset instead of the 413.
    body = b"x" * (8 << 20)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", "/hook", body=body, headers={"Content-Type": "text/plain"})
        resp = conn.getresponse()
        assert resp.status == 413 and resp.read() == b"request body too large\n"
    finally:
        conn.close()


def test_idle_connections_beyond_the_cap_make_room_and_metrics_answer() -> None:
    """Three times the cap of idle connections: the cap makes room by closing waiting ones, so
    a scrape is answered. The head and idle timeouts are far longer than the socket's own
    5 s, so only eviction can make that room (with LIMITS' 0.5 s head timeout, a stall of the
    test under load could see its own connections timed out instead)."""
    patient = replace(LIMITS, idle_timeout_s=60.0, head_timeout_s=60.0)
    with _serving(patient) as srv:
        idle = [_connect(srv) for _ in range(3 * patient.max_connections)]
        try:
            for s in idle[-10:]:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_response(s)[0] == 200
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and srv.connections > patient.max_connections:
                time.sleep(0.05)
            assert srv.connections <= patient.max_connections
            with _connect(srv) as s:  # answered within the socket's 5 s, not the 60 s timeouts
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_response(s)[0] == 200
            evicted = sum(socket_closed(s) for s in idle[:10])
            assert evicted == 10  # the oldest idle ones made the room
        finally:
            for s in idle:
                s.close()


@pytest.mark.parametrize(("count", "status"), [(7, 200), (8, 200), (9, 431)])
def test_the_header_count_limit_holds_at_its_boundary(count: int, status: int) -> None:
    """``max_headers`` 8: a request with 8 header lines (Host and 7 more) is read, one with 9
    is 431; off by one either way, one of the two would fail."""
    limits = replace(LIMITS, idle_timeout_s=5.0, head_timeout_s=5.0, max_headers=8)
    extra = "".join(f"X-H{i}: {i}\r\n" for i in range(count - 1))
    with _serving(limits) as srv, _connect(srv) as s:
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
        assert _read_response(s)[0] == status


@pytest.mark.parametrize(("extra", "status"), [(-1, 200), (0, 200), (1, 431)])
@pytest.mark.parametrize("split", [False, True])
def test_the_head_size_limit_holds_at_its_boundary(extra: int, split: bool,
                                                    status: int) -> None:
    """``max_head_bytes`` 1024: a head of 1023 or 1024 bytes (its blank line included) is
    read, one of 1025 is 431, whether it arrives in one write or in two; off by one either
    way, one of them would fail. A request follows the head, so the size is the head's, not
    of what arrived with it."""
    limits = replace(LIMITS, idle_timeout_s=5.0, head_timeout_s=5.0, max_head_bytes=1024)
    start, end = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: ", b"\r\n\r\n"
    head = start + b"p" * (1024 + extra - len(start) - len(end)) + end
    assert len(head) == 1024 + extra
    after = b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with _serving(limits) as srv, _connect(srv) as s:
        if split:
            s.sendall(head[:100])
            time.sleep(0.2)
            s.sendall(head[100:] + after)
        else:
            s.sendall(head + after)
        assert _read_response(s)[0] == status


def test_a_route_that_raises_is_a_500_and_the_server_lives_on() -> None:
    class Broken(Routes):
        max_body_bytes = 10

        def handle(self, request: Request) -> Response | None:
            raise RuntimeError("bug")

    with _serving(routes=Broken()) as srv, _connect(srv) as s:
        s.sendall(b"GET /anything HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(s)[0] == 500
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(s)[0] == 200


def test_stop_closes_every_connection_and_the_port() -> None:
    srv = ExpositionServer(CollectorRegistry(), "127.0.0.1", 0, lambda: 1, lambda: None,
                           limits=LIMITS)
    srv.start()
    port = srv.port
    held = socket.create_connection(("127.0.0.1", port), timeout=5)
    deadline = time.monotonic() + 5
    while srv.connections == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.stop()
    assert socket_closed(held)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
