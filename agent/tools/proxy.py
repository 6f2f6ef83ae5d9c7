"""``mrc-agent proxy``: the OpenAI meter as a streaming reverse proxy, for any server.

TGI and Triton are not Python and take no ASGI middleware; the proxy sits in front of them (or of
anything speaking HTTP/1.1) and hands every ``POST /v1/chat/completions`` and ``/v1/completions``
it forwards to the meter (:mod:`mrc_agent.exporters.instrumentation.meter`), whose families it
serves on ``--metrics-listen`` with the agent's exposition server.

What it does to the traffic, and what it does not:

* **bytes** — bodies and events pass byte for byte, each chunk forwarded as soon as it is read
  (no buffering: a stream's events reach the client as the upstream writes them); the request
  line's target is passed as received;
* **headers** — the hop-by-hop ones (RFC 9110 §7.6.1: ``Connection`` and every header it names,
  ``Keep-Alive``, ``Proxy-Connection``, ``TE``, ``Transfer-Encoding``, ``Upgrade``) are removed
  first, and each hop frames its own message (a chunked request stays chunked; a
  ``Content-Length`` frames the body even when ``Connection`` names it); ``Host`` names the
  upstream, as nginx sends it; ``X-Forwarded-For`` is appended to, ``X-Forwarded-Proto`` and
  ``-Host`` are replaced by the proxy's view (nginx's ``proxy_set_header``), never the client's;
* **framing** — as a strict HTTP/1.1 intermediary (RFC 9112 §6.3): a request with both
  ``Content-Length`` and ``Transfer-Encoding`` is refused with 400 and its connection closed, as
  nginx and Envoy do (a server behind that reads the other length would see a smuggled request);
  an answer with both, or with a chunk size line that is not 1-16 hex digits and visible
  extensions, is a 502 when none of it reached the client (the connection is cut otherwise) and
  counts as the upstream's error; an answer to HEAD, a 204 or a 304 has no body whatever its
  headers say. An upstream connection goes back to the pool only when its answer ended exactly
  at a message boundary with no byte left over, and a pooled one that receives any byte is
  closed: bytes past an answer are never read as the next client's;
* **back-pressure** — both ways: a chunk is read only after the previous one was written and
  drained, so a slow reader slows its writer instead of filling memory;
* **a client that leaves** — closes the upstream connection at once, which vLLM, SGLang and TGI
  take as an abort of the request;
* **an upstream that is down** — 502 with an OpenAI-shaped error body, counted (outcome
  ``error``); one that fails mid-answer closes the client's connection, so the client sees a
  truncated answer rather than a complete-looking one;
* **limits** — none on bodies or durations of its own: the upstream's limits decide; a request
  head is at most 64 KiB (twice uvicorn's; its blank line included, however it arrives; 431
  past it) and must arrive whole within ``head_timeout``; at most ``max_connections`` client
  connections are open: at the cap the one that has waited longest for a request head (idle,
  or part-way through one) is closed to make room, and when every one is being answered the new
  one gets 503.

Upstream connections are kept alive and reused while idle for at most ``POOL_IDLE_S``, below
uvicorn's five-second keep-alive, so a reused connection is not one the upstream is closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from http import HTTPStatus

import h11

from mrc_agent.agent.tools.proxy_http import (
    HEAD_END,
    LINGER_BYTES,
    LINGER_S,
    Upstream,
    both_lengths,
    error_body,
    forward_headers,
    raw_error,
    split_hostport,  # noqa: F401  (re-exported: the proxy's address rule)
)
from mrc_agent.agent.tools.proxy_upstream import (
    CHUNK,
    MAX_HEAD,
    ChunkRelay,
    ClientGone,
    UpstreamConn,
    UpstreamFailed,
)
from mrc_agent.exporters.exposition.http.wire import linger
from mrc_agent.exporters.instrumentation.meter import METERED_PATHS, Exchange, metered
from mrc_agent.exporters.instrumentation.metrics import MRCMetrics

log = logging.getLogger(__name__)

#: Seconds an idle upstream connection is kept for reuse.
POOL_IDLE_S = 2.0
#: Idle upstream connections kept at most.
POOL_SIZE = 64
#: Client connections open at once, by default: nginx's ``worker_connections`` default is
#: 512 per worker, and each proxied connection costs two descriptors (client and upstream).
MAX_CONNECTIONS = 1024
_timeout = getattr(asyncio, "timeout", None)


class _Answer:
    """How far the answer got: whether its status line went to the client."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False


