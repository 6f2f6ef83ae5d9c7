"""``GET /metrics`` for an MRC service on Starlette or FastAPI, multiprocess-aware.

Three shapes of the same handler, pick the one that fits the app::

    app.add_route("/metrics", metrics_endpoint(metrics.registry))   # FastAPI or Starlette
    routes = [..., metrics_route(metrics.registry)]                 # Starlette route list
    app = metrics_app(metrics.registry)                             # a standalone ASGI app

Single process: the given registry is rendered. Multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set
before the process started): each scrape builds a fresh ``CollectorRegistry`` with a
``MultiProcessCollector`` that merges the files of every worker, so whichever worker answers, the
scrape shows the whole service; the given registry is then not rendered (its values are this
worker's share only). The format is negotiated by :mod:`mrc_agent.exporters.render`, as the agent's
is (OpenMetrics when the scraper asks for it, text for an ``Accept`` it cannot read), and the body
is gzipped when the scraper accepts it. Rendering runs in Starlette's thread pool, so reading the
workers' files never blocks the event loop that serves requests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import CollectorRegistry
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mrc_agent.exporters import render as _render
from mrc_agent.exporters.instrumentation.multiprocess import multiprocess_enabled

Handler = Callable[[Request], Awaitable[Response]]


def exposition_registry(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """The registry a scrape should render now: a fresh multiprocess one, or ``registry``."""
    if multiprocess_enabled():
        fresh = CollectorRegistry()
        MultiProcessCollector(fresh)
        return fresh
    if registry is None:
        raise ValueError("pass the registry to serve (MRCMetrics.registry); the global registry "
                         "is never served implicitly")
    return registry


def render(registry: CollectorRegistry | None = None, accept: str = "",
           accept_encoding: str = "") -> tuple[bytes, dict[str, str]]:
    """Encode the exposition for an ``Accept`` / ``Accept-Encoding`` pair: (body, headers)."""
    return _render.render(exposition_registry(registry), accept,
                          _render.wants_gzip(accept_encoding))


def metrics_endpoint(registry: CollectorRegistry | None = None) -> Handler:
    """A Starlette/FastAPI request handler serving the metrics (``app.add_route``)."""
    if registry is None:
        exposition_registry(None)  # fail at wiring time, not at the first scrape

    async def metrics(request: Request) -> Response:
        body, headers = await run_in_threadpool(
            render, registry, request.headers.get("accept", ""),
            request.headers.get("accept-encoding", ""))
        return Response(body, headers=headers)

    return metrics


def metrics_route(registry: CollectorRegistry | None = None, path: str = "/metrics") -> Route:
    """A Starlette ``Route`` for ``GET``/``HEAD`` ``path`` serving the metrics."""
    return Route(path, metrics_endpoint(registry), methods=["GET"], include_in_schema=False)


def metrics_app(registry: CollectorRegistry | None = None) -> ASGIApp:
    """A standalone ASGI app answering ``GET``/``HEAD`` with the metrics, whatever the path.

    Prefer :func:`metrics_endpoint` inside an app: ``Mount("/metrics", ...)`` answers
    ``/metrics/`` and redirects ``/metrics`` to it.
    """
    endpoint = metrics_endpoint(registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise RuntimeError(f"metrics_app serves HTTP only, not {scope['type']!r}")
        request = Request(scope, receive)
        response: Response
        if request.method in ("GET", "HEAD"):
            response = await endpoint(request)
        else:
            response = PlainTextResponse("Method Not Allowed\n", status_code=405,
                                         headers={"Allow": "GET, HEAD"})
        await response(scope, receive, send)

    return app
