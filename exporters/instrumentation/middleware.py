"""The OpenAI meter as ASGI middleware: one class for vLLM's ``--middleware`` and Starlette apps.

vLLM (and servers built like it) add a middleware class by import path, with no arguments::

    vllm serve MODEL --middleware mrc_agent.exporters.instrumentation.MRCMeterMiddleware

and a Starlette or FastAPI app adds it the same way, or with its own metrics::

    app.add_middleware(MRCMeterMiddleware)                         # the global registry
    app.add_middleware(MRCMeterMiddleware, metrics=MRCMetrics(registry=mine,
                                                              resolution_unknown=True))

Without ``metrics`` the families go on prometheus-client's global ``REGISTRY``, once per process,
which is what vLLM's and SGLang's ``/metrics`` serve, so they appear there beside the engine's own;
with ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM's several API server processes) they are written to
its files and merged by the host's ``MultiProcessCollector``, like the host's own metrics.

Pure ASGI, no framework import: the middleware wraps ``receive`` and ``send``, hands each chunk to
an :class:`~mrc_agent.exporters.instrumentation.meter.Exchange` and passes it on unchanged and at
once, so nothing is buffered, streaming stays streaming and back-pressure is the host's. Requests
other than ``POST`` to the metered paths pass through untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from prometheus_client import REGISTRY

from mrc_agent.exporters.instrumentation.meter import METERED_PATHS, Exchange, metered
from mrc_agent.exporters.instrumentation.metrics import MRCMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_default: MRCMetrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> MRCMetrics:
    """The process's meter metrics on prometheus-client's global ``REGISTRY``, made once."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MRCMetrics(registry=REGISTRY, resolution_unknown=True)
        return _default


def content_type(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The ``Content-Type`` of ASGI response headers (names are lower case there), or ''."""
    for name, value in headers:
        if name == b"content-type":
            return value.decode("latin-1")
    return ""


class MRCMeterMiddleware:
    """Meters ``POST /v1/chat/completions`` and ``/v1/completions`` of the wrapped app."""

    def __init__(self, app: ASGIApp, metrics: MRCMetrics | None = None,
                 paths: Iterable[str] = METERED_PATHS) -> None:
        self.app = app
        self.metrics = metrics if metrics is not None else default_metrics()
        if self.metrics.unknown_resolution_index is None:
            raise ValueError("the meter needs metrics with the unknown resolution cell: "
                             "MRCMetrics(..., resolution_unknown=True)")
        self.paths = tuple(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not metered(scope["method"], scope["path"], self.paths):
            await self.app(scope, receive, send)
            return
        exchange = Exchange(self.metrics)
        left = False

        async def metered_receive() -> Message:
            nonlocal left
            message = await receive()
            kind = message["type"]
            if kind == "http.request":
                exchange.request_body(message.get("body", b""), message.get("more_body", False))
            elif kind == "http.disconnect":
                left = True
            return message

        async def metered_send(message: Message) -> None:
            nonlocal left
            kind = message["type"]
            if kind == "http.response.start":
                exchange.response_start(message["status"],
                                        content_type(message.get("headers", ())))
            elif kind == "http.response.body":
                exchange.response_body(message.get("body", b""),
                                       message.get("more_body", False))
            try:
                await send(message)
            except OSError:  # the server could not write: the client is gone
                left = True
                raise

        try:
            await self.app(scope, metered_receive, metered_send)
        finally:
            exchange.finish(client_left=left)
