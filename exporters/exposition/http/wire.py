"""The exposition server's wire: request heads parsed and request bodies framed by h11 (the
HTTP/1.1 parser uvicorn and httpx use), under the server's own limits; answers written here.

h11 checks the grammar: the request line, header names and values (a bare CR, NUL or other
control character is refused, as RFC 9112 lets a server do), ``Content-Length`` (digits, at most
20, one value however often it is repeated) and ``Transfer-Encoding`` (``chunked`` alone), and an
HTTP/1.1 request without ``Host`` (RFC 9112 3.2). What h11 leaves to its user stays here, as
policy: how many headers and bytes a head may have (h11 bounds only a head still arriving),
which versions, methods and targets are served, and that ``Content-Length`` and
``Transfer-Encoding`` together, or a list of lengths, are refused rather than reconciled (two
framings that some proxy might read otherwise: request smuggling).

One h11 connection parses one request: bytes that arrive behind it (a pipelined request, or
what follows a body) carry over to the next. Answers are written here rather than through h11,
which closes every HTTP/1.0 connection, where the agent keeps one open when the client asks
for ``keep-alive``, as exporter-toolkit's server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus

import h11

from mrc_agent.exporters.exposition.limits import Limits

#: Bytes read at a time once a body is being read.
_CHUNK = 1 << 16
#: Content-Length header lines, and one whose value is a list: h11 reconciles equal values,
#: the server refuses them.
_LENGTH_LINE = re.compile(rb"(?im)^content-length[ \t]*:([^\r\n]*)")
_VERSIONS = {b"1.1": "HTTP/1.1", b"1.0": "HTTP/1.0"}


class BadRequest(Exception):
    """A request refused before it is answered; the connection then closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Head:
    method: str
    target: str
    version: str
    #: Lower-cased names; a repeated header's values joined with ", " (RFC 9110 5.3).
    headers: dict[str, str]

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.1":
            return "close" not in tokens
        return "keep-alive" in tokens


