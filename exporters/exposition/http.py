"""HTTP exposition server: ``/metrics`` (Prometheus text or OpenMetrics, gzip when asked),
``/healthz`` (live) and ``/readyz`` (sampling current; 503 with the reason otherwise), plus
optional extra :class:`Routes` (the agent's Alertmanager webhook and captures).

One asyncio event loop in one thread serves every connection: no thread per connection, no
polling (an idle agent's loop sleeps until a packet or a timer), and a hard cap on connections
(:class:`Limits`): at the cap, of the client address holding the most connections, the one
that has waited longest for a request to finish arriving — idle between requests, or
part-way through its request head — is closed to make room; only one whose request is being
answered is kept. So neither a flood of idle connections nor one of slow heads (a request
line and nothing more) can exhaust memory or lock Prometheus out, and a flood from a few
addresses that reconnects as fast as it is closed closes its own connections, not a
scraper's kept-alive one. Every read is bounded in bytes and time — request head, body, idle
keep-alive — and a slow reader cannot hold a write forever. HTTP/1.1 connections stay open
unless the client says ``close``; HTTP/1.0 ones only when the client asks for ``keep-alive``,
and the answer says so.

Requests are paced per client address (:mod:`mrc_agent.exporters.pacing`; an IPv6 client by its /64,
as the credential checks count): once a request line arrives, the server reads no further until the
address's budget allows it, so a client that loops on cheap requests — a 16 KiB head, a wrong
password, a 503 — is slowed by TCP's flow control at the cost of a timer, never refused, and one
that reconnects finds the same budget. Idle connections cost nothing; a 503 from the full check
queue costs two requests. Pacing does not help against many addresses (each has a budget of its own)
and slows everyone behind one address together (a NAT): the connection cap and the per-address check
queue are what bound those.

The rendered body is cached per snapshot (:mod:`mrc_agent.exporters.exposition.render_cache`), so
fifty scrapers of one snapshot cost one render; a scrape never touches hardware, and the
``Content-Type`` is one of a fixed set, never the client's bytes. The socket is bound in the
constructor so that "address in use" surfaces before the agent starts sampling.

No byte of a request body is ever read as a request. Where a method takes no body (all but
POST to the extra routes), a small declared ``Content-Length`` is read and dropped; a bigger
one (413), an unreadable one (400) or any ``Transfer-Encoding`` (400) is refused and the
connection closed after a lingering close. A header carrying a bare CR, NUL or other control
character is refused (400), as RFC 9112 lets a server do.

Extra routes see a plain :class:`Request` and answer a :class:`Response`, in a worker thread
(they may read files). A request body is read only when it declares a ``Content-Length``
within the routes' ``max_body_bytes``; otherwise the answer is 411/413/400 and the connection
closes after a *lingering close* (the unread body is drained for a short while), so the
client reads the answer instead of a connection reset.

Transport security and access come in already built (the agent reads them from the exporter-toolkit
web configuration file): an ``ssl.SSLContext`` for TLS (the handshake is bounded by the head
timeout), an :class:`Authenticator` that every request, on every path, must pass (401 with
``WWW-Authenticate: Basic`` otherwise, as exporter-toolkit answers), and headers added to every
response. :meth:`ExpositionServer.reconfigure` swaps them while serving. A credential that passed
before is answered on the loop at once; the others wait in a
:class:`~mrc_agent.exporters.exposition.checks.CheckQueue` (client addresses in turn, bounded: 503
with ``Retry-After`` when full) for the one check thread. A failed check is answered no sooner than
the authenticator's ``failure_floor_s`` after it began — a sleep on the loop, not in the thread — so
that a wrong password takes as long for every user.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from http import HTTPStatus
from typing import Protocol

from prometheus_client.registry import CollectorRegistry

from mrc_agent.exporters.exposition.checks import CheckQueue, peer_key
from mrc_agent.exporters.exposition.limits import Limits
from mrc_agent.exporters.exposition.render_cache import RenderCache
from mrc_agent.exporters.pacing import AddressBudgets, TokenBucket
from mrc_agent.exporters.render import negotiate, wants_gzip

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Request:
    """What an extra route sees: method, path as sent (query removed), lower-cased headers."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes = b""


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class Routes(Protocol):
    """Extra endpoints served beside ``/metrics``."""

    #: Largest request body read; a bigger declared ``Content-Length`` gets 413 unread.
    max_body_bytes: int

    def handle(self, request: Request) -> Response | None:
        """The response, or None when the path is not one of these routes (the server then
        answers 404 to GET/HEAD and 405 to POST, as without routes)."""
        ...

    # Optional: ``checks_own_bearer(path) -> bool``, True for paths whose requests carry a
    # bearer token that :meth:`handle` checks; basic auth then does not apply to them.