async def _next(conn: h11.Connection, reader: asyncio.StreamReader | UpstreamConn) -> object:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        if isinstance(reader, UpstreamConn):
            data = await reader.read()
        else:
            data = await reader.read(CHUNK)
        conn.receive_data(data)


class Proxy:
    """The proxy's server; :meth:`serve` runs it on the current event loop."""

    def __init__(self, upstream: Upstream, metrics: MRCMetrics,
                 paths: tuple[str, ...] = METERED_PATHS, connect_timeout: float = 10.0,
                 head_timeout: float = 60.0, tls: ssl.SSLContext | None = None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.paths = paths
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        self._tls = tls if tls is not None else (ssl.create_default_context()
                                                 if upstream.scheme == "https" else None)
        self._pool: list[UpstreamConn] = []
        self._server: asyncio.Server | None = None
        self.max_connections = max_connections
        self._clients: set[asyncio.Task[None]] = set()
        #: The client connections with a request being answered now.
        self._busy: set[asyncio.Task[None]] = set()
        #: The client connections waiting for a request head, the longest waiting first, and
        #: their writers (closing one is how the cap evicts it).
        self._waiting: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._draining = False

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port. ``reuse_port``: with
        ``SO_REUSEPORT``, so several processes listen on one port and the kernel spreads the
        connections among them."""
        self._server = await asyncio.start_server(self._client, host.strip("[]"), port,
                                                  limit=CHUNK, backlog=1024,
                                                  reuse_port=reuse_port or None)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, drain: float = 0.0) -> None:
        """Stop accepting; close idle client connections at once and give the ones being
        answered up to ``drain`` seconds to finish (a stream is not cut at a rollout), then
        close the rest."""
        self._draining = True
        if self._server is not None:
            self._server.close()
        for task in self._clients - self._busy:
            task.cancel()
        if drain > 0 and self._busy:
            await asyncio.wait(set(self._busy), timeout=drain)
        left = list(self._clients)
        for task in left:
            task.cancel()
        if left:  # let them close their sockets, upstream ones included, before returning
            await asyncio.wait(left, timeout=5)
        for c in self._pool:
            c.close()
        self._pool.clear()

    # --- upstream connections ---------------------------------------------------------------

    async def _connect(self) -> UpstreamConn:
        now = time.monotonic()
        while self._pool:
            c = self._pool.pop()
            c.pooled = False
            if now - c.idle_since < POOL_IDLE_S and c.usable():
                return c
            c.close()
        up = self.upstream
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(UpstreamConn, up.host, up.port, ssl=self._tls),
            self.connect_timeout)
        return conn

    def _release(self, c: UpstreamConn) -> None:
        """Back to the pool when the answer ended exactly at a message boundary, with no
        byte left in h11's buffer or the connection's; closed otherwise (bytes past an answer
        would be read as the next client's answer)."""
        conn = c.h11
        if (conn.our_state is h11.DONE and conn.their_state is h11.DONE
                and not conn.trailing_data[0] and c.usable()):
            conn.start_next_cycle()
            self._pool_add(c)
        else:
            c.close()

    def _pool_add(self, c: UpstreamConn) -> None:
        if len(self._pool) < POOL_SIZE and not self._draining:
            c.idle_since = time.monotonic()
            c.pooled = True
            self._pool.append(c)
        else:
            c.close()

    # --- one client connection --------------------------------------------------------------

    def _admit(self, task: asyncio.Task[None]) -> bool:
        """Make room for a new client connection at the cap: close the one that has waited
        longest for its next request head (idle between requests, or part-way through a
        head); one being answered is never closed. False when all are being answered."""
        if len(self._clients) >= self.max_connections and self._waiting:
            oldest, oldest_writer = next(iter(self._waiting.items()))
            self._forget(oldest)
            oldest_writer.close()  # its read sees the end and its task returns
        if len(self._clients) >= self.max_connections:
            return False
        self._clients.add(task)
        return True

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._clients.discard(task)
        self._waiting.pop(task, None)
        self._busy.discard(task)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if not self._admit(task):
            log.warning("%d client connections, all being answered: refusing one",
                        len(self._clients))
            with contextlib.suppress(Exception):
                writer.write(raw_error(503, "the proxy is at its connection limit"))
                writer.close()
            return
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        peer = writer.get_extra_info("peername")
        client_ip = peer[0] if isinstance(peer, tuple) else ""
        try:
            while True:
                self._waiting[task] = writer  # the newest waiter last: evicted after the rest
                try:
                    event = await self._read_head(conn, reader)
                except (TimeoutError, ConnectionError):
                    return
                except h11.RemoteProtocolError as e:
                    await self._refuse(conn, writer, e.error_status_hint, str(e))
                    await linger(reader, writer, LINGER_S, LINGER_BYTES)
                    return
                finally:
                    self._waiting.pop(task, None)
                if not isinstance(event, h11.Request):
                    return  # ConnectionClosed or PAUSED: nothing more to serve
                self._busy.add(task)
                try:
                    keep = await self._exchange(conn, reader, writer, event, client_ip)
                finally:
                    self._busy.discard(task)
                if not keep or self._draining or conn.our_state is not h11.DONE \
                        or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except asyncio.CancelledError:
            # The proxy stops. Ending quietly: asyncio (3.11) logs a connection task that
            # ends cancelled as an unhandled exception.
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            self._forget(task)

    async def _read_head(self, conn: h11.Connection, reader: asyncio.StreamReader) -> object:
        """The next request's head, or what ends the connection: whole within
        ``head_timeout`` (not each read: a head trickled a byte at a time is cut as soon as
        one sent at once would be) and at most :data:`MAX_HEAD` bytes, its blank line
        included, however it arrives."""
        if _timeout is None:  # Python 3.10
            return await asyncio.wait_for(self._head_bytes(conn, reader), self.head_timeout)
        async with _timeout(self.head_timeout):
            return await self._head_bytes(conn, reader)

    @staticmethod
    async def _head_bytes(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
        data = b""
        while True:
            # h11 bounds a head only while it is incomplete: one that arrives whole in a
            # read is measured here, with the bytes h11 holds already (a pipelined head).
            pending = conn.trailing_data[0] + data if data else conn.trailing_data[0]
            end = HEAD_END.search(pending, 0, MAX_HEAD + 2)
            if (end.end() if end is not None else len(pending)) > MAX_HEAD:
                raise h11.RemoteProtocolError("the request head is over 64 KiB",
                                              error_status_hint=431)
            if data:
                conn.receive_data(data)
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await reader.read(CHUNK)
            if not data:
                conn.receive_data(b"")  # the end: h11 gives ConnectionClosed or an error

    async def _refuse(self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int,
                      message: str) -> None:
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = error_body(status, message)
        with contextlib.suppress(Exception):
            writer.write(conn.send(h11.Response(
                status_code=status, reason=HTTPStatus(status).phrase.encode(),
                headers=[(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")])))
            writer.write(conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()

    async def _exchange(self, conn: h11.Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, request: h11.Request,
                        client_ip: str) -> bool:
        """Forward one request and its answer; False when the client connection must close."""
        path = request.target.split(b"?", 1)[0].decode("latin-1")
        exchange = (Exchange(self.metrics)
                    if metered(request.method.decode("latin-1"), path, self.paths) else None)
        client_left = False
        try:
            if both_lengths(list(request.headers)):
                # nginx (since 1.21.1) and Envoy (unless allow_chunked_length) refuse it with
                # 400 and close: which length a server behind would read is the smuggler's bet.
                if exchange is not None:
                    exchange.response_start(400, "application/json")
                    exchange.response_body(b"", False)
                await self._refuse(conn, writer, 400, "the request has both Content-Length "
                                   "and Transfer-Encoding")
                await linger(reader, writer, LINGER_S, LINGER_BYTES)
                return False
            try:
                up = await self._connect()
            except (OSError, TimeoutError) as e:
                log.warning("upstream %s:%d unreachable: %s", self.upstream.host,
                            self.upstream.port, e or type(e).__name__)
                if exchange is not None:
                    exchange.response_start(502, "application/json")
                await self._refuse(conn, writer, 502, "the upstream server is unreachable")
                return False
            try:
                return await self._relay(conn, reader, writer, request, client_ip, up,
                                         exchange)
            except ClientGone:
                client_left = True
                up.close()
                return False
            except UpstreamFailed:
                up.close()
                return False
            except BaseException:  # cancelled (the proxy stops): the upstream stops too
                up.close()
                raise
        finally:
            if exchange is not None:
                exchange.finish(client_left=client_left)

    async def _relay(self, conn: h11.Connection, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter, request: h11.Request, client_ip: str,
                     up: UpstreamConn, exchange: Exchange | None) -> bool:
        # Connection-named headers go first, so nothing below is rebuilt from one of them.
        kept = forward_headers(list(request.headers))
        headers = [(n, v) for n, v in kept
                   if n not in (b"host", b"x-forwarded-for", b"x-forwarded-host",
                                b"x-forwarded-proto")]
        forwarded = [v for n, v in kept if n == b"x-forwarded-for"]
        host = next((v for n, v in kept if n == b"host"), b"")
        # X-Forwarded-For is appended to; -Host and -Proto are this proxy's view, replacing
        # the client's own (nginx's proxy_set_header), so the server never reads a value the
        # client chose for them.
        chain = b", ".join([*forwarded, client_ip.encode()]) if client_ip else b""
        headers = [(b"host", self.upstream.authority), *headers]
        if chain:
            headers.append((b"x-forwarded-for", chain))
        if host:
            headers.append((b"x-forwarded-host", host))
        headers.append((b"x-forwarded-proto", b"http"))
        if any(n == b"transfer-encoding" for n, _ in request.headers):
            headers.append((b"transfer-encoding", b"chunked"))
        try:
            head = up.h11.send(h11.Request(method=request.method, target=request.target,
                                           headers=headers, http_version=b"1.1"))
        except h11.LocalProtocolError as e:
            await self._refuse(conn, writer, 400, f"cannot forward this request: {e}")
            raise UpstreamFailed from e

        # The request body goes up in a task of its own, which then watches for the client
        # leaving; the answer comes down here. When the body task fails (the client left, the
        # upstream stopped reading) it cancels this one: no task and no wait per event.
        body = asyncio.ensure_future(self._pump_request(conn, reader, up, exchange, head))
        main = asyncio.current_task()
        failed: list[BaseException] = []
        state = _Answer()

        def body_ended(task: asyncio.Future[None]) -> None:
            if not task.cancelled() and task.exception() is not None and main is not None:
                failed.append(task.exception())  # type: ignore[arg-type]
                main.cancel()

        body.add_done_callback(body_ended)
        try:
            return await self._pump_response(conn, writer, up, exchange, state,
                                             request.method == b"HEAD")
        except asyncio.CancelledError:
            if not failed:
                raise
            if main is not None and hasattr(main, "uncancel"):
                main.uncancel()
            exc = failed[0]
            if isinstance(exc, ClientGone):
                raise exc from None
            if not state.started:
                await self._refuse(conn, writer, 502, "the upstream server failed")
            raise UpstreamFailed from exc
        finally:
            body.remove_done_callback(body_ended)
            if not body.done():
                body.cancel()
            with contextlib.suppress(BaseException):
                await body  # retrieves its exception, whichever way it ended

    async def _pump_request(self, conn: h11.Connection, reader: asyncio.StreamReader,
                            up: UpstreamConn, exchange: Exchange | None, head: bytes) -> None:
        """The request's head and the client's body to the upstream, whatever of it has
        arrived in one write; then watch for the client leaving."""
        pending = [head]
        body: list[bytes] = []  # metered once forwarded: the meter is off the hot path
        while True:
            try:
                event: object = conn.next_event()
                if event is h11.NEED_DATA:
                    await self._up_write(up, pending, exchange, body, False)
                    pending, body = [], []
                    event = await _next(conn, reader)
            except (ConnectionError, h11.RemoteProtocolError) as e:
                raise ClientGone from e
            if isinstance(event, h11.Data):
                body.append(bytes(event.data))
                pending.append(self._up_frame(up, h11.Data(data=event.data)))
            elif isinstance(event, h11.EndOfMessage):
                pending.append(self._up_frame(up, h11.EndOfMessage()))
                await self._up_write(up, pending, exchange, body, True)
                break
            else:  # ConnectionClosed before the body ended
                raise ClientGone
        # The request is whole. Until the answer ends, a read that returns nothing means the
        # client left; bytes mean a pipelined request, which h11 keeps for the next cycle.
        try:
            data = await reader.read(CHUNK)
        except ConnectionError as e:  # a reset: it left with bytes unread
            raise ClientGone from e
        if not data:
            raise ClientGone
        conn.receive_data(data)
        await asyncio.Event().wait()  # one pipelined chunk is enough: stop watching

    @staticmethod
    def _up_frame(up: UpstreamConn, event: h11.Data | h11.EndOfMessage) -> bytes:
        try:
            return up.h11.send(event) or b""
        except h11.LocalProtocolError as e:
            raise UpstreamFailed from e

    @staticmethod
    async def _up_write(up: UpstreamConn, pending: list[bytes], exchange: Exchange | None,
                        body: list[bytes], ended: bool) -> None:
        """Write ``pending`` upstream, then hand the body chunks it carried to the meter."""
        try:
            up.write(b"".join(pending))
        except ConnectionError as e:
            raise UpstreamFailed from e
        if exchange is not None:
            for chunk in body:
                exchange.request_body(chunk, True)
            if ended:
                exchange.request_body(b"", False)
        try:
            await up.drain()
        except ConnectionError as e:
            raise UpstreamFailed from e

    async def _pump_response(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                             up: UpstreamConn, exchange: Exchange | None,
                             state: _Answer, head_request: bool) -> bool:
        while True:
            try:
                event = await _next(up.h11, up)
            except (ConnectionError, h11.RemoteProtocolError, OSError) as e:
                if not state.started:
                    await self._refuse(conn, writer, 502, "the upstream server failed")
                raise UpstreamFailed from e
            if isinstance(event, h11.InformationalResponse):
                if event.status_code != 101:  # 100 Continue, 103 Early Hints; no upgrades
                    await self._send(conn, writer, h11.InformationalResponse(
                        status_code=event.status_code, headers=forward_headers(
                            list(event.headers)), reason=event.reason))
                continue
            if isinstance(event, h11.Response):
                if both_lengths(list(event.headers)):
                    # Which length frames it is anyone's guess: the client would get a
                    # Content-Length head over chunk framing. 502, never passed on.
                    await self._refuse(conn, writer, 502, "the upstream server's answer has "
                                       "both Content-Length and Transfer-Encoding")
                    raise UpstreamFailed
                state.started = True
                headers = forward_headers(list(event.headers))
                media = next((v for n, v in event.headers if n == b"content-type"), b"")
                start = (event.status_code, media.decode("latin-1"))
                answer = h11.Response(status_code=event.status_code, headers=headers,
                                      reason=event.reason)
                # An answer to HEAD, a 204 or a 304 has no body whatever its headers say
                # (RFC 9112 §6.3): h11 frames it so; only a body can be chunked.
                chunked = (not head_request and event.status_code not in (204, 304)
                           and any(n == b"transfer-encoding" and b"chunked" in v.lower()
                                   for n, v in event.headers))
                if chunked and conn.their_http_version == b"1.1":
                    # A chunked answer to a chunked client: its chunks pass as they are, the
                    # head with the first of them.
                    try:
                        head = conn.send(answer) or b""
                    except h11.LocalProtocolError as e:
                        raise ClientGone from e
                    return await self._relay_chunks(conn, writer, up, exchange, head, start)
                await self._send(conn, writer, answer)
                if exchange is not None:  # metered once forwarded, as everything here
                    exchange.response_start(*start)
            elif isinstance(event, h11.Data):
                if exchange is not None:
                    exchange.response_body(bytes(event.data), True)
                await self._send(conn, writer, h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                if exchange is not None:
                    exchange.response_body(b"", False)
                if conn.their_state is not h11.DONE:
                    # Answered before the whole body arrived: this client connection ends.
                    await self._send(conn, writer, h11.EndOfMessage())
                    up.close()
                    return False
                await self._send(conn, writer, h11.EndOfMessage())
                self._release(up)
                return True
            else:  # ConnectionClosed before the answer ended
                if not state.started:
                    await self._refuse(conn, writer, 502, "the upstream server closed early")
                raise UpstreamFailed

    async def _relay_chunks(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                            up: UpstreamConn, exchange: Exchange | None, head: bytes,
                            start: tuple[int, str]) -> bool:
        """The body of a chunked answer, relayed by a :class:`ChunkRelay` in the upstream
        connection's protocol; this task only waits for its end and drains the client's side
        when the relay says it is full. Against reading each event in a task and framing it
        through h11 twice: 12 % less CPU per stream at 64 streams, as much at 1 and 16
        (docs/openai-meter.md#cost)."""
        data, closed = up.h11.trailing_data
        relay = ChunkRelay(up, conn, writer.transport, exchange, head, start)
        up.relay = relay
        loop = asyncio.get_running_loop()
        try:
            relay.feed(data + up.take())
            if closed or up.at_eof():
                relay.fail(UpstreamFailed())
            while not relay.ended:
                if relay.error is not None:
                    raise relay.error
                if relay.blocked:
                    await self._drain(writer)
                    relay.blocked = False
                    if up.transport is not None:
                        up.transport.resume_reading()
                    continue
                relay.waiter = loop.create_future()
                await relay.waiter
        except UpstreamFailed:
            if not relay.head_sent:  # a broken first chunk: the client can still get a 502
                with contextlib.suppress(ConnectionError):
                    writer.write(raw_error(502, "the upstream server's answer is malformed"))
                    await writer.drain()
            raise
        finally:
            up.relay = None
        if exchange is not None:
            exchange.response_body(b"", False)
        await self._drain(writer)  # the last chunk went with the relay's last write
        if conn.their_state is not h11.DONE or relay.leftover or not up.usable():
            up.close()  # answered early, or bytes past the answer: neither side is reusable
            return conn.their_state is h11.DONE
        up.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        if up.transport is not None:
            up.transport.resume_reading()
        self._pool_add(up)
        return True

    @staticmethod
    async def _drain(writer: asyncio.StreamWriter) -> None:
        try:
            await writer.drain()
        except ConnectionError as e:
            raise ClientGone from e

    @staticmethod
    async def _send(conn: h11.Connection, writer: asyncio.StreamWriter,
                    event: h11.Response | h11.InformationalResponse | h11.Data
                    | h11.EndOfMessage) -> None:
        try:
            data = conn.send(event)
            if data:
                writer.write(data)
                await writer.drain()
        except (ConnectionError, h11.LocalProtocolError) as e:
            raise ClientGone from e
