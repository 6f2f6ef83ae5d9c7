"""ASGI middleware: a hard cap on request body size.

Starlette reads a body whole, so without a cap one request could make the service hold
gigabytes. A declared ``Content-Length`` over the cap is refused before a byte is read; a
chunked body is counted as it arrives and refused the moment it passes the cap. Either way the
client gets 413 with the service's JSON error.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """``on_refuse(path, status)`` is called for every request refused here (to count it)."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 on_refuse: Callable[[str, int], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {name for name, _ in scope.get("headers", [])}
        if b"content-length" in names and b"transfer-encoding" in names:
            # Two framings that disagree: behind some proxies, a request-smuggling attempt.
            if self.on_refuse is not None:
                self.on_refuse(scope.get("path", ""), 400)
            await self._send_error(send, 400, "bad_request", "a request may not carry both "
                                   "Content-Length and Transfer-Encoding")
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and (not value.isdigit()
                                              or int(value) > self.max_bytes):
                await self._refuse(send, scope.get("path", ""))
                return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
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
                await self._refuse(send, scope.get("path", ""))

    async def _send_error(self, send: Send, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def _refuse(self, send: Send, path: str = "") -> None:
        if self.on_refuse is not None:
            self.on_refuse(path, 413)
        await self._send_error(send, 413, "image_too_large",
                               f"the request body is over {self.max_bytes} bytes")