class Authenticator(Protocol):
    """Decides whether a request's ``Authorization`` header lets it in."""

    def cached(self, authorization: str | None) -> bool | None:
        """The answer when it costs nothing (no credentials, malformed ones, a check that
        already passed); None when only :meth:`check` can tell."""
        ...

    def check(self, authorization: str | None) -> bool:
        """The full check. It may take tens of milliseconds (bcrypt), so the server runs it
        in its own worker thread, never on the event loop."""
        ...

    # Optional: ``failure_floor_s() -> float``, the least time from the start of a failed
    # check to its answer; the server waits out the rest on the loop.


_INDEX = b"""<html><head><title>mrc-agent</title></head><body><h1>mrc-agent</h1>
<p><a href="/metrics">/metrics</a> &middot; <a href="/healthz">/healthz</a> &middot;
<a href="/readyz">/readyz</a></p></body></html>
"""
_TEXT = "text/plain; charset=utf-8"
#: Methods that take no body here (POST without routes is answered 405 and drained).
_BODILESS = ("GET", "HEAD", "PUT", "DELETE", "PATCH")
#: Control characters other than horizontal tab: never in a header line (RFC 9110 5.5).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Head:
    method: str
    target: str
    version: str
    headers: dict[str, str]

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.1":
            return "close" not in tokens
        return "keep-alive" in tokens


@dataclass
class _Conn:
    writer: asyncio.StreamWriter
    #: Its client address's request budget, shared with that address's other connections.
    budget: TokenBucket
    #: Its client address (:func:`~mrc_agent.exporters.exposition.checks.peer_key`).
    who: str = ""
    #: Set when the cap closes it, so that a connection waiting for its address's budget
    #: ends at once instead of holding its task and transport until the wait is over.
    evicted: asyncio.Event = field(default_factory=asyncio.Event)


