"""A hand-written HTTP/1.1 upstream on loopback that misbehaves on demand, for the proxy's
framing tests: it writes whatever bytes a test gives it (extra bytes past an answer, both
length headers, a body after HEAD or 204, odd chunk sizes) and reads requests as a lax server
does, ``Content-Length`` first, so a request that a strict intermediary should not have
forwarded shows up as a second, smuggled request in :attr:`RawUpstream.seen`."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Seen:
    """One request as the upstream parsed it."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""

    def header(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.headers if n == name.lower()]


Answer = Callable[[Seen], bytes]


class _Counted(Protocol):
    lock: threading.Lock
    accepted: int


def serve_each(sock: socket.socket, owner: _Counted,
               handle: Callable[[socket.socket], None]) -> None:
    """Accept on ``sock`` in a thread until it closes, counting each connection in
    ``owner.accepted`` and handling it with ``handle`` in a thread of its own."""

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with owner.lock:
                owner.accepted += 1
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def _read_chunked(conn: socket.socket, buf: bytes) -> tuple[bytes, bytes] | None:
    """A chunked body from ``buf`` and the socket: (body, the bytes after it)."""
    body = bytearray()
    while True:
        while b"\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                return None
            buf += data
        line, _, buf = buf.partition(b"\r\n")
        size = int(line.split(b";")[0], 16)
        while len(buf) < size + 2:
            data = conn.recv(65536)
            if not data:
                return None
            buf += data
        if size == 0:  # no trailers from the proxy: the last chunk's CRLF ends it
            return bytes(body), buf[2:]
        body += buf[:size]
        buf = buf[size + 2:]


@dataclass
class RawUpstream:
    """A server that answers each request with ``answer(request)`` (or the same bytes every
    time), written by hand, and closes the connection after each answer when ``close``.

    Requests are read ``Content-Length`` first, as a lax server reads them; with
    ``chunked=True`` a ``Transfer-Encoding: chunked`` body without ``Content-Length`` is
    read too (otherwise a request without ``Content-Length`` has no body)."""

    answer: bytes | Answer
    close_after: bool = False
    chunked: bool = True
    #: Bytes written ``late_s`` seconds after each answer, on the same connection.
    late: bytes = b""
    late_s: float = 0.2
    #: Requests as parsed, in order of arrival.
    seen: list[Seen] = field(default_factory=list)
    #: Bytes of answers written so far.
    sent: int = 0
    #: Connections accepted so far.
    accepted: int = 0
    #: Serve HTTPS with this server context (the URL is then ``https://``).
    tls: ssl.SSLContext | None = None
    #: The loopback address to listen on.
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.sock = socket.create_server((self.host, 0))
        self.port = int(self.sock.getsockname()[1])
        self.url = f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"
        self.lock = threading.Lock()
        serve_each(self.sock, self, self._one)

    def _one(self, conn: socket.socket) -> None:
        if self.tls is not None:
            try:  # a client that does not speak TLS, or does not trust us, ends here
                conn = self.tls.wrap_socket(conn, server_side=True)
            except OSError:
                conn.close()
                return
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                line, *fields = head.split(b"\r\n")
                method, target, _ = (line.split(b" ") + [b"", b""])[:3]
                headers = [(n.strip().lower(), v.strip())
                           for n, _, v in (f.partition(b":") for f in fields)]
                seen = Seen(method, target, headers)
                lengths = seen.header(b"content-length")
                if lengths:
                    length = int(lengths[0])
                    while len(buf) < length:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                    seen.body, buf = buf[:length], buf[length:]
                elif self.chunked and any(b"chunked" in v.lower()
                                          for v in seen.header(b"transfer-encoding")):
                    read = _read_chunked(conn, buf)
                    if read is None:
                        return
                    seen.body, buf = read
                with self.lock:
                    self.seen.append(seen)
                answer = self.answer(seen) if callable(self.answer) else self.answer
                view = memoryview(answer)
                while view:
                    try:
                        n = conn.send(view[:65536])
                    except OSError:
                        return
                    self.sent += n
                    view = view[n:]
                if self.late:
                    time.sleep(self.late_s)
                    try:
                        conn.sendall(self.late)
                    except OSError:
                        return
                    self.sent += len(self.late)
                if self.close_after:
                    return

    def close(self) -> None:
        self.sock.close()


def chunked_answer(*chunks: bytes, tail: bytes = b"0\r\n\r\n",
                   content_type: bytes = b"text/event-stream") -> bytes:
    """A 200 answer framed chunked, one chunk per item, then ``tail``."""
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type
            + b"\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + tail)


def length_answer(body: bytes, status: bytes = b"200 OK", extra: bytes = b"",
                  content_type: bytes = b"application/json") -> bytes:
    """An answer framed by ``Content-Length``, with ``extra`` bytes written after it."""
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type
            + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body + extra)


def unchunk(body: bytes) -> bytes:
    """The payload of a chunked body (trailers ignored)."""
    out, pos = bytearray(), 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2:end + 2 + size]
        pos = end + 2 + size + 2


class AnswerReader:
    """Answers read one after another from a client socket, by the framing each head
    declares (bytes read past one answer are kept for the next)."""

    def __init__(self, sock: socket.socket, timeout: float = 10.0) -> None:
        self.sock = sock
        sock.settimeout(timeout)
        self.buf = b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def read(self, head_request: bool = False) -> tuple[bytes, bytes]:
        """The next answer's head and body (de-chunked); (b"", b"") when the connection
        closes before a head. ``head_request``: it answers HEAD, so it has no body."""
        while b"\r\n\r\n" not in self.buf:
            if not self._more():
                return b"", b""
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lower = head.lower()
        status = int(head.split(b" ", 2)[1])
        if head_request or status in (204, 304) or 100 <= status < 200:
            return head, b""
        if b"transfer-encoding: chunked" in lower:
            while True:
                try:
                    body, used = _unchunk_prefix(self.buf)
                    self.buf = self.buf[used:]
                    return head, body
                except ValueError:
                    if not self._more():
                        raise
        length = next((int(line.split(b":")[1]) for line in lower.split(b"\r\n")
                       if line.startswith(b"content-length:")), None)
        if length is None:  # to the end of the connection
            while self._more():
                pass
            body, self.buf = self.buf, b""
            return head, body
        while len(self.buf) < length:
            if not self._more():
                break
        body, self.buf = self.buf[:length], self.buf[length:]
        return head, body


def _unchunk_prefix(data: bytes) -> tuple[bytes, int]:
    """The payload of the chunked body at the start of ``data`` and its length on the wire
    (no trailers); ValueError when it has not all arrived."""
    out, pos = bytearray(), 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if len(data) < end + 2 + size + 2:
            raise ValueError("incomplete")
        if size == 0:
            return bytes(out), end + 4
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2


def status_of(head: bytes) -> int:
    return int(head.split(b" ", 2)[1]) if head else 0
