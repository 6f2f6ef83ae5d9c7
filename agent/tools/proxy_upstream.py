"""The upstream side of ``mrc-agent proxy``: one connection to the upstream as an asyncio
protocol, and the relay that carries a chunked answer's body from it to the client.

A streamed answer is a few hundred events a second per stream; each one is parsed, written to
the client and handed to the meter inside the protocol's ``data_received``, with no task woken
and no future made per event, and the meter reads each piece after it was written, so that its
work is not on the way to the client.
"""

from __future__ import annotations

import asyncio
import re
from typing import cast

import h11

from mrc_agent.exporters.instrumentation.meter import Exchange

#: Bytes read from a socket at a time, and the client write buffer above which the upstream
#: is not read until the client has drained it.
CHUNK = 64 * 1024
#: The largest request or response head accepted, and the longest chunk size line.
MAX_HEAD = 64 * 1024


class ClientGone(Exception):
    """The client left, or its connection failed."""


class UpstreamFailed(Exception):
    """The upstream closed, failed or broke the framing of its answer."""


def _settle(waiter: asyncio.Future[None] | None) -> None:
    """Wake the task waiting on ``waiter``, if one is."""
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


#: A chunk's size line (RFC 9112 §7.1): at most 16 hex digits (a size below 2**64), then
#: optional whitespace and extensions made of visible characters, spaces and tabs alone: no
#: ``0x``, no sign, no bare CR or LF, no control byte for a lax parser behind the client to
#: read otherwise.
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[\x20-\x7e\t\x80-\xff]*)?")


def chunk_size(buf: bytearray, pos: int, end: int) -> int:
    """The size of a chunk from its size line ``buf[pos:end]`` (extensions ignored);
    UpstreamFailed when the line is not one a strict HTTP/1.1 parser reads."""
    m = _CHUNK_LINE.fullmatch(buf, pos, end)
    if m is None:
        raise UpstreamFailed
    return int(m.group(1), 16)