class ExpositionServer:
    """The agent's HTTP server. ``port`` 0 picks a free port."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        version: Callable[[], int],
        not_ready: Callable[[], str | None],
        routes: Routes | None = None,
        limits: Limits = Limits(),  # noqa: B008 - frozen, immutable
        *,
        tls: ssl.SSLContext | None = None,
        auth: Authenticator | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._cache = RenderCache(registry, version)
        self._not_ready = not_ready
        self._routes = routes
        self.limits = limits
        self._tls = tls
        self._auth = auth
        self._headers = dict(headers or {})
        # One thread for the slow credential checks, fed in turns by client address and
        # bounded; the loop goes on answering credentials that passed before.
        self._checks = CheckQueue(limits.max_checks_per_peer, limits.max_checks)
        self._budgets = AddressBudgets(limits.pace_rate, limits.pace_burst,
                                       limits.max_paced_addresses)
        self._listener: asyncio.Server | None = None
        host = host.strip("[]")  # "[::1]" or "::1": an IPv6 address either way
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)  # 50+ concurrent scrapers must not see refused connects
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._conns: dict[int, _Conn] = {}
        # The connections not being answered, by client address, each address's oldest first.
        self._waiting: dict[str, dict[int, _Conn]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._conns)

    @property
    def handlers(self) -> int:
        """Connection handlers still running: the open connections, and closed ones whose
        handler has not yet returned (for a moment after the close)."""
        return len(self._tasks)

    @property
    def credential_checks(self) -> int:
        """Credential checks waiting or running now."""
        return len(self._checks)

    def reconfigure(self, tls: ssl.SSLContext | None, auth: Authenticator | None,
                    headers: Mapping[str, str] | None) -> None:
        """Serve new connections with ``tls`` and every next request with ``auth`` and
        ``headers`` (SIGHUP). Connections already open keep the TLS session they have."""
        self._auth, self._headers = auth, dict(headers or {})
        if tls is self._tls:
            return
        self._tls = tls
        loop = self._loop
        if loop is not None and not loop.is_closed() and self._listener is not None:
            asyncio.run_coroutine_threadsafe(self._relisten(), loop).result(10)

    # -- life ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mrc-agent-http", daemon=True)
        self._thread.start()
        self._started.wait(10)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.run_until_complete(self._checks.close())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
            self._sock.close()

    async def _listen(self) -> asyncio.Server:
        """An asyncio server on a duplicate of the bound socket, so that :meth:`_relisten`
        can close it without closing the port (connections wait in the backlog meanwhile)."""
        tls = self._tls
        return await asyncio.start_server(
            self._client, sock=self._sock.dup(), limit=self.limits.max_head_bytes, ssl=tls,
            ssl_handshake_timeout=self.limits.head_timeout_s if tls is not None else None)

    async def _relisten(self) -> None:
        new = await self._listen()
        old, self._listener = self._listener, new
        if old is not None:
            old.close()  # stops accepting; its connections stay open

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        self._listener = await self._listen()
        self._started.set()
        try:
            await self._stopped.wait()
        finally:
            if self._listener is not None:
                self._listener.close()
            for conn in list(self._conns.values()):
                conn.writer.close()  # their reads see the end and the handlers return
            if self._tasks:
                _, late = await asyncio.wait(list(self._tasks), timeout=2.0)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
            # Transports close their sockets in callbacks: let those run before the loop ends.
            for _ in range(3):
                await asyncio.sleep(0)
        # The bound socket itself is closed when the loop has ended (_run).

    def stop(self) -> None:
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stopped.set)
        if self._thread is not None:
            self._thread.join(10)
        else:
            self._sock.close()

    # -- one connection ------------------------------------------------------------------------
    def _unwait(self, conn: _Conn) -> None:
        queue = self._waiting.get(conn.who)
        if queue is not None:
            queue.pop(id(conn), None)
            if not queue:
                del self._waiting[conn.who]

    def _make_room(self) -> None:
        """At the cap, close a connection waiting for its request — idle, or part-way through
        its head — never one being answered: of the client address holding the most
        connections, the one that has waited longest. A head that has not arrived whole costs
        the server nothing to drop, and protecting it would let a client that sends request
        lines alone hold every slot; choosing by address first means a flood from a few
        addresses that reconnects as fast as it is closed (5,000 a second on loopback) closes
        its own connections, not a scraper's kept-alive one idle between two scrapes."""
        if len(self._conns) < self.limits.max_connections or not self._waiting:
            return
        # Every address in the table has a waiting connection (empty ones are dropped), each
        # address's in the order they began to wait: the first is its oldest, without a scan.
        who = max(self._waiting, key=self._budgets.connections)
        oldest = next(iter(self._waiting[who].values()))
        oldest.writer.close()
        oldest.evicted.set()
        self._conns.pop(id(oldest), None)
        self._unwait(oldest)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._make_room()
        if len(self._conns) >= self.limits.max_connections:
            writer.close()  # every connection is busy: refuse this one
            return
        who = peer_key(writer.get_extra_info("peername"))
        conn = _Conn(writer, self._budgets.opened(who), who)
        self._conns[id(conn)] = conn
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                # Headers and body go out in one write, but a kept-alive scrape must never wait
                # for the client's delayed ACK.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = writer.get_extra_info("peername")
        try:
            first = True
            while True:
                self._unwait(conn)
                self._waiting.setdefault(who, {})[id(conn)] = conn
                wait = self.limits.head_timeout_s if first else self.limits.idle_timeout_s
                try:
                    line = await asyncio.wait_for(reader.readline(), wait)
                except (TimeoutError, asyncio.TimeoutError):
                    break
                except ValueError:  # a request line longer than the head limit
                    await self._send(writer, None, 414, b"request line too long\n", _TEXT,
                                     close=True)
                    break
                if not line:
                    break
                # A request costs its address a token once it begins (an idle connection
                # costs none; a stray line break one); when they are spent it waits its turn,
                # unread and evictable, while TCP holds the client back.
                pause = conn.budget.reserve()
                if pause:
                    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                        await asyncio.wait_for(conn.evicted.wait(), pause)
                    if writer.is_closing():  # evicted while it waited
                        break
                if not line.strip():
                    continue  # stray line breaks between requests are allowed (RFC 9112 2.2)
                first = False
                if not await self._one(conn, reader, writer, line, who):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError,
                asyncio.TimeoutError) as exc:
            log.debug("%s: connection ended: %s", peer, exc)
        finally:
            self._conns.pop(id(conn), None)
            self._unwait(conn)
            self._budgets.closed(who)
            if task is not None:
                self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _one(self, conn: _Conn, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter, first_line: bytes, who: str) -> bool:
        """Serve one request; False when the connection must close afterwards."""
        try:
            head = await asyncio.wait_for(self._read_head(reader, first_line),
                                          self.limits.head_timeout_s)
        except _BadRequest as exc:
            await self._send(writer, None, exc.status, f"{exc}\n".encode(), _TEXT, close=True)
            return False
        except (TimeoutError, asyncio.TimeoutError):
            await self._send(writer, None, 408, b"request head too slow\n", _TEXT, close=True)
            return False
        self._unwait(conn)
        keep = head.keep_alive()
        method = head.method
        auth = self._auth  # once: a reload may swap it meanwhile
        if auth is not None and not self._checked_by_route(head):
            verdict = await self._authorized(auth, head, who)
            if verdict is not True:
                # Every path, as exporter-toolkit guards them; a body is never read for a
                # stranger, nor while the checks are too busy to tell.
                length = head.headers.get("content-length", "0").strip()
                body_follows = "transfer-encoding" in head.headers or length != "0"
                if verdict is None:
                    # Twice the cost: the address already has its checks queued, so more
                    # requests from it now are waste (and Retry-After asks for a second).
                    conn.budget.reserve()
                    status, text, extra = 503, b"credential checks busy, retry\n", {
                        "Retry-After": "1"}
                else:
                    if head.headers.get("authorization"):
                        # A wrong password (not a request without one, which a client sends
                        # first to learn that it needs one): see Limits.failed_login_cost.
                        conn.budget.reserve(self.limits.failed_login_cost)
                    status, text, extra = 401, b"unauthorized\n", {
                        "WWW-Authenticate": 'Basic realm="mrc-agent"'}
                await self._send(writer, head, status, text, _TEXT, extra,
                                 close=body_follows or not keep)
                if body_follows:
                    await self._linger(reader, writer)
                    return False
                return keep
        if method in _BODILESS:
            refused = await self._skip_body(reader, head)
            if refused is not None:
                await self._send(writer, head, refused.status, refused.body,
                                 refused.content_type, close=True)
                await self._linger(reader, writer)
                return False
        if method in ("GET", "HEAD"):
            status, body, ctype, extra = await self._get(head)
        elif method == "POST" and self._routes is None:
            # Nothing takes a body here: answer without reading it, then drain and close.
            await self._send(writer, head, 405, b"method not allowed\n", _TEXT,
                             {"Allow": "GET, HEAD"}, close=True)
            await self._linger(reader, writer)
            return False
        elif method == "POST":
            got = await self._read_body(reader, head)
            if isinstance(got, Response):
                await self._send(writer, head, got.status, got.body, got.content_type,
                                 got.headers, close=True)
                await self._linger(reader, writer)
                return False
            status, body, ctype, extra = await self._post(head, got)
        elif method in ("PUT", "DELETE", "PATCH"):
            status, body, ctype, extra = (405, b"method not allowed\n", _TEXT,
                                          {"Allow": "GET, HEAD"})
        else:
            status, body, ctype, extra = 501, b"not implemented\n", _TEXT, {}
            keep = False
        await self._send(writer, head, status, body, ctype, extra, close=not keep)
        return keep

    def _checked_by_route(self, head: _Head) -> bool:
        """Whether a route checks this request's credential itself: a bearer token sent to a
        path of routes that guard themselves with one (Alertmanager's webhook config sends a
        single credential, so the webhook cannot carry basic auth as well). Everywhere else,
        and without a bearer token, the web configuration's basic auth applies."""
        own = getattr(self._routes, "checks_own_bearer", None)
        bearer = head.headers.get("authorization", "")[:7].lower() == "bearer "
        return bool(bearer and own is not None and own(head.path))

    async def _authorized(self, auth: Authenticator, head: _Head, who: str) -> bool | None:
        """Whether ``head``'s credentials pass ``auth``: at once when the answer is cached,
        else in the server's credential-check thread (bcrypt must not stall the loop), in
        ``who``'s turn. None when the check queue has no room for ``who``."""
        header = head.headers.get("authorization")
        try:
            quick = auth.cached(header)
            if quick is not None:
                return quick
            pending = self._checks.submit(who, partial(auth.check, header))
            if pending is None:
                return None
            ok, started = await pending
        except Exception:  # a bug in the check refuses the request, never kills the server
            log.exception("credential check failed")
            return False
        if not ok:
            # Wait out the floor here, not in the thread: the next check need not wait.
            floor = getattr(auth, "failure_floor_s", None)
            left = started + (floor() if floor is not None else 0.0) - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)
        return ok

    async def _read_head(self, reader: asyncio.StreamReader, first_line: bytes) -> _Head:
        try:
            line = first_line.decode("latin-1").rstrip("\r\n")
            method, target, version = line.split(" ")
        except ValueError:
            raise _BadRequest(400, "bad request line") from None
        if version not in ("HTTP/1.0", "HTTP/1.1"):
            raise _BadRequest(505, "HTTP/1.0 or HTTP/1.1 only")
        if not method.isascii() or not method.isalpha() or not target.startswith("/"):
            raise _BadRequest(400, "bad request line")
        headers: dict[str, str] = {}
        size = len(first_line)
        for _ in range(self.limits.max_headers + 1):
            try:
                raw = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError):
                raise _BadRequest(431, "request header too large") from None
            size += len(raw)
            if size > self.limits.max_head_bytes:
                raise _BadRequest(431, "request headers too large")
            if not raw.endswith(b"\n"):
                raise ConnectionError("client closed in the request head")
            text = raw.decode("latin-1").rstrip("\r\n")
            if not text:
                break
            if _CONTROL.search(text):
                # A bare CR could end a header for one reader and not another (RFC 9112 2.2).
                raise _BadRequest(400, "control character in a header")
            name, sep, value = text.partition(":")
            if not sep or not name or name != name.strip():
                raise _BadRequest(400, "bad header line")
            key = name.lower()
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        else:
            raise _BadRequest(431, "too many request headers")
        if "content-length" in headers and "transfer-encoding" in headers:
            # Two framings disagree: a request-smuggling attempt behind some proxies.
            raise _BadRequest(400, "both Content-Length and Transfer-Encoding")
        return _Head(method, target, version, headers)

    async def _read_body(self, reader: asyncio.StreamReader, head: _Head) -> bytes | Response:
        assert self._routes is not None
        limit = self._routes.max_body_bytes
        length = head.headers.get("content-length")
        if length is None:
            if head.headers.get("transfer-encoding"):
                return Response(411, b"Content-Length required\n", _TEXT)
            return b""
        if not (length.isascii() and length.isdigit()) or len(length) > 18:
            return Response(400, b"bad Content-Length\n", _TEXT)
        n = int(length)
        if n > limit:
            return Response(413, b"request body too large\n", _TEXT)
        try:
            return await asyncio.wait_for(reader.readexactly(n), self.limits.body_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            return Response(408, b"request body too slow\n", _TEXT)

    async def _skip_body(self, reader: asyncio.StreamReader, head: _Head) -> Response | None:
        """Read and drop the body of a request whose method takes none here, so that no byte
        of it is read as the next request; the refusal when it cannot be skipped safely (the
        connection then closes)."""
        if "transfer-encoding" in head.headers:
            return Response(400, b"a request body is not taken here\n", _TEXT)
        length = head.headers.get("content-length")
        if length is None or length == "0":
            return None
        if not (length.isascii() and length.isdigit()) or len(length) > 18:
            return Response(400, b"bad Content-Length\n", _TEXT)
        n = int(length)
        if n > self.limits.max_skipped_body_bytes:
            return Response(413, b"request body too large\n", _TEXT)
        try:
            await asyncio.wait_for(reader.readexactly(n), self.limits.body_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            return Response(408, b"request body too slow\n", _TEXT)
        return None

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """After an early answer, drain what the client still sends for a short while, so it
        reads the answer instead of a reset."""
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
        left = self.limits.linger_bytes
        deadline = time.monotonic() + self.limits.linger_s
        with contextlib.suppress(ConnectionError, TimeoutError, asyncio.TimeoutError):
            while left > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                chunk = await asyncio.wait_for(reader.read(min(left, 1 << 16)), remaining)
                if not chunk:
                    break
                left -= len(chunk)

    async def _get(self, head: _Head) -> tuple[int, bytes, str, dict[str, str]]:
        path = head.path
        if path == "/metrics":
            gz = wants_gzip(head.headers.get("accept-encoding", ""))
            fmt = negotiate(head.headers.get("accept", ""))
            return (200, self._cache.render(fmt, gz), fmt.content_type,
                    {"Content-Encoding": "gzip"} if gz else {})
        if path == "/healthz":
            return 200, b"ok\n", _TEXT, {}
        if path == "/readyz":
            reason = self._not_ready()
            if reason is None:
                return 200, b"ready\n", _TEXT, {}
            return 503, f"not ready: {reason}\n".encode(), _TEXT, {}
        if path == "/":
            return 200, _INDEX, "text/html; charset=utf-8", {}
        resp = await self._route(head, b"")
        if resp is None:
            return 404, b"not found\n", _TEXT, {}
        return resp.status, resp.body, resp.content_type, resp.headers

    async def _post(self, head: _Head, body: bytes) -> tuple[int, bytes, str, dict[str, str]]:
        resp = await self._route(head, body)
        if resp is None:
            return 405, b"method not allowed\n", _TEXT, {"Allow": "GET, HEAD"}
        return resp.status, resp.body, resp.content_type, resp.headers

    async def _route(self, head: _Head, body: bytes) -> Response | None:
        """Let the extra routes answer (in a worker thread); None when they do not know the
        path."""
        if self._routes is None:
            return None
        request = Request(head.method, head.path, dict(head.headers), body)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, self._routes.handle, request)
        except Exception:  # a bug in a route must not kill the server
            log.exception("%s %s failed", head.method, head.path)
            return Response(500, b"internal error\n", _TEXT)

    async def _send(self, writer: asyncio.StreamWriter, head: _Head | None, status: int,
                    body: bytes, ctype: str, extra: Mapping[str, str] | None = None, *,
                    close: bool) -> None:
        version = head.version if head is not None else "HTTP/1.1"
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        lines = [f"HTTP/1.1 {status} {reason}", "Server: mrc-agent",
                 f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
        extra = extra or {}
        lines += [f"{k}: {v}" for k, v in extra.items()]
        # The configured headers, unless the answer sets its own (as a Go handler may).
        own = {k.lower() for k in extra}
        lines += [f"{k}: {v}" for k, v in self._headers.items() if k.lower() not in own]
        if close:
            lines.append("Connection: close")
        elif version == "HTTP/1.0":
            lines.append("Connection: keep-alive")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        writer.write(data if head is not None and head.method == "HEAD" else data + body)
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
