"""The transport side of ``mrc-agent proxy``: its two connections as asyncio protocols, and the
relay that carries a message body from one to the other.

A streamed answer is a few hundred events a second per stream; each one is parsed, written to
the client and handed to the meter inside the upstream protocol's ``data_received``, with no
task woken and no future made per event; a request body goes up the same way from the client
protocol's. Back-pressure is the transports' own flow control: when the side written to calls
``pause_writing``, the side read from stops reading until ``resume_writing``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import cast

from mrc_agent.agent.tools.proxy_http import HEAD_END

#: The largest request or response head accepted, and the longest chunk size line.
MAX_HEAD = 64 * 1024
#: Why a connection's reading is paused (several may hold at once).
BACKPRESSURE, FULL = 1, 2


class ClientGone(Exception):
    """The client left, or its connection failed."""


class UpstreamFailed(Exception):
    """The upstream closed, failed or broke the framing of its answer."""


def settle(waiter: asyncio.Future[None] | None) -> None:
    """Wake the task waiting on ``waiter``, if one is."""
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


#: A chunk's size line (RFC 9112 §7.1): at most 16 hex digits (a size below 2**64), then
#: optional whitespace and extensions made of visible characters, spaces and tabs alone: no
#: ``0x``, no sign, no bare CR or LF, no control byte for a lax parser behind to read otherwise.
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[\x20-\x7e\t\x80-\xff]*)?")


def chunk_size(buf: bytearray, pos: int, end: int) -> int:
    """The size of a chunk from its size line ``buf[pos:end]`` (extensions ignored); ValueError
    when the line is not one a strict HTTP/1.1 parser reads."""
    m = _CHUNK_LINE.fullmatch(buf, pos, end)
    if m is None:
        raise ValueError("malformed chunk size line")
    return int(m.group(1), 16)


class Side(asyncio.Protocol):
    """One of the proxy's connections: the bytes waiting for its next head (:attr:`buf`), the
    body :attr:`relay` its bytes go through while one is forwarded, holds on its reading, each
    for a reason, and the side that writes into it (:attr:`feeder`), held while this side's
    write buffer is full."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.feeder: Side | None = None
        self.relay: Relay | None = None
        self.buf = bytearray()
        self.eof = False
        self.writing_paused = False
        self.lost = False
        self._holds = 0
        self._reading: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._ended()
        self.resume_writing()

    def _ended(self) -> None:
        """The connection ended (or half-ended): a wait for bytes returns, a body being read
        from it fails (or ends, when the end delimits it)."""
        self.eof = True
        self._wake()
        if self.relay is not None:
            self.relay.source_ended()

    def _buffer(self, data: bytes) -> None:
        """Keep ``data`` for the next head; past a head's bound, stop reading until one is
        taken."""
        self.buf += data
        if len(self.buf) > MAX_HEAD + 2:
            self.hold(FULL)
        self._wake()

    def _wake(self) -> None:
        settle(self._reading)
        self._reading = None

    async def _more(self) -> None:
        """Until bytes arrive or the connection ends."""
        self._reading = asyncio.get_running_loop().create_future()
        await self._reading

    def split_head(self) -> bytes | None:
        """The head at the start of :attr:`buf`, its blank line included, taken from it; None
        while it is incomplete; ValueError when it is over :data:`MAX_HEAD` bytes, however it
        arrived."""
        buf = self.buf
        end = HEAD_END.search(buf, 0, MAX_HEAD + 2)
        if end is not None and end.end() <= MAX_HEAD:
            head = bytes(buf[:end.end()])
            del buf[:end.end()]
            if len(buf) <= MAX_HEAD + 2:
                self.release(FULL)
            return head
        if (end.end() if end is not None else len(buf)) > MAX_HEAD:
            raise ValueError("a head over 64 KiB")
        return None

    def hold(self, reason: int) -> None:
        if not self._holds and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._holds |= reason

    def release(self, reason: int) -> None:
        if self._holds & reason:
            self._holds &= ~reason
            if not self._holds and self.transport is not None \
                    and not self.transport.is_closing():
                self.transport.resume_reading()

    def feed_from(self, side: Side | None) -> None:
        """``side`` writes into this one now; it is held while this one's buffer is full."""
        old = self.feeder
        if old is not None:
            old.release(BACKPRESSURE)
        self.feeder = side
        if side is not None and self.writing_paused:
            side.hold(BACKPRESSURE)

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.feeder is not None:
            self.feeder.hold(BACKPRESSURE)

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.feeder is not None:
            self.feeder.release(BACKPRESSURE)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Relay:
    """A message body from the side that reads it to the side that writes it, parsed where it
    arrives (the reading protocol's ``data_received``), so no task wakes per piece:

    * ``CHUNKED``: chunks (size line, payload, CRLF) pass as they are, everything forwardable
      in one read in one write; the last chunk and trailers are replaced by a last chunk of
      this hop's own (trailers are dropped, as h11 and uvicorn drop them);
    * ``DECHUNK``: the payloads only, for an HTTP/1.0 client;
    * ``LENGTH``: ``length`` bytes;
    * ``CLOSE``: everything until the reading side ends.

    A payload is forwarded piece by piece, never waited for whole, and handed to ``payload``
    after it was written, so the meter's work is not on the way. ``head`` goes with the first
    write. :meth:`feed` returns the bytes past the body's end (a pipelined request). ``done`` is
    called once, when the body ended or the relay failed (:attr:`error`: ``source_error`` for
    broken framing, ClientGone or UpstreamFailed for the side written to)."""

    CHUNKED, DECHUNK, LENGTH, CLOSE = range(4)
    _SIZE, _DATA, _CRLF, _TRAILERS = range(4)

    __slots__ = ("_mode", "_sink", "_sink_error", "_source_error", "_payload", "_start",
                 "_buf", "_state", "_left", "_head", "_end", "done", "ended", "leftover",
                 "error", "waiter")

    def __init__(self, mode: int, length: int, sink: asyncio.WriteTransport, head: bytes,
                 payload: Callable[[bytes], None] | None,
                 start: Callable[[], None] | None, sink_error: type[Exception],
                 source_error: type[Exception]) -> None:
        self._mode, self._sink, self._head = mode, sink, head
        self._end = b"0\r\n\r\n" if mode == self.CHUNKED else b""
        self._payload, self._start = payload, start
        self._sink_error, self._source_error = sink_error, source_error
        self._buf = bytearray()
        self._state = self._SIZE
        self._left = length
        self.done: Callable[[Relay], None] | None = None
        self.ended = False
        self.leftover = False  # bytes came after the body's end
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    @property
    def head_sent(self) -> bool:
        """Whether ``head`` has been written (a failure before it can still be answered)."""
        return not self._head

    def fail(self, exc: Exception) -> None:
        if not self.ended and self.error is None:
            self.error = exc
            self._finish()

    def source_ended(self) -> None:
        """The reading side closed: the end of a ``CLOSE`` body, a failure of any other."""
        if self._mode == self.CLOSE and not self.ended and self.error is None:
            self._out(b"", True, [])
        else:
            self.fail(self._source_error())

    async def wait(self) -> None:
        """Until the body has ended; raises :attr:`error` when the relay failed."""
        while not self.ended and self.error is None:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        if self.error is not None:
            raise self.error

    def _finish(self) -> None:
        settle(self.waiter)
        self.waiter = None
        done, self.done = self.done, None
        if done is not None:
            done(self)

    def feed(self, data: bytes) -> bytes:
        if self.ended or self.error is not None:
            self.leftover = self.leftover or bool(data)
            return data
        try:
            if self._mode == self.LENGTH:
                return self._feed_length(data)
            if self._mode == self.CLOSE:
                self._out(data, False, [data] if data else [])
                return b""
            return self._feed_chunks(data)
        except ValueError:
            self.fail(self._source_error())
        except (ClientGone, UpstreamFailed) as e:
            self.fail(e)
        return b""

    def _feed_length(self, data: bytes) -> bytes:
        n = min(self._left, len(data))
        piece = data[:n] if n < len(data) else data
        self._left -= n
        self._out(piece, not self._left, [piece] if piece else [])
        if n < len(data):
            self.leftover = True
            return data[n:]
        return b""

    def _feed_chunks(self, data: bytes) -> bytes:
        buf = self._buf
        buf += data
        pos = 0
        forward = 0  # buf[:forward] goes on (CHUNKED)
        ended = False
        payloads: list[bytes] = []
        while True:
            state = self._state
            if state == self._SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_HEAD:
                        raise ValueError("no chunk size line in 64 KiB")
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
                    raise ValueError("no CRLF after a chunk")
                pos += 2
                forward = pos
                self._state = self._SIZE
            else:  # trailers, up to an empty line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_HEAD:
                        raise ValueError("trailers over 64 KiB")
                    break
                empty = end == pos
                pos = end + 2
                if empty:
                    ended = True
                    break
        if self._mode == self.CHUNKED:
            out = bytes(buf[:forward]) if forward else b""
        else:
            out = b"".join(payloads)
        rest = bytes(buf[pos:]) if ended else b""
        self.leftover = bool(rest)
        del buf[:pos]
        if ended:
            buf.clear()
        self._out(out, ended, payloads)
        return rest

    def _out(self, data: bytes, ended: bool, payloads: list[bytes]) -> None:
        """Write ``data`` (with the head before it and ``end`` after it when the body ended),
        then meter the payloads it carried."""
        if self._head:
            data, self._head = self._head + data, b""
        if ended:
            data += self._end
        if data:
            sink = self._sink
            if sink.is_closing():
                raise self._sink_error()
            sink.write(data)
        if self._start is not None:
            start, self._start = self._start, None
            start()
        if self._payload is not None:
            for payload in payloads:
                self._payload(payload)
        if ended:
            self.ended = True
            self._finish()


