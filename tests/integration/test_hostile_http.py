"""The agent's exposition server and the shared renderer against a hostile client: slow heads
that would hold every connection slot, floods of wrong passwords, ``Accept`` headers that
would defeat the render cache or crash the negotiation, request bodies smuggled behind a GET,
and ``gzip;q=0``. Real sockets on loopback against the real server, small limits so nothing
waits long; a hand-written authenticator where a test must hold checks still and see their
order."""

from __future__ import annotations

import asyncio
import base64
import socket
import statistics
import threading
import time
from collections.abc import Iterable, Iterator

import bcrypt
import httpx
import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from mrc_agent.exporters import render
from mrc_agent.exporters.exposition.http import Authenticator, ExpositionServer, Limits, webconfig
from mrc_agent.exporters.exposition.http.webconfig import BasicAuth
from mrc_agent.exporters.instrumentation.asgi import metrics_app
from tests.conftest import read_http_response, socket_closed, wait_until

LIMITS = Limits(max_connections=8, idle_timeout_s=5.0, head_timeout_s=5.0, body_timeout_s=1.0,
                write_timeout_s=2.0, linger_s=0.5)


class Counting:
    """A collector that counts how often it is rendered."""

    def __init__(self) -> None:
        self.collects = 0

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        self.collects += 1
        yield GaugeMetricFamily("mrc_test_value_ratio", "A value for the test.", value=0.5)


def _serve(registry: CollectorRegistry | None = None, limits: Limits = LIMITS,
           auth: Authenticator | None = None) -> ExpositionServer:
    srv = ExpositionServer(registry or CollectorRegistry(), "127.0.0.1", 0, lambda: 1,
                           lambda: None, limits=limits, auth=auth)
    srv.start()
    return srv


@pytest.fixture
def server() -> Iterator[ExpositionServer]:
    srv = _serve()
    yield srv
    srv.stop()


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the server on 127.0.0.1 from ``source`` (any address of 127/8 is
    loopback on Linux: a second client address without leaving the machine)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


class Reader:
    """Responses off one socket, keeping what was read past each."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.left = sock, b""

    def response(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        """The next response; ``head_only`` for the answer to a HEAD (no body follows)."""
        if head_only:
            while b"\r\n\r\n" not in self.left:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionError("closed before a full response head")
                self.left += chunk
            head, _, self.left = self.left.partition(b"\r\n\r\n")
            line = head.decode("latin-1").split("\r\n")[0]
            return int(line.split(" ")[1]), {}, b""
        line, headers, body, self.left = read_http_response(self.sock, self.left)
        return int(line.split(" ")[1]), headers, body


def _get(port: int, path: str = "/metrics", headers: str = "",
         source: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    with _connect(port, source) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        return Reader(s).response()




# -- 1. slow heads -----------------------------------------------------------------------------

def test_connections_part_way_through_their_head_make_room_for_a_scrape(
        server: ExpositionServer) -> None:
    """Every slot taken by a connection that sent its request line and nothing more: the
    oldest is closed for the newcomer, as an idle one would be (it used to be refused)."""
    slow = [_connect(server.port) for _ in range(LIMITS.max_connections)]
    try:
        for s in slow:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # the head never ends
        wait_until(lambda: server.connections == LIMITS.max_connections)
        status, _, body = _get(server.port, "/healthz")
        assert (status, body) == (200, b"ok\n")
        assert socket_closed(slow[0])  # the oldest went
        assert not socket_closed(slow[-1], within=0.2)  # the youngest is still reading its head
    finally:
        for s in slow:
            s.close()


class GatedAuth(Authenticator):
    """An authenticator whose full check waits until the test lets it go, recording the order
    in which checks began. ``GOOD`` passes, ``CACHED`` passes without a check."""

    GOOD, CACHED = "Basic good", "Basic cached"

    def __init__(self) -> None:
        self.order: list[str] = []
        self.gate = threading.Semaphore(0)

    def cached(self, authorization: str | None) -> bool | None:
        return True if authorization == self.CACHED else None

    def check(self, authorization: str | None) -> bool:
        self.order.append(authorization or "")
        assert self.gate.acquire(timeout=20)
        return authorization == self.GOOD


def _ask(port: int, authorization: str, source: str = "127.0.0.1") -> socket.socket:
    s = _connect(port, source)
    s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {authorization}\r\n\r\n"
              .encode())
    return s


def test_at_the_cap_the_address_with_most_connections_loses_one_not_a_scraper() -> None:
    """A scraper's kept-alive connection, idle between two scrapes, was the oldest waiting
    connection within 50 ms of a flood of reconnecting slow heads, and was closed (a failed
    scrape). The address holding the most connections now gives one up."""
    limits = Limits(max_connections=4, head_timeout_s=10.0, idle_timeout_s=10.0)
    srv = _serve(limits=limits)
    flood: list[socket.socket] = []
    try:
        with _connect(srv.port, "127.0.0.2") as scraper:
            scraper.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            reader = Reader(scraper)
            assert reader.response()[0] == 200  # now idle, and the oldest connection
            for _ in range(3 * limits.max_connections):  # slow heads, each newer than it
                flood.append(_connect(srv.port, "127.0.0.3"))
                flood[-1].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                time.sleep(0.02)
            wait_until(lambda: sum(socket_closed(s, within=0.01) for s in flood)
                       >= 2 * limits.max_connections, timeout=10)
            scraper.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert reader.response()[0] == 200
    finally:
        for s in flood:
            s.close()
        srv.stop()


def _release(srv: ExpositionServer, auth: GatedAuth, socks: list[socket.socket]) -> None:
    """A test's end: let every gated check go, close its sockets, stop its server."""
    for _ in range(10):
        auth.gate.release()
    for s in socks:
        s.close()
    srv.stop()


