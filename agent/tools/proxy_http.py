"""HTTP/1.1 rules ``mrc-agent proxy`` applies to each message it relays (RFC 9110, RFC 9112):
how a head is read and written, which headers are hop-by-hop, which framing is refused, the
error answers it writes itself; and the command's addresses.

Heads are parsed by llhttp (Node.js's parser, through httptools, uvicorn's default): 1.8 us for
a chat request's head against h11's 21 us, measured in one process on this project's machine
(docs/openai-meter.md#cost); the proxy frames bodies itself and never needs a parser's state
machine. llhttp is strict where a lax reading could let a request through that a server behind
reads otherwise: a bare LF, obsolete line folding, duplicate ``Content-Length`` headers, a
``Content-Length`` beside ``Transfer-Encoding`` and a method outside its table are refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import resource
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import httptools

log = logging.getLogger(__name__)

#: How long, and how much, of what a refused client still sends is read and dropped before
#: its connection closes (:func:`~mrc_agent.exporters.exposition.http.wire.linger`; nginx's
#: ``lingering_time`` is 30 s, a request head or a small body arrives in well under a second).
LINGER_S = 2.0
LINGER_BYTES = 1 << 20
#: The end of a head: h11 takes a bare LF as a line end, so this is where it ends a head.
HEAD_END = re.compile(rb"\n\r?\n")
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te",
                         b"transfer-encoding", b"upgrade", b"proxy-authenticate",
                         b"proxy-authorization", b"trailer"})


class ProxyError(ValueError):
    """A proxy setting that cannot work (exit code 2)."""


class BadHead(Exception):
    """A head that is refused: ``status`` is the answer a client gets for it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class MessageHead:
    """A request or response head: names lowercased, values without surrounding blanks."""

    __slots__ = ("method", "target", "status", "reason", "version", "headers", "_complete")

    def __init__(self) -> None:
        self.method = b""
        self.target = b""
        self.status = 0
        self.reason = b""
        self.version = b"1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self._complete = False

    # httptools' callbacks
    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value.strip(b" \t")))

    def on_headers_complete(self) -> None:
        self._complete = True

    def get(self, name: bytes) -> bytes | None:
        """The value of header ``name`` (the last one, if repeated)."""
        found = None
        for n, v in self.headers:
            if n == name:
                found = v
        return found

    def count(self, name: bytes) -> int:
        return sum(1 for n, _ in self.headers if n == name)

    def other_coding(self) -> bool:
        """A ``Transfer-Encoding`` other than one ``chunked``: the proxy relays no other."""
        coding = self.get(b"transfer-encoding")
        return coding is not None and (self.count(b"transfer-encoding") > 1
                                       or coding.lower() != b"chunked")

    def tokens(self, name: bytes) -> set[bytes]:
        """The comma-separated, lowercased tokens of every ``name`` header."""
        return {t.strip().lower() for n, v in self.headers if n == name for t in v.split(b",")}


_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _feed(parser: Any, head: MessageHead, data: bytes, status: int, what: str) -> None:
    """Parse the head ``data`` into ``head``; BadHead(``status``) when llhttp refuses it (an
    unknown method is left to the caller: its status depends on the method's shape)."""
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        pass  # an Upgrade or CONNECT head, read whole: refused or stripped by the caller
    except httptools.HttpParserInvalidMethodError:
        raise
    except httptools.HttpParserError as e:
        raise BadHead(status, f"{what} is malformed: {e}") from None
    if not head._complete:
        raise BadHead(status, f"{what} is malformed")