class UpstreamConn(Side):
    """One connection to the upstream: a head is read with :meth:`next_head`; a body goes
    straight from :meth:`data_received` to the client through a :class:`Relay`."""

    def __init__(self) -> None:
        super().__init__()
        self.idle_since = 0.0
        #: In the pool, owing no answer: any byte received now closes it.
        self.pooled = False

    # asyncio.Protocol
    def data_received(self, data: bytes) -> None:
        relay = self.relay
        if relay is not None:
            relay.feed(data)
            return
        if self.pooled:
            # Bytes from an upstream that owes no answer: past the end of the last one. The
            # next request must not read them as its own answer.
            self.eof = True
            self.close()
            return
        self._buffer(data)

    def eof_received(self) -> bool:
        self._ended()
        return False

    # what the proxy calls
    async def next_head(self) -> bytes:
        """The next answer head, its blank line included; UpstreamFailed when the connection
        ends first or the head is over :data:`MAX_HEAD`."""
        while True:
            try:
                head = self.split_head()
            except ValueError:
                raise UpstreamFailed from None
            if head is not None:
                return head
            if self.eof:
                raise UpstreamFailed
            await self._more()

    def take(self) -> bytes:
        """The bytes received past the last head, and not yet read."""
        data = bytes(self.buf)
        self.buf.clear()
        self.release(FULL)
        return data

    def write(self, data: bytes) -> None:
        if self.lost or self.transport is None or self.transport.is_closing():
            raise UpstreamFailed
        self.transport.write(data)

    def usable(self) -> bool:
        return (not self.eof and not self.buf and self.transport is not None
                and not self.transport.is_closing())
