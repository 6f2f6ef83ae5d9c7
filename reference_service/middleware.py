"""ASGI middleware: a hard cap on request body size, and a client that leaves mid-request.

Starlette reads a body whole, so without a cap one request could make the service hold
gigabytes. A declared ``Content-Length`` over the cap is refused before the application sees a
byte; a chunked body is counted as it arrives and refused the moment it passes the cap. Either
way the client gets 413 with the service's JSON error and ``Connection: close``.

Before that 413 goes out, the rest of the body is read and thrown away, up to
:data:`DRAIN_MAX_BYTES` (or twice the cap, if more) and :data:`DRAIN_TIMEOUT_S`. A client such
as Python's ``urllib.request`` sends its whole body before it reads a byte of the answer; had
the server answered and closed with that body still unread in its socket, the kernel would
have sent a reset, and the client would have seen "connection reset by peer" instead of the
413. The drain is skipped when the client sent ``Expect: 100-continue`` (it sends nothing
until told to, so the answer goes out at once) and when a declared length is past the bound
(reading it would cost more than the answer is worth: that client may see the reset). Chunks
are dropped as they arrive, so memory stays at uvicorn's 64 KiB read buffer.

A client that closes its connection before its body is complete (or whose body stalled past
the server's body timeout) makes Starlette raise ``ClientDisconnect`` in the handler. That used
to reach the 500 handler and uvicorn, each writing a traceback at ERROR, and was counted as a
server error. It is the client's doing: one line at INFO here (with the traceback only at
DEBUG), counted as 499 (``client_error``).

The path in these lines is the client's, percent-decoded: ``%0a`` in it would start a new line of
its own (a forged ``MRC_SUCCESS`` one). Every client-given field is written through
:func:`~mrc_agent.reference_service.logs.escape`, as the request log lines are.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mrc_agent.reference_service.errors import error_json
from mrc_agent.reference_service.logs import escape

log = logging.getLogger(__name__)

#: Read and drop at most this much of a refused body (or twice the cap, if more) so that the
#: client reads the 413: a client sending far more than the cap gets the reset instead.
DRAIN_MAX_BYTES = 64 * 1024 * 1024
#: And for at most this long: 64 MiB takes a fraction of a second on a LAN, so a client that
#: is still sending after this has no claim on the service's time.
DRAIN_TIMEOUT_S = 5.0
#: The status counted for a request whose client left before it was answered (nginx's 499).
CLIENT_CLOSED = 499


class BodyTooLarge(Exception):
    pass


def _where(scope: Scope) -> tuple[str, str]:
    """The request's method and path, fit for a log line."""
    return escape(str(scope.get("method", ""))), escape(str(scope.get("path", "")))


class BodyLimit:
    """``on_refuse(path, status)`` is called once for every request refused here (to count
    it), and for every request whose client left while its body was being read."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 on_refuse: Callable[[str, int], None] | None = None,
                 drain_max_bytes: int = DRAIN_MAX_BYTES,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refuse = on_refuse
        self.drain_max_bytes = max(drain_max_bytes, 2 * max_bytes)
        self.drain_timeout_s = drain_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = dict(scope.get("headers", []))
        if b"content-length" in headers and b"transfer-encoding" in headers:
            # Two framings that disagree: behind some proxies, a request-smuggling attempt.
            if self.on_refuse is not None:
                self.on_refuse(path, 400)
            await self._send_error(send, path, 400, "bad_request", "a request may not carry "
                                   "both Content-Length and Transfer-Encoding")
            return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            waiting = headers.get(b"expect", b"").lower() == b"100-continue"
            if declared.isdigit() and not waiting and int(declared) <= self.drain_max_bytes:
                await self._drain(receive, 0, scope)
            await self._refuse(send, path)
            return
        seen = 0
        more = True
        started = False

        async def counting_receive() -> Message:
            nonlocal seen, more
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                more = bool(message.get("more_body", False))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                if more:
                    await self._drain(receive, seen, scope)
                await self._refuse(send, path)
        except ClientDisconnect:
            # One line; the traceback only when someone asked for DEBUG.
            log.info("%s %s: the connection closed before the request body was complete",
                     *_where(scope), exc_info=log.isEnabledFor(logging.DEBUG))
            if not started and self.on_refuse is not None:
                self.on_refuse(path, CLIENT_CLOSED)

    async def _drain(self, receive: Receive, seen: int, scope: Scope) -> None:
        """Read and drop the rest of the body, within the byte and time bounds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while seen <= self.drain_max_bytes:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                break
            if message["type"] != "http.request":
                return  # the client left: nobody to answer
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
        log.info("%s %s: stopped reading a refused body after %d bytes (bounds: %d bytes, "
                 "%g s): answering and closing", *_where(scope), seen, self.drain_max_bytes,
                 self.drain_timeout_s)

    async def _send_error(self, send: Send, path: str, status: int, code: str,
                          message: str) -> None:
        body = json.dumps(error_json(path, status, code, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def _refuse(self, send: Send, path: str = "") -> None:
        if self.on_refuse is not None:
            self.on_refuse(path, 413)
        await self._send_error(send, path, 413, "image_too_large",
                               f"the request body is over {self.max_bytes} bytes")
