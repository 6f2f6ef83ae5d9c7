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

Upstream connections are kept alive and reused while idle for less than ``POOL_IDLE_S``, below
uvicorn's five-second keep-alive, so a reused connection is not one the upstream is closing.

Both connections are asyncio protocols (:mod:`~mrc_agent.agent.tools.proxy_upstream`): heads
are read by llhttp and written by hand, bodies pass from one transport to the other in the
reading protocol's callback, and one task per client connection waits only for heads, the
upstream connection and the end of each answer: nothing wakes per event. Under uvloop (used
when installed) that costs about a third of what asyncio streams with h11 on both sides did
(docs/openai-meter.md#cost).
"""


from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Coroutine
from typing import TypeVar, cast

from mrc_agent.agent.tools.proxy_http import (
    LINGER_BYTES,
    LINGER_S,
    BadHead,
    MessageHead,
    Upstream,
    content_length,
    forward_headers,
    head_bytes,
    parse_request,
    parse_response,
    raw_error,
    split_hostport,  # noqa: F401  (re-exported: the proxy's address rule)
)
from mrc_agent.agent.tools.proxy_upstream import (
    FULL,
    ClientGone,
    Relay,
    Side,
    UpstreamConn,
    UpstreamFailed,
    settle,
)
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
T = TypeVar("T")


def run_loop(main: Coroutine[object, object, T]) -> T:
    """``asyncio.run(main)``, on uvloop's event loop where uvloop is installed: its transports
    cost the relay less per event than asyncio's (docs/openai-meter.md#cost)."""
    runner = getattr(asyncio, "Runner", None)  # Python 3.11 and later
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if runner is None:
        return asyncio.run(main)
    with runner(loop_factory=uvloop.new_event_loop) as r:
        return cast(T, r.run(main))


class ClientConn(Side):
    """One client connection: its bytes wait in :attr:`buf` for the next head, or go up
    through :attr:`relay` while a request body is being forwarded. Leaving while a request is
    answered cancels the connection's task (:attr:`gone`), which closes the upstream."""

    def __init__(self, proxy: Proxy) -> None:
        super().__init__()
        self.proxy = proxy
        self.answering = False
        self.gone = False
        self.task: asyncio.Task[None] | None = None
        self.peer = ""
        self._drop = -1  # lingering: bytes still to read and drop
        self._lingered: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else ""
        self.proxy._accept(self)

    def data_received(self, data: bytes) -> None:
        if self._drop >= 0:
            self._drop = max(0, self._drop - len(data))
            if not self._drop:
                settle(self._lingered)
            return
        relay = self.relay
        if relay is not None:
            data = relay.feed(data)  # what is left is the next request's
            if not data:
                return
        self._buffer(data)

    def eof_received(self) -> bool:
        self._ended()
        return True  # still writable: a refusal can be answered

    def _ended(self) -> None:
        super()._ended()
        settle(self._lingered)
        self.leave()

    def leave(self) -> None:
        """The client left, or broke its request's framing, while it was being answered."""
        if self.answering and not self.gone and self.task is not None:
            self.gone = True
            self.task.cancel()

    def request_done(self, relay: Relay) -> None:
        """The request body relay ended or failed."""
        if relay is self.relay:
            self.relay = None
        if isinstance(relay.error, ClientGone):
            self.leave()

    async def next_head(self) -> bytes | None:
        """The next request head, its blank line included; None when the connection ended
        between requests; BadHead when it is over :data:`MAX_HEAD` bytes, however it arrives,
        or cut short."""
        buf = self.buf
        while True:
            if buf[:1] in (b"\r", b"\n"):  # blank lines before a request (RFC 9112 §2.2)
                blank = len(buf) - len(buf.lstrip(b"\r\n"))
                del buf[:blank]
            try:
                head = self.split_head()
            except ValueError:
                raise BadHead(431, "the request head is over 64 KiB") from None
            if head is not None:
                return head
            if self.lost or (self.eof and not buf):
                return None
            if self.eof:
                raise BadHead(400, "the connection ended part-way through a request head")
            await self._more()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def linger(self, seconds: float, limit: int) -> None:
        """After an answer that ends the connection: stop writing, then read and drop what
        the client still sends, for at most ``seconds`` and ``limit`` bytes, so that it reads
        the answer instead of a reset (nginx's ``lingering_close``)."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.eof:
            return
        with contextlib.suppress(OSError, RuntimeError, NotImplementedError):
            if transport.can_write_eof():
                transport.write_eof()
        self._drop = max(1, limit - len(self.buf))
        self.buf.clear()
        self.release(FULL)
        self._lingered = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(self._lingered, seconds)


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
        self._server: asyncio.AbstractServer | None = None
        self.max_connections = max_connections
        self._clients: set[asyncio.Task[None]] = set()
        #: The client connections with a request being answered now.
        self._busy: set[asyncio.Task[None]] = set()
        #: The client connections waiting for a request head, the longest waiting first
        #: (closing one is how the cap evicts it).
        self._waiting: dict[asyncio.Task[None], ClientConn] = {}
        self._draining = False

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port. ``reuse_port``: with
        ``SO_REUSEPORT``, so several processes listen on one port and the kernel spreads the
        connections among them."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: ClientConn(self), host.strip("[]"),
                                                port, backlog=1024,
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

    def _pool_add(self, c: UpstreamConn) -> None:
        if len(self._pool) < POOL_SIZE and not self._draining and c.usable():
            c.idle_since = time.monotonic()
            c.pooled = True
            self._pool.append(c)
        else:
            c.close()

    # --- one client connection --------------------------------------------------------------

    def _accept(self, client: ClientConn) -> None:
        """Start serving a new client connection. At the cap, make room first: close the one
        that has waited longest for its next request head (idle between requests, or part-way
        through a head); one being answered is never closed, and when all are, the new one
        gets 503."""
        if len(self._clients) >= self.max_connections and self._waiting:
            oldest, oldest_client = next(iter(self._waiting.items()))
            self._forget(oldest)
            oldest_client.close()  # its wait for a head sees the end and its task returns
        if len(self._clients) >= self.max_connections:
            log.warning("%d client connections, all being answered: refusing one",
                        len(self._clients))
            client.write(raw_error(503, "the proxy is at its connection limit"))
            client.close()
            return
        task = asyncio.get_running_loop().create_task(self._serve(client))
        client.task = task
        self._clients.add(task)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._clients.discard(task)
        self._waiting.pop(task, None)
        self._busy.discard(task)

    async def _serve(self, client: ClientConn) -> None:
        task = client.task
        assert task is not None
        try:
            while True:
                self._waiting[task] = client  # the newest waiter last: evicted after the rest
                raw = None
                try:
                    raw = await self._read_head(client)
                    if raw is None:
                        return
                    head = parse_request(raw)
                except (TimeoutError, asyncio.TimeoutError):
                    return
                except BadHead as e:
                    # A head over the limit or cut short has no whole head: its request line
                    # is still what the client sent first.
                    self._meter_refusal(raw if raw is not None else bytes(client.buf), e.status)
                    client.write(raw_error(e.status, e.message))
                    await client.linger(LINGER_S, LINGER_BYTES)
                    return
                finally:
                    self._waiting.pop(task, None)
                self._busy.add(task)
                try:
                    keep = await self._exchange(client, head)
                finally:
                    self._busy.discard(task)
                if not keep or self._draining:
                    return
        except asyncio.CancelledError:
            # The proxy stops. Ending quietly: asyncio (3.11) logs a connection task that
            # ends cancelled as an unhandled exception.
            return
        finally:
            client.close()
            self._forget(task)

    async def _read_head(self, client: ClientConn) -> bytes | None:
        """The next request's head, whole within ``head_timeout`` (not each read: a head
        trickled a byte at a time is cut as soon as one sent at once would be)."""
        if _timeout is None:  # Python 3.10
            return await asyncio.wait_for(client.next_head(), self.head_timeout)
        async with _timeout(self.head_timeout):
            return await client.next_head()

    def _meter_refusal(self, raw: bytes | None, status: int) -> None:
        """Count a refused head whose request line names a metered path."""
        if raw is None:
            return
        parts = raw.split(b"\n", 1)[0].rstrip(b"\r").split(b" ")  # a bare LF ends it too
        if len(parts) == 3:
            path = parts[1].split(b"?", 1)[0].decode("latin-1")
            if metered(parts[0].decode("latin-1"), path, self.paths):
                exchange = Exchange(self.metrics)
                exchange.response_start(status, "application/json")
                exchange.response_body(b"", False)
                exchange.finish(client_left=False)

    async def _exchange(self, client: ClientConn, head: MessageHead) -> bool:
        """Forward one request and its answer; False when the client connection must close."""
        path = head.target.split(b"?", 1)[0].decode("latin-1")
        exchange = (Exchange(self.metrics)
                    if metered(head.method.decode("latin-1"), path, self.paths) else None)
        client_left = False
        client.answering = True
        up: UpstreamConn | None = None
        try:
            try:
                up = await self._connect()
            except (OSError, TimeoutError, asyncio.TimeoutError) as e:
                log.warning("upstream %s:%d unreachable: %s", self.upstream.host,
                            self.upstream.port, e or type(e).__name__)
                if exchange is not None:
                    exchange.response_start(502, "application/json")
                client.write(raw_error(502, "the upstream server is unreachable"))
                return False
            return await self._relay(client, head, up, exchange)
        except ClientGone:
            client_left = True
            return False
        except UpstreamFailed:
            return False
        except asyncio.CancelledError:
            if not client.gone:
                raise  # the proxy stops
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()
            client_left = True
            return False
        finally:
            client.answering = False
            client.relay = None
            if up is not None and not up.pooled:
                # Failed, cut or answered early: the upstream's side of this exchange is
                # not at a message boundary (a server behind takes the close as an abort).
                up.relay = None
                up.close()
            if exchange is not None:
                exchange.finish(client_left=client_left)

    def _upstream_head(self, client: ClientConn, head: MessageHead) -> bytes:
        # Connection-named headers go first, so nothing below is rebuilt from one of them.
        kept = forward_headers(head.headers)
        headers = [(b"host", self.upstream.authority)]
        forwarded: list[bytes] = []
        host = b""
        for n, v in kept:
            if n == b"x-forwarded-for":
                forwarded.append(v)
            elif n == b"host":
                host = v
            elif n not in (b"x-forwarded-host", b"x-forwarded-proto"):
                headers.append((n, v))
        # X-Forwarded-For is appended to; -Host and -Proto are this proxy's view, replacing
        # the client's own (nginx's proxy_set_header), so the server never reads a value the
        # client chose for them.
        if client.peer:
            headers.append((b"x-forwarded-for", b", ".join([*forwarded, client.peer.encode()])))
        if host:
            headers.append((b"x-forwarded-host", host))
        headers.append((b"x-forwarded-proto", b"http"))
        if head.get(b"transfer-encoding") is not None:
            headers.append((b"transfer-encoding", b"chunked"))
        return head_bytes(head.method + b" " + head.target + b" HTTP/1.1", headers)

    async def _relay(self, client: ClientConn, head: MessageHead, up: UpstreamConn,
                     exchange: Exchange | None) -> bool:
        up_head = self._upstream_head(client, head)
        chunked = head.get(b"transfer-encoding") is not None
        length = 0 if chunked else content_length(head)
        if chunked or length:
            # The body goes up from the client protocol's callback as it arrives, while this
            # task waits for the answer, which may come before the body has ended.
            assert up.transport is not None
            body = Relay(Relay.CHUNKED if chunked else Relay.LENGTH, length, up.transport,
                         up_head, None if exchange is None else
                         lambda piece: exchange.request_body(piece, True),
                         None, UpstreamFailed, ClientGone)

            def body_done(relay: Relay) -> None:
                client.request_done(relay)
                if relay.ended and exchange is not None:
                    exchange.request_body(b"", False)

            body.done = body_done
            up.feed_from(client)
            client.relay = body
            pending = bytes(client.buf)
            client.buf.clear()
            client.buf += body.feed(pending)
            client.release(FULL)
        else:
            up.write(up_head)
            if exchange is not None:
                exchange.request_body(b"", False)
        answer = await self._answer_head(client, up)
        return await self._relay_answer(client, head, up, exchange, answer)

    async def _answer_head(self, client: ClientConn, up: UpstreamConn) -> MessageHead:
        """The answer's head; informational answers (100 Continue, 103 Early Hints) are
        passed on on the way (no upgrades: ``Upgrade`` never reaches the upstream)."""
        while True:
            try:
                raw = await up.next_head()
            except UpstreamFailed:
                client.write(raw_error(502, "the upstream server failed"))
                raise
            try:
                answer = parse_response(raw)
            except BadHead as e:
                client.write(raw_error(502, e.message))
                raise UpstreamFailed from e
            if answer.status >= 200:
                return answer
            if answer.status != 101:
                client.write(head_bytes(b"HTTP/1.1 %d %s" % (answer.status, answer.reason),
                                        forward_headers(answer.headers)))

    async def _relay_answer(self, client: ClientConn, head: MessageHead, up: UpstreamConn,
                            exchange: Exchange | None, answer: MessageHead) -> bool:
        # An answer to HEAD, a 204 or a 304 has no body whatever its headers say
        # (RFC 9112 §6.3); only a body can be chunked.
        if head.method == b"HEAD" or answer.status in (204, 304):
            mode, length = Relay.LENGTH, 0
        elif answer.get(b"transfer-encoding") is not None:
            mode, length = (Relay.CHUNKED if head.version == b"1.1" else Relay.DECHUNK), 0
        elif answer.get(b"content-length") is not None:
            mode, length = Relay.LENGTH, content_length(answer)
        else:
            mode, length = Relay.CLOSE, 0  # delimited by the upstream closing
        keep = (head.version == b"1.1" and mode != Relay.CLOSE and not self._draining
                and b"close" not in head.tokens(b"connection"))
        headers = forward_headers(answer.headers)
        if mode == Relay.CHUNKED:
            headers.append((b"transfer-encoding", b"chunked"))
        if not keep:
            headers.append((b"connection", b"close"))
        start = payload = None
        if exchange is not None:
            media = (answer.get(b"content-type") or b"").decode("latin-1")
            status = answer.status

            def start() -> None:
                exchange.response_start(status, media)

            def payload(piece: bytes) -> None:
                exchange.response_body(piece, True)

        assert client.transport is not None
        relay = Relay(mode, length, client.transport,
                      head_bytes(b"HTTP/1.1 %d %s" % (answer.status, answer.reason), headers),
                      payload, start,
                      ClientGone, UpstreamFailed)
        client.feed_from(up)
        up.relay = relay
        try:
            relay.feed(up.take())
            if up.eof:
                relay.source_ended()
            await relay.wait()
        except UpstreamFailed:
            if not relay.head_sent:  # a broken first chunk: the client can still get a 502
                client.write(raw_error(502, "the upstream server's answer is malformed"))
            raise
        finally:
            up.relay = None
            client.feed_from(None)
        if exchange is not None:
            exchange.response_body(b"", False)
        if client.relay is not None or client.eof:
            return False  # answered before the whole request arrived: both sides end
        if mode != Relay.CLOSE and not relay.leftover:  # bytes past the answer: closed
            up.feed_from(None)
            self._pool_add(up)
        return keep
