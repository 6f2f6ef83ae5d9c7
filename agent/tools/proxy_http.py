"""HTTP/1.1 rules ``mrc-agent proxy`` applies to each message it relays (RFC 9110, RFC 9112):
which headers are hop-by-hop, which framing is refused, the error answers it writes itself;
and the command's addresses."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import resource
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

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


def both_lengths(headers: list[tuple[bytes, bytes]]) -> bool:
    """A message with ``Content-Length`` and ``Transfer-Encoding`` both: the framing a
    request-smuggling attack relies on (RFC 9112 §6.3)."""
    names = {n for n, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


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
