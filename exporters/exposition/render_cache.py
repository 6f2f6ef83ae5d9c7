"""The agent's cache of rendered exposition bodies: fifty scrapers of one snapshot cost one
render. Keyed by snapshot version, format and gzip; the formats are the fixed set
:data:`mrc_agent.exporters.render.FORMATS` whatever the ``Accept`` header says, so the cache holds
at most two bodies per format. Safe to call from any thread (the server's routes run in workers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client.registry import CollectorRegistry

from mrc_agent.exporters.render import FORMATS, Format, encode


class RenderCache:
    """Rendered exposition bodies keyed by (snapshot version, format, gzip). Only the current
    version's are kept, and the formats are a fixed set: at most ``2 * len(FORMATS)`` bodies,
    whatever clients send."""

    LIMIT = 2 * len(FORMATS)

    def __init__(self, registry: CollectorRegistry, version: Callable[[], int]) -> None:
        self._registry = registry
        self._version = version
        self._lock = threading.Lock()
        self._bodies: dict[tuple[int, str, bool], bytes] = {}

    def render(self, fmt: Format, gzipped: bool) -> bytes:
        version = self._version()
        key = (version, fmt.content_type, gzipped)
        body = self._bodies.get(key)
        if body is None:
            with self._lock:
                body = self._bodies.get(key)
                if body is None:
                    body = encode(self._registry, fmt, gzipped)
                    bodies = {k: v for k, v in self._bodies.items() if k[0] == version}
                    if len(bodies) >= self.LIMIT:  # only if FORMATS and keys ever disagree
                        bodies.clear()
                    bodies[key] = body
                    self._bodies = bodies
        return body