def test_a_connection_being_answered_is_not_evicted_one_reading_its_head_is() -> None:
    auth = GatedAuth()
    limits = Limits(max_connections=3, head_timeout_s=5.0, idle_timeout_s=5.0)
    srv = _serve(limits=limits, auth=auth)
    socks: list[socket.socket] = []
    try:
        socks.append(_ask(srv.port, GatedAuth.GOOD))  # head complete: being answered
        wait_until(lambda: len(auth.order) == 1)
        for _ in range(2):
            socks.append(_connect(srv.port))
            socks[-1].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        wait_until(lambda: srv.connections == 3)
        status, _, _ = _get(srv.port, "/healthz", f"Authorization: {GatedAuth.CACHED}\r\n")
        assert status == 200
        assert socket_closed(socks[1])  # the oldest connection still reading its head
        auth.gate.release()
        assert Reader(socks[0]).response()[0] == 200  # the one being answered was kept
    finally:
        _release(srv, auth, socks)


# -- 2. credential checks: fairness, a bounded queue, equal timing -----------------------------

def test_a_login_from_another_address_is_checked_before_a_flood_from_one() -> None:
    auth = GatedAuth()
    srv = _serve(auth=auth)
    flood: list[socket.socket] = []
    try:
        for i in range(4):  # one after another, so that flood0 is the one running
            flood.append(_ask(srv.port, f"Basic flood{i}"))
            wait_until(lambda: srv.credential_checks == len(flood))
        legit = _ask(srv.port, GatedAuth.GOOD, source="127.0.0.2")
        wait_until(lambda: srv.credential_checks == 5)
        for _ in range(5):
            auth.gate.release()
        assert Reader(legit).response()[0] == 200
        # The first flood check was already running; the other address came next.
        assert auth.order[:2] == ["Basic flood0", GatedAuth.GOOD]
        for s in flood:
            assert Reader(s).response()[0] == 401
        legit.close()
    finally:
        _release(srv, auth, flood)


def test_a_full_check_queue_answers_503_with_retry_after_and_cached_logins_pass() -> None:
    auth = GatedAuth()
    limits = Limits(max_checks_per_peer=2, max_checks=3, head_timeout_s=5.0)
    srv = _serve(limits=limits, auth=auth)
    socks: list[socket.socket] = []
    try:
        for i in range(2):
            socks.append(_ask(srv.port, f"Basic wrong{i}"))
        wait_until(lambda: srv.credential_checks == 2)
        # This address has its two checks waiting: a third is refused at once, not queued.
        with _ask(srv.port, "Basic wrong2") as s:
            status, headers, _ = Reader(s).response()
            assert status == 503 and int(headers["retry-after"]) >= 1
        socks.append(_ask(srv.port, "Basic other", source="127.0.0.2"))
        wait_until(lambda: srv.credential_checks == 3)
        with _ask(srv.port, "Basic third", source="127.0.0.3") as s:  # the queue is full
            assert Reader(s).response()[0] == 503
        # A credential that already passed never waits for the queue.
        assert _get(srv.port, headers=f"Authorization: {GatedAuth.CACHED}\r\n")[0] == 200
        for _ in range(3):
            auth.gate.release()
        assert [Reader(s).response()[0] for s in socks] == [401, 401, 401]
        assert srv.credential_checks == 0
    finally:
        _release(srv, auth, socks)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _hash(password: str, cost: int) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode()


class CountingAuth(Authenticator):
    """The real :class:`BasicAuth`, counting the checks that began before a given one."""

    def __init__(self, inner: BasicAuth, watch: str) -> None:
        self.inner, self.watch = inner, watch
        self.started = 0
        self.ahead: int | None = None

    def cached(self, authorization: str | None) -> bool | None:
        return self.inner.cached(authorization)

    def check(self, authorization: str | None) -> bool:
        if authorization == self.watch and self.ahead is None:
            self.ahead = self.started
        self.started += 1
        return self.inner.check(authorization)

    def failure_floor_s(self) -> float:
        return self.inner.failure_floor_s()