class UpstreamConn(asyncio.Protocol):
    """One connection to the upstream, as an asyncio protocol: h11 reads its answers' heads
    through :meth:`read`; a chunked answer's body goes straight from :meth:`data_received` to
    the client through a :class:`ChunkRelay`, with no task woken per event."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.idle_since = 0.0
        #: In the pool, owing no answer: any byte received now closes it.
        self.pooled = False
        self.relay: ChunkRelay | None = None
        self._buf = bytearray()
        self._eof = False
        self._lost: Exception | None = None
        self._reading: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.feed(data)
            return
        if self.pooled:
            # Bytes from an upstream that owes no answer: past the end of the last one. The
            # next request must not read them as its own answer.
            self._eof = True
            self.close()
            return
        self._buf += data
        if len(self._buf) > CHUNK and self.transport is not None:
            self.transport.pause_reading()  # until read() takes it
        self._wake_reader()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake_reader()
        if self.relay is not None:
            self.relay.fail(UpstreamFailed())
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._lost = exc or ConnectionResetError("the upstream closed the connection")
        self._wake_reader()
        if self.relay is not None:
            self.relay.fail(UpstreamFailed())
        self.resume_writing()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        _settle(self._writable)
        self._writable = None

    def _wake_reader(self) -> None:
        _settle(self._reading)
        self._reading = None

    # what the proxy calls
    async def read(self) -> bytes:
        """The bytes received so far (waiting for some); b"" at the end."""
        while not self._buf and not self._eof:
            self._reading = asyncio.get_running_loop().create_future()
            await self._reading
        return self.take()

    def at_eof(self) -> bool:
        return self._eof and not self._buf

    def take(self) -> bytes:
        """The bytes received and not yet read, without waiting."""
        data = bytes(self._buf)
        self._buf.clear()
        if self.transport is not None and not self._eof:
            self.transport.resume_reading()
        return data

    def write(self, data: bytes) -> None:
        if self._lost is not None or self.transport is None:
            raise ConnectionResetError("the upstream connection is closed")
        if data:
            self.transport.write(data)

    async def drain(self) -> None:
        while self._paused:
            if self._lost is not None:
                raise ConnectionResetError("the upstream connection is closed")
            self._writable = asyncio.get_running_loop().create_future()
            await self._writable
        if self._lost is not None:
            raise ConnectionResetError("the upstream connection is closed")

    def usable(self) -> bool:
        return (not self._eof and not self._buf and self.transport is not None
                and not self.transport.is_closing())

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class ChunkRelay:
    """The body of a chunked answer, parsed where it arrives (the upstream protocol's
    ``data_received``), so no task wakes per event: the chunks the upstream wrote (size line,
    payload, CRLF) go to the client as they are, everything forwardable in one read in one
    write, each payload handed to the meter as it comes; a chunk is forwarded piece by piece,
    never waited for whole. The last chunk and any trailers are not forwarded: the client
    side's h11 ``EndOfMessage`` ends the client's answer, written with the bytes before it
    (trailers are dropped, as h11 drops them). The meter reads each piece after it was
    written, so its work is not on the way to the client.

    The task that started it waits on :attr:`waiter`, resolved when the answer has ended
    (:attr:`ended`), when it failed (:attr:`error`: UpstreamFailed or ClientGone) or when
    the client's write buffer is full (:attr:`blocked`): upstream reading is then paused until
    that task has drained the client's side."""

    _SIZE, _DATA, _CRLF, _TRAILERS = range(4)

    __slots__ = ("_up", "_conn", "_client", "_exchange", "_buf", "_state", "_left", "_head",
                 "_start", "ended", "leftover", "error", "blocked", "waiter")

    def __init__(self, up: UpstreamConn, conn: h11.Connection, client: asyncio.WriteTransport,
                 exchange: Exchange | None, head: bytes, start: tuple[int, str]) -> None:
        self._up, self._conn, self._client, self._exchange = up, conn, client, exchange
        self._buf = bytearray()
        self._state = self._SIZE
        self._left = 0
        self._head = head  # the client's response head, sent with the first bytes
        self._start: tuple[int, str] | None = start  # the meter's response_start, once sent
        self.ended = False
        self.leftover = False  # bytes came after the answer's end
        self.error: Exception | None = None
        self.blocked = False
        self.waiter: asyncio.Future[None] | None = None

    def _signal(self) -> None:
        _settle(self.waiter)
        self.waiter = None

    @property
    def head_sent(self) -> bool:
        """Whether the client's response head has been written (a failure before it can still
        be answered 502)."""
        return not self._head

    def fail(self, exc: Exception) -> None:
        if not self.ended and self.error is None:
            self.error = exc
            if self._up.transport is not None:
                self._up.transport.pause_reading()
            self._signal()

    def feed(self, data: bytes) -> None:
        if self.ended or self.error is not None:
            self.leftover = self.leftover or bool(data)
            return
        try:
            self._feed(data)
        except (UpstreamFailed, ClientGone) as e:
            self.fail(e)

    def _feed(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        forward = 0  # buf[:forward] goes to the client
        ended = False
        payloads: list[bytes] = []  # metered once forwarded: the meter is off the hot path
        while True:
            state = self._state
            if state == self._SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_HEAD:
                        raise UpstreamFailed  # no size line in 64 KiB
                    break
                size = chunk_size(buf, pos, end)
                pos = end + 2
                if size == 0:
                    self._state = self._TRAILERS
                    continue
                forward = pos
                self._left = size
                self._state = self._DATA
            elif state == self._DATA:
                n = min(self._left, len(buf) - pos)
                if n == 0:
                    break
                payloads.append(bytes(buf[pos:pos + n]))
                pos += n
                forward = pos
                self._left -= n
                if not self._left:
                    self._state = self._CRLF
            elif state == self._CRLF:
                if len(buf) - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise UpstreamFailed
                pos += 2
                forward = pos
                self._state = self._SIZE
            else:  # trailers, up to an empty line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_HEAD:
                        raise UpstreamFailed
                    break
                empty = end == pos
                pos = end + 2
                if empty:
                    ended = True
                    break
        out = bytes(buf[:forward]) if forward else b""
        if ended:  # the client's last chunk goes with the bytes before it
            try:
                out += self._conn.send(h11.EndOfMessage()) or b""
            except h11.LocalProtocolError as e:
                raise ClientGone from e
        if out or self._head:
            self._write(out)
        del buf[:pos]
        meter = self._exchange
        if meter is not None:
            if self._start is not None:
                meter.response_start(*self._start)
                self._start = None
            for payload in payloads:
                meter.response_body(payload, True)
        if ended:
            self.ended = True
            self.leftover = bool(buf)
            if self._up.transport is not None:
                self._up.transport.pause_reading()
            self._signal()

    def _write(self, data: bytes) -> None:
        client = self._client
        if client.is_closing():
            raise ClientGone
        if self._head:
            data, self._head = self._head + data, b""
        client.write(data)
        if client.get_write_buffer_size() > CHUNK and not self.blocked:
            # The client reads slower than the upstream writes: stop reading until it drains.
            self.blocked = True
            if self._up.transport is not None:
                self._up.transport.pause_reading()
            self._signal()