class Wire:
    """One connection's requests, read through h11: the bytes received and not yet parsed,
    the head of the request being read and its body."""

    def __init__(self, reader: asyncio.StreamReader, limits: Limits) -> None:
        self._reader = reader
        self._limits = limits
        self._pending = b""
        self._h11: h11.Connection | None = None
        # The head being read: its chunks, their bytes, and whether its first line has ended.
        self._chunks: list[bytes] = []
        self._received = 0
        self._line_ended = False

    async def arrive(self) -> bool | None:
        """Waits for the first bytes of the next request. True when they are here; None when
        only line breaks came (allowed between requests, RFC 9112 2.2: dropped); False when
        the client closed."""
        if not self._pending:
            chunk = await self._reader.read(self._limits.max_head_bytes)
            if not chunk:
                return False
            self._pending = chunk
        self._pending = self._pending.lstrip(b"\r\n")
        return True if self._pending else None

    def begin(self) -> Head | None:
        """Starts parsing the next request on the bytes :meth:`arrive` buffered: its head
        when they hold it whole (as a real client's head arrives, in one segment: no wait),
        else None, and :meth:`rest` reads the rest. Raises :class:`BadRequest` with the
        status to answer."""
        limit = self._limits.max_head_bytes
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limit)
        self._h11 = conn
        first, self._pending = self._pending, b""
        self._chunks = [first]
        self._received = len(first)
        self._line_ended = b"\n" in first
        conn.receive_data(first)
        return self._parsed(conn)

    async def rest(self) -> Head:
        """The head begun by :meth:`begin`, whole. Raises :class:`BadRequest`, or
        ConnectionError when the client closes part-way."""
        conn = self._h11
        assert conn is not None
        while True:
            # No more than one byte past the limit: a head that ends within it is parsed
            # whatever follows it; one that does not is refused before h11 sees the rest.
            chunk = await self._reader.read(self._limits.max_head_bytes + 1 - self._received)
            if not chunk:
                raise ConnectionError("client closed in the request head")
            self._received += len(chunk)
            self._line_ended = self._line_ended or b"\n" in chunk
            self._chunks.append(chunk)
            conn.receive_data(chunk)
            head = self._parsed(conn)
            if head is not None:
                return head

    def _too_large(self) -> BadRequest:
        if not self._line_ended:
            return BadRequest(414, "request line too long")
        return BadRequest(431, "request headers too large")

    def _parsed(self, conn: h11.Connection) -> Head | None:
        """The head, when h11 has it whole and the server's policy takes it; None when h11
        needs more bytes."""
        limit = self._limits.max_head_bytes
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:  # its bound on a head still arriving
                raise self._too_large() from None
            raise BadRequest(exc.error_status_hint, _reason(exc)) from None
        if event is h11.NEED_DATA:
            if self._received > limit:  # and the head is not whole yet
                raise self._too_large()
            return None
        assert isinstance(event, h11.Request), event
        behind, _ = conn.trailing_data
        size = self._received - len(behind)
        if size > limit:
            raise BadRequest(431, "request headers too large")
        if len(event.headers) > self._limits.max_headers:
            raise BadRequest(431, "too many request headers")
        version = _VERSIONS.get(event.http_version)
        if version is None:
            raise BadRequest(505, "HTTP/1.0 or HTTP/1.1 only")
        method = event.method.decode("ascii")
        target = event.target.decode("latin-1")
        if not method.isalpha() or not target.startswith("/"):
            raise BadRequest(400, "bad request line")
        headers: dict[str, str] = {}
        for name, value in event.headers:
            key, text = name.decode("ascii"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if "content-length" in headers and "transfer-encoding" in headers:
            # Two framings disagree: a request-smuggling attempt behind some proxies.
            raise BadRequest(400, "both Content-Length and Transfer-Encoding")
        if "content-length" in headers:
            lengths = _LENGTH_LINE.findall(b"".join(self._chunks)[:size])
            if len(lengths) != 1 or b"," in lengths[0]:
                raise BadRequest(400, "bad Content-Length")
        return Head(method, target, version, headers)

    async def body(self, limit: int, timeout: float) -> bytes:
        """The body of the request whose head was read last, at most ``limit`` bytes (the
        caller has checked its declared length), within ``timeout`` seconds. Raises
        TimeoutError when it is slower, ConnectionError when the client closes first."""
        if limit == 0:  # nothing to wait for
            self.done()
            return b""
        return await asyncio.wait_for(self._body(limit), timeout)

    async def _body(self, limit: int) -> bytes:
        conn = self._h11
        assert conn is not None
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise ConnectionError(f"request body: {exc}") from None
            if event is h11.NEED_DATA:
                chunk = await self._reader.read(_CHUNK)
                if not chunk:
                    raise ConnectionError("client closed in the request body")
                conn.receive_data(chunk)
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:  # not reached after the caller's check; a bound regardless
                    raise ConnectionError("request body longer than declared")
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self._pending, _ = conn.trailing_data
                self._h11 = None
                return b"".join(parts)
            else:  # ConnectionClosed, or what a request cannot be followed by
                raise ConnectionError(f"request body: {event!r}")

    def done(self) -> None:
        """The request has no body (none declared): what arrived behind its head is the next
        request's."""
        conn = self._h11
        if conn is not None:
            self._pending, _ = conn.trailing_data
            self._h11 = None


def _reason(exc: h11.RemoteProtocolError) -> str:
    """h11's message for the answer's body: its own words, less any bytes it quotes."""
    text = str(exc).split(":", 1)[0].strip()
    return text or "bad request"


def response_head(status: int, ctype: str, length: int, extra: Mapping[str, str],
                  configured: Mapping[str, str], *, close: bool, http10: bool) -> bytes:
    """The status line and headers of an answer: the answer's own ``extra`` headers, then the
    configured ones (the web configuration's) that the answer does not set itself, as a Go
    handler may."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    lines = [f"HTTP/1.1 {status} {reason}", "Server: mrc-agent",
             f"Content-Type: {ctype}", f"Content-Length: {length}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    own = {k.lower() for k in extra}
    lines += [f"{k}: {v}" for k, v in configured.items() if k.lower() not in own]
    if close:
        lines.append("Connection: close")
    elif http10:
        lines.append("Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seconds: float,
                 limit: int) -> None:
    """After an early answer that ends the connection: stop writing, then read and drop what
    the client still sends, for at most ``seconds`` and ``limit`` bytes, so that it reads the
    answer instead of a reset (nginx's ``lingering_close``)."""
    with contextlib.suppress(OSError, RuntimeError):
        if writer.can_write_eof():
            writer.write_eof()
    left = limit
    deadline = time.monotonic() + seconds
    with contextlib.suppress(ConnectionError, TimeoutError, asyncio.TimeoutError):
        while left > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            chunk = await asyncio.wait_for(reader.read(min(left, _CHUNK)), remaining)
            if not chunk:
                break
            left -= len(chunk)