def test_a_first_login_is_answered_quickly_under_a_flood_of_wrong_passwords() -> None:
    """48 connections from one address, each with three wrong passwords pipelined, against
    cost-10 hashes; a correct login from another address waits for a check or two, not for
    the 48 queued before it."""
    right = _basic("prometheus", "scrape")
    auth = CountingAuth(BasicAuth({"prometheus": _hash("scrape", 10)}), right)
    srv = _serve(limits=Limits(max_connections=64), auth=auth)
    wrong = "".join(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: "
                    f"{_basic('prometheus', f'guess{i}')}\r\n\r\n" for i in range(3)).encode()
    flood = [_connect(srv.port) for _ in range(48)]
    try:
        for s in flood:
            s.sendall(wrong)
        wait_until(lambda: auth.started >= 1)
        started = time.monotonic()
        status, _, _ = _get(srv.port, headers=f"Authorization: {right}\r\n", source="127.0.0.2")
        took = time.monotonic() - started
        assert status == 200
        assert auth.ahead is not None and auth.ahead <= 4, auth.ahead
        assert took < 10  # Prometheus's default scrape timeout; ~0.1-0.3 s measured
    finally:
        for s in flood:
            s.close()
        srv.stop()


def test_an_unknown_user_is_checked_against_the_costliest_hash(monkeypatch) -> None:
    auth = BasicAuth({"cheap": _hash("a", 4), "dear": _hash("b", 6)})
    costs: list[int] = []
    real = bcrypt.checkpw

    def checkpw(password: bytes, hashed: bytes) -> bool:
        costs.append(int(hashed[4:6]))
        return real(password, hashed)

    monkeypatch.setattr(webconfig.bcrypt, "checkpw", checkpw)
    assert auth.check(_basic("mallory", "b")) is False  # dear's password, no such user
    assert costs == [6]


def test_wrong_passwords_take_as_long_whatever_the_user_and_its_cost() -> None:
    """A cost-4 user's wrong password used to be answered in ~1 ms and a cost-10 user's in
    ~60 ms; now every failure waits as long as a check of the costliest hash."""
    users = {"cheap": _hash("a", 4), "dear": _hash("b", 10)}
    srv = _serve(auth=BasicAuth(users))

    def answer(user: str) -> float:
        started = time.monotonic()
        status, _, _ = _get(srv.port, headers=f"Authorization: {_basic(user, 'wrong')}\r\n")
        assert status == 401
        return time.monotonic() - started

    try:
        times: dict[str, list[float]] = {"cheap": [], "dear": [], "nobody": []}
        for _ in range(3):
            for user, got in times.items():
                got.append(answer(user))
        dear = statistics.median(times["dear"])
        assert statistics.median(times["cheap"]) > 0.6 * dear, times
        assert statistics.median(times["nobody"]) > 0.6 * dear, times
    finally:
        srv.stop()


# -- 3. the render cache -----------------------------------------------------------------------

def test_a_new_accept_version_on_every_scrape_costs_one_render() -> None:
    counting = Counting()
    registry = CollectorRegistry()
    registry.register(counting)
    srv = _serve(registry)
    try:
        with _connect(srv.port) as s:
            reader, ctypes = Reader(s), set()
            for n in range(60):
                s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/"
                          f"openmetrics-text; version=1.0.{n}\r\n\r\n".encode())
                status, headers, body = reader.response()
                assert status == 200 and body.endswith(b"# EOF\n")
                ctypes.add(headers["content-type"])
        assert ctypes == {"application/openmetrics-text; version=1.0.0; charset=utf-8; "
                          "escaping=underscores"}
        assert counting.collects == 1
    finally:
        srv.stop()


def test_the_content_type_never_carries_client_bytes() -> None:
    registry = CollectorRegistry()
    for accept in ("application/openmetrics-text; version=1\r.0.0; escaping=underscores",
                   "application/openmetrics-text; version=1.0.0\rSet-Cookie: a=b; x=y",
                   "text/plain; version=7.0.0; escaping=allow-utf-8\n",
                   "application/openmetrics-text; version=99999999999999999.0.0"):
        _, headers = render.render(registry, accept)
        assert headers["Content-Type"] in {f.content_type for f in render.FORMATS}, accept


