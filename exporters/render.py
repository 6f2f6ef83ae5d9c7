"""The one exposition renderer both halves use: negotiate the format with prometheus-client's
``choose_encoder`` (OpenMetrics when the scraper asks for it), encode a registry, and gzip the
body when the scraper accepts it."""

from __future__ import annotations

import gzip

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry


def wants_gzip(accept_encoding: str) -> bool:
    return "gzip" in accept_encoding


def render(registry: CollectorRegistry, accept: str = "",
           gzipped: bool = False) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of ``registry``'s exposition for an ``Accept`` header."""
    encoder, content_type = choose_encoder(accept)
    body = encoder(registry)
    headers = {"Content-Type": content_type}
    if gzipped:
        body = gzip.compress(body, compresslevel=1)  # level 1: most of the gain, little CPU
        headers["Content-Encoding"] = "gzip"
    return body, headers


def content_type(accept: str) -> str:
    """The content type :func:`render` answers for ``accept`` (without rendering)."""
    return choose_encoder(accept)[1]
