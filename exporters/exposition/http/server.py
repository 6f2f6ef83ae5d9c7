"""HTTP exposition server: ``/metrics`` (Prometheus text or OpenMetrics, gzip when asked),
``/healthz`` (live) and ``/readyz`` (sampling current; 503 with the reason otherwise), plus
optional extra :class:`Routes` (the agent's Alertmanager webhook and captures).

One asyncio event loop in one thread serves every connection: no thread per connection, no
polling (an idle agent's loop sleeps until a packet or a timer), and a hard cap on connections
(:class:`Limits`; which one makes room: :mod:`~mrc_agent.exporters.exposition.http.connections`).
So neither a flood of idle connections nor one of slow heads (a request line and nothing more)
can exhaust memory or lock Prometheus out. Every read is bounded in bytes and time — request
head, body, idle keep-alive — and a slow reader cannot hold a write forever. Requests are
parsed by h11 (:mod:`~mrc_agent.exporters.exposition.http.wire`). HTTP/1.1 connections stay open
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
connection closed after a lingering close.

Extra routes (:class:`Routes`) see a plain :class:`Request` and answer a :class:`Response`, in
a worker thread (they may read files). A request body is read only when it declares a
``Content-Length`` within the routes' ``max_body_bytes``; otherwise the answer is 411/413/400
and the connection closes after a *lingering close* (the unread body is drained for a short
while), so the client reads the answer instead of a connection reset.

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
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial

from prometheus_client.registry import CollectorRegistry

from mrc_agent.exporters.exposition.checks import CheckQueue, peer_key
from mrc_agent.exporters.exposition.http.connections import Conn, Connections
from mrc_agent.exporters.exposition.http.routes import Authenticator, Request, Response, Routes
from mrc_agent.exporters.exposition.http.wire import (
    BadRequest,
    Head,
    Wire,
    linger,
    response_head,
)
from mrc_agent.exporters.exposition.limits import Limits
from mrc_agent.exporters.exposition.render_cache import RenderCache
from mrc_agent.exporters.pacing import AddressBudgets
from mrc_agent.exporters.render import negotiate, wants_gzip

log = logging.getLogger(__name__)

_INDEX = b"""<html><head><title>mrc-agent</title></head><body><h1>mrc-agent</h1>
<p><a href="/metrics">/metrics</a> &middot; <a href="/healthz">/healthz</a> &middot;
<a href="/readyz">/readyz</a></p></body></html>
"""
_TEXT = "text/plain; charset=utf-8"
#: Methods that take no body here (POST without routes is answered 405 and drained).
_BODILESS = ("GET", "HEAD", "PUT", "DELETE", "PATCH")

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
        self._conns = Connections(limits.max_connections, self._budgets.connections)
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
            for conn in self._conns.all():
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
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        who = peer_key(writer.get_extra_info("peername"))
        conn = self._conns.admit(lambda: Conn(writer, self._budgets.opened(who), who))
        if conn is None:
            writer.close()  # every connection is busy: refuse this one
            return
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
        wire = Wire(reader, self.limits)
        try:
            first = True
            while True:
                self._conns.waits(conn)
                wait = self.limits.head_timeout_s if first else self.limits.idle_timeout_s
                try:
                    arrived = await asyncio.wait_for(wire.arrive(), wait)
                except (TimeoutError, asyncio.TimeoutError):
                    break
                if arrived is False:
                    break
                # A request costs its address a token once it begins (an idle connection
                # costs none; stray line breaks one); when they are spent it waits its turn,
                # unread and evictable, while TCP holds the client back.
                pause = conn.budget.reserve()
                if pause:
                    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                        await asyncio.wait_for(conn.evicted.wait(), pause)
                    if writer.is_closing():  # evicted while it waited
                        break
                if arrived is None:
                    continue
                first = False
                if not await self._one(conn, wire, reader, writer, who):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError,
                asyncio.TimeoutError) as exc:
            log.debug("%s: connection ended: %s", peer, exc)
        finally:
            self._conns.closed(conn)
            self._budgets.closed(who)
            if task is not None:
                self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _one(self, conn: Conn, wire: Wire, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter, who: str) -> bool:
        """Serve one request; False when the connection must close afterwards."""
        try:
            head = wire.begin()
            if head is None:  # the rest of the head is still on its way
                head = await asyncio.wait_for(wire.rest(), self.limits.head_timeout_s)
        except BadRequest as exc:
            await self._send(writer, None, exc.status, f"{exc}\n".encode(), _TEXT, close=True)
            return False
        except (TimeoutError, asyncio.TimeoutError):
            await self._send(writer, None, 408, b"request head too slow\n", _TEXT, close=True)
            return False
        self._conns.answers(conn)
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
                wire.done()
                return keep
        if method in _BODILESS:
            refused = await self._skip_body(wire, head)
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
            got = await self._read_body(wire, head)
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

    def _checked_by_route(self, head: Head) -> bool:
        """Whether a route checks this request's credential itself: a bearer token sent to a
        path of routes that guard themselves with one (Alertmanager's webhook config sends a
        single credential, so the webhook cannot carry basic auth as well). Everywhere else,
        and without a bearer token, the web configuration's basic auth applies."""
        bearer = head.headers.get("authorization", "")[:7].lower() == "bearer "
        return bool(bearer and self._routes is not None
                    and self._routes.checks_own_bearer(head.path))

    async def _authorized(self, auth: Authenticator, head: Head, who: str) -> bool | None:
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
            left = started + auth.failure_floor_s() - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)
        return ok

    def _declared_length(self, head: Head) -> int | None:
        """The body length the head declares (h11 has checked its digits), or None."""
        length = head.headers.get("content-length")
        return None if length is None else int(length)

    async def _read_body(self, wire: Wire, head: Head) -> bytes | Response:
        assert self._routes is not None
        n = self._declared_length(head)
        if n is None:
            if head.headers.get("transfer-encoding"):
                return Response(411, b"Content-Length required\n", _TEXT)
            wire.done()
            return b""
        if n > self._routes.max_body_bytes:
            return Response(413, b"request body too large\n", _TEXT)
        try:
            return await wire.body(n, self.limits.body_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            return Response(408, b"request body too slow\n", _TEXT)

    async def _skip_body(self, wire: Wire, head: Head) -> Response | None:
        """Read and drop the body of a request whose method takes none here, so that no byte
        of it is read as the next request; the refusal when it cannot be skipped safely (the
        connection then closes)."""
        if "transfer-encoding" in head.headers:
            return Response(400, b"a request body is not taken here\n", _TEXT)
        n = self._declared_length(head) or 0
        if n > self.limits.max_skipped_body_bytes:
            return Response(413, b"request body too large\n", _TEXT)
        try:
            await wire.body(n, self.limits.body_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            return Response(408, b"request body too slow\n", _TEXT)
        return None

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await linger(reader, writer, self.limits.linger_s, self.limits.linger_bytes)

    async def _get(self, head: Head) -> tuple[int, bytes, str, dict[str, str]]:
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

    async def _post(self, head: Head, body: bytes) -> tuple[int, bytes, str, dict[str, str]]:
        resp = await self._route(head, body)
        if resp is None:
            return 405, b"method not allowed\n", _TEXT, {"Allow": "GET, HEAD"}
        return resp.status, resp.body, resp.content_type, resp.headers

    async def _route(self, head: Head, body: bytes) -> Response | None:
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

    async def _send(self, writer: asyncio.StreamWriter, head: Head | None, status: int,
                    body: bytes, ctype: str, extra: Mapping[str, str] | None = None, *,
                    close: bool) -> None:
        data = response_head(status, ctype, len(body), extra or {}, self._headers, close=close,
                             http10=head is not None and head.version == "HTTP/1.0")
        writer.write(data if head is not None and head.method == "HEAD" else data + body)
        if writer.transport.get_write_buffer_size():  # what the socket did not take at once
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