@pytest.mark.parametrize("accept", [
    "",
    "text/plain",
    "text/plain; version=0.0.4",
    "text/plain;version=1.0.0",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=dots",
    "application/openmetrics-text",
    "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text; version=1.0.0; escaping=values",
    "application/openmetrics-text; version=0.0.1",
    "application/openmetrics-text; version=2.0.0",
    "application/json, text/html",
    # Prometheus 3's default.
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
])
def test_well_formed_accept_headers_get_what_prometheus_client_answers(accept: str) -> None:
    registry = CollectorRegistry()
    registry.register(Counting())
    registry.register(_DottedNames())
    encoder, ctype = choose_encoder(accept)
    body, headers = render.render(registry, accept)
    assert (body, headers["Content-Type"]) == (encoder(registry), ctype)


class _DottedNames:
    """A metric whose name each escaping scheme writes differently."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("mrc_test_dotted_value", "Underscores for dots.", value=1)


def test_every_format_the_cache_can_hold_is_one_of_a_fixed_set() -> None:
    assert 2 <= len(render.FORMATS) <= 16
    assert len({f.content_type for f in render.FORMATS}) == len(render.FORMATS)


# -- 4. malformed Accept -----------------------------------------------------------------------

MALFORMED = "application/openmetrics-text; version=1.a"


def test_a_malformed_accept_gets_text_and_the_connection_goes_on(
        server: ExpositionServer) -> None:
    with _connect(server.port) as s:
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: {MALFORMED}\r\n\r\n"
                  "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        reader = Reader(s)
        status, headers, _ = reader.response()
        assert status == 200
        assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert reader.response()[2] == b"ok\n"


@pytest.mark.parametrize(("accept", "answer"), [
    (MALFORMED, "text/plain; version=0.0.4"),
    ("text/plain; version=1.0.0.x", "text/plain; version=0.0.4"),
    # A quoted parameter value is well-formed (RFC 9110 5.6.6); prometheus-client raised on it.
    ('application/openmetrics-text; version="1.0.0"', "application/openmetrics-text; version=1"),
])
def test_the_services_metrics_app_answers_a_malformed_accept_with_text(accept: str,
                                                                       answer: str) -> None:
    registry = CollectorRegistry()
    registry.register(Counting())

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=metrics_app(registry))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/metrics", headers={"Accept": accept})

    resp = asyncio.run(go())
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith(answer)
    assert "mrc_test_value_ratio 0.5" in resp.text


# -- 5. bodies where none is taken -------------------------------------------------------------

@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "DELETE"])
def test_a_body_behind_a_bodiless_method_is_never_read_as_a_request(
        server: ExpositionServer, method: str) -> None:
    smuggled = b"XXXX / HTTP/1.1\r\n\r\n"
    with _connect(server.port) as s:
        s.sendall(f"{method} /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: {len(smuggled)}"
                  "\r\n\r\n".encode() + smuggled + b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        reader = Reader(s)
        first = reader.response(head_only=method == "HEAD")[0]
        assert first == (405 if method in ("PUT", "DELETE") else 200)
        status, _, body = reader.response()
        assert (status, body) == (200, b"ready\n")  # the next real request, not "XXXX"


@pytest.mark.parametrize(("head", "status"), [
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"14\r\nXXXX / HTTP/1.1\r\n\r\n\r\n0\r\n\r\n", 400),
    (b"DELETE /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\nXXXX", 413),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 3, 3\r\n\r\nabc", 400),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\rb\r\n\r\n", 400),
])
def test_a_body_that_cannot_be_skipped_is_refused_and_the_connection_closed(
        server: ExpositionServer, head: bytes, status: int) -> None:
    with _connect(server.port) as s:
        s.sendall(head)
        got, headers, _ = Reader(s).response()
        assert (got, headers["connection"]) == (status, "close")
        assert socket_closed(s)


# -- 6. Accept-Encoding ------------------------------------------------------------------------

@pytest.mark.parametrize(("accept_encoding", "gzipped"), [
    ("gzip", True), ("GZIP", True), ("deflate, gzip;q=0.5", True), ("gzip ; q=1.0", True),
    ("gzip;q=0", False), ("gzip; q=0.000", False), ("identity, gzip;q=0", False),
    ("gzipped", False), ("", False), ("x-gzip-not", False),
])
def test_gzip_only_when_accepted_with_a_positive_weight(accept_encoding: str,
                                                        gzipped: bool) -> None:
    assert render.wants_gzip(accept_encoding) is gzipped


def test_the_server_does_not_gzip_for_q_zero(server: ExpositionServer) -> None:
    _, headers, body = _get(server.port, headers="Accept-Encoding: gzip;q=0\r\n")
    assert "content-encoding" not in headers and not body.startswith(b"\x1f\x8b")
    _, headers, body = _get(server.port, headers="Accept-Encoding: gzip\r\n")
    assert headers["content-encoding"] == "gzip" and body.startswith(b"\x1f\x8b")