def parse_request(data: bytes) -> MessageHead:
    """The request head ``data`` (its blank line included); BadHead when it is refused."""
    head = MessageHead()
    parser = httptools.HttpRequestParser(head)
    try:
        _feed(parser, head, data, 400, "the request head")
    except httptools.HttpParserInvalidMethodError:
        method = data.split(b" ", 1)[0]
        if _TOKEN.fullmatch(method):
            raise BadHead(501, "the request method is not supported") from None
        raise BadHead(400, "the request line is malformed") from None
    head.method = parser.get_method()
    head.version = parser.get_http_version().encode()
    if head.version not in (b"1.0", b"1.1"):
        raise BadHead(505, "only HTTP/1.0 and HTTP/1.1 are supported")
    if head.method == b"CONNECT":
        raise BadHead(501, "CONNECT is not supported")
    hosts = head.count(b"host")
    if hosts > 1:  # RFC 9112 §3.2: whatever the version
        raise BadHead(400, "a request may have only one Host header")
    if hosts == 0 and head.version == b"1.1":
        raise BadHead(400, "an HTTP/1.1 request needs a Host header")
    if head.other_coding():
        raise BadHead(501, "only Transfer-Encoding: chunked is supported")
    return head


def parse_response(data: bytes) -> MessageHead:
    """The response head ``data`` (its blank line included); BadHead (502) when it is not one
    a strict HTTP/1.1 client reads."""
    head = MessageHead()
    parser = httptools.HttpResponseParser(head)
    _feed(parser, head, data, 502, "the upstream server's answer head")
    head.status = parser.get_status_code()
    head.version = parser.get_http_version().encode()
    if not 100 <= head.status <= 599 or head.version not in (b"1.0", b"1.1"):
        raise BadHead(502, "the upstream server's answer has a malformed status line")
    if head.other_coding():
        raise BadHead(502, "the upstream server's answer has a transfer coding other than "
                      "chunked")
    return head


def content_length(head: MessageHead) -> int:
    """The body length ``head`` declares (llhttp has checked its digits and that it is not
    repeated), 0 when none."""
    value = head.get(b"content-length")
    return int(value) if value else 0


def head_bytes(line: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A head: ``line`` (request or status line) and ``headers``, ending with the blank line."""
    return b"\r\n".join([line, *[n + b": " + v for n, v in headers], b"", b""])


@dataclass(frozen=True)
class Upstream:
    """Where requests go: ``http(s)://host[:port]`` with no path."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ProxyError(f"--upstream {url!r} is not an http(s)://host[:port] URL")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ProxyError(f"--upstream {url!r} has a path; give the origin only, the "
                             "request's path is passed as received")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as e:
            raise ProxyError(f"--upstream {url!r}: {e}") from None
        return cls(parts.scheme, parts.hostname, port)

    @property
    def authority(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default else f"{host}:{self.port}").encode()


def forward_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` less the hop-by-hop ones: those RFC 9110 §7.6.1 names and those the
    ``Connection`` header names. ``Content-Length`` stays even when named: it frames the
    message, which a connection option cannot undo (RFC 9110 §7.6.1 forbids naming it), and
    dropping it would leave a body without a length."""
    named: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            named.update(v.strip().lower() for v in value.split(b","))
    named.discard(b"content-length")
    return [(n, v) for n, v in headers if n not in _HOP_BY_HOP and n not in named]


def error_body(status: int, message: str) -> bytes:
    kind = ("bad_gateway" if status == 502 else "server_error" if status >= 500
            else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()


def raw_error(status: int, message: str) -> bytes:
    """A whole error answer that closes the connection, written without h11: for when the
    client's h11 state already holds a head that was never sent."""
    body = error_body(status, message)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, HTTPStatus(status).phrase.encode(),
                                             len(body)) + body)


def split_hostport(value: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a pair; ProxyError when it is not one."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ProxyError(f"{flag} {value!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def descriptors_for(connections: int, pool: int) -> None:
    """Raise the soft open-file limit toward what ``connections`` need (a client and an
    upstream descriptor each, plus the pool and the metrics port), as far as the hard limit
    allows; say so when it cannot reach it, since the cap is then the kernel's, not ours."""
    need = 2 * connections + pool + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("open-file limit %d is below the %d that --max-connections %d needs",
                    soft, need, connections)
