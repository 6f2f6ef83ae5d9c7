"""HTTP exposition server: ``/metrics`` (Prometheus text or OpenMetrics, gzip when asked),
``/healthz`` (live) and ``/readyz`` (sampling current; 503 with the reason otherwise), plus
optional extra :class:`Routes` (the agent's Alertmanager webhook and captures).

The rendered body is cached per snapshot version and format, so fifty scrapers of the same
snapshot cost one render; a scrape never touches hardware. The socket is bound in the
constructor so that "address in use" surfaces before the agent starts sampling.

Extra routes see a plain :class:`Request` and answer a :class:`Response`; the server reads a
request body only when it declares a ``Content-Length`` within the routes' ``max_body_bytes``
(else 411/413 without reading it), with a read timeout, so a slow or huge body cannot hold a
thread or memory.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from prometheus_client.registry import CollectorRegistry

from exporters.render import content_type, render, wants_gzip

log = logging.getLogger(__name__)

#: Seconds a client may take to send a request body.
BODY_READ_TIMEOUT_S = 10.0


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

_INDEX = b"""<html><head><title>mrc-agent</title></head><body><h1>mrc-agent</h1>
<p><a href="/metrics">/metrics</a> &middot; <a href="/healthz">/healthz</a> &middot;
<a href="/readyz">/readyz</a></p></body></html>
"""


class _RenderCache:
    """Rendered exposition bodies keyed by (snapshot version, content type, gzip)."""

    def __init__(self, registry: CollectorRegistry, version: Callable[[], int]) -> None:
        self._registry = registry
        self._version = version
        self._lock = threading.Lock()
        self._key: tuple[int, str] | None = None
        self._bodies: dict[tuple[int, str, bool], bytes] = {}

    def render(self, accept: str, gzipped: bool) -> tuple[bytes, str]:
        ctype = content_type(accept)
        version = self._version()
        key = (version, ctype, gzipped)
        body = self._bodies.get(key)
        if body is None:
            with self._lock:
                body = self._bodies.get(key)
                if body is None:
                    body = render(self._registry, accept, gzipped)[0]
                    # Keep only the current version's bodies.
                    self._bodies = {k: v for k, v in self._bodies.items() if k[0] == version}
                    self._bodies[key] = body
        return body, ctype


class ExpositionServer:
    """A threaded HTTP server for the agent's endpoints. ``port`` 0 picks a free port."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        version: Callable[[], int],
        not_ready: Callable[[], str | None],
        routes: Routes | None = None,
    ) -> None:
        cache = _RenderCache(registry, version)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive for Prometheus' connection reuse
            # Headers and body go out in two writes; with Nagle on, the body waits for the
            # client's delayed ACK of the headers (~40 ms per scrape on a kept-alive socket).
            disable_nagle_algorithm = True
            server_version = "mrc-agent"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                log.debug("%s " + format, self.address_string(), *args)

            def _send(self, status: int, body: bytes, ctype: str,
                      extra: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    gz = wants_gzip(self.headers.get("Accept-Encoding", ""))
                    body, ctype = cache.render(self.headers.get("Accept", ""), gz)
                    self._send(200, body, ctype, {"Content-Encoding": "gzip"} if gz else None)
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain; charset=utf-8")
                elif path == "/readyz":
                    reason = not_ready()
                    if reason is None:
                        self._send(200, b"ready\n", "text/plain; charset=utf-8")
                    else:
                        self._send(503, f"not ready: {reason}\n".encode(),
                                   "text/plain; charset=utf-8")
                elif path == "/":
                    self._send(200, _INDEX, "text/html; charset=utf-8")
                elif not self._route(path, b""):
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")

            do_HEAD = do_GET

            def _not_allowed(self) -> None:
                self._send(405, b"method not allowed\n", "text/plain; charset=utf-8",
                           {"Allow": "GET, HEAD"})

            do_PUT = do_DELETE = do_PATCH = _not_allowed

            def do_POST(self) -> None:  # noqa: N802
                if routes is None:
                    self._not_allowed()
                    return
                body = self._read_body(routes.max_body_bytes)
                if body is not None and not self._route(self.path.split("?", 1)[0], body):
                    self._not_allowed()

            def _route(self, path: str, body: bytes) -> bool:
                """Let the extra routes answer; False when they do not know the path."""
                if routes is None:
                    return False
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    resp = routes.handle(Request(self.command, path, headers, body))
                except Exception:  # a bug in a route must not kill the server thread
                    log.exception("%s %s failed", self.command, path)
                    resp = Response(500, b"internal error\n", "text/plain; charset=utf-8")
                if resp is None:
                    return False
                self._send(resp.status, resp.body, resp.content_type, resp.headers)
                return True

            def _read_body(self, limit: int) -> bytes | None:
                """The body, or None after answering 411/413/400 (and closing)."""
                length = self.headers.get("Content-Length")
                if length is None:
                    if self.headers.get("Transfer-Encoding"):
                        self.close_connection = True
                        self._send(411, b"Content-Length required\n", "text/plain; charset=utf-8")
                        return None
                    return b""
                if not length.strip().isdigit():
                    self.close_connection = True
                    self._send(400, b"bad Content-Length\n", "text/plain; charset=utf-8")
                    return None
                n = int(length)
                if n > limit:
                    self.close_connection = True  # the body stays unread
                    self._send(413, b"request body too large\n", "text/plain; charset=utf-8")
                    return None
                self.connection.settimeout(BODY_READ_TIMEOUT_S)
                try:
                    body = self.rfile.read(n)
                except OSError:
                    self.close_connection = True
                    return None
                finally:
                    self.connection.settimeout(None)
                if len(body) != n:
                    self.close_connection = True
                    return None
                return body

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128  # 50+ concurrent scrapers must not see refused connects

        host = host.strip("[]")  # "[::1]" or "::1": an IPv6 address either way
        if ":" in host:
            Server.address_family = socket.AF_INET6
        self._httpd = Server((host, port), Handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
            name="mrc-agent-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
